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
pub mod quant;
mod run;
#[cfg(test)]
mod tests;

pub use run::{RankBuffers, run_local_batch, run_rank_batch};

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::exec::{Step, Steps};
use reshard_core::copy::{Cast, CopyGeometry, Place};
use reshard_core::dtype::DType;
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
// most pieces one fused buffer may be cut into on one rank
use reshard_core::limits::MAX_FUSED_PIECES as MAX_PIECES;
use reshard_core::plan::quant::AMAX_BYTES;
use reshard_core::plan::{
    Plan, PlanOptions, QuantPlan, QuantRequest, QuantizedMove, Schedule, check_compatible,
    rank_plan, rank_plan_quantized,
};
use reshard_core::region::Region;
use reshard_transport::Lands;

/// One tensor of the batch: its name and both layouts (over one rank numbering).
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
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
    pub name: String,
    pub side: Side,
    pub dim: usize,
    pub members: Vec<usize>,
}

/// A box of one tensor, dense and row-major in `bytes` of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: usize,
    pub region: Region,
    pub bytes: Range<usize>,
}

/// One buffer of a rank: a tensor's shard, or a fused buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// The tensor's or the fusion's name.
    pub name: String,
    pub len: usize,
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

    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

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

    /// Each member of a fusion on `side`, with its fusion.
    fn fusion_of(&self, side: Side) -> BTreeMap<usize, &Fusion> {
        self.fusions
            .iter()
            .filter(|f| f.side == side)
            .flat_map(|f| f.members.iter().map(move |&m| (m, f)))
            .collect()
    }

    /// `rank`'s buffers on `side`, in a fixed order: tensors in batch order, a fused buffer
    /// where its first member comes. Fails if a fusion's members disagree on this rank.
    pub fn buffers(&self, side: Side, rank: Rank) -> Result<Vec<Buffer>> {
        let fusion_of = self.fusion_of(side);
        let mut out = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            match fusion_of.get(&i) {
                Some(f) if f.members[0] == i => {
                    if let Some(b) = self.fused_buffer(f, side, rank)? {
                        out.push(b);
                    }
                }
                Some(_) => {}
                None => {
                    let l = t.layout(side);
                    if let Some(region) = l.local_region(rank) {
                        let len = l.local_bytes(rank) as usize;
                        out.push(Buffer::whole(&t.name, i, region, len));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The members' local shards on `rank`, concatenated along the fusion's dim.
    fn fused_buffer(&self, f: &Fusion, side: Side, rank: Rank) -> Result<Option<Buffer>> {
        let boxes: Vec<Option<Region>> = f
            .members
            .iter()
            .map(|&m| self.tensors[m].layout(side).local_region(rank))
            .collect();
        let elem = self.tensors[f.members[0]].layout(side).dtype().size();
        self.fuse(f, rank, boxes, elem)
    }

    /// `rank`'s scale buffers, one per destination buffer that holds quantized tensors, in
    /// the order of [`Batch::buffers`]: a tensor's scale shard (its box of the block grid,
    /// row-major, in the scale dtype), or for a fused buffer the members' scale shards
    /// concatenated along the same dim in block coordinates, as the engine fuses the scales
    /// of a fused weight (vLLM's `qkv_proj.weight_scale_inv`, `w13_weight_scale_inv`). Every
    /// member but the last must hold whole blocks along the fused dim, or the blocks of the
    /// fused buffer would straddle two members: an error naming the fusion and the member.
    pub fn scale_buffers(&self, rank: Rank) -> Result<Vec<Buffer>> {
        let fusion_of = self.fusion_of(Side::Dst);
        let mut out = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let Some(q) = &t.quant else { continue };
            match fusion_of.get(&i) {
                Some(f) if f.members[0] == i => {
                    self.check_whole_blocks(f, rank)?;
                    let boxes = f
                        .members
                        .iter()
                        .map(|&m| {
                            let t = &self.tensors[m];
                            t.quant.as_ref().and_then(|q| q.dst_scale_box(&t.dst, rank))
                        })
                        .collect();
                    if let Some(b) = self.fuse(f, rank, boxes, q.scale_bytes())? {
                        out.push(b);
                    }
                }
                Some(_) => {}
                None => {
                    if let Some(region) = q.dst_scale_box(&t.dst, rank) {
                        let len = region.volume() as usize * q.scale_bytes();
                        out.push(Buffer::whole(&t.name, i, region, len));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Every member of a destination fusion but the last holds whole blocks along its dim on
    /// `rank`.
    fn check_whole_blocks(&self, f: &Fusion, rank: Rank) -> Result<()> {
        let Some((_, leading)) = f.members.split_last() else {
            return Ok(());
        };
        for &m in leading {
            let t = &self.tensors[m];
            let (Some(q), Some(shard)) = (&t.quant, t.dst.local_region(rank)) else {
                continue;
            };
            let block = q.grid.block()[f.dim];
            let held = shard.extent[f.dim];
            if !held.is_multiple_of(block) {
                return Err(batch_error(
                    "fusion",
                    &f.name,
                    format!(
                        "on rank {rank}, `{}` holds {held} elements along dim {}, not a multiple of its block's {block}: the fused buffer's blocks would straddle two members",
                        t.name, f.dim
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The boxes `boxes` of `f`'s members on `rank` (elements of `elem` bytes), concatenated
    /// along the fusion's dim: a fused buffer of values, or of scales.
    fn fuse(
        &self,
        f: &Fusion,
        rank: Rank,
        boxes: Vec<Option<Region>>,
        elem: usize,
    ) -> Result<Option<Buffer>> {
        if boxes.iter().all(Option::is_none) {
            return Ok(None);
        }
        let Some(boxes) = boxes.into_iter().collect::<Option<Vec<Region>>>() else {
            return Err(batch_error(
                "fusion",
                &f.name,
                format!("rank {rank} holds some members but not all"),
            ));
        };
        let d = f.dim;
        let lead = &boxes[0];
        for (b, &m) in boxes.iter().zip(&f.members) {
            let agree = (0..lead.ndim()).all(|k| k == d || b.extent[k] == lead.extent[k]);
            if !agree {
                return Err(batch_error(
                    "fusion",
                    &f.name,
                    format!(
                        "on rank {rank}, `{}` holds a box of extent {:?} but `{}` one of {:?}: they may differ along dim {d} only",
                        self.tensors[f.members[0]].name,
                        lead.extent,
                        self.tensors[m].name,
                        b.extent
                    ),
                ));
            }
        }
        let mut extent = lead.extent.clone();
        extent[d] = boxes.iter().map(|b| b.extent[d]).sum();
        // element strides of the fused buffer, row-major
        let mut strides = vec![1u64; extent.len()];
        for k in (0..extent.len().saturating_sub(1)).rev() {
            strides[k] = strides[k + 1] * extent[k + 1];
        }
        let outer: u64 = lead.extent[..d].iter().product();
        if outer as usize * f.members.len() > MAX_PIECES {
            return Err(batch_error(
                "fusion",
                &f.name,
                format!(
                    "fusing along dim {d} cuts rank {rank}'s buffer into more than {MAX_PIECES} pieces"
                ),
            ));
        }
        let mut pieces = Vec::new();
        let mut along = 0u64;
        for (b, &m) in boxes.iter().zip(&f.members) {
            if b.volume() > 0 {
                for o in 0..outer {
                    // the outer coordinates of piece `o`, mixed radix over dims 0..d
                    let mut rest = o;
                    let mut start = along * strides[d];
                    let mut region = b.clone();
                    for k in (0..d).rev() {
                        let j = rest % lead.extent[k];
                        rest /= lead.extent[k];
                        start += j * strides[k];
                        region.offset[k] += j;
                        region.extent[k] = 1;
                    }
                    let len = region.volume() * elem as u64;
                    let start = (start * elem as u64) as usize;
                    pieces.push(Piece {
                        tensor: m,
                        region,
                        bytes: start..start + len as usize,
                    });
                }
            }
            along += b.extent[d];
        }
        let len = extent.iter().product::<u64>() as usize * elem;
        Ok(Some(Buffer {
            name: f.name.clone(),
            len,
            pieces,
        }))
    }

    /// The quantized tensors `rank` holds a source shard of, and its partial amax moves (both
    /// ways, each exchange's buffer numbered across the tensors, unsorted).
    fn quant_sources(&self, rank: Rank) -> (Vec<QuantSource>, Vec<Move>) {
        let mut quant = Vec::new();
        let mut amax = Vec::new();
        // amax buffers, counted across the tensors
        let mut at = 0;
        for (i, t) in self.tensors.iter().enumerate() {
            let (Some(q), Some(shard)) = (&t.quant, t.src.local_region(rank)) else {
                continue;
            };
            let mut exchanges = Vec::new();
            for (peer, blocks) in reshard_core::convert::amax_exchange(&t.src, &q.grid, rank) {
                let len = blocks.volume() as usize * AMAX_BYTES;
                let send = Move {
                    tensor: i,
                    kind: MoveKind::Amax,
                    from: rank,
                    to: peer,
                    region: blocks.clone(),
                    elem_bytes: AMAX_BYTES,
                    src_box: blocks.clone(),
                    dst_box: blocks.clone(),
                    src_at: Some((at, 0..len)),
                    dst_at: None,
                };
                amax.push(Move {
                    from: peer,
                    to: rank,
                    src_at: None,
                    dst_at: Some((at, 0..len)),
                    ..send.clone()
                });
                amax.push(send);
                exchanges.push(blocks);
                at += 1;
            }
            quant.push(QuantSource {
                tensor: i,
                blocks: q.grid.blocks_touching(&shard),
                shard,
                exchanges,
            });
        }
        (quant, amax)
    }

    /// Everything `rank` does in the batch, computed from the layouts alone.
    pub fn rank_batch(&self, rank: Rank) -> Result<RankBatch> {
        let mut cache = Pieces::new(self);
        let src = self.buffers(Side::Src, rank)?;
        let dst = self.buffers(Side::Dst, rank)?;
        let scales = self.scale_buffers(rank)?;
        let (quant, amax) = self.quant_sources(rank);
        let src_count = src.len();
        let staged_at = |i: usize| {
            quant
                .iter()
                .position(|s: &QuantSource| s.tensor == i)
                .map(|k| src_count + k)
        };
        let mut out = RankBatch {
            rank,
            moves: Vec::new(),
            packs: Vec::new(),
            src_buffers: src.len(),
            dst_buffers: dst.len(),
            direct: self.options.direct,
            src,
            dst,
            scales: Vec::new(),
            quant: Vec::new(),
            amax,
        };
        for (i, t) in self.tensors.iter().enumerate() {
            if self.is_packed(i) {
                continue;
            }
            let plan = match &t.quant {
                None => rank_plan(&t.src, &t.dst, rank, &self.options.plan),
                Some(q) => rank_plan_quantized(&t.src, &t.dst, rank, &self.options.plan, q),
            }
            .map_err(|e| batch_error("tensor", &t.name, e.to_string()))?;
            let kind = match &t.quant {
                Some(_) => MoveKind::Quantize(t.src.dtype(), t.dst.dtype()),
                None if t.converts() => MoveKind::Cast(t.src.dtype(), t.dst.dtype()),
                None => MoveKind::Copy,
            };
            for tr in plan.sends.iter().chain(&plan.recvs).chain(&plan.locals) {
                let src_pieces = cache.of(Holder::Src, tr.src, i)?;
                let dst_pieces = cache.of(Holder::Dst, tr.dst, i)?;
                for (sb, sp, sbox) in &src_pieces {
                    let Some(part) = tr.region.intersect(sbox) else {
                        continue;
                    };
                    for (db, dp, dbox) in &dst_pieces {
                        let Some(part) = part.intersect(dbox) else {
                            continue;
                        };
                        let src_at =
                            (tr.src == rank).then(|| (*sb, out.src[*sb].pieces[*sp].bytes.clone()));
                        let dst_at =
                            (tr.dst == rank).then(|| (*db, out.dst[*db].pieces[*dp].bytes.clone()));
                        out.moves.push(Move {
                            tensor: i,
                            kind,
                            from: tr.src,
                            to: tr.dst,
                            region: part,
                            // the wire carries destination elements
                            elem_bytes: t.dst.dtype().size(),
                            src_box: sbox.clone(),
                            dst_box: dbox.clone(),
                            src_at,
                            dst_at,
                        });
                    }
                }
                // the scales of the blocks this transfer carries: from the sender's staged
                // scales (the blocks its shard touches) into the receiver's scale pieces
                let Some(q) = &t.quant else { continue };
                let Some(st) = q.scales_of(&t.dst, tr) else {
                    continue;
                };
                let Some(sender) = t.src.local_region(st.src) else {
                    return Err(batch_error(
                        "tensor",
                        &t.name,
                        format!("rank {} sends it but holds no source shard", st.src),
                    ));
                };
                let staged = q.grid.blocks_touching(&sender);
                let staged_len = staged.volume() as usize * q.scale_bytes();
                for (db, dp, dbox) in &cache.of(Holder::Scales, st.dst, i)? {
                    let Some(part) = st.region.intersect(dbox) else {
                        continue;
                    };
                    let src_at = match st.src == rank {
                        true => Some((
                            staged_at(i).ok_or_else(|| Error::Internal {
                                rank,
                                detail: format!("{}: no staged scales for a send", t.name),
                            })?,
                            0..staged_len,
                        )),
                        false => None,
                    };
                    let dst_at = (st.dst == rank)
                        .then(|| (out.dst_buffers + *db, scales[*db].pieces[*dp].bytes.clone()));
                    out.moves.push(Move {
                        tensor: i,
                        kind: MoveKind::Scales,
                        from: st.src,
                        to: st.dst,
                        region: part,
                        elem_bytes: q.scale_bytes(),
                        src_box: staged.clone(),
                        dst_box: dbox.clone(),
                        src_at,
                        dst_at,
                    });
                }
            }
        }
        // the blobs follow the staged scales (source side) and the scale buffers
        let (src_extra, dst_extra) = (quant.len(), scales.len());
        for (&root, members) in &self.packs {
            let mut offset = 0usize;
            let mut layout = Vec::new();
            let mut receivers = BTreeSet::new();
            for &i in members {
                let t = &self.tensors[i];
                let len = t.src.total_bytes() as usize;
                layout.push((i, offset..offset + len));
                offset += len;
                receivers.extend(t.dst.mesh().ranks().iter().copied().filter(|&r| r != root));
            }
            let blob = Region::full(&[offset as u64]);
            let pack = Pack {
                root,
                len: offset,
                tensors: layout,
            };
            let count = |role| out.packs.iter().filter(|(_, r)| *r == role).count();
            let blob_move = |to: Rank| Move {
                tensor: self.tensors.len() + root,
                kind: MoveKind::Copy,
                from: root,
                to,
                region: blob.clone(),
                elem_bytes: 1,
                src_box: blob.clone(),
                dst_box: blob.clone(),
                src_at: None,
                dst_at: None,
            };
            if rank == root {
                let at = out.src_buffers + src_extra + count(PackRole::Root);
                for &r in &receivers {
                    out.moves.push(Move {
                        src_at: Some((at, 0..offset)),
                        ..blob_move(r)
                    });
                }
                out.packs.push((pack, PackRole::Root));
            } else if receivers.contains(&rank) {
                let at = out.dst_buffers + dst_extra + count(PackRole::Receiver);
                out.moves.push(Move {
                    dst_at: Some((at, 0..offset)),
                    ..blob_move(rank)
                });
                out.packs.push((pack, PackRole::Receiver));
            }
        }
        out.scales = scales;
        out.quant = quant;
        // values before scales within a tensor, on both ends of every pair alike
        let schedule = &self.schedule;
        out.moves.sort_by(|a, b| {
            let key = |m: &Move| {
                let scales = m.kind == MoveKind::Scales;
                (schedule.step(m.from, m.to), m.from, m.to, m.tensor, scales)
            };
            key(a).cmp(&key(b)).then_with(|| a.region.cmp(&b.region))
        });
        let amax_schedule = &self.amax_schedule;
        out.amax.sort_by(|a, b| {
            let key = |m: &Move| (amax_schedule.step(m.from, m.to), m.from, m.to, m.tensor);
            key(a).cmp(&key(b)).then_with(|| a.region.cmp(&b.region))
        });
        Ok(out)
    }
}

/// Where a piece of a tensor is: buffer index, piece index, box.
type PieceAt = (usize, usize, Region);

/// The buffers pieces are looked up in: a rank's source or destination buffers, or its scale
/// buffers (whose pieces are boxes of the block grid).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Holder {
    Src,
    Dst,
    Scales,
}

/// Every rank's pieces of every tensor, computed once per (holder, rank) as moves need them.
struct Pieces<'b> {
    batch: &'b Batch,
    by_rank: BTreeMap<(Holder, Rank), BTreeMap<usize, Vec<PieceAt>>>,
}

impl<'b> Pieces<'b> {
    fn new(batch: &'b Batch) -> Pieces<'b> {
        Pieces {
            batch,
            by_rank: BTreeMap::new(),
        }
    }

    /// (buffer, piece, box) of tensor `i` on `rank`'s `holder`.
    fn of(&mut self, holder: Holder, rank: Rank, i: usize) -> Result<Vec<PieceAt>> {
        let key = (holder, rank);
        if !self.by_rank.contains_key(&key) {
            let buffers = match holder {
                Holder::Src => self.batch.buffers(Side::Src, rank)?,
                Holder::Dst => self.batch.buffers(Side::Dst, rank)?,
                Holder::Scales => self.batch.scale_buffers(rank)?,
            };
            let mut map: BTreeMap<usize, Vec<PieceAt>> = BTreeMap::new();
            for (b, buffer) in buffers.into_iter().enumerate() {
                for (p, piece) in buffer.pieces.into_iter().enumerate() {
                    map.entry(piece.tensor)
                        .or_default()
                        .push((b, p, piece.region));
                }
            }
            self.by_rank.insert(key, map);
        }
        Ok(self.by_rank[&key].get(&i).cloned().unwrap_or_default())
    }
}

/// What a move carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveKind {
    /// Values in their own dtype (or a packed blob).
    Copy,
    /// Values cast from the first float dtype into the second while they are packed.
    Cast(DType, DType),
    /// Values quantized from the first dtype into the second (fp8) while they are packed,
    /// with the sender's scales.
    Quantize(DType, DType),
    /// Scales of a quantized tensor: a region of its block grid.
    Scales,
    /// Partial amax of a quantized tensor between two of its source ranks (4 bytes per
    /// block of the region, in grid coordinates).
    Amax,
}

/// One cut of a transfer: a region of one tensor between one source piece and one
/// destination piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// The tensor (or, past the batch's tensors, a packed blob).
    pub tensor: usize,
    pub kind: MoveKind,
    pub from: Rank,
    pub to: Rank,
    /// In tensor coordinates, or block grid coordinates for scales and amax.
    pub region: Region,
    /// Bytes per element on the wire (the destination's).
    pub elem_bytes: usize,
    pub src_box: Region,
    pub dst_box: Region,
    /// Buffer and bytes of `src_box` on this rank, when it sends.
    pub src_at: Option<(usize, Range<usize>)>,
    /// Buffer and bytes of `dst_box` on this rank, when it receives.
    pub dst_at: Option<(usize, Range<usize>)>,
}

impl Move {
    /// The executor's step of this move, converting with `cast` and landing where `lands` says.
    pub fn step(&self, cast: Option<Cast>, lands: reshard_transport::Lands) -> Step<'_> {
        Step {
            from: self.from,
            to: self.to,
            region: &self.region,
            elem_bytes: self.elem_bytes,
            src_box: &self.src_box,
            dst_box: &self.dst_box,
            src_at: self.src_at.clone(),
            dst_at: self.dst_at.clone(),
            cast,
            lands,
        }
    }
}

/// A quantized tensor this rank holds a source shard of: it computes the amax of the blocks
/// its shard touches, exchanges partial amax where a block straddles source shards, and
/// stages those blocks' scales for its scale moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantSource {
    pub tensor: usize,
    /// The rank's source box of the tensor (its pieces may lie in a fused buffer).
    pub shard: Region,
    /// The blocks it touches: the staged scales, row-major.
    pub blocks: Region,
    /// The blocks of each partial amax exchange, in the order of their buffers (the
    /// `src_at`/`dst_at` of the rank's amax moves count across all its quantized tensors).
    pub exchanges: Vec<Region>,
}

/// A packed broadcast: the root's small tensors, whole, one after the other in a blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pack {
    pub root: Rank,
    pub len: usize,
    /// Each tensor and its bytes in the blob.
    pub tensors: Vec<(usize, Range<usize>)>,
}

/// What a rank does with a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackRole {
    Root,
    Receiver,
}

/// A rank's blobs: those it roots, those it receives.
pub type Blobs = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// One rank's part of a batch: its buffers, its moves in schedule order, its packs.
///
/// The executor's buffers: on the source side, the rank's source buffers, then the staged
/// scales of each [`QuantSource`], then one blob per pack it roots; on the destination side,
/// its destination buffers, then its scale buffers, then one blob per pack it receives.
#[derive(Clone, Debug)]
pub struct RankBatch {
    pub rank: Rank,
    /// The rank's source buffers.
    pub src: Vec<Buffer>,
    /// The rank's destination buffers.
    pub dst: Vec<Buffer>,
    /// The rank's scale buffers ([`Batch::scale_buffers`]).
    pub scales: Vec<Buffer>,
    /// Every value and scale move, in schedule order.
    pub moves: Vec<Move>,
    pub packs: Vec<(Pack, PackRole)>,
    /// The quantized tensors it holds a source shard of, in tensor order.
    pub quant: Vec<QuantSource>,
    /// Its partial amax sends and receives, in the amax schedule's order.
    pub amax: Vec<Move>,
    src_buffers: usize,
    dst_buffers: usize,
    /// [`BatchOptions::direct`]: the tensor whose value moves land in the receiver's shard.
    direct: Option<usize>,
}

impl RankBatch {
    /// The steps the executor runs: every move, a value move of a converting tensor with its
    /// cast. `quant` holds the quantizing casts of this rank's source pieces (from
    /// [`quant::prepare`]); a rank that only receives quantized values carries the marker
    /// cast, so that it cuts their transfers as their senders do.
    pub fn steps(&self, quant: Option<&quant::Casts>) -> Result<Steps<'_, '_>> {
        let mut steps = Steps {
            rank: self.rank,
            ..Steps::default()
        };
        for m in &self.moves {
            let cast = match m.kind {
                MoveKind::Copy | MoveKind::Scales | MoveKind::Amax => None,
                MoveKind::Cast(from, to) => {
                    Cast::between(from, to).map_err(|source| Error::Convert {
                        tensor: format!("tensor {}", m.tensor),
                        source,
                    })?
                }
                MoveKind::Quantize(from, to) if m.from != self.rank => {
                    Some(Cast::quantizing(from, to, None))
                }
                MoveKind::Quantize(..) => {
                    let cast = m
                        .src_at
                        .as_ref()
                        .and_then(|(b, bytes)| quant?.of(*b, bytes.start));
                    Some(cast.cloned().ok_or_else(|| Error::Internal {
                        rank: self.rank,
                        detail: format!(
                            "tensor {} is quantized, but this rank has no scales for its piece",
                            m.tensor
                        ),
                    })?)
                }
            };
            let step = m.step(cast, self.lands(m));
            if m.from == m.to {
                steps.locals.push(step);
            } else if m.from == self.rank {
                steps.sends.push(step);
            } else {
                steps.recvs.push(step);
            }
        }
        Ok(steps)
    }

    /// Where move `m` lands on its receiver: in its shard when it carries values of the
    /// batch's direct tensor ([`BatchOptions::direct`]), aside otherwise (other tensors,
    /// scales, partial amax), as both ends compute it from the same batch.
    pub fn lands(&self, m: &Move) -> Lands {
        let values = matches!(
            m.kind,
            MoveKind::Copy | MoveKind::Cast(..) | MoveKind::Quantize(..)
        );
        match values && self.direct == Some(m.tensor) {
            true => Lands::Shard,
            false => Lands::Aside,
        }
    }

    /// Zeroed blobs for the packs this rank roots (to follow its source buffers) and receives
    /// (to follow its destination buffers); [`Error::OutOfMemory`] when they do not fit.
    pub fn blobs(&self) -> Result<Blobs> {
        let rank = self.rank;
        let blobs = |role| {
            self.packs
                .iter()
                .filter(|(_, r)| *r == role)
                .map(|(p, _)| {
                    reshard_core::memory::zeroed(p.len as u64, || {
                        format!("rank {rank}'s packed tensors")
                    })
                })
                .collect::<Result<Vec<_>>>()
        };
        Ok((blobs(PackRole::Root)?, blobs(PackRole::Receiver)?))
    }

    /// Packs this rank's rooted blobs from its source buffers; `blobs` as from [`Self::blobs`].
    pub fn pack(&self, batch: &Batch, src: &[&[u8]], blobs: &mut [Vec<u8>]) {
        let roots = self.packs.iter().filter(|(_, r)| *r == PackRole::Root);
        for ((pack, _), blob) in roots.zip(blobs) {
            for (i, bytes) in &pack.tensors {
                let whole = Region::full(batch.tensors[*i].src.shape());
                let elem = batch.tensors[*i].src.dtype().size();
                for (b, buffer) in self.src.iter().enumerate() {
                    for piece in buffer.pieces.iter().filter(|p| p.tensor == *i) {
                        let g = CopyGeometry::new(
                            &piece.region,
                            Place::Within(&piece.region),
                            Place::Within(&whole),
                            elem,
                        );
                        g.copy(
                            &src[b][piece.bytes.clone()],
                            &mut blob[bytes.clone()],
                            0..g.len(),
                        );
                    }
                }
            }
        }
    }

    /// Copies this rank's boxes of packed tensors out of the received blobs, and those of the
    /// packs it roots and keeps itself straight from its source buffers. Returns the bytes.
    pub fn unpack(
        &self,
        batch: &Batch,
        root_blobs: &[Vec<u8>],
        received: &[Vec<u8>],
        dst: &mut [&mut [u8]],
    ) -> u64 {
        let mut copied = 0u64;
        let (mut roots, mut receives) = (root_blobs.iter(), received.iter());
        for (pack, role) in &self.packs {
            let blob = match role {
                PackRole::Root => roots.next(),
                PackRole::Receiver => receives.next(),
            };
            let Some(blob) = blob else { continue };
            for (i, bytes) in &pack.tensors {
                let whole = Region::full(batch.tensors[*i].src.shape());
                let elem = batch.tensors[*i].src.dtype().size();
                for (b, buffer) in self.dst.iter().enumerate() {
                    for piece in buffer.pieces.iter().filter(|p| p.tensor == *i) {
                        let g = CopyGeometry::new(
                            &piece.region,
                            Place::Within(&whole),
                            Place::Within(&piece.region),
                            elem,
                        );
                        g.copy(
                            &blob[bytes.clone()],
                            &mut dst[b][piece.bytes.clone()],
                            0..g.len(),
                        );
                        copied += g.len() as u64;
                    }
                }
            }
        }
        copied
    }
}
