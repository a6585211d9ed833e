//! Many tensors in one reshard: a whole model's refit as one plan and one run.
//!
//! A rank's tensors live in *buffers*. By default every tensor's local shard is a buffer of its
//! own; a [`Fusion`] makes several tensors share one buffer per rank, their local shards
//! concatenated along one dim (vLLM's `qkv_proj` = `[q; k; v]`, `gate_up_proj` = `[gate; up]`,
//! and the MoE `w13` = `[gate; up]` per expert, along dim 1 of `[E, I, H]`). A buffer is a list
//! of [`Piece`]s: boxes of one tensor each, dense and row-major in a byte range of the buffer
//! (a fused buffer along dim 1 has one piece per member and expert), so the executor writes
//! every byte in place, with no temporary copy of any tensor.
//!
//! Planning is per tensor ([`reshard_core::plan::rank_plan`]), then every transfer is cut at the
//! pieces of both sides and all of a rank's moves are ordered by peer pair first (one stream
//! per pair, in the global shift order that keeps blocking transports deadlock free), then by
//! tensor. Tensors smaller than [`BatchOptions::pack_below`] whose source is fully replicated
//! (norms, biases, routers) go as one packed broadcast per source root instead: the root packs
//! them into one blob, sends it whole to every rank that needs any of them, and each unpacks
//! its own boxes; many tiny messages become one per receiver.
//!
//! A tensor may change dtype on the way ([`Tensor::dst`] of its own dtype): a float cast, or,
//! with a [`Tensor::quant`], fp8 values with block scales. Its values are converted by the
//! sender while it packs (or in the local copy), straight from the source piece into the
//! wire or the destination piece, so quantized tensors move in the same schedule as the
//! others, fused buffers included, and their scales land in the rank's *scale buffers*
//! ([`Batch::scale_buffers`]), fused like their weights. [`quant`] has the phases of a
//! quantizing batch and why they cannot deadlock.

pub mod baseline;
mod buffers;
pub mod lower;
mod plan;
pub mod quant;
mod run;
#[cfg(test)]
mod tests;

pub use plan::{Blobs, Move, MoveKind, Pack, PackRole, QuantSource, RankBatch};
pub use run::RankBuffers;
pub(crate) use run::check_all;
bench_use!(run::{run_local_batch, run_rank_batch});

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
// most pieces one fused buffer may be cut into on one rank
use reshard_core::limits::MAX_FUSED_PIECES as MAX_PIECES;
use reshard_core::plan::{
    Plan, PlanOptions, QuantPlan, QuantRequest, QuantizedMove, Schedule, check_compatible,
};
use reshard_core::region::Region;

/// One tensor of the batch: its name and both layouts (over one rank numbering).
#[derive(Clone, Debug)]
pub struct Tensor {
    /// Its name, for reports and errors.
    pub name: String,
    /// Where it lies before the move (the trainer's side).
    pub src: Layout,
    /// Of the source's dtype, another float dtype (cast in flight), or fp8 with `quant`.
    pub dst: Layout,
    /// With an fp8 destination: its quantization over both layouts ([`QuantPlan::new`]);
    /// checked again by [`Batch::new`], which keeps the checked one.
    pub quant: Option<QuantPlan>,
}

impl Tensor {
    /// A tensor moved in its own dtype, or cast into `dst`'s float dtype.
    pub fn new(name: impl Into<String>, src: Layout, dst: Layout) -> Tensor {
        Tensor {
            name: name.into(),
            src,
            dst,
            quant: None,
        }
    }

    /// Whether its values change dtype on the way (a cast or a quantization).
    pub fn converts(&self) -> bool {
        self.src.dtype() != self.dst.dtype()
    }

    fn layout(&self, side: Side) -> &Layout {
        if side == Side::Src {
            &self.src
        } else {
            &self.dst
        }
    }
}

/// Tensors whose local shards share one buffer per rank, concatenated along `dim` in
/// `members` order (indices into the batch's tensors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fusion {
    /// The fused buffer's name (`qkv_proj`, `gate_up_proj`).
    pub name: String,
    /// The side whose buffers are fused.
    pub side: Side,
    /// The dim the members' local shards are concatenated along.
    pub dim: usize,
    /// The fused tensors, as indices into the batch's tensors, in buffer order.
    pub members: Vec<usize>,
}

