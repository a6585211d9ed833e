//! Deterministic tensor contents, a pure function of an element's global index, so that any
//! rank can fill its source shard and check its destination shard without seeing the rest.

use crate::error::Field;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Layout, Rank};
use crate::memory;
use crate::region::Region;

/// How the global tensor is filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Element `i` (row-major linear index) holds `i mod 2^(8 x elem_bytes)`, little-endian.
    /// Easy to read in a dump, but it repeats every `2^(8 x elem_bytes)` elements (every 256
    /// for 1-byte types, every 65536 for 2-byte ones: rows `r` and `r + 8` of an 8192-column
    /// bf16 tensor are equal), so a block that lands in the wrong place can still verify.
    Index,
    /// Element `i` holds the low bytes of a 64-bit hash of `(seed, i)`: location-sensitive
    /// for every dtype. A misplaced element of a 1-byte type goes unseen with probability
    /// 1/256, so a misplaced run of `k` elements with `256^-k`; wider types do better.
    Hash {
        /// Seeds the hash: another seed, other contents.
        seed: u64,
    },
    /// `normal:SEED`: finite floats of varied magnitude, for the conversions (`--dst-dtype`,
    /// `--quant`), whose results depend on the values: element `i` is an approximately normal
    /// value (a sum of four uniforms, scaled to unit variance) times a power of two drawn per
    /// row (the last dim) from 2^-8..2^8, so that block scales differ from block to block;
    /// about one row in 16 is all zeros (the amax clamp and the zero scale) and one in 16 is
    /// tiny (near 2^-20, below the clamp). Only basic arithmetic, no `ln` or `cos` (whose last
    /// bit may differ between C libraries), so every host computes the same bits. Generated
    /// as f32 and cast (nearest even) to the tensor's float dtype; float dtypes only.
    Normal {
        /// Seeds the values and the rows' magnitudes.
        seed: u64,
    },
}

impl Default for Fill {
    /// `hash`: the fill under which a verification sees where bytes land, not only that some
    /// bytes did.
    fn default() -> Fill {
        Fill::Hash { seed: 0 }
    }
}

impl fmt::Display for Fill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fill::Index => f.write_str("index"),
            Fill::Hash { seed } => write!(f, "hash:{seed}"),
            Fill::Normal { seed } => write!(f, "normal:{seed}"),
        }
    }
}

impl FromStr for Fill {
    type Err = Error;

    /// `index`, `hash`, `hash:SEED`, `normal` or `normal:SEED`.
    fn from_str(s: &str) -> Result<Fill> {
        let bad = || Error::InvalidOption {
            field: Field::Fill,
            value: s.to_string(),
            reason: "expected `index`, `hash`, `hash:SEED`, `normal` or `normal:SEED`".into(),
        };
        match s.split_once(':') {
            None if s == "index" => Ok(Fill::Index),
            None if s == "hash" => Ok(Fill::Hash { seed: 0 }),
            None if s == "normal" => Ok(Fill::Normal { seed: 0 }),
            Some(("hash", seed)) => seed
                .parse()
                .map(|seed| Fill::Hash { seed })
                .map_err(|_| bad()),
            Some(("normal", seed)) => seed
                .parse()
                .map(|seed| Fill::Normal { seed })
                .map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}

/// SplitMix64's finalizer: a cheap, well-mixed 64-bit hash.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rows of `normal` that are all zeros, or tiny: one in `NORMAL_SPECIAL_ROWS` each.
const NORMAL_SPECIAL_ROWS: u64 = 16;

impl Fill {
    /// The value of global element `index`, as 8 little-endian bytes (the low ones count).
    /// For `normal`, whose magnitude depends on the row, this is the f32 bits of the element
    /// of a tensor that is one row; [`Fill::element`] gives the element of any shape.
    pub fn value(self, index: u64) -> u64 {
        match self {
            Fill::Index => index,
            Fill::Hash { seed } => mix(index ^ mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15))),
            Fill::Normal { seed } => Self::normal(seed, 0, index).to_bits() as u64,
        }
    }

