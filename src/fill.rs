//! Deterministic tensor contents, a pure function of an element's global index, so that any
//! rank can fill its source shard and check its destination shard without seeing the rest.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

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
    Hash { seed: u64 },
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
        }
    }
}

impl FromStr for Fill {
    type Err = Error;

    /// `index`, `hash` or `hash:SEED`.
    fn from_str(s: &str) -> Result<Fill> {
        let bad = || Error::InvalidOption {
            field: "--fill",
            value: s.to_string(),
            reason: "expected `index`, `hash` or `hash:SEED`".into(),
        };
        match s.split_once(':') {
            None if s == "index" => Ok(Fill::Index),
            None if s == "hash" => Ok(Fill::Hash { seed: 0 }),
            Some(("hash", seed)) => seed
                .parse()
                .map(|seed| Fill::Hash { seed })
                .map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}

/// SplitMix64's finalizer: a cheap, well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Fill {
    /// The value of global element `index`, as 8 little-endian bytes (the low ones count).
    pub fn value(self, index: u64) -> u64 {
        match self {
            Fill::Index => index,
            Fill::Hash { seed } => mix(index ^ mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15))),
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
        let elem = layout.dtype().size();
        let row_len = region.extent.last().copied().unwrap_or(1);
        Self::for_each_row(layout.shape(), region, |pos, global| {
            let start = pos as usize * elem;
            let row = &mut buf[start..start + row_len as usize * elem];
            for (i, out) in row.chunks_exact_mut(elem).enumerate() {
                out.copy_from_slice(&self.value(global + i as u64).to_le_bytes()[..elem]);
            }
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
        let elem = layout.dtype().size();
        let row_len = region.extent.last().copied().unwrap_or(1) as usize;
        let mut first = None;
        let mut count = 0u64;
        Self::for_each_row(layout.shape(), region, |pos, global| {
            let start = pos as usize * elem;
            let row = &buf[start..start + row_len * elem];
            for (i, got) in row.chunks_exact(elem).enumerate() {
                let want = self.value(global + i as u64).to_le_bytes();
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

    /// Checks `buf`, the bytes of box `region` that start at byte `at` of one of `rank`'s
    /// buffers, against the fill: the first wrong byte (its offset in that buffer) and how many
    /// are wrong, as an error.
    pub fn verify_region(
        self,
        layout: &Layout,
        region: &Region,
        buf: &[u8],
        (rank, at): (Rank, u64),
    ) -> Result<()> {
        match self.check_region(layout, region, buf) {
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

    /// Checks every destination shard of `layout` against the fill, byte for byte.
    pub fn verify_shards(self, layout: &Layout, shards: &BTreeMap<Rank, Vec<u8>>) -> Result<()> {
        crate::exec::check_buffers(layout, crate::error::Side::Dst, shards)?;
        let mut first = None;
        let mut mismatches = 0;
        for (p, &rank) in layout.mesh().ranks().iter().enumerate() {
            if let Some((offset, expected, found, n)) =
                self.check_region(layout, &layout.region_at(p), &shards[&rank])
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
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
    fn parse() {
        assert_eq!("hash:9".parse::<Fill>().unwrap(), Fill::Hash { seed: 9 });
        assert!(
            "zeros"
                .parse::<Fill>()
                .unwrap_err()
                .to_string()
                .contains("--fill: zeros")
        );
    }
}