/// A box of one tensor, dense and row-major in `bytes` of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The tensor, as an index into the batch's tensors.
    pub tensor: usize,
    /// The box, in tensor coordinates.
    pub region: Region,
    /// Its bytes in the buffer.
    pub bytes: Range<usize>,
}

/// One buffer of a rank: a tensor's shard, or a fused buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// The tensor's or the fusion's name.
    pub name: String,
    /// Its size in bytes.
    pub len: usize,
    /// The boxes it holds, each in a byte range of its own.
    pub pieces: Vec<Piece>,
}

impl Buffer {
    /// A buffer holding one tensor's box `region` whole, `len` bytes.
    fn whole(name: &str, tensor: usize, region: Region, len: usize) -> Buffer {
        Buffer {
            name: name.to_string(),
            len,
            pieces: vec![Piece {
                tensor,
                region,
                bytes: 0..len,
            }],
        }
    }
}

/// Knobs of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchOptions {
    /// How each tensor is planned.
    pub plan: PlanOptions,
    /// Tensors smaller than this (in bytes) whose source is fully replicated go in one packed
    /// broadcast per source root; 0 turns packing off.
    pub pack_below: u64,
    /// The tensor (index into the batch's tensors) whose destination shard same-host senders
    /// may write straight into: its value moves land in the receiver's shard
    /// ([`reshard_transport::Lands::Shard`]), so a shm link offered that shard (a
    /// [`reshard_transport::segment::SharedBuffer`], see [`crate::Destination`])
    /// copies each byte once, by the sender, instead of twice through a ring. A shm link
    /// knows one destination box per receiver, so one tensor at most; its destination must be
    /// a buffer of its own (not fused), and it must not be packed (a packed tensor moves in a
    /// blob). Every other move, its scales included, lands aside. Both ends of a transfer
    /// read it from the batch, so they agree on where each chunk lands.
    pub direct: Option<usize>,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            plan: PlanOptions::default(),
            pack_below: DEFAULT_PACK_BELOW,
            direct: None,
        }
    }
}

/// The default packing threshold (see BENCHMARKS.md for the measurement behind it).
pub const DEFAULT_PACK_BELOW: u64 = 1 << 20;

/// A validated set of tensors and fusions.
#[derive(Clone, Debug)]
pub struct Batch {
    tensors: Vec<Tensor>,
    fusions: Vec<Fusion>,
    options: BatchOptions,
    /// Packed tensors by source root, in tensor order.
    packs: BTreeMap<Rank, Vec<usize>>,
    world: usize,
    /// One order on rank pairs for all the tensors: their source ranks against their
    /// destination ranks.
    schedule: Schedule,
    /// The order of the partial amax exchange: the quantized tensors' source ranks among
    /// themselves.
    amax_schedule: Schedule,
}

fn batch_error(what: &'static str, name: &str, reason: impl Into<String>) -> Error {
    Error::Batch {
        what,
        name: name.to_string(),
        reason: reason.into(),
    }
}

/// Checks that tensor `direct` can take direct writes ([`BatchOptions::direct`]): it exists,
/// its destination is not fused, and it is not packed.
fn check_direct(
    direct: usize,
    tensors: &[Tensor],
    fusions: &[Fusion],
    packs: &BTreeMap<Rank, Vec<usize>>,
) -> Result<()> {
    let Some(t) = tensors.get(direct) else {
        return Err(batch_error(
            "direct writes into tensor",
            &direct.to_string(),
            format!(
                "it is not a tensor of the batch ({} tensors)",
                tensors.len()
            ),
        ));
    };
    let refused = |reason: String| batch_error("direct writes into tensor", &t.name, reason);
    if let Some(f) = fusions
        .iter()
        .find(|f| f.side == Side::Dst && f.members.contains(&direct))
    {
        return Err(refused(format!(
            "its destination is fused into `{}`, which holds other tensors too",
            f.name
        )));
    }
    if packs.values().any(|p| p.contains(&direct)) {
        return Err(refused(
            "it is packed into a broadcast (small and replicated); set pack_below at most its size"
                .into(),
        ));
    }
    Ok(())
}

