//! A tensor's contents across versions, for refits that send only what changed: a [`Fill`]
//! at version 0, then one update per version, each computable from an element's global
//! index alone, so that every rank fills its source shard and checks its destination shard
//! of any version without talking to another.
//!
//! Two updates ([`Update`]):
//! - [`Update::Density`]: a seeded fraction of the elements, drawn afresh every version,
//!   moves one ulp (the next bit pattern away from zero, or towards it at the top of the
//!   finite range; integers add one). Exactly the drawn elements change at each version.
//! - [`Update::Training`]: as an optimizer updates f32 master weights: every version, every
//!   master moves by `lr * g` with `g` a seeded uniform in [-1, 1] (the size of an Adam step,
//!   whose normalized update is about one in magnitude), accumulated in f32 as training does
//!   in place, then cast to the tensor's dtype. Which elements change follows from the
//!   values: a master moves past a rounding boundary of the dtype with a probability of
//!   about `lr` over its ulp there, so bf16 copies of weights near 0.02 (ulp 1.2e-4) change in
//!   about one element in a hundred at `lr = 1e-6`. Over `--fill normal`, whose rows range
//!   from 2^-8 to 2^8 in magnitude and one row in eight is zero or tiny (those change at any
//!   rate), [`Evolution::changed_fraction`] measures, on 1024x1024 at version 2: bf16 13% at
//!   `lr` 1e-6, 18% at 1e-5, 30% at 1e-4, 47% at 1e-3; fp8e4m3 2.6%, 3.1%, 3.7%, 13%.

use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::error::{Error, Field, Result};
use crate::fill::{Fill, check_elements, mix, verified, write_elements};
use crate::layout::{Layout, Rank};
use crate::region::Region;

/// What changes from one version to the next.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    /// A seeded fraction (0..=1) of the elements, one ulp each.
    Density(f64),
    /// f32 masters stepped by `lr` times a seeded uniform in [-1, 1], cast to the dtype.
    Training {
        /// The learning rate: the largest step a master takes per version.
        lr: f32,
    },
}

impl std::fmt::Display for Update {
    /// As the reports name it: `density 0.01`, `training lr 0.00001`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Update::Density(d) => write!(f, "density {d}"),
            Update::Training { lr } => write!(f, "training lr {lr}"),
        }
    }
}

/// A tensor's contents at every version.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evolution {
    /// The contents at version 0.
    pub fill: Fill,
    /// What changes from one version to the next.
    pub update: Update,
    /// Seeds the updates' draws (apart from the fill's own seed).
    pub seed: u64,
}

/// The first magnitude that is not finite, for a float dtype's bit pattern.
fn non_finite(dtype: DType) -> Option<u64> {
    match dtype {
        DType::F64 => Some(0x7ff0_0000_0000_0000),
        DType::F32 => Some(0x7f80_0000),
        DType::Bf16 => Some(0x7f80),
        DType::F16 => Some(0x7c00),
        DType::Fp8E4M3 => Some(0x7f),
        DType::Fp8E5M2 => Some(0x7c),
        _ => None,
    }
}

/// `bits` (an element of `dtype`, in the low bytes) moved by `n` ulps: away from zero while
/// the result stays finite, else towards it; integers wrap, a bool flips with odd `n`.
fn step(dtype: DType, bits: u64, n: u64) -> u64 {
    let width = 8 * dtype.size() as u32;
    let all = if width == 64 {
        u64::MAX
    } else {
        (1 << width) - 1
    };
    if n == 0 {
        return bits;
    }
    match (dtype, non_finite(dtype)) {
        (DType::Bool, _) => bits ^ (n & 1),
        (_, Some(limit)) => {
            let sign = 1u64 << (width - 1);
            let magnitude = bits & (sign - 1);
            let moved = match magnitude.checked_add(n) {
                Some(m) if magnitude < limit && m < limit => m,
                _ => magnitude.wrapping_sub(n) & (sign - 1),
            };
            (bits & sign) | moved
        }
        _ => bits.wrapping_add(n) & all,
    }
}

