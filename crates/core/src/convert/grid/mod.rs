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
use crate::convert::quant::QuantScheme;
use crate::error::{Dims, Side};
use crate::layout::Layout;
use crate::region::Region;

mod amax;
mod scales;
#[cfg(test)]
mod tests;

pub use amax::{AmaxGrid, amax_exchange};
pub use scales::Scales;

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
