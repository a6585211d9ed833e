//! The block grid of a quantized tensor, and what the ranks do with it: which blocks a region
//! touches, which destination boundaries are legal, which partial amax the source ranks
//! exchange (planned without communication, like the transfers), each rank's amax and scales,
//! and the quantizing copy of a run of source elements.
//!
//! The order of work on a source rank, for one tensor:
//! 1. [`BlockGrid::new`] and [`BlockGrid::check_aligned`] on the destination layout (and on the
//!    source for an already quantized source), before any byte moves;
//! 2. [`AmaxGrid::local`] over its shard (the error for a non-finite value names the block);
//! 3. for every `(peer, blocks)` of [`amax_exchange`]: send [`AmaxGrid::payload`] of `blocks`,
//!    receive the peer's and [`AmaxGrid::merge`] it (nothing to do when no block is cut by a
//!    source shard boundary);
//! 4. [`Scales::new`], then [`Scales::quantize_run`] on every run it packs, and
//!    [`Scales::write`] of [`BlockGrid::scales_carried`] for every transfer, so that each
//!    destination receives its [`BlockGrid::scale_region`] exactly once.

use crate::convert::ConvertError;
use crate::convert::cast::read_f32;
use crate::convert::quant::{BlockScale, Quant, QuantScheme};
use crate::dtype::DType;
use crate::error::{Dims, Side};
use crate::layout::{Layout, Rank};
use crate::region::Region;

/// The blocks of a tensor of `shape` under a scheme: block `b` (grid coordinates) covers
/// elements `b[d] * block[d] .. min((b[d] + 1) * block[d], shape[d])` along every dim `d`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockGrid {
    shape: Vec<u64>,
    block: Vec<u64>,
    may_cut: Vec<bool>,
}