impl Evolution {
    /// Checks the update against the tensor's dtype, naming the field: a density in 0..=1;
    /// a learning rate that is finite and not negative, for a float dtype filled `normal`
    /// (the masters).
    pub fn new(fill: Fill, update: Update, seed: u64, dtype: DType) -> Result<Evolution> {
        let invalid = |field, value: String, reason: &str| Error::InvalidOption {
            field,
            value,
            reason: reason.into(),
        };
        match update {
            Update::Density(d) if !(0.0..=1.0).contains(&d) => {
                return Err(invalid(
                    Field::Flag("--delta-density"),
                    d.to_string(),
                    "must be a fraction between 0 and 1",
                ));
            }
            Update::Training { lr } if !lr.is_finite() || lr < 0.0 => {
                return Err(invalid(
                    Field::Flag("--delta-lr"),
                    lr.to_string(),
                    "must be a finite learning rate, 0 or more",
                ));
            }
            Update::Training { .. } if !matches!(fill, Fill::Normal { .. }) => {
                return Err(invalid(
                    Field::Fill,
                    fill.to_string(),
                    "training-like updates step f32 masters: use --fill normal",
                ));
            }
            _ => {}
        }
        fill.check_dtype(dtype)?;
        Ok(Evolution { fill, update, seed })
    }

