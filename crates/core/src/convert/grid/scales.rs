//! The scales of the blocks one rank quantizes, and the quantizing copy of a run.

use super::amax::AmaxGrid;
use super::{BlockGrid, for_each_point, index_in};
use crate::convert::quant::{BlockScale, Quant};
use crate::dtype::DType;
use crate::region::Region;

/// The scales of the blocks one rank quantizes, from their whole amax.
#[derive(Clone, Debug, PartialEq)]
pub struct Scales {
    /// The scheme, fp8 format and scale dtype the scales are for.
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
