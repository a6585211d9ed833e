//! The runtime's per-rank program, for the torch executor: each tensor's plan lowered by the
//! runtime ([`reshard_runtime::exec::lower::lower_plan`]), its steps cut into one message per
//! peer and direction, the regions of every message in the program's order, at the offsets
//! the message holds them. Python turns the regions into tensor views and posts
//! torch.distributed sends and receives; it derives no message of its own, so the two ends of
//! a message, each lowering its own part, agree on it as the runtime's ranks do.

use std::borrow::Cow;
use std::collections::BTreeMap;

use pyo3::prelude::*;
use reshard_core::error::Error;
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::rank_plan as core_rank_plan;
use reshard_core::region::Region;
use reshard_runtime::exec::ExecOptions;
use reshard_runtime::exec::lower::{PlanJob, Slot, lower_plan};
use reshard_runtime::exec::program::{Buf, Step};

use crate::layout::PyLayout;
use crate::{error, plan_options};

/// Regions inside a message start at multiples of this, so that a byte buffer can be viewed
/// as any element type.
pub(crate) const ALIGN: usize = 16;

pub(crate) fn aligned(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// One region of a message, as Python takes it: the tensor (its index in the call), the
/// region's offset in that rank's local shard, its extent, its offset in the global tensor,
/// the byte it starts at in the message, and its bytes.
type PyPiece = (usize, Vec<u64>, Vec<u64>, Vec<u64>, usize, usize);

/// A message: the peer, its bytes (the regions, each aligned), its regions in order.
type PyMessage = (Rank, usize, Vec<PyPiece>);

/// A local copy: the tensor, the region's offset in the rank's source shard, in its
/// destination shard, and its extent.
type PyLocal = (usize, Vec<u64>, Vec<u64>, Vec<u64>);

fn relative(region: &Region, shard: &Region) -> Vec<u64> {
    region
        .offset
        .iter()
        .zip(&shard.offset)
        .map(|(o, b)| o - b)
        .collect()
}

/// Where a rank's shard of one side lies, as lowering takes it.
pub(crate) fn slot<'a>(
    region: &'a Option<Region>,
    buf: Buf,
    layout: &Layout,
    rank: Rank,
) -> Option<Slot<'a>> {
    region.as_ref().map(|r| Slot {
        region: Cow::Borrowed(r),
        buf,
        bytes: 0..layout.local_bytes(rank) as usize,
    })
}

/// Appends `step` of tensor `tensor` to the message of `peer`.
fn add(
    messages: &mut BTreeMap<Rank, (usize, Vec<PyPiece>)>,
    peer: Rank,
    tensor: usize,
    step: &Step<'_>,
    shard: &Region,
) {
    let (len, pieces) = messages.entry(peer).or_default();
    let at = aligned(*len);
    let nbytes = step.bytes() as usize;
    pieces.push((
        tensor,
        relative(&step.region, shard),
        step.region.extent.clone(),
        step.region.offset.clone(),
        at,
        nbytes,
    ));
    *len = at + nbytes;
}

/// This rank's program for moving every `(src, dst)` pair of `layouts` (one dtype on both
/// sides of each) at once: `(sends, recvs, locals)`, the messages by peer in rank order, each
/// holding the regions of every tensor in the call's order and, within a tensor, in the
/// order the runtime's lowering schedules them.
#[pyfunction]
#[pyo3(signature = (layouts, rank, min_split_bytes = None))]
pub(crate) fn rank_program(
    layouts: Vec<(PyRef<'_, PyLayout>, PyRef<'_, PyLayout>)>,
    rank: Rank,
    min_split_bytes: Option<u64>,
) -> PyResult<(Vec<PyMessage>, Vec<PyMessage>, Vec<PyLocal>)> {
    let options = plan_options(min_split_bytes);
    let exec = ExecOptions::default();
    let mut sends = BTreeMap::new();
    let mut recvs = BTreeMap::new();
    let mut locals = Vec::new();
    for (tensor, (src, dst)) in layouts.iter().enumerate() {
        let (src, dst) = (&src.inner, &dst.inner);
        let plan = core_rank_plan(src, dst, rank, &options).map_err(error)?;
        let src_box = src.local_region(rank);
        let dst_box = dst.local_region(rank);
        let job = PlanJob {
            plan: &plan,
            src_layout: src,
            dst_dtype: dst.dtype(),
            src: slot(&src_box, Buf::Src(0), src, rank),
            dst: slot(&dst_box, Buf::Dst(0), dst, rank),
            quant: None,
        };
        let program = lower_plan(&job, &exec).map_err(error)?;
        for phase in &program.phases {
            if !(phase.before.is_empty() && phase.after.is_empty() && phase.scaling.is_empty()) {
                return Err(error(Error::Internal {
                    rank,
                    detail: "a plain reshard lowered to copies outside its steps".into(),
                }));
            }
            let shard = |b: &Option<Region>| {
                b.clone().ok_or_else(|| {
                    error(Error::Internal {
                        rank,
                        detail: "a step of a rank that holds no shard".into(),
                    })
                })
            };
            for step in &phase.steps.sends {
                add(&mut sends, step.to, tensor, step, &shard(&src_box)?);
            }
            for step in &phase.steps.recvs {
                add(&mut recvs, step.from, tensor, step, &shard(&dst_box)?);
            }
            for step in &phase.steps.locals {
                locals.push((
                    tensor,
                    relative(&step.region, &shard(&src_box)?),
                    relative(&step.region, &shard(&dst_box)?),
                    step.region.extent.clone(),
                ));
            }
        }
    }
    let messages = |m: BTreeMap<Rank, (usize, Vec<PyPiece>)>| {
        m.into_iter()
            .map(|(peer, (len, pieces))| (peer, len, pieces))
            .collect()
    };
    Ok((messages(sends), messages(recvs), locals))
}