    /// The f32 value of `normal`'s element `index`, in row `row`.
    pub fn normal(seed: u64, row: u64, index: u64) -> f32 {
        let row_hash = mix(row ^ mix(seed ^ 0x6a09_e667_f3bc_c909));
        let power = match row_hash % NORMAL_SPECIAL_ROWS {
            0 => return 0.0,
            1 => -20,
            _ => ((row_hash >> 8) % 17) as i32 - 8,
        };
        let h = mix(index ^ mix(seed.wrapping_add(0xbb67_ae85_84ca_a73b)));
        // four 16-bit uniforms in [0, 1): their sum has mean 2 and variance 1/3
        let sum: f64 = (0..4)
            .map(|k| ((h >> (16 * k)) & 0xffff) as f64 / 65536.0)
            .sum();
        let unit = (sum - 2.0) * 3f64.sqrt();
        (unit * 2f64.powi(power)) as f32
    }

    /// Whether this fill gives values of `dtype`: `normal` fills float dtypes only.
    pub fn check_dtype(self, dtype: DType) -> Result<()> {
        let float = matches!(
            dtype,
            DType::F64 | DType::F32 | DType::Bf16 | DType::F16 | DType::Fp8E4M3 | DType::Fp8E5M2
        );
        match self {
            Fill::Normal { .. } if !float => Err(Error::InvalidOption {
                field: Field::Fill,
                value: self.to_string(),
                reason: format!(
                    "fills float dtypes only (f64, f32, bf16, f16, fp8e4m3, fp8e5m2), and the dtype is {dtype}"
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Global element `index` of a tensor of `shape` and `dtype`, as little-endian bytes in
    /// the low `dtype.size()` of 8. For `normal`, the f32 value cast to `dtype` (to nearest
    /// even; fp8 saturates); for an integer dtype, which [`Fill::check_dtype`] refuses, the
    /// f32 bits, truncated.
    pub fn element(self, shape: &[u64], dtype: DType, index: u64) -> u64 {
        match self {
            Fill::Normal { seed } => {
                let row_len = shape.last().copied().unwrap_or(1).max(1);
                let x = Self::normal(seed, index / row_len, index);
                let mut out = [0u8; 8];
                crate::convert::cast::write_f32(dtype, x, &mut out);
                u64::from_le_bytes(out)
            }
            _ => self.value(index),
        }
    }

    /// Calls `f(position_in_region_stream, global_index)` for every row of `region` (runs of
    /// the innermost dim), in row-major order.
    fn for_each_row(shape: &[u64], region: &Region, mut f: impl FnMut(u64, u64)) {
        let n = shape.len();
        if region.is_empty() {
            return;
        }
        if n == 0 {
            f(0, 0);
            return;
        }
        let rows = region.volume() / region.extent[n - 1];
        let mut idx = vec![0u64; n - 1];
        for row in 0..rows {
            let global = (0..n).fold(0u64, |acc, d| {
                let c = region.offset[d] + if d < n - 1 { idx[d] } else { 0 };
                acc * shape[d] + c
            });
            f(row * region.extent[n - 1], global);
            for d in (0..n - 1).rev() {
                idx[d] += 1;
                if idx[d] < region.extent[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    /// Fills `buf`, the dense row-major buffer of box `region` of `layout`'s tensor.
    pub fn fill_region(self, layout: &Layout, region: &Region, buf: &mut [u8]) {
        write_elements(layout, region, buf, |index| {
            self.element(layout.shape(), layout.dtype(), index)
        });
    }

    /// A filled source shard for every rank of `layout`; [`Error::OutOfMemory`] when they do
    /// not fit in memory.
    pub fn shards(self, layout: &Layout) -> Result<BTreeMap<Rank, Vec<u8>>> {
        let mut out = BTreeMap::new();
        for &r in layout.mesh().ranks() {
            if let Some(buf) = self.shard(layout, r)? {
                out.insert(r, buf);
            }
        }
        Ok(out)
    }

    /// `rank`'s filled shard of `layout`, if it holds one; [`Error::OutOfMemory`] when it does
    /// not fit in memory.
    pub fn shard(self, layout: &Layout, rank: Rank) -> Result<Option<Vec<u8>>> {
        let Some(region) = layout.local_region(rank) else {
            return Ok(None);
        };
        let mut buf = memory::zeroed(layout.local_bytes(rank), || {
            format!("rank {rank}'s source shard")
        })?;
        self.fill_region(layout, &region, &mut buf);
        Ok(Some(buf))
    }

    /// Checks `buf` against the fill; returns (first wrong byte offset, expected, found, count).
    pub fn check_region(
        self,
        layout: &Layout,
        region: &Region,
        buf: &[u8],
    ) -> Option<(u64, u8, u8, u64)> {
        self.check_converted(layout.dtype(), layout, region, buf)
    }

    /// [`Fill::check_region`] for a destination converted from a source of `from` elements
    /// (`--dst-dtype`): each expected element is the fill's value in `from`, cast to `layout`'s
    /// dtype as [`crate::convert::cast()`] does (exactly torch's `.to()`). Pairs the cast refuses
    /// are never planned; for them the fill's own value in `layout`'s dtype is expected.
    pub fn check_converted(
        self,
        from: DType,
        layout: &Layout,
        region: &Region,
        buf: &[u8],
    ) -> Option<(u64, u8, u8, u64)> {
        let elem = layout.dtype().size();
        let to = layout.dtype();
        let converts = from != to && crate::convert::cast_supported(from, to).is_ok();
        let expect = |index: u64| -> [u8; 8] {
            if !converts {
                return self.element(layout.shape(), to, index).to_le_bytes();
            }
            let v = self.element(layout.shape(), from, index).to_le_bytes();
            let mut out = [0u8; 8];
            // a supported pair, on one element each side: cannot fail
            let _ = crate::convert::cast(from, to, &v[..from.size()], &mut out[..elem]);
            out
        };
        check_elements(layout, region, buf, expect)
    }

    /// Checks `buf`, the bytes of box `region` that start at byte `at` of one of `rank`'s
    /// buffers, against the fill: the first wrong byte (its offset in that buffer) and how many
    /// are wrong, as an error.
    pub fn verify_region(
        self,
        layout: &Layout,
        region: &Region,
        buf: &[u8],
        at: (Rank, u64),
    ) -> Result<()> {
        self.verify_converted(layout.dtype(), layout, region, buf, at)
    }

    /// [`Fill::verify_region`] for a destination converted from `from` elements (see
    /// [`Fill::check_converted`]).
    pub fn verify_converted(
        self,
        from: DType,
        layout: &Layout,
        region: &Region,
        buf: &[u8],
        (rank, at): (Rank, u64),
    ) -> Result<()> {
        verified((rank, at), self.check_converted(from, layout, region, buf))
    }

    /// Checks every destination shard of `layout` against the fill, byte for byte.
    pub fn verify_shards(self, layout: &Layout, shards: &BTreeMap<Rank, Vec<u8>>) -> Result<()> {
        self.verify_shards_converted(layout.dtype(), layout, shards)
    }

    /// [`Fill::verify_shards`] for destinations converted from `from` elements (see
    /// [`Fill::check_converted`]).
    pub fn verify_shards_converted(
        self,
        from: DType,
        layout: &Layout,
        shards: &BTreeMap<Rank, Vec<u8>>,
    ) -> Result<()> {
        layout.check_buffers(crate::error::Side::Dst, shards)?;
        let mut first = None;
        let mut mismatches = 0;
        for (p, &rank) in layout.mesh().ranks().iter().enumerate() {
            if let Some((offset, expected, found, n)) =
                self.check_converted(from, layout, &layout.region_at(p), &shards[&rank])
            {
                mismatches += n;
                first.get_or_insert((rank, offset, expected, found));
            }
        }
        match first {
            None => Ok(()),
            Some((rank, offset, expected, found)) => Err(Error::VerifyFailed {
                rank,
                offset,
                expected,
                found,
                mismatches,
            }),
        }
    }
}

/// Writes `buf`, the dense row-major buffer of box `region` of `layout`'s tensor, with
/// `value(global index)` (little-endian, the low bytes of the dtype's size): the one walk of a
/// box's rows that every fill (and every version of one, [`crate::evolve`]) writes through.
pub(crate) fn write_elements(
    layout: &Layout,
    region: &Region,
    buf: &mut [u8],
    value: impl Fn(u64) -> u64,
) {
    let elem = layout.dtype().size();
    let row_len = region.extent.last().copied().unwrap_or(1) as usize;
    Fill::for_each_row(layout.shape(), region, |pos, global| {
        let start = pos as usize * elem;
        let row = &mut buf[start..start + row_len * elem];
        for (i, out) in row.chunks_exact_mut(elem).enumerate() {
            out.copy_from_slice(&value(global + i as u64).to_le_bytes()[..elem]);
        }
    });
}

/// Checks `buf`, box `region` of `layout`'s tensor, against `expect(global index)` (as
/// [`write_elements`] writes it): the first wrong byte's offset, the byte expected and the one
/// found, and how many bytes are wrong.
/// A check's outcome ([`check_elements`]) as the error that names the first wrong byte of a
/// buffer starting at byte `at` of `rank`'s.
pub(crate) fn verified(
    (rank, at): (Rank, u64),
    first_wrong: Option<(u64, u8, u8, u64)>,
) -> Result<()> {
    match first_wrong {
        None => Ok(()),
        Some((offset, expected, found, mismatches)) => Err(Error::VerifyFailed {
            rank,
            offset: at + offset,
            expected,
            found,
            mismatches,
        }),
    }
}

pub(crate) fn check_elements(
    layout: &Layout,
    region: &Region,
    buf: &[u8],
    expect: impl Fn(u64) -> [u8; 8],
) -> Option<(u64, u8, u8, u64)> {
    let elem = layout.dtype().size();
    let row_len = region.extent.last().copied().unwrap_or(1) as usize;
    let mut first = None;
    let mut count = 0u64;
    Fill::for_each_row(layout.shape(), region, |pos, global| {
        let start = pos as usize * elem;
        let row = &buf[start..start + row_len * elem];
        for (i, got) in row.chunks_exact(elem).enumerate() {
            let want = expect(global + i as u64);
            if got != &want[..elem] {
                for b in 0..elem {
                    if got[b] != want[b] {
                        count += 1;
                        first.get_or_insert(((start + i * elem + b) as u64, want[b], got[b]));
                    }
                }
            }
        }
    });
    first.map(|(o, e, g)| (o, e, g, count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;

    #[test]
    fn index_fill_is_the_linear_index_mod_elem_width() {
        let l = LayoutSpec::parse("mesh=1 place=R")
            .unwrap()
            .resolve(&[3, 200], DType::U8, 0)
            .unwrap();
        let shards = Fill::Index.shards(&l).unwrap();
        let buf = &shards[&0];
        assert_eq!(buf[0], 0);
        assert_eq!(buf[255], 255);
        assert_eq!(buf[256], 0); // mod 2^8
        let l = LayoutSpec::parse("mesh=2 place=S(1)")
            .unwrap()
            .resolve(&[2, 4], DType::Bf16, 0)
            .unwrap();
        let shards = Fill::Index.shards(&l).unwrap();
        // rank 1 holds columns 2..4: elements 2, 3, 6, 7
        assert_eq!(shards[&1], [2, 0, 3, 0, 6, 0, 7, 0]);
        assert!(Fill::Index.verify_shards(&l, &shards).is_ok());
    }

    #[test]
    fn verify_reports_first_mismatch_and_count() {
        let l = LayoutSpec::parse("mesh=2 place=S(0)")
            .unwrap()
            .resolve(&[4, 4], DType::F32, 0)
            .unwrap();
        let mut shards = Fill::Hash { seed: 7 }.shards(&l).unwrap();
        shards.get_mut(&1).unwrap()[5] ^= 1;
        shards.get_mut(&1).unwrap()[9] ^= 1;
        let err = Fill::Hash { seed: 7 }
            .verify_shards(&l, &shards)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::VerifyFailed {
                    rank: 1,
                    offset: 5,
                    mismatches: 2,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// For a 1-byte type, an element of the default fill equals one `d` places away about once
    /// in 256 (by chance), for every distance, where `index` repeats exactly every 256.
    #[test]
    fn the_default_fill_does_not_repeat_for_one_byte_types() {
        let byte = |fill: Fill, i: u64| fill.value(i) as u8;
        assert_eq!(Fill::default(), Fill::Hash { seed: 0 });
        let n = 1u64 << 16;
        for d in [1, 2, 8, 255, 256, 512, 4096, 65536] {
            let same = (0..n)
                .filter(|&i| byte(Fill::default(), i) == byte(Fill::default(), i + d))
                .count() as f64;
            // 256 expected; 5 standard deviations (about 16 each) either way
            assert!((176.0..336.0).contains(&same), "distance {d}: {same}");
        }
        assert!((0..n).all(|i| byte(Fill::Index, i) == byte(Fill::Index, i + 256)));
    }

    #[test]
    fn normal_parses_and_refuses_integer_dtypes() {
        assert_eq!("normal".parse::<Fill>().unwrap(), Fill::Normal { seed: 0 });
        assert_eq!(
            "normal:7".parse::<Fill>().unwrap(),
            Fill::Normal { seed: 7 }
        );
        assert_eq!(Fill::Normal { seed: 7 }.to_string(), "normal:7");
        assert!(
            "normal:x"
                .parse::<Fill>()
                .unwrap_err()
                .to_string()
                .contains("fill: normal:x")
        );
        for d in DType::ALL {
            let float = matches!(
                d,
                DType::F64
                    | DType::F32
                    | DType::Bf16
                    | DType::F16
                    | DType::Fp8E4M3
                    | DType::Fp8E5M2
            );
            assert_eq!(
                Fill::Normal { seed: 0 }.check_dtype(d).is_ok(),
                float,
                "{d}"
            );
            assert!(Fill::default().check_dtype(d).is_ok());
        }
        let err = Fill::Normal { seed: 3 }
            .check_dtype(DType::I32)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("fill: normal:3 is invalid") && err.ends_with("the dtype is i32"),
            "{err}"
        );
    }

    /// `normal` is finite, varies in magnitude from row to row (zero rows, tiny rows, powers
    /// 2^-8..2^8), is the same for every shard of it, and is cast from its f32 values.
    #[test]
    fn normal_has_rows_of_varied_magnitude() {
        let fill = Fill::Normal { seed: 5 };
        let (rows, cols) = (512u64, 64u64);
        let mut zero_rows = 0;
        let mut tiny_rows = 0;
        let mut powers = std::collections::BTreeSet::new();
        for r in 0..rows {
            let xs: Vec<f32> = (0..cols)
                .map(|c| Fill::normal(5, r, r * cols + c))
                .collect();
            assert!(xs.iter().all(|x| x.is_finite()));
            let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
            if amax == 0.0 {
                zero_rows += 1;
            } else if amax < 1e-5 {
                tiny_rows += 1;
            } else {
                // a unit-variance row's amax over 64 lies within 2^-1..2^2 of its power
                powers.insert(amax.log2().round() as i32);
            }
        }
        assert!((8..=64).contains(&zero_rows), "{zero_rows}");
        assert!((8..=64).contains(&tiny_rows), "{tiny_rows}");
        assert!(
            powers.first().unwrap() <= &-7 && powers.last().unwrap() >= &8,
            "{powers:?}"
        );
        // every dtype's element is the f32 value cast; shards agree with the whole
        for dtype in [
            DType::F32,
            DType::Bf16,
            DType::F16,
            DType::F64,
            DType::Fp8E4M3,
        ] {
            let whole = LayoutSpec::parse("mesh=1 place=R")
                .unwrap()
                .resolve(&[6, 10], dtype, 0)
                .unwrap();
            let split = LayoutSpec::parse("mesh=2x2 place=S(0),S(1)")
                .unwrap()
                .resolve(&[6, 10], dtype, 0)
                .unwrap();
            let all = fill.shards(&whole).unwrap().remove(&0).unwrap();
            let e = dtype.size();
            for i in 0..60u64 {
                let x = Fill::normal(5, i / 10, i);
                let mut want = [0u8; 8];
                crate::convert::cast::write_f32(dtype, x, &mut want);
                assert_eq!(
                    &all[i as usize * e..(i as usize + 1) * e],
                    &want[..e],
                    "{dtype} {i}"
                );
            }
            let parts = fill.shards(&split).unwrap();
            assert!(fill.verify_shards(&split, &parts).is_ok());
            assert_eq!(parts[&3][..e], all[(3 * 10 + 5) * e..(3 * 10 + 6) * e]);
        }
    }

    #[test]
    fn parse() {
        assert_eq!("hash:9".parse::<Fill>().unwrap(), Fill::Hash { seed: 9 });
        assert!(
            "zeros"
                .parse::<Fill>()
                .unwrap_err()
                .to_string()
                .contains("fill: zeros")
        );
    }
}
