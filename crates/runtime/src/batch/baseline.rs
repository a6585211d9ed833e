//! Gather+broadcast for a whole batch, tensor after tensor, as refits ran before reshard: each
//! tensor is all-gathered inside one source replica and broadcast whole to the destination
//! ranks ([`GatherBroadcast`]), which copy their boxes out into their (possibly fused)
//! buffers. One full-tensor buffer per rank, as large as the largest tensor, is reused. A
//! tensor whose destination has another float dtype moves in its source dtype and is
//! converted as each rank keeps its boxes, as an engine converts what it received.

use super::lower::lower_batch_baseline;
use super::{Batch, RankBatch};
use crate::exec::program::Buf;
use crate::exec::{ExecOptions, RankStats, run_program};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::plan::{GatherBroadcast, RankPlan};
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
    let program = lower_batch_baseline(
        batch,
        baseline,
        mine,
        rb,
        Buf::Dst(dst.len()),
        full.len(),
        options,
    )?;
    let mut bufs: Vec<&mut [u8]> = dst.iter_mut().map(|b| &mut **b).collect();
    bufs.push(full);
    run_program(&program, src, &mut bufs, transport, options)
}
