//! Each source rank's amax of the blocks it holds, and the partial amax exchange between the
//! source ranks that share a block (planned without communication).

use super::{BlockGrid, for_each_point, for_each_row, index_in};
use crate::convert::ConvertError;
use crate::convert::cast::read_f32;
use crate::dtype::DType;
use crate::error::Dims;
use crate::layout::{Layout, Rank};
use crate::region::Region;

/// Every block's amax over the part of the tensor one rank holds (later: merged with its
/// peers' partial amax into the whole block's).
#[derive(Clone, Debug, PartialEq)]
pub struct AmaxGrid {
    /// The blocks covered, in grid coordinates.
    pub blocks: Region,
    /// Their amax, row-major over `blocks`.
    pub amax: Vec<f32>,
}

/// The largest magnitude among `bytes` (elements of `dtype`) read as f32, and whether all
/// are finite. For IEEE formats the order of magnitudes is the order of the bit patterns
/// without the sign, so the scan is an integer maximum, which vectorizes; NaN and infinities
/// sort above every finite value. An f64 beyond the f32 range reads as an infinity, as the
/// quantizer's f32 arithmetic would see it.
pub(super) fn max_abs(dtype: DType, bytes: &[u8]) -> (f32, bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { max_abs_avx2(dtype, bytes) };
    }
    max_abs_body(dtype, bytes)
}

/// [`max_abs`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn max_abs_avx2(dtype: DType, bytes: &[u8]) -> (f32, bool) {
    max_abs_body(dtype, bytes)
}

#[inline(always)]
fn max_abs_body(dtype: DType, bytes: &[u8]) -> (f32, bool) {
    match dtype {
        DType::F32 => {
            let m = bytes
                .chunks_exact(4)
                .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) & 0x7fff_ffff)
                .fold(0, u32::max);
            (f32::from_bits(m), m < 0x7f80_0000)
        }
        DType::Bf16 | DType::F16 => {
            let m = bytes
                .chunks_exact(2)
                .map(|s| u16::from_le_bytes([s[0], s[1]]) & 0x7fff)
                .fold(0, u16::max);
            if dtype == DType::Bf16 {
                (crate::convert::cast::bf16_to_f32(m), m < 0x7f80)
            } else {
                (crate::convert::cast::f16_to_f32(m), m < 0x7c00)
            }
        }
        DType::F64 => {
            let m = bytes
                .chunks_exact(8)
                .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")) & (u64::MAX >> 1))
                .fold(0, u64::max);
            let m = f64::from_bits(m) as f32;
            (m, m.is_finite())
        }
        _ => bytes
            .chunks_exact(dtype.size())
            .map(|s| read_f32(dtype, s))
            .fold((0f32, true), |(m, ok), x| {
                (m.max(x.abs()), ok && x.is_finite())
            }),
    }
}

impl AmaxGrid {
    /// The amax of every block `shard` touches, over the elements of `buf`, the rank's dense
    /// row-major buffer of `shard` (dtype `dtype`, a float type). A NaN or an infinity is an
    /// error naming its block and element: it has no fp8 value and would poison its block's
    /// scale.
    ///
    /// Panics if `buf` is shorter than `shard`: the executor checks buffer sizes first.
    pub fn local(
        grid: &BlockGrid,
        shard: &Region,
        buf: &[u8],
        dtype: DType,
    ) -> Result<AmaxGrid, ConvertError> {
        let blocks = grid.blocks_touching(shard);
        let mut amax = vec![0f32; blocks.volume() as usize];
        let elem = dtype.size();
        let n = shard.ndim();
        let mut err = None;
        for_each_row(shard, shard, |p, local, len| {
            if err.is_some() {
                return;
            }
            let mut b: Vec<u64> = (0..n).map(|d| p[d] / grid.block[d]).collect();
            let last = n.saturating_sub(1);
            let mut col = p.get(last).copied().unwrap_or(0);
            let end = col + len;
            let mut at = local as usize * elem;
            while col < end {
                let bl = grid.block.get(last).copied().unwrap_or(1);
                let run_end = ((col / bl + 1) * bl).min(end);
                if n > 0 {
                    b[last] = col / bl;
                }
                let bytes = &buf[at..at + (run_end - col) as usize * elem];
                let (m, finite) = max_abs(dtype, bytes);
                let bad = if finite {
                    None
                } else {
                    bytes
                        .chunks_exact(elem)
                        .map(|s| read_f32(dtype, s))
                        .enumerate()
                        .find(|(_, x)| !x.is_finite())
                };
                if let Some((i, x)) = bad {
                    let mut element = p.to_vec();
                    if n > 0 {
                        element[last] = col + i as u64;
                    }
                    err = Some(ConvertError::NonFinite {
                        block: b.clone(),
                        element,
                        value: x,
                    });
                    return;
                }
                let k = index_in(&blocks, &b);
                amax[k] = amax[k].max(m);
                at += (run_end - col) as usize * elem;
                col = run_end;
            }
        });
        match err {
            Some(e) => Err(e),
            None => Ok(AmaxGrid { blocks, amax }),
        }
    }