impl Batch {
    /// An already-quantized move ([`QuantizedMove`]) as one batch of two tensors, `values` and `scales` (in that order, so a
    /// rank's buffers are `[values, scales]`: [`QuantizedMove::VALUES`],
    /// [`QuantizedMove::SCALES`]), each planned as its own plan is, so that a run of the
    /// batch moves both in one schedule: one stream per peer pair, the scales of a pair right
    /// after its values. Small replicated tensors are not packed into broadcasts: every byte
    /// moves as the two plans say, so the wire carries exactly their bytes (values + scales)
    /// and [`QuantizedMove::totals`] stays what a run moves. The values may be written
    /// straight into their receivers' shards ([`BatchOptions::direct`]): over a shm link
    /// offered a rank's value shard, same-host senders copy the values there themselves,
    /// while the scales (another buffer) go through rings.
    ///
    /// ```
    /// use reshard_core::layout::LayoutSpec;
    /// use reshard_runtime::batch::Batch;
    /// use reshard_core::plan::{QuantRequest, QuantizedMove};
    /// use reshard_core::{DType, PlanOptions, Side};
    /// let layout = |spec: &str, first| {
    ///     LayoutSpec::parse(spec).unwrap().resolve(&[256, 256], DType::Fp8E4M3, first).unwrap()
    /// };
    /// let request = QuantRequest { scheme: "block:128x128".parse().unwrap(), scale_dtype: None };
    /// let mv = QuantizedMove::new(
    ///     layout("mesh=2 place=S(0)", 0),
    ///     layout("mesh=2 place=S(1)", 2),
    ///     PlanOptions::default(),
    ///     request,
    /// )
    /// .unwrap();
    /// let batch = Batch::quantized(&mv).unwrap();
    /// // rank 2 receives its 256x128 values and their 2x1 f32 scales
    /// let lens: Vec<usize> = batch.buffers(Side::Dst, 2).unwrap().iter().map(|b| b.len).collect();
    /// assert_eq!(lens, [256 * 128, 2 * 4]);
    /// ```
    pub fn quantized(mv: &QuantizedMove) -> Result<Batch> {
        let tensor =
            |name: &str, plan: &Plan| Tensor::new(name, plan.src().clone(), plan.dst().clone());
        Batch::new(
            vec![tensor("values", &mv.values), tensor("scales", &mv.scales)],
            Vec::new(),
            BatchOptions {
                plan: mv.values.options(),
                pack_below: 0,
                direct: Some(QuantizedMove::VALUES),
            },
        )
    }

