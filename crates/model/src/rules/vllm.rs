//! The inference side: vLLM's layouts (`tp, dp, pp`, `ep`).

use reshard_core::layout::{Layout, Placement, Rank};

use super::super::parallel::Inference;
use super::super::params::Param;
use super::axes::{Axis, build, expert_dim, stage_axis, tp_axes};
use super::pipeline::{ModelFacts, check_stages, stages_of};
use super::{Kind, Which};
use crate::error::ModelError;

/// The inference layout of `param` (vLLM; see the module docs), ranks from `base`.
pub fn infer_layout(
    param: &Param,
    kind: Kind,
    i: &Inference,
    facts: &ModelFacts,
    base: Rank,
) -> Result<Layout, ModelError> {
    let which = Which::Infer;
    check_stages(i.pp, facts, which)?;
    let stages = stages_of(param, facts, i.pp);
    let mut axes = stage_axis(&stages, i.tp);
    let dp_stride = i.tp * i.pp;
    if kind.is_expert() {
        let dim = expert_dim(param, kind, which)?;
        // one split over the stage's tp x dp ranks, in the order d x tp + t
        let split = if i.ep { 0 } else { dim };
        axes.push(Axis::blocks(
            i.dp,
            dp_stride,
            i.tp,
            1,
            Placement::Shard(split),
        ));
    } else {
        axes.extend(tp_axes(param, kind, i.tp, facts, which)?);
        axes.push(Axis::new(i.dp, dp_stride, Placement::Replicate));
    }
    build(param, base + stages[0] * i.tp, &axes, which)
}

/// The inference side's engines, ranks from `base`: engine `d` (a data-parallel replica) is
/// its `tp x pp` ranks `base + t + tp x (s + pp x d)`, numbered as [`infer_layout`] numbers
/// them. In engine order, each in rank order.
pub fn infer_engines(i: &Inference, base: Rank) -> Vec<Vec<Rank>> {
    let size = i.tp * i.pp;
    (0..i.dp)
        .map(|d| (base + d * size..base + (d + 1) * size).collect())
        .collect()
}
