//! The training side: Megatron-LM's layouts (`tp, cp, ep, etp, dp, pp`, FSDP).

use reshard_core::layout::{Layout, Placement};

use super::super::parallel::Training;
use super::super::params::Param;
use super::axes::{Axis, build, expert_dim, stage_axis, tp_axes};
use super::pipeline::{ModelFacts, check_stages, stages_of};
use super::{Kind, Which};
use crate::error::ModelError;

/// The training layout of `param` (Megatron-LM; see the module docs).
pub fn train_layout(
    param: &Param,
    kind: Kind,
    t: &Training,
    facts: &ModelFacts,
) -> Result<Layout, ModelError> {
    let which = Which::Train;
    check_stages(t.pp, facts, which)?;
    let stages = stages_of(param, facts, t.pp);
    let stage = t.stage_size();
    let mut axes = stage_axis(&stages, stage);
    // data-parallel axes: `dp` ranks at `stride`, FSDP splitting dim 0 inside groups of f
    let data = |dp: usize, stride: usize| match t.fsdp {
        Some(f) => vec![
            Axis::new(dp / f, stride * f, Placement::Replicate),
            Axis::new(f, stride, Placement::Shard(0)),
        ],
        None => vec![Axis::new(dp, stride, Placement::Replicate)],
    };
    if kind.is_expert() {
        let dim = expert_dim(param, kind, which)?;
        axes.push(Axis::new(t.ep, t.etp, Placement::Shard(0)));
        axes.push(Axis::new(t.etp, 1, Placement::Shard(dim)));
        axes.extend(data(t.edp(), t.etp * t.ep));
    } else {
        axes.extend(tp_axes(param, kind, t.tp, facts, which)?);
        axes.push(Axis::new(t.cp, t.tp, Placement::Replicate));
        axes.extend(data(t.dp, t.tp * t.cp));
    }
    build(param, stages[0] * stage, &axes, which)
}
