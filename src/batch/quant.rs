//! The quantized tensors of a refit into an fp8 engine, run beside the batch.
//!
//! The batch moves every tensor in its own dtype, through fused buffers, in one schedule.
//! A quantized tensor also needs its partial amax exchanged among the source ranks that
//! share a block before any value moves, and its scales carried beside its values; so each
//! one runs as a planned single-tensor reshard ([`crate::exec::run_rank`] with its
//! [`QuantJob`]), one after the other in tensor order, over the same transport, in the same
//! job. Every rank takes the tensors in the same order, so that the messages of one pair
//! match, and a rank that finished its part of a tensor only ever waits on peers that are at
//! it or behind it: the sequence is as deadlock free as each run. Each quantized tensor
//! lands in a destination shard of its own (fp8) and a scale shard (f32, row-major over its
//! box of the block grid), not inside a fused buffer.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::exec::{ExecOptions, QuantJob, RankJob, RankStats, run_rank};
use crate::layout::Rank;
use crate::plan::{Plan, QuantRankPlan, RankPlan};
use crate::region::Region;
use crate::transport::Transport;

/// A quantized tensor: its name and its quantizing plan ([`Plan::quantized`]).
#[derive(Clone, Debug)]
pub struct QuantTensor {
    pub name: String,
    pub plan: Plan,
}

/// One rank's part of one quantized tensor.
#[derive(Clone, Debug)]
pub struct QuantPart {
    /// Index into the tensors.
    pub tensor: usize,
    pub plan: RankPlan,
    pub quant: QuantRankPlan,
    /// Its source box, if it is a source of the tensor.
    pub src: Option<Region>,
    /// Its destination box, if it is a destination.
    pub dst: Option<Region>,
    /// Bytes of its source shard, destination shard and scale shard (0 where it has none).
    pub src_len: usize,
    pub dst_len: usize,
    pub scale_len: usize,
}

/// One rank's parts of the quantized tensors, in tensor order.
#[derive(Clone, Debug)]
pub struct RankQuant {
    pub rank: Rank,
    pub parts: Vec<QuantPart>,
}

impl RankQuant {
    /// `rank`'s parts: every tensor it is a source or destination of, from the layouts alone.
    pub fn new(tensors: &[QuantTensor], rank: Rank) -> Result<RankQuant> {
        let mut parts = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let (src, dst) = (t.plan.src(), t.plan.dst());
            let (src_box, dst_box) = (src.local_region(rank), dst.local_region(rank));
            if src_box.is_none() && dst_box.is_none() {
                continue;
            }
            let Some(q) = t.plan.quant() else {
                return Err(Error::Batch {
                    what: "tensor",
                    name: t.name.clone(),
                    reason: "is listed among the quantized tensors, but its plan does not quantize"
                        .into(),
                });
            };
            let plan = t.plan.rank_part(rank);
            let quant = q.for_rank(src, dst, &plan);
            parts.push(QuantPart {
                tensor: i,
                src_len: src.local_bytes(rank) as usize,
                dst_len: dst.local_bytes(rank) as usize,
                scale_len: q.dst_scale_bytes(dst, rank) as usize,
                plan,
                quant,
                src: src_box,
                dst: dst_box,
            });
        }
        Ok(RankQuant { rank, parts })
    }

    /// The ranks it receives from and sends to, values, scales and partial amax together.
    pub fn peers(&self) -> (BTreeSet<Rank>, BTreeSet<Rank>) {
        let (mut senders, mut receivers) = (BTreeSet::new(), BTreeSet::new());
        for p in &self.parts {
            senders.extend(p.plan.senders());
            receivers.extend(p.plan.receivers());
            senders.extend(p.quant.amax_peers());
            receivers.extend(p.quant.amax_peers());
        }
        (senders, receivers)
    }
}

/// The buffers of one part: its source shard, destination shard and scale shard, each where
/// the rank has one.
pub struct PartBuffers<'s, 'd> {
    pub src: Option<&'s [u8]>,
    pub dst: Option<&'d mut [u8]>,
    pub scales: Option<&'d mut [u8]>,
}

/// Runs `rank`'s parts of the quantized tensors over `transport`, one tensor after the
/// other; `buffers` holds one entry per part, in order. Returns its stats, added up.
pub fn run_rank_quantized<T>(
    tensors: &[QuantTensor],
    rq: &RankQuant,
    buffers: Vec<PartBuffers<'_, '_>>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    if buffers.len() != rq.parts.len() {
        return Err(Error::Internal {
            rank: rq.rank,
            detail: format!(
                "{} quantized parts but {} sets of buffers",
                rq.parts.len(),
                buffers.len()
            ),
        });
    }
    let mut total = RankStats {
        rank: rq.rank,
        ..RankStats::default()
    };
    for (part, bufs) in rq.parts.iter().zip(buffers) {
        let t = &tensors[part.tensor];
        let q = t.plan.quant().expect("checked by RankQuant::new");
        let mut stage = vec![0u8; part.quant.stage_bytes(q.scale_bytes())];
        let job = RankJob {
            plan: &part.plan,
            src_layout: t.plan.src(),
            src: part.src.as_ref().zip(bufs.src),
            dst: part.dst.as_ref().zip(bufs.dst),
            dst_dtype: t.plan.dst().dtype(),
            quant: Some(QuantJob {
                tensor: &t.name,
                plan: q,
                rank: &part.quant,
                stage: &mut stage,
                scales: bufs.scales,
            }),
        };
        let stats = run_rank(job, transport, options)?;
        total.absorb(&stats);
    }
    Ok(total)
}
