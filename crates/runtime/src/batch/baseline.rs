//! Gather+broadcast for a whole batch, tensor after tensor, as refits ran before reshard: each
//! tensor is all-gathered inside one source replica and broadcast whole to the destination
//! ranks ([`GatherBroadcast`]), which copy their boxes out into their (possibly fused)
//! buffers. One full-tensor buffer per rank, as large as the largest tensor, is reused. A
//! tensor whose destination has another float dtype moves in its source dtype and is
//! converted as each rank keeps its boxes, as an engine converts what it received.

use super::{Batch, RankBatch};
use crate::exec::baseline::{BaselineJob, run_rank_gather_broadcast};
use crate::exec::{ExecOptions, RankStats};
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::plan::{GatherBroadcast, RankPlan};
use reshard_core::region::Region;
use reshard_transport::Transport;

/// The baseline of every tensor of a batch.
#[derive(Clone, Debug)]
pub struct BatchBaseline {
    pub tensors: Vec<GatherBroadcast>,
}

/// One rank's part of a tensor's baseline.
#[derive(Clone, Debug, Default)]
pub struct RankBaseline {
    /// Per tensor: this rank's part of the gather and of the broadcast.
    pub parts: Vec<(Option<RankPlan>, Option<RankPlan>)>,
}

impl BatchBaseline {
    pub fn new(batch: &Batch) -> Result<BatchBaseline> {
        let tensors = batch
            .tensors()
            .iter()
            .map(|t| {
                GatherBroadcast::new(&t.src, &t.dst).map_err(|e| Error::Batch {
                    what: "tensor",
                    name: t.name.clone(),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<_>>()?;
        Ok(BatchBaseline { tensors })
    }

    /// Bytes on the wire, all tensors together.
    pub fn wire_bytes(&self) -> u64 {
        self.tensors.iter().map(GatherBroadcast::wire_bytes).sum()
    }

    /// The full-tensor buffer `rank` needs: the largest tensor it gathers or receives.
    pub fn full_bytes(&self, rank: Rank) -> usize {
        self.tensors
            .iter()
            .filter(|g| g.gets_tensor(rank))
            // the tensor moves in its source dtype (a destination of its own dtype converts
            // its boxes as it keeps them)
            .map(|g| g.full_bytes() as usize)
            .max()
            .unwrap_or(0)
    }

    /// `rank`'s part of every tensor's gather and broadcast.
    pub fn for_rank(&self, rank: Rank) -> Result<RankBaseline> {
        let parts = self.tensors.iter().map(|g| g.rank_parts(rank)).collect();
        Ok(RankBaseline { parts })
    }
}

/// Runs `rank`'s part of the baseline of every tensor, in batch order, over `transport`.
/// `src` and `dst` are the rank's buffers (as for [`super::run_rank_batch`]); `full` holds at
/// least [`BatchBaseline::full_bytes`].
#[allow(clippy::too_many_arguments)]
pub fn run_rank_batch_baseline<T>(
    batch: &Batch,
    baseline: &BatchBaseline,
    mine: &RankBaseline,
    rb: &RankBatch,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    full: &mut [u8],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let rank = rb.rank;
    let mut stats = RankStats {
        rank,
        ..RankStats::default()
    };
    let mut scratch = Vec::new();
    for (i, (gb, (gather, broadcast))) in baseline.tensors.iter().zip(&mine.parts).enumerate() {
        let t = &batch.tensors()[i];
        let elem = t.src.dtype().size();
        let whole = Region::full(t.src.shape());
        let total = t.src.total_bytes() as usize;
        // this rank's source shard, assembled from its pieces when a fused buffer splits it
        let src_box = t.src.local_region(rank);
        let shard: Option<&[u8]> = match &src_box {
            None => None,
            Some(b) => {
                let pieces: Vec<_> = rb
                    .src
                    .iter()
                    .enumerate()
                    .flat_map(|(k, buf)| buf.pieces.iter().map(move |p| (k, p)))
                    .filter(|(_, p)| p.tensor == i)
                    .collect();
                match pieces.as_slice() {
                    [(k, p)] if p.region == *b => Some(&src[*k][p.bytes.clone()]),
                    _ => {
                        let need = t.src.local_bytes(rank) as usize;
                        let more = need.saturating_sub(scratch.len());
                        reshard_core::memory::reserve(&mut scratch, more, || {
                            format!("rank {rank}'s copy of tensor {}'s source shard", t.name)
                        })?;
                        scratch.resize(need, 0);
                        for (k, p) in &pieces {
                            let g = CopyGeometry::new(
                                &p.region,
                                Place::Within(&p.region),
                                Place::Within(b),
                                elem,
                            );
                            g.copy(&src[*k][p.bytes.clone()], &mut scratch, 0..g.len());
                            stats.bytes_local += g.len() as u64;
                        }
                        Some(&scratch)
                    }
                }
            }
        };
        let gets = gb.gets_tensor(rank);
        if full.len() < total && gets {
            return Err(Error::Batch {
                what: "tensor",
                name: t.name.clone(),
                reason: format!(
                    "rank {rank}'s full-tensor buffer holds {} bytes, less than the tensor's {total}",
                    full.len()
                ),
            });
        }
        let job = BaselineJob {
            baseline: gb,
            gather: gather.as_ref(),
            broadcast: broadcast.as_ref(),
            src: src_box.as_ref().zip(shard),
            full: gets.then(|| &mut full[..total]),
            dst: None,
        };
        let s = run_rank_gather_broadcast(rank, job, transport, options)?;
        stats.absorb(&s);
        // keep: every piece of this tensor in this rank's destination buffers
        let tensor: Option<&[u8]> = if gets {
            Some(&full[..total])
        } else if gb.holders.contains(&rank) {
            shard
        } else {
            None
        };
        for (k, buf) in rb.dst.iter().enumerate() {
            for p in buf.pieces.iter().filter(|p| p.tensor == i) {
                let Some(tensor) = tensor else {
                    return Err(Error::MissingBuffer {
                        side: reshard_core::error::Side::Dst,
                        rank,
                    });
                };
                // converted as it is kept, when the destination has a float dtype of its own
                let g = CopyGeometry::converting(
                    &p.region,
                    Place::Within(&whole),
                    Place::Within(&p.region),
                    t.dst.dtype().size(),
                    gb.cast(),
                );
                g.copy(tensor, &mut dst[k][p.bytes.clone()], 0..g.len());
                stats.bytes_local += g.len() as u64;
            }
        }
    }
    Ok(stats)
}
