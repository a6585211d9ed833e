//! Gather+broadcast for a whole batch, tensor after tensor, as refits ran before reshard: each
//! tensor is all-gathered inside one source replica and broadcast whole to the destination
//! ranks ([`GatherBroadcast`]), which copy their boxes out into their (possibly fused)
//! buffers. One full-tensor buffer per rank, as large as the largest tensor, is reused. A
//! tensor whose destination has another float dtype moves in its source dtype and is
//! converted as each rank keeps its boxes, as an engine converts what it received. A rank's
//! part lowers to one program ([`lower_batch_baseline`]): each tensor's gather, broadcast and
//! keep phases, one tensor after the other.

use std::borrow::Cow;

use super::{Batch, RankBatch};
use crate::exec::lower::{BaselineParts, Slot, baseline_chunk, baseline_phases};
use crate::exec::program::{Buf, LocalCopy, Phase, PhaseKind, Program};
use crate::exec::{ExecOptions, RankStats, run_program};
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::plan::{GatherBroadcast, RankPlan};
use reshard_core::region::Region;
use reshard_transport::Transport;

/// The baseline of every tensor of a batch.
#[derive(Clone, Debug)]
pub struct BatchBaseline {
    /// Each tensor's gather+broadcast, in batch order.
    pub tensors: Vec<GatherBroadcast>,
}

/// One rank's part of a tensor's baseline.
#[derive(Clone, Debug, Default)]
pub struct RankBaseline {
    /// Per tensor: this rank's part of the gather and of the broadcast.
    pub parts: Vec<(Option<RankPlan>, Option<RankPlan>)>,
}

impl BatchBaseline {
    /// Every tensor's baseline, or an error naming the first tensor it cannot be built for.
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
pub(crate) fn run_rank_batch_baseline<T>(
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

/// The program of `rank`'s part of the baseline of every tensor of `batch`, in batch order:
/// each tensor gathered and broadcast whole through the full-tensor buffer `full` (of
/// `full_len` bytes), then every piece of it this rank holds copied out (converted when the
/// destination has a float dtype of its own). A source shard that a fused buffer splits is
/// assembled into a copy first.
#[allow(clippy::too_many_arguments)]
pub fn lower_batch_baseline<'p>(
    batch: &'p Batch,
    baseline: &'p BatchBaseline,
    mine: &'p RankBaseline,
    rb: &'p RankBatch,
    full: Buf,
    full_len: usize,
    options: &ExecOptions,
) -> Result<Program<'p>> {
    let rank = rb.rank;
    let mut program = Program::new(rank, baseline_chunk(options));
    // one copy buffer for the shards fused buffers split, as large as the largest
    let split = |i: usize| {
        let t = &batch.tensors[i];
        let b = t.src.local_region(rank)?;
        let pieces: Vec<_> = rb
            .src
            .iter()
            .flat_map(|buf| buf.pieces.iter())
            .filter(|p| p.tensor == i)
            .collect();
        let whole = matches!(pieces.as_slice(), [p] if p.region == b);
        (!whole).then(|| t.src.local_bytes(rank) as usize)
    };
    let largest = (0..batch.tensors.len())
        .filter_map(|i| split(i).map(|n| (n, i)))
        .max();
    let copy = largest.map(|(n, i)| {
        let what = format!("copy of tensor {}'s source shard", batch.tensors[i].name);
        Buf::Scratch(program.add_scratch(n, what))
    });
    for (i, (gb, (gather, broadcast))) in baseline.tensors.iter().zip(&mine.parts).enumerate() {
        let t = &batch.tensors[i];
        let whole = Region::full(t.src.shape());
        let total = t.src.total_bytes() as usize;
        let src_box = t.src.local_region(rank);
        let gets = gb.gets_tensor(rank);
        if full_len < total && gets {
            return Err(Error::Batch {
                what: "tensor",
                name: t.name.clone(),
                reason: format!(
                    "rank {rank}'s full-tensor buffer holds {full_len} bytes, less than the tensor's {total}"
                ),
            });
        }
        let mut assemble = Vec::new();
        let shard: Option<Slot<'p>> = match (&src_box, split(i), copy) {
            (None, _, _) => None,
            (Some(b), Some(need), Some(copy)) => {
                for (k, buf) in rb.src.iter().enumerate() {
                    for p in buf.pieces.iter().filter(|p| p.tensor == i) {
                        assemble.push(LocalCopy {
                            region: Cow::Borrowed(&p.region),
                            from: (Buf::Src(k), p.bytes.clone()),
                            from_box: Cow::Borrowed(&p.region),
                            to: (copy, 0..need),
                            to_box: Cow::Owned(b.clone()),
                            elem_bytes: t.src.dtype().size(),
                            cast: None,
                            counted: true,
                        });
                    }
                }
                Some(Slot {
                    region: Cow::Owned(b.clone()),
                    buf: copy,
                    bytes: 0..need,
                })
            }
            (Some(b), _, _) => rb.src.iter().enumerate().find_map(|(k, buf)| {
                let p = buf.pieces.iter().find(|p| p.tensor == i)?;
                Some(Slot {
                    region: Cow::Owned(b.clone()),
                    buf: Buf::Src(k),
                    bytes: p.bytes.clone(),
                })
            }),
        };
        let first = program.phases.len();
        let parts = BaselineParts {
            rank,
            baseline: gb,
            gather: gather.as_ref(),
            broadcast: broadcast.as_ref(),
            src: shard.clone(),
            full: gets.then_some((full, 0..total)),
            dst: None,
            whole: Cow::Owned(whole.clone()),
        };
        baseline_phases(&mut program, parts, i, options)?;
        // keep: every piece of this tensor in this rank's destination buffers
        let tensor = match gets {
            true => Some((full, 0..total)),
            false => shard
                .filter(|_| gb.holders.contains(&rank))
                .map(|s| (s.buf, s.bytes)),
        };
        let mut keep = Phase::new(rank, PhaseKind::Keep, 3 * i + 2, Vec::new(), Vec::new());
        keep.skip_empty = true;
        for (k, buf) in rb.dst.iter().enumerate() {
            for p in buf.pieces.iter().filter(|p| p.tensor == i) {
                let Some(tensor) = &tensor else {
                    return Err(Error::MissingBuffer {
                        side: Side::Dst,
                        rank,
                    });
                };
                // converted as it is kept, when the destination has a float dtype of its own
                keep.after.push(LocalCopy {
                    region: Cow::Borrowed(&p.region),
                    from: tensor.clone(),
                    from_box: Cow::Owned(whole.clone()),
                    to: (Buf::Dst(k), p.bytes.clone()),
                    to_box: Cow::Borrowed(&p.region),
                    elem_bytes: t.dst.dtype().size(),
                    cast: gb.cast(),
                    counted: true,
                });
            }
        }
        if !keep.after.is_empty() || !assemble.is_empty() {
            program.phases.push(keep);
        }
        // the shard is assembled before the tensor's first phase
        if let Some(p) = program.phases.get_mut(first) {
            p.before.splice(0..0, assemble);
        }
    }
    Ok(program)
}
