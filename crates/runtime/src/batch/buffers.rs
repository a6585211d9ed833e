//! A rank's buffers of a batch: each tensor's shard, or a fused buffer of several tensors'
//! shards, cut into pieces; and its scale buffers, fused like their weights.

use std::collections::BTreeMap;

use super::{Batch, Buffer, Fusion, MAX_PIECES, Piece, batch_error};
use reshard_core::error::{Result, Side};
use reshard_core::layout::Rank;
use reshard_core::region::Region;

impl Batch {
    /// Each member of a fusion on `side`, with its fusion.
    fn fusion_of(&self, side: Side) -> BTreeMap<usize, &Fusion> {
        self.fusions
            .iter()
            .filter(|f| f.side == side)
            .flat_map(|f| f.members.iter().map(move |&m| (m, f)))
            .collect()
    }

    /// `rank`'s buffers on `side`, in a fixed order: tensors in batch order, a fused buffer
    /// where its first member comes. Fails if a fusion's members disagree on this rank.
    pub fn buffers(&self, side: Side, rank: Rank) -> Result<Vec<Buffer>> {
        let fusion_of = self.fusion_of(side);
        let mut out = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            match fusion_of.get(&i) {
                Some(f) if f.members[0] == i => {
                    if let Some(b) = self.fused_buffer(f, side, rank)? {
                        out.push(b);
                    }
                }
                Some(_) => {}
                None => {
                    let l = t.layout(side);
                    if let Some(region) = l.local_region(rank) {
                        let len = l.local_bytes(rank) as usize;
                        out.push(Buffer::whole(&t.name, i, region, len));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The members' local shards on `rank`, concatenated along the fusion's dim.
    fn fused_buffer(&self, f: &Fusion, side: Side, rank: Rank) -> Result<Option<Buffer>> {
        let boxes: Vec<Option<Region>> = f
            .members
            .iter()
            .map(|&m| self.tensors[m].layout(side).local_region(rank))
            .collect();
        let elem = self.tensors[f.members[0]].layout(side).dtype().size();
        self.fuse(f, rank, boxes, elem)
    }

    /// `rank`'s scale buffers, one per destination buffer that holds quantized tensors, in
    /// the order of [`Batch::buffers`]: a tensor's scale shard (its box of the block grid,
    /// row-major, in the scale dtype), or for a fused buffer the members' scale shards
    /// concatenated along the same dim in block coordinates, as the engine fuses the scales
    /// of a fused weight (vLLM's `qkv_proj.weight_scale_inv`, `w13_weight_scale_inv`). Every
    /// member but the last must hold whole blocks along the fused dim, or the blocks of the
    /// fused buffer would straddle two members: an error naming the fusion and the member.
    pub fn scale_buffers(&self, rank: Rank) -> Result<Vec<Buffer>> {
        let fusion_of = self.fusion_of(Side::Dst);
        let mut out = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let Some(q) = &t.quant else { continue };
            match fusion_of.get(&i) {
                Some(f) if f.members[0] == i => {
                    self.check_whole_blocks(f, rank)?;
                    let boxes = f
                        .members
                        .iter()
                        .map(|&m| {
                            let t = &self.tensors[m];
                            t.quant.as_ref().and_then(|q| q.dst_scale_box(&t.dst, rank))
                        })
                        .collect();
                    if let Some(b) = self.fuse(f, rank, boxes, q.scale_bytes())? {
                        out.push(b);
                    }
                }
                Some(_) => {}
                None => {
                    if let Some(region) = q.dst_scale_box(&t.dst, rank) {
                        let len = region.volume() as usize * q.scale_bytes();
                        out.push(Buffer::whole(&t.name, i, region, len));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Every member of a destination fusion but the last holds whole blocks along its dim on
    /// `rank`.
    fn check_whole_blocks(&self, f: &Fusion, rank: Rank) -> Result<()> {
        let Some((_, leading)) = f.members.split_last() else {
            return Ok(());
        };
        for &m in leading {
            let t = &self.tensors[m];
            let (Some(q), Some(shard)) = (&t.quant, t.dst.local_region(rank)) else {
                continue;
            };
            let block = q.grid.block()[f.dim];
            let held = shard.extent[f.dim];
            if !held.is_multiple_of(block) {
                return Err(batch_error(
                    "fusion",
                    &f.name,
                    format!(
                        "on rank {rank}, `{}` holds {held} elements along dim {}, not a multiple of its block's {block}: the fused buffer's blocks would straddle two members",
                        t.name, f.dim
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The boxes `boxes` of `f`'s members on `rank` (elements of `elem` bytes), concatenated
    /// along the fusion's dim: a fused buffer of values, or of scales.
    fn fuse(
        &self,
        f: &Fusion,
        rank: Rank,
        boxes: Vec<Option<Region>>,
        elem: usize,
    ) -> Result<Option<Buffer>> {
        if boxes.iter().all(Option::is_none) {
            return Ok(None);
        }
        let Some(boxes) = boxes.into_iter().collect::<Option<Vec<Region>>>() else {
            return Err(batch_error(
                "fusion",
                &f.name,
                format!("rank {rank} holds some members but not all"),
            ));
        };
        let d = f.dim;
        let lead = &boxes[0];
        for (b, &m) in boxes.iter().zip(&f.members) {
            let agree = (0..lead.ndim()).all(|k| k == d || b.extent[k] == lead.extent[k]);
            if !agree {
                return Err(batch_error(
                    "fusion",
                    &f.name,
                    format!(
                        "on rank {rank}, `{}` holds a box of extent {:?} but `{}` one of {:?}: they may differ along dim {d} only",
                        self.tensors[f.members[0]].name,
                        lead.extent,
                        self.tensors[m].name,
                        b.extent
                    ),
                ));
            }
        }
        let mut extent = lead.extent.clone();
        extent[d] = boxes.iter().map(|b| b.extent[d]).sum();
        // element strides of the fused buffer, row-major
        let mut strides = vec![1u64; extent.len()];
        for k in (0..extent.len().saturating_sub(1)).rev() {
            strides[k] = strides[k + 1] * extent[k + 1];
        }
        let outer: u64 = lead.extent[..d].iter().product();
        if outer as usize * f.members.len() > MAX_PIECES {
            return Err(batch_error(
                "fusion",
                &f.name,
                format!(
                    "fusing along dim {d} cuts rank {rank}'s buffer into more than {MAX_PIECES} pieces"
                ),
            ));
        }
        let mut pieces = Vec::new();
        let mut along = 0u64;
        for (b, &m) in boxes.iter().zip(&f.members) {
            if b.volume() > 0 {
                for o in 0..outer {
                    // the outer coordinates of piece `o`, mixed radix over dims 0..d
                    let mut rest = o;
                    let mut start = along * strides[d];
                    let mut region = b.clone();
                    for k in (0..d).rev() {
                        let j = rest % lead.extent[k];
                        rest /= lead.extent[k];
                        start += j * strides[k];
                        region.offset[k] += j;
                        region.extent[k] = 1;
                    }
                    let len = region.volume() * elem as u64;
                    let start = (start * elem as u64) as usize;
                    pieces.push(Piece {
                        tensor: m,
                        region,
                        bytes: start..start + len as usize,
                    });
                }
            }
            along += b.extent[d];
        }
        let len = extent.iter().product::<u64>() as usize * elem;
        Ok(Some(Buffer {
            name: f.name.clone(),
            len,
            pieces,
        }))
    }
}
