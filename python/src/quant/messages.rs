//! The messages of a rank's part of a reshard into fp8, from the runtime's program of it
//! ([`lower_plan`]): the partial amax exchanges of its amax phase, then by peer the values and
//! the scales of its values phase, each in the program's order. A message holds its values
//! (fp8, one byte each, row-major per transfer, one transfer after the other), then at the
//! next multiple of 16 its scales.

use pyo3::prelude::*;

use reshard_core::error::Error;
use reshard_core::plan::{QuantPlan, QuantRankPlan, RankPlan};
use reshard_core::region::Region;
use reshard_core::{Layout, Rank, Transfer};
use reshard_runtime::exec::ExecOptions;
use reshard_runtime::exec::lower::{PlanJob, QuantParts, lower_plan};
use reshard_runtime::exec::program::{Buf, PhaseKind, Step};
use reshard_transport::Lands;

use crate::error;
use crate::program::{aligned, slot};

/// One message: the value transfers it holds, then their scale transfers from `scales_at`.
pub(super) struct Message {
    pub(super) peer: Rank,
    pub(super) values: Vec<Transfer>,
    pub(super) scales: Vec<Transfer>,
    pub(super) scales_at: usize,
    pub(super) size: usize,
}

impl Message {
    fn new(peer: Rank, values: Vec<Transfer>, scales: Vec<Transfer>, scale_bytes: usize) -> Self {
        let value_bytes: u64 = values.iter().map(|t| t.region.volume()).sum();
        let scales_at = aligned(value_bytes as usize);
        let scale_total: u64 = scales.iter().map(|t| t.region.volume()).sum();
        Message {
            peer,
            values,
            scales,
            scales_at,
            size: scales_at + scale_total as usize * scale_bytes,
        }
    }
}

/// Appends `step` to the message of `peer` in `messages` (in order of first appearance): its
/// values when it lands in the shard, its scales when it lands aside.
fn add(messages: &mut Vec<(Rank, Vec<Transfer>, Vec<Transfer>)>, peer: Rank, step: &Step<'_>) {
    let at = match messages.iter().position(|m| m.0 == peer) {
        Some(at) => at,
        None => {
            messages.push((peer, Vec::new(), Vec::new()));
            messages.len() - 1
        }
    };
    let transfer = Transfer::direct(step.from, step.to, step.region.clone().into_owned());
    match step.lands {
        Lands::Shard => messages[at].1.push(transfer),
        Lands::Aside => messages[at].2.push(transfer),
    }
}

/// The messages of a rank's part of a quantizing plan, from the runtime's program of it
/// ([`lower_plan`]): the amax exchanges of its amax phase, then the values and scales of its
/// values phase by peer, each in the program's order, so that the torch executor moves what
/// the runtime's executor would and derives no message of its own.
#[allow(clippy::type_complexity)]
pub(super) fn lowered(
    src: &Layout,
    dst: &Layout,
    rank: Rank,
    plan: &RankPlan,
    qp: &QuantPlan,
    qrp: &QuantRankPlan,
) -> PyResult<(
    Vec<(Rank, Region)>,
    Vec<Message>,
    Vec<Message>,
    Option<Message>,
)> {
    let (src_box, dst_box) = (src.local_region(rank), dst.local_region(rank));
    let job = PlanJob {
        plan,
        src_layout: src,
        dst_dtype: dst.dtype(),
        src: slot(&src_box, Buf::Src(0), src, rank),
        dst: slot(&dst_box, Buf::Dst(0), dst, rank),
        quant: Some(QuantParts {
            tensor: "tensor",
            plan: qp,
            rank: qrp,
            scales: dst_box.as_ref().map(|_| Buf::Dst(1)),
        }),
    };
    let program = lower_plan(&job, &ExecOptions::default()).map_err(error)?;
    let internal = |detail: &str| {
        error(Error::Internal {
            rank,
            detail: detail.into(),
        })
    };
    let mut amax = Vec::new();
    let (mut sends, mut recvs, mut locals) = (Vec::new(), Vec::new(), Vec::new());
    for phase in &program.phases {
        if !(phase.before.is_empty() && phase.after.is_empty()) {
            return Err(internal(
                "a quantizing reshard lowered to copies outside its steps",
            ));
        }
        match phase.kind {
            PhaseKind::Amax => {
                amax.extend(
                    phase
                        .steps
                        .sends
                        .iter()
                        .map(|s| (s.to, s.region.clone().into_owned())),
                );
            }
            PhaseKind::Values => {
                for step in &phase.steps.sends {
                    add(&mut sends, step.to, step);
                }
                for step in &phase.steps.recvs {
                    add(&mut recvs, step.from, step);
                }
                for step in &phase.steps.locals {
                    add(&mut locals, rank, step);
                }
            }
            _ => return Err(internal("a quantizing reshard lowered to relay rounds")),
        }
    }
    let scale_bytes = qp.scale_bytes();
    let messages = |list: Vec<(Rank, Vec<Transfer>, Vec<Transfer>)>| -> Vec<Message> {
        list.into_iter()
            .map(|(peer, values, scales)| Message::new(peer, values, scales, scale_bytes))
            .collect()
    };
    Ok((
        amax,
        messages(sends),
        messages(recvs),
        messages(locals).pop(),
    ))
}