    /// The partial amax of `sub` (a box within [`AmaxGrid::blocks`]), row-major, as
    /// little-endian f32: what a rank sends a peer of [`amax_exchange`].
    pub fn payload(&self, sub: &Region) -> Vec<u8> {
        let mut out = Vec::with_capacity(sub.volume() as usize * 4);
        for_each_point(sub, |b| {
            out.extend_from_slice(&self.amax[index_in(&self.blocks, b)].to_le_bytes())
        });
        out
    }

    /// Takes a peer's partial amax of `sub` (as [`AmaxGrid::payload`] wrote it) into this
    /// rank's: the maximum of both. A payload of the wrong length is an error.
    pub fn merge(&mut self, sub: &Region, payload: &[u8]) -> Result<(), ConvertError> {
        if payload.len() as u64 != sub.volume() * 4 {
            return Err(ConvertError::AmaxPayload {
                blocks: Dims(sub.extent.clone()),
                got: payload.len() as u64,
            });
        }
        let mut values = payload.chunks_exact(4);
        let blocks = &self.blocks;
        let amax = &mut self.amax;
        for_each_point(sub, |b| {
            let v = f32::from_le_bytes(
                values
                    .next()
                    .expect("length checked")
                    .try_into()
                    .expect("4"),
            );
            let k = index_in(blocks, b);
            amax[k] = amax[k].max(v);
        });
        Ok(())
    }
}

/// For the source rank `rank` of `src`, the partial amax exchanges it takes part in: every
/// `(peer, blocks)` means "send your partial amax of `blocks` to `peer`, and receive its
/// partial amax of the same blocks". Only blocks cut by a source shard boundary appear, so a
/// layout whose shards hold whole blocks exchanges nothing. Replicas exchange within their
/// replica group (the ranks of one replica index), each group reaching the same amax; every
/// rank computes the whole exchange alone, and the two ends of a pair compute each other.
pub fn amax_exchange(src: &Layout, grid: &BlockGrid, rank: Rank) -> Vec<(Rank, Region)> {
    let Some(position) = src.mesh().position(rank) else {
        return Vec::new();
    };
    let own_index = src.piece_index(&src.mesh().coords(position));
    let own_touch = grid.blocks_touching(&src.region_at(position));
    if own_touch.is_empty() {
        return Vec::new();
    }
    let own_holders = src.holders(&own_index);
    let slot = own_holders
        .iter()
        .position(|&r| r == rank)
        .expect("a rank holds its own piece");
    // per dim, the pieces whose blocks meet ours
    let candidates: Vec<Vec<(usize, std::ops::Range<u64>)>> = (0..src.ndim())
        .map(|d| {
            let mine = own_touch.range(d);
            src.dim_pieces(d)
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.is_empty())
                .filter_map(|(i, p)| {
                    let t = p.start / grid.block[d]..p.end.div_ceil(grid.block[d]);
                    let lo = t.start.max(mine.start);
                    let hi = t.end.min(mine.end);
                    (lo < hi).then_some((i, lo..hi))
                })
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    if candidates.iter().any(Vec::is_empty) {
        return out;
    }
    let counts = Region {
        offset: vec![0; candidates.len()],
        extent: candidates.iter().map(|c| c.len() as u64).collect(),
    };
    for_each_point(&counts, |choice| {
        let index: Vec<usize> = (0..choice.len())
            .map(|d| candidates[d][choice[d] as usize].0)
            .collect();
        if index == own_index {
            return;
        }
        let ranges: Vec<_> = (0..choice.len())
            .map(|d| candidates[d][choice[d] as usize].1.clone())
            .collect();
        let peer = src.holders(&index)[slot];
        out.push((peer, Region::from_ranges(&ranges)));
    });
    out
}