impl BlockGrid {
    /// The grid of `scheme` over a tensor of `shape`.
    pub fn new(scheme: QuantScheme, shape: &[u64]) -> Result<BlockGrid, ConvertError> {
        Ok(BlockGrid {
            shape: shape.to_vec(),
            block: scheme.block_shape(shape)?,
            may_cut: scheme.may_cut(shape.len()),
        })
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// A block's extent along every dim (the last block of a dim may be shorter).
    pub fn block(&self) -> &[u64] {
        &self.block
    }

    /// The shape of the scale tensor: `ceil(shape[d] / block[d])` along every dim.
    pub fn grid_shape(&self) -> Vec<u64> {
        self.shape
            .iter()
            .zip(&self.block)
            .map(|(&n, &b)| n.div_ceil(b))
            .collect()
    }

    /// The elements of block `b`.
    pub fn block_region(&self, b: &[u64]) -> Region {
        let ranges: Vec<_> = (0..self.shape.len())
            .map(|d| {
                let lo = b[d] * self.block[d];
                lo..(lo + self.block[d]).min(self.shape[d])
            })
            .collect();
        Region::from_ranges(&ranges)
    }

    /// The blocks (a box of grid coordinates) that share an element with `region`; empty for
    /// an empty region.
    pub fn blocks_touching(&self, region: &Region) -> Region {
        if region.is_empty() {
            return Region {
                offset: vec![0; self.shape.len()],
                extent: vec![0; self.shape.len()],
            };
        }
        let ranges: Vec<_> = (0..self.shape.len())
            .map(|d| {
                let r = region.range(d);
                r.start / self.block[d]..r.end.div_ceil(self.block[d])
            })
            .collect();
        Region::from_ranges(&ranges)
    }

    /// The blocks that lie wholly inside `region` (a block cut short by the tensor's end
    /// counts as whole).
    pub fn blocks_inside(&self, region: &Region) -> Region {
        let ranges: Vec<_> = (0..self.shape.len())
            .map(|d| {
                let r = region.range(d);
                let lo = r.start.div_ceil(self.block[d]);
                let hi = if r.end >= self.shape[d] {
                    self.shape[d].div_ceil(self.block[d])
                } else {
                    r.end / self.block[d]
                };
                lo..hi.max(lo)
            })
            .collect();
        Region::from_ranges(&ranges)
    }

    /// Checks that every shard boundary of `layout` falls on a block boundary (or the
    /// tensor's end) along the dims where blocks may not be cut: the destination's rule (vLLM
    /// loads whole blocks), and the source's too when it is already quantized.
    pub fn check_aligned(&self, layout: &Layout, side: Side) -> Result<(), ConvertError> {
        for d in 0..self.shape.len() {
            if self.may_cut[d] {
                continue;
            }
            let b = self.block[d];
            for piece in layout.dim_pieces(d) {
                for boundary in [piece.start, piece.end] {
                    if !boundary.is_multiple_of(b) && boundary != self.shape[d] {
                        return Err(ConvertError::CutBlock {
                            side,
                            dim: d,
                            boundary,
                            block: Dims(self.block.clone()),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The scales a destination shard holds (a box of grid coordinates): the blocks its
    /// shard touches, which are the blocks inside it once [`BlockGrid::check_aligned`] has
    /// passed, and, along the dims a shard may cut (`channel`, `tensor`), the replicated
    /// scales of the blocks it holds part of. Its `rank<R>.scale.bin` is this box of the
    /// scale tensor, row-major.
    pub fn scale_region(&self, dst_shard: &Region) -> Region {
        self.blocks_touching(dst_shard)
    }

    /// The scales a transfer of `region` into the destination shard `dst_shard` carries:
    /// block `b` goes with the transfer that holds the first element of `b` inside the
    /// shard. Transfers tile the shard, so every scale of [`BlockGrid::scale_region`] travels
    /// exactly once.
    pub fn scales_carried(&self, dst_shard: &Region, region: &Region) -> Region {
        if region.is_empty() {
            return self.blocks_touching(region);
        }
        let ranges: Vec<_> = (0..self.shape.len())
            .map(|d| {
                let (b, shard, r) = (self.block[d], dst_shard.range(d), region.range(d));
                // blocks whose anchor max(block start, shard start) lies in r
                let first = if r.start == shard.start {
                    r.start / b
                } else {
                    r.start.div_ceil(b)
                };
                let last = r.end.div_ceil(b);
                first..last.max(first)
            })
            .collect();
        Region::from_ranges(&ranges)
    }
}

/// Every block's amax over the part of the tensor one rank holds (later: merged with its
/// peers' partial amax into the whole block's).
#[derive(Clone, Debug, PartialEq)]
pub struct AmaxGrid {
    /// The blocks covered, in grid coordinates.
    pub blocks: Region,
    /// Their amax, row-major over `blocks`.
    pub amax: Vec<f32>,
}

/// Row-major index of grid point `b` within `boxed` (which contains it).
fn index_in(boxed: &Region, b: &[u64]) -> usize {
    (0..b.len()).fold(0u64, |acc, d| {
        acc * boxed.extent[d] + (b[d] - boxed.offset[d])
    }) as usize
}

/// Calls `f(point)` for every point of `region`, row-major.
fn for_each_point(region: &Region, mut f: impl FnMut(&[u64])) {
    if region.is_empty() {
        return;
    }
    let n = region.ndim();
    let mut p = region.offset.clone();
    loop {
        f(&p);
        let mut d = n;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            p[d] += 1;
            if p[d] < region.offset[d] + region.extent[d] {
                break;
            }
            p[d] = region.offset[d];
        }
    }
}

/// Calls `f(first_element_coords, shard_element_index, len)` for every row run of `region`
/// inside `shard` (runs along the last dim), row-major. `region` must lie in `shard`.
fn for_each_row(shard: &Region, region: &Region, mut f: impl FnMut(&[u64], u64, u64)) {
    let n = region.ndim();
    if region.is_empty() {
        return;
    }
    if n == 0 {
        f(&[], 0, 1);
        return;
    }
    let rows = Region {
        offset: region.offset.clone(),
        extent: region.extent[..n - 1].iter().copied().chain([1]).collect(),
    };
    let len = region.extent[n - 1];
    for_each_point(&rows, |p| {
        let local = (0..n).fold(0u64, |acc, d| {
            acc * shard.extent[d] + (p[d] - shard.offset[d])
        });
        f(p, local, len);
    });
}

/// The largest magnitude among `bytes` (elements of `dtype`) read as f32, and whether all
/// are finite. For IEEE formats the order of magnitudes is the order of the bit patterns
/// without the sign, so the scan is an integer maximum, which vectorizes; NaN and infinities
/// sort above every finite value. An f64 beyond the f32 range reads as an infinity, as the
/// quantizer's f32 arithmetic would see it.
fn max_abs(dtype: DType, bytes: &[u8]) -> (f32, bool) {
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

/// The scales of the blocks one rank quantizes, from their whole amax.
#[derive(Clone, Debug, PartialEq)]
pub struct Scales {
    pub quant: Quant,
    /// The blocks, in grid coordinates.
    pub blocks: Region,
    /// Each block's scale, row-major over `blocks`.
    pub scales: Vec<BlockScale>,
    /// Each block's multiplier, row-major over `blocks`: the quantizing copy's lookups.
    mults: Vec<f32>,
    block: Vec<u64>,
}

impl Scales {
    /// The scales of `amax`'s blocks (after the exchange, when one was planned).
    pub fn new(quant: Quant, grid: &BlockGrid, amax: &AmaxGrid) -> Scales {
        Scales {
            quant,
            blocks: amax.blocks.clone(),
            scales: amax.amax.iter().map(|&a| quant.scale(a)).collect(),
            mults: amax.amax.iter().map(|&a| quant.scale(a).mult).collect(),
            block: grid.block.clone(),
        }
    }

    /// Writes the scales of `sub` (a box within [`Scales::blocks`]), row-major, in the
    /// scale dtype, into `out` (`sub.volume()` scales long). Panics if `sub` or `out` does
    /// not fit: both come from the plan, never from a user.
    pub fn write(&self, sub: &Region, out: &mut [u8]) {
        let size = self.quant.scale_dtype.size();
        let mut at = 0;
        for_each_point(sub, |b| {
            let s = &self.scales[index_in(&self.blocks, b)];
            self.quant.write_scale(s, &mut out[at..at + size]);
            at += size;
        });
    }

    /// The quantizing copy: encodes `src`, a contiguous run of elements of the rank's dense
    /// buffer of `shard` (dtype `dtype`) starting at element `first` of that buffer, into
    /// `dst` (one fp8 byte per element, `dst.len()` elements). The run may span rows; it is
    /// cut where the row or the block changes, and each piece gets its block's multiplier.
    /// The executor calls it on every run it packs, in place of a copy. Panics if the run
    /// leaves `shard` or `src`, or reaches a block these scales do not cover (the rank's
    /// own shard's blocks always are).
    pub fn quantize_run(
        &self,
        shard: &Region,
        dtype: DType,
        first: u64,
        src: &[u8],
        dst: &mut [u8],
    ) {
        let n = shard.ndim();
        let elem = dtype.size();
        let row_len = shard.extent.last().copied().unwrap_or(1).max(1);
        let total = dst.len().min(src.len() / elem);
        let (bl, b_last0, blocks_last) = match n {
            0 => (1, 0, 1),
            _ => (
                self.block[n - 1],
                self.blocks.offset[n - 1],
                self.blocks.extent[n - 1],
            ),
        };
        let mut done = 0usize;
        while done < total {
            let at = first + done as u64;
            let (row, col) = (at / row_len, at % row_len);
            // the row's first block, as an index into the blocks' row-major order
            let mut rest = row;
            let mut base = 0u64;
            let mut stride = blocks_last;
            for d in (0..n.saturating_sub(1)).rev() {
                let c = shard.offset[d] + rest % shard.extent[d];
                rest /= shard.extent[d];
                base += (c / self.block[d] - self.blocks.offset[d]) * stride;
                stride *= self.blocks.extent[d];
            }
            // the rest of this row, block by block
            let row_end = done + ((row_len - col) as usize).min(total - done);
            let mut c = shard.offset.get(n.wrapping_sub(1)).copied().unwrap_or(0) + col;
            while done < row_end {
                let len = (((c / bl + 1) * bl - c) as usize).min(row_end - done);
                let k = base + if n > 0 { c / bl - b_last0 } else { 0 };
                self.quant.fp8.encode_scaled(
                    dtype,
                    &src[done * elem..(done + len) * elem],
                    self.mults[k as usize],
                    &mut dst[done..done + len],
                );
                done += len;
                c += len as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;

    fn layout(spec: &str, shape: &[u64], first: Rank) -> Layout {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, DType::Bf16, first)
            .unwrap()
    }

    fn block(r: u64, c: u64) -> QuantScheme {
        QuantScheme::Block {
            rows: r,
            cols: c,
            ue8m0: false,
        }
    }

    #[test]
    fn blocks_a_region_touches_and_holds() {
        let g = BlockGrid::new(block(128, 128), &[2, 300, 256]).unwrap();
        assert_eq!(g.grid_shape(), [2, 3, 2]);
        let r = Region::from_ranges(&[1..2, 100..300, 0..130]);
        assert_eq!(
            g.blocks_touching(&r),
            Region::from_ranges(&[1..2, 0..3, 0..2])
        );
        // rows 128..256 whole, and 256..300 is the short last block, whole too
        assert_eq!(
            g.blocks_inside(&r),
            Region::from_ranges(&[1..2, 1..3, 0..1])
        );
        assert_eq!(
            g.block_region(&[1, 2, 1]),
            Region::from_ranges(&[1..2, 256..300, 128..256])
        );
        let empty = Region::from_ranges(&[0..0, 0..10, 0..10]);
        assert!(g.blocks_touching(&empty).is_empty());
        assert_eq!(
            BlockGrid::new(QuantScheme::Mx, &[4, 70])
                .unwrap()
                .grid_shape(),
            [4, 3]
        );
        assert_eq!(
            BlockGrid::new(QuantScheme::Tensor, &[4, 70])
                .unwrap()
                .grid_shape(),
            [1, 1]
        );
    }

    #[test]
    fn destination_boundaries_must_fall_on_blocks() {
        let shape = [512, 384];
        let g = BlockGrid::new(block(128, 128), &shape).unwrap();
        assert!(
            g.check_aligned(&layout("mesh=4 place=S(0)", &shape, 0), Side::Dst)
                .is_ok()
        );
        assert!(
            g.check_aligned(&layout("mesh=3 place=S(1)", &shape, 0), Side::Dst)
                .is_ok()
        );
        let err = g
            .check_aligned(&layout("mesh=2x2 place=S(1),S(1)", &shape, 0), Side::Dst)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "dst: a shard boundary at 96 along dim 1 cuts a quantization block of 128x128 (boundaries must be multiples of the block size)"
        );
        // an uneven last shard ends at the tensor's end, which is fine
        let g = BlockGrid::new(block(128, 128), &[300, 128]).unwrap();
        assert!(
            g.check_aligned(&layout("mesh=3 place=S(0)", &[300, 128], 0), Side::Dst)
                .is_err()
        );
        assert!(
            g.check_aligned(&layout("mesh=2 place=S(0)", &[300, 128], 0), Side::Dst)
                .is_err()
        );
        assert!(
            g.check_aligned(&layout("mesh=2 place=S(0)", &[256 + 44, 128], 0), Side::Src)
                .is_err()
        );
        let g = BlockGrid::new(block(128, 128), &[255, 128]).unwrap();
        assert!(
            g.check_aligned(&layout("mesh=2 place=S(0)", &[255, 128], 0), Side::Dst)
                .is_ok()
        );
        // channel and tensor scales may be cut (replicated) where their block spans the dim
        let g = BlockGrid::new(QuantScheme::Channel, &[8, 10]).unwrap();
        assert!(
            g.check_aligned(&layout("mesh=3 place=S(1)", &[8, 10], 0), Side::Dst)
                .is_ok()
        );
        let g = BlockGrid::new(QuantScheme::Tensor, &[8, 10]).unwrap();
        assert!(
            g.check_aligned(&layout("mesh=3x3 place=S(0),S(1)", &[8, 10], 0), Side::Dst)
                .is_ok()
        );
        let g = BlockGrid::new(QuantScheme::Mx, &[8, 64]).unwrap();
        assert!(
            g.check_aligned(&layout("mesh=4 place=S(1)", &[8, 64], 0), Side::Dst)
                .is_err()
        );
    }

    #[test]
    fn channel_scales_are_replicated_on_column_shards() {
        let g = BlockGrid::new(QuantScheme::Channel, &[4, 10]).unwrap();
        let shard = Region::from_ranges(&[0..4, 4..8]);
        assert_eq!(g.scale_region(&shard), Region::from_ranges(&[0..4, 0..1]));
        // two transfers tile the shard: the first carries the scales, the second none
        let a = Region::from_ranges(&[0..4, 4..6]);
        let b = Region::from_ranges(&[0..4, 6..8]);
        assert_eq!(
            g.scales_carried(&shard, &a),
            Region::from_ranges(&[0..4, 0..1])
        );
        assert!(g.scales_carried(&shard, &b).is_empty());
    }

    #[test]
    fn partial_amax_is_exchanged_only_for_cut_blocks() {
        let shape = [256, 256];
        let g = BlockGrid::new(block(128, 128), &shape).unwrap();
        // two shards of 128 rows: every block lies in one shard
        let even = layout("mesh=2 place=S(0)", &shape, 0);
        assert!(amax_exchange(&even, &g, 0).is_empty());
        assert!(amax_exchange(&even, &g, 1).is_empty());
        // three shards of 86, 86, 84 rows: block row 0 is cut between ranks 0 and 1, block
        // row 1 between ranks 1 and 2
        let three = layout("mesh=3 place=S(0)", &shape, 0);
        assert_eq!(
            amax_exchange(&three, &g, 0),
            [(1, Region::from_ranges(&[0..1, 0..2]))]
        );
        assert_eq!(
            amax_exchange(&three, &g, 1),
            [
                (0, Region::from_ranges(&[0..1, 0..2])),
                (2, Region::from_ranges(&[1..2, 0..2]))
            ]
        );
        // with two replicas (mesh 2x3, replicated rows), each replica group exchanges alone
        let replicas = layout("mesh=2x3 ranks=10..16 place=R,S(0)", &shape, 0);
        assert_eq!(
            amax_exchange(&replicas, &g, 13),
            [(14, Region::from_ranges(&[0..1, 0..2]))]
        );
        // tensor: every rank with data meets every other of its replica group
        let g = BlockGrid::new(QuantScheme::Tensor, &shape).unwrap();
        let peers: Vec<Rank> = amax_exchange(&layout("mesh=2x2 place=S(0),S(1)", &shape, 0), &g, 3)
            .into_iter()
            .map(|(p, b)| {
                assert_eq!(b, Region::from_ranges(&[0..1, 0..1]));
                p
            })
            .collect();
        assert_eq!(peers, [0, 1, 2]);
        assert!(amax_exchange(&three, &g, 99).is_empty());
    }

    #[test]
    fn amax_payloads_merge_and_are_checked() {
        let g = BlockGrid::new(block(2, 2), &[2, 4]).unwrap();
        let shard = Region::from_ranges(&[0..2, 1..4]);
        let vals: [f32; 6] = [1.0, -5.0, 2.0, 0.5, 0.25, -3.0];
        let buf: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut amax = AmaxGrid::local(&g, &shard, &buf, DType::F32).unwrap();
        assert_eq!(amax.amax, [1.0, 5.0]);
        let sub = Region::from_ranges(&[0..1, 0..1]);
        assert_eq!(amax.payload(&sub), 1f32.to_le_bytes());
        amax.merge(&sub, &7f32.to_le_bytes()).unwrap();
        assert_eq!(amax.amax, [7.0, 5.0]);
        let err = amax.merge(&sub, &[0; 3]).unwrap_err();
        assert!(matches!(err, ConvertError::AmaxPayload { got: 3, .. }));
        // a NaN names its block and element
        let mut bad = buf.clone();
        bad[16..20].copy_from_slice(&f32::NAN.to_le_bytes());
        let err = AmaxGrid::local(&g, &shard, &bad, DType::F32).unwrap_err();
        assert_eq!(
            err.to_string(),
            "block [0, 1] holds a non-finite value (NaN) at element [1, 2], which fp8 cannot carry"
        );
        // an f64 beyond the f32 range is an infinity to the f32 arithmetic of the schemes
        let big: Vec<u8> = [1.0f64, 2.0, 1e300, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let err = AmaxGrid::local(&g, &shard, &big, DType::F64).unwrap_err();
        assert!(
            matches!(&err, ConvertError::NonFinite { block, element, value }
                if block == &[0, 1] && element == &[0, 3] && *value == f32::INFINITY),
            "{err}"
        );
        // the magnitude scan of every float dtype agrees with reading each element
        let xs = [0.0f32, -0.0, 1e-40, -3.5, 448.0, -1e-3, 65000.0, 2.5e-8];
        for dtype in [DType::F32, DType::Bf16, DType::F16, DType::F64] {
            let mut buf = vec![0u8; xs.len() * dtype.size()];
            for (i, &x) in xs.iter().enumerate() {
                crate::convert::cast::write_f32(dtype, x, &mut buf[i * dtype.size()..]);
            }
            let want = buf
                .chunks_exact(dtype.size())
                .map(|s| read_f32(dtype, s).abs())
                .fold(0f32, f32::max);
            assert_eq!(max_abs(dtype, &buf), (want, true), "{dtype}");
        }
    }
}
