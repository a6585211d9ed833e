//! Mesh axes: the building block of every layout the rules make (a size, the rank distance
//! between neighbours, a placement), and the tensor-parallel and expert axes both sides share.

use reshard_core::layout::{Layout, Mesh, Placement, Rank};

use super::super::params::Param;
use super::pipeline::ModelFacts;
use super::{Kind, Which};
use crate::error::ModelError;

/// One mesh axis: its size, the rank distance between neighbours along it, its placement.
/// An axis may also run over two strides (`inner` ranks at `stride`, then the next block of
/// `inner` at `outer_stride`), for a split over ranks that are not evenly spaced, like vLLM's
/// expert parallelism across pipeline stages.
#[derive(Clone, Copy, Debug)]
pub(super) struct Axis {
    size: usize,
    stride: usize,
    inner: usize,
    outer_stride: usize,
    place: Placement,
}

impl Axis {
    pub(super) fn new(size: usize, stride: usize, place: Placement) -> Axis {
        Axis {
            size,
            stride,
            inner: size,
            outer_stride: 0,
            place,
        }
    }

    /// `outer x inner` positions: `inner` ranks at `stride`, blocks of them at `outer_stride`.
    pub(super) fn blocks(
        outer: usize,
        outer_stride: usize,
        inner: usize,
        stride: usize,
        place: Placement,
    ) -> Axis {
        Axis {
            size: outer * inner,
            stride,
            inner,
            outer_stride,
            place,
        }
    }

    /// The rank distance of coordinate `c` from coordinate 0.
    fn offset(&self, c: usize) -> usize {
        (c / self.inner) * self.outer_stride + (c % self.inner) * self.stride
    }

    /// The largest distance between neighbours: what orders axes slowest first.
    fn span(&self) -> usize {
        self.stride.max(self.outer_stride)
    }
}

/// The layout over `axes` (for axes sharding the same dim, list order = nesting order), ranks
/// `base + sum(offset of each coord)`. Size-1 axes are dropped; a single rank gets a one-axis
/// replicated mesh.
pub(super) fn build(
    param: &Param,
    base: Rank,
    axes: &[Axis],
    which: Which,
) -> Result<Layout, ModelError> {
    let mut axes: Vec<Axis> = axes.iter().copied().filter(|a| a.size > 1).collect();
    // Slowest axes first, so that ranks read in row-major order where possible (`ranks=0..8`),
    // but never swapping two axes that shard the same dim: their order is the nesting order.
    for end in (1..axes.len()).rev() {
        for i in 0..end {
            let (a, b) = (axes[i], axes[i + 1]);
            let same_dim =
                matches!((a.place, b.place), (Placement::Shard(x), Placement::Shard(y)) if x == y);
            if a.span() < b.span() && !same_dim {
                axes.swap(i, i + 1);
            }
        }
    }
    let axes = if axes.is_empty() {
        vec![Axis::new(1, 1, Placement::Replicate)]
    } else {
        axes
    };
    let dims: Vec<usize> = axes.iter().map(|a| a.size).collect();
    let count: usize = dims.iter().product();
    let mut ranks = Vec::with_capacity(count);
    for mut position in 0..count {
        let mut rank = base;
        for a in axes.iter().rev() {
            rank += a.offset(position % a.size);
            position /= a.size;
        }
        ranks.push(rank);
    }
    let err = |source| ModelError::Layout {
        tensor: param.name.clone(),
        side: which.field(),
        source,
    };
    let mesh = Mesh::new(dims, ranks).map_err(err)?;
    let placements = axes.iter().map(|a| a.place).collect();
    Layout::new(param.shape.clone(), param.dtype, mesh, placements).map_err(err)
}

/// The tensor-parallel axes of a dense (non-expert) parameter of `kind`, TP ranks at stride 1.
pub(super) fn tp_axes(
    param: &Param,
    kind: Kind,
    tp: usize,
    facts: &ModelFacts,
    which: Which,
) -> Result<Vec<Axis>, ModelError> {
    let shard = |dim: usize| Placement::Shard(dim);
    Ok(match kind {
        Kind::Replicate | Kind::ExpertColumn | Kind::ExpertRow => {
            vec![Axis::new(tp, 1, Placement::Replicate)]
        }
        Kind::Column => vec![Axis::new(tp, 1, shard(0))],
        Kind::Row => vec![Axis::new(tp, 1, shard(1))],
        Kind::KvColumn => {
            let Some(kv) = facts.heads.map(|h| h.kv as usize) else {
                return Ok(vec![Axis::new(tp, 1, shard(0))]);
            };
            if kv.is_multiple_of(tp) {
                vec![Axis::new(tp, 1, shard(0))]
            } else if tp.is_multiple_of(kv) {
                let copies = tp / kv;
                vec![
                    Axis::new(kv, copies, shard(0)),
                    Axis::new(copies, 1, Placement::Replicate),
                ]
            } else {
                return Err(ModelError::Parallel {
                    side: which.field(),
                    key: "tp".into(),
                    value: tp.to_string(),
                    reason: format!(
                        "{}: tp must divide or be a multiple of the {kv} key/value heads",
                        param.name
                    ),
                });
            }
        }
    })
}

pub(super) fn expert_dim(param: &Param, kind: Kind, which: Which) -> Result<usize, ModelError> {
    if param.shape.len() != 3 {
        return Err(ModelError::KindShape {
            tensor: param.name.clone(),
            side: which.field(),
            kind: kind.name(),
            ndim: param.shape.len(),
        });
    }
    Ok(if kind == Kind::ExpertColumn { 1 } else { 2 })
}

/// An axis holding every stage in `stages` (one or two), placed as a replication.
pub(super) fn stage_axis(stages: &[usize], stage_stride: usize) -> Vec<Axis> {
    match stages {
        [first, .., last] if last > first => vec![Axis::new(
            2,
            (last - first) * stage_stride,
            Placement::Replicate,
        )],
        _ => Vec::new(),
    }
}