    /// A uniform draw in [0, 1) for element `index` at `version`.
    fn draw(&self, index: u64, version: u64) -> f64 {
        let h = mix(index ^ mix(version ^ mix(self.seed ^ 0x3c6e_f372_fe94_f82b)));
        (h >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Global element `index` of a tensor of `shape` and `dtype` at `version` (0: the fill),
    /// as little-endian bytes in the low `dtype.size()` of 8.
    pub fn element(&self, shape: &[u64], dtype: DType, index: u64, version: u64) -> u64 {
        match self.update {
            Update::Density(d) => {
                let moves = (1..=version).filter(|&v| self.draw(index, v) < d).count();
                step(dtype, self.fill.element(shape, dtype, index), moves as u64)
            }
            Update::Training { lr } => {
                let mut master = f32::from_bits(self.fill.element(shape, DType::F32, index) as u32);
                for v in 1..=version {
                    let g = (2.0 * self.draw(index, v) - 1.0) as f32;
                    master -= lr * g;
                }
                let mut out = [0u8; 8];
                crate::convert::cast::write_f32(dtype, master, &mut out);
                u64::from_le_bytes(out)
            }
        }
    }

    /// Fills `buf`, the dense row-major buffer of box `region` of `layout`'s tensor, with
    /// `version`.
    pub fn fill_region(&self, layout: &Layout, region: &Region, buf: &mut [u8], version: u64) {
        let (shape, dtype) = (layout.shape(), layout.dtype());
        write_elements(layout, region, buf, |index| {
            self.element(shape, dtype, index, version)
        });
    }

    /// Every rank's shard of `layout` at `version`.
    pub fn shards(&self, layout: &Layout, version: u64) -> Result<BTreeMap<Rank, Vec<u8>>> {
        let mut out = BTreeMap::new();
        for &rank in layout.mesh().ranks() {
            let bytes = layout.local_bytes(rank);
            let mut buf = crate::memory::zeroed(bytes, || format!("rank {rank}'s shard"))?;
            if let Some(region) = layout.local_region(rank) {
                self.fill_region(layout, &region, &mut buf, version);
            }
            out.insert(rank, buf);
        }
        Ok(out)
    }

    /// Checks every destination shard against `version`, naming the first wrong byte.
    pub fn verify_shards(
        &self,
        layout: &Layout,
        shards: &BTreeMap<Rank, Vec<u8>>,
        version: u64,
    ) -> Result<()> {
        self.verify_shards_from(layout.dtype(), layout, shards, version)
    }

    /// [`Evolution::verify_shards`] of destinations cast from `from` elements: each expected
    /// element is the source's at `version`, cast to the destination's dtype (a training-like
    /// update casts its f32 masters whatever `from` is).
    pub fn verify_shards_from(
        &self,
        from: DType,
        layout: &Layout,
        shards: &BTreeMap<Rank, Vec<u8>>,
        version: u64,
    ) -> Result<()> {
        layout.check_buffers(crate::error::Side::Dst, shards)?;
        // the first wrong byte of all, with every rank's count of them
        let (mut first, mut mismatches) = (None, 0);
        for &rank in layout.mesh().ranks() {
            match self.verify_shard_from(from, layout, rank, &shards[&rank], version) {
                Ok(()) => {}
                Err(e @ Error::VerifyFailed { .. }) => {
                    if let Error::VerifyFailed { mismatches: n, .. } = e {
                        mismatches += n;
                    }
                    first.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        match first {
            Some(Error::VerifyFailed {
                rank,
                offset,
                expected,
                found,
                ..
            }) => Err(Error::VerifyFailed {
                rank,
                offset,
                expected,
                found,
                mismatches,
            }),
            _ => Ok(()),
        }
    }

    /// Checks `rank`'s destination shard `buf` of `layout` against `version` (cast from
    /// `from`, as [`Evolution::verify_shards_from`]), naming the first wrong byte.
    pub fn verify_shard_from(
        &self,
        from: DType,
        layout: &Layout,
        rank: Rank,
        buf: &[u8],
        version: u64,
    ) -> Result<()> {
        match layout.local_region(rank) {
            Some(region) => self.verify_region_from(from, layout, &region, buf, (rank, 0), version),
            None => Ok(()),
        }
    }

    /// Checks `buf`, the dense row-major box `region` of `layout`'s tensor, against
    /// `version` (cast from `from`, as [`Evolution::verify_shards_from`]); `at` names the rank
    /// and the byte of its buffer where `buf` starts, for the error.
    pub fn verify_region_from(
        &self,
        from: DType,
        layout: &Layout,
        region: &Region,
        buf: &[u8],
        (rank, at): (Rank, u64),
        version: u64,
    ) -> Result<()> {
        let (shape, dtype) = (layout.shape(), layout.dtype());
        let from = match self.update {
            Update::Training { .. } => dtype,
            Update::Density(_) => from,
        };
        let expect = |index| {
            let e = self.element(shape, from, index, version).to_le_bytes();
            if from == dtype {
                return e;
            }
            let mut out = [0u8; 8];
            // a cast the plan made is a cast this can make
            let _ = crate::convert::cast::cast(
                from,
                dtype,
                &e[..from.size()],
                &mut out[..dtype.size()],
            );
            out
        };
        verified((rank, at), check_elements(layout, region, buf, expect))
    }

    /// The fraction of `samples` evenly spread elements of a tensor of `shape` in `dtype`
    /// whose bytes differ between `version - 1` and `version`: what a delta of that version
    /// sends.
    pub fn changed_fraction(&self, shape: &[u64], dtype: DType, version: u64, samples: u64) -> f64 {
        let total: u64 = shape.iter().product();
        let samples = samples.min(total).max(1);
        if total == 0 || version == 0 {
            return 0.0;
        }
        let changed = (0..samples)
            .map(|k| k * total / samples)
            .filter(|&i| {
                self.element(shape, dtype, i, version) != self.element(shape, dtype, i, version - 1)
            })
            .count();
        changed as f64 / samples as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;

    fn layout(spec: &str, shape: &[u64], dtype: DType) -> Layout {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, dtype, 0)
            .unwrap()
    }

    #[test]
    fn version_zero_is_the_fill() {
        let l = layout("mesh=2 place=S(1)", &[6, 10], DType::Bf16);
        let fill = Fill::Normal { seed: 3 };
        let e = Evolution::new(fill, Update::Density(0.5), 9, DType::Bf16).unwrap();
        assert_eq!(e.shards(&l, 0).unwrap(), fill.shards(&l).unwrap());
        let t = Evolution::new(fill, Update::Training { lr: 1e-3 }, 9, DType::Bf16).unwrap();
        assert_eq!(t.shards(&l, 0).unwrap(), fill.shards(&l).unwrap());
    }

    #[test]
    fn a_density_changes_that_fraction_every_version_and_only_it() {
        for dtype in [
            DType::Bf16,
            DType::F32,
            DType::Fp8E4M3,
            DType::I32,
            DType::Bool,
        ] {
            let fill = if dtype == DType::I32 || dtype == DType::Bool {
                Fill::Hash { seed: 1 }
            } else {
                Fill::Normal { seed: 1 }
            };
            for d in [0.0, 0.01, 0.5, 1.0] {
                let e = Evolution::new(fill, Update::Density(d), 7, dtype).unwrap();
                let shape = [200, 200];
                for v in 1..=3 {
                    let got = e.changed_fraction(&shape, dtype, v, 40_000);
                    assert!(
                        (got - d).abs() < 0.01,
                        "{dtype} density {d} version {v}: {got}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_step_moves_one_ulp_and_stays_finite() {
        assert_eq!(step(DType::Bf16, 0x3f80, 1), 0x3f81);
        assert_eq!(step(DType::Bf16, 0xbf80, 1), 0xbf81);
        // the largest finite bf16 steps down, not into infinity
        assert_eq!(step(DType::Bf16, 0x7f7f, 1), 0x7f7e);
        assert_eq!(step(DType::Fp8E4M3, 0x7e, 1), 0x7d);
        assert_eq!(step(DType::U8, 0xff, 1), 0x00);
        assert_eq!(step(DType::Bool, 1, 1), 0);
        assert_eq!(step(DType::F64, 0, 2), 2);
    }

    #[test]
    fn training_changes_what_its_learning_rate_reaches() {
        let shape = [256, 256];
        let fill = Fill::Normal { seed: 5 };
        let frac = |lr: f32, dtype| {
            let e = Evolution::new(fill, Update::Training { lr }, 11, dtype).unwrap();
            e.changed_fraction(&shape, dtype, 2, 20_000)
        };
        // f32 masters change almost everywhere; their bf16 copies far less, and less still
        // for a smaller learning rate
        assert!(frac(1e-4, DType::F32) > 0.9);
        let (big, small) = (frac(1e-3, DType::Bf16), frac(1e-5, DType::Bf16));
        assert!(
            big > small && small < 0.2,
            "bf16: {big} at 1e-3, {small} at 1e-5"
        );
        assert_eq!(frac(0.0, DType::Bf16), 0.0);
    }

    #[test]
    fn a_shard_verifies_at_its_version_only() {
        let l = layout("mesh=3 place=S(0)", &[7, 5], DType::F16);
        let e = Evolution::new(
            Fill::Normal { seed: 2 },
            Update::Density(0.3),
            1,
            DType::F16,
        )
        .unwrap();
        let v2 = e.shards(&l, 2).unwrap();
        assert!(e.verify_shards(&l, &v2, 2).is_ok());
        assert!(matches!(
            e.verify_shards(&l, &v2, 1),
            Err(Error::VerifyFailed { .. })
        ));
    }

    #[test]
    fn bad_updates_name_their_flag() {
        let fill = Fill::Normal { seed: 0 };
        let e = Evolution::new(fill, Update::Density(1.5), 0, DType::Bf16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--delta-density: 1.5 is invalid: must be a fraction between 0 and 1"
        );
        let e =
            Evolution::new(Fill::Index, Update::Training { lr: 1e-5 }, 0, DType::Bf16).unwrap_err();
        assert!(e.to_string().contains("use --fill normal"), "{e}");
        assert!(Evolution::new(fill, Update::Training { lr: f32::NAN }, 0, DType::Bf16).is_err());
    }
}