    /// Validates the tensors and fusions, before any buffer exists.
    pub fn new(
        mut tensors: Vec<Tensor>,
        fusions: Vec<Fusion>,
        options: BatchOptions,
    ) -> Result<Batch> {
        for t in &mut tensors {
            match &t.quant {
                None => check_compatible(&t.src, &t.dst)
                    .map_err(|e| batch_error("tensor", &t.name, e.to_string()))?,
                Some(q) => {
                    if t.src.shape() != t.dst.shape() {
                        return Err(batch_error(
                            "tensor",
                            &t.name,
                            format!(
                                "its source is of shape {:?} but its destination of {:?}",
                                t.src.shape(),
                                t.dst.shape()
                            ),
                        ));
                    }
                    let request = QuantRequest {
                        scheme: q.quant.scheme,
                        scale_dtype: Some(q.quant.scale_dtype),
                    };
                    let checked = QuantPlan::new(request, &t.src, &t.dst).map_err(|e| match e {
                        Error::Convert { source, .. } => Error::Convert {
                            tensor: t.name.clone(),
                            source,
                        },
                        other => batch_error("tensor", &t.name, other.to_string()),
                    })?;
                    t.quant = Some(checked);
                }
            }
        }
        let mut fused: BTreeSet<(usize, bool)> = BTreeSet::new();
        for f in &fusions {
            if f.members.is_empty() {
                return Err(batch_error("fusion", &f.name, "it has no members"));
            }
            let first = f.members[0];
            for &m in &f.members {
                let Some(t) = tensors.get(m) else {
                    return Err(batch_error(
                        "fusion",
                        &f.name,
                        format!(
                            "member {m} is not a tensor of the batch ({} tensors)",
                            tensors.len()
                        ),
                    ));
                };
                if !fused.insert((m, f.side == Side::Src)) {
                    return Err(batch_error(
                        "fusion",
                        &f.name,
                        format!(
                            "tensor `{}` is already fused on the {} side",
                            t.name, f.side
                        ),
                    ));
                }
                let lead = &tensors[first];
                if t.src.ndim() != lead.src.ndim() || f.dim >= t.src.ndim() {
                    return Err(batch_error(
                        "fusion",
                        &f.name,
                        format!(
                            "dim {} does not exist in every member (`{}` has {} dims)",
                            f.dim,
                            t.name,
                            t.src.ndim()
                        ),
                    ));
                }
                let (mine, theirs) = (t.layout(f.side).dtype(), lead.layout(f.side).dtype());
                if mine != theirs {
                    return Err(batch_error(
                        "fusion",
                        &f.name,
                        format!(
                            "members of one buffer share a dtype, but `{}` is {theirs} and `{}` is {mine}",
                            lead.name, t.name,
                        ),
                    ));
                }
                let scales = |t: &Tensor| t.quant.as_ref().map(|q| q.quant.scale_dtype);
                if f.side == Side::Dst && scales(t) != scales(lead) {
                    return Err(batch_error(
                        "fusion",
                        &f.name,
                        format!(
                            "members of one buffer share their scales' dtype, but `{}` has {:?} and `{}` {:?}",
                            lead.name,
                            scales(lead),
                            t.name,
                            scales(t)
                        ),
                    ));
                }
            }
        }
        let mut packs: BTreeMap<Rank, Vec<usize>> = BTreeMap::new();
        for (i, t) in tensors.iter().enumerate() {
            let whole_everywhere = t.src.replication() == t.src.mesh().size();
            let src_fused = fused.contains(&(i, true));
            // a packed tensor is copied out of the blob as it is: it keeps its dtype
            if options.pack_below > 0
                && t.src.total_bytes() < options.pack_below
                && whole_everywhere
                && !src_fused
                && !t.converts()
            {
                packs.entry(t.src.mesh().ranks()[0]).or_default().push(i);
            }
        }
        if let Some(d) = options.direct {
            check_direct(d, &tensors, &fusions, &packs)?;
        }
        let world = tensors
            .iter()
            .flat_map(|t| t.src.mesh().ranks().iter().chain(t.dst.mesh().ranks()))
            .max()
            .map_or(0, |&r| r + 1);
        let schedule = Schedule::new(
            tensors
                .iter()
                .flat_map(|t| t.src.mesh().ranks().iter().copied()),
            tensors
                .iter()
                .flat_map(|t| t.dst.mesh().ranks().iter().copied()),
        );
        let quant_src = || {
            tensors
                .iter()
                .filter(|t| t.quant.is_some())
                .flat_map(|t| t.src.mesh().ranks().iter().copied())
        };
        let amax_schedule = Schedule::new(quant_src(), quant_src());
        Ok(Batch {
            tensors,
            fusions,
            options,
            packs,
            world,
            schedule,
            amax_schedule,
        })
    }

    /// Whether any tensor changes dtype on the way: then every rank cuts its transfers into
    /// chunks of whole elements of every dtype ([`crate::exec::cut_chunk`]), those that keep
    /// their dtype too, so that both ends of every transfer cut it alike.
    pub fn converts(&self) -> bool {
        self.tensors.iter().any(Tensor::converts)
    }

    /// The tensors, in batch order: the indices moves, fusions and pieces name them by.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The fusions, as given.
    pub fn fusions(&self) -> &[Fusion] {
        &self.fusions
    }

    /// One more than the highest rank of any layout.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether tensor `i` goes in a packed broadcast.
    pub fn is_packed(&self, i: usize) -> bool {
        self.packs.values().any(|p| p.contains(&i))
    }
}
