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
//! Planning is per tensor ([`crate::plan::rank_plan`]), then every transfer is cut at the
//! pieces of both sides and all of a rank's moves are ordered by peer pair first (one stream
//! per pair, in the global shift order that keeps blocking transports deadlock free), then by
//! tensor. Tensors smaller than [`BatchOptions::pack_below`] whose source is fully replicated
//! (norms, biases, routers) go as one packed broadcast per source root instead: the root packs
//! them into one blob, sends it whole to every rank that needs any of them, and each unpacks
//! its own boxes; many tiny messages become one per receiver.

pub mod baseline;
pub mod quant;
mod run;
#[cfg(test)]
mod tests;

pub use run::{run_local_batch, run_rank_batch};

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::copy::{CopyGeometry, Place};
use crate::error::{Error, Result, Side};
use crate::exec::{Step, Steps};
use crate::layout::{Layout, Rank};
// most pieces one fused buffer may be cut into on one rank
use crate::limits::MAX_FUSED_PIECES as MAX_PIECES;
use crate::plan::{PlanOptions, Schedule, check_compatible, rank_plan};
use crate::region::Region;

/// One tensor of the batch: its name and both layouts (over one rank numbering).
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub src: Layout,
    pub dst: Layout,
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

/// Knobs of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchOptions {
    pub plan: PlanOptions,
    /// Tensors smaller than this (in bytes) whose source is fully replicated go in one packed
    /// broadcast per source root; 0 turns packing off.
    pub pack_below: u64,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            plan: PlanOptions::default(),
            pack_below: DEFAULT_PACK_BELOW,
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
}

fn batch_error(what: &'static str, name: &str, reason: impl Into<String>) -> Error {
    Error::Batch {
        what,
        name: name.to_string(),
        reason: reason.into(),
    }
}

impl Batch {
    /// Validates the tensors and fusions, before any buffer exists.
    pub fn new(tensors: Vec<Tensor>, fusions: Vec<Fusion>, options: BatchOptions) -> Result<Batch> {
        for t in &tensors {
            check_compatible(&t.src, &t.dst)
                .map_err(|e| batch_error("tensor", &t.name, e.to_string()))?;
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
                if t.src.dtype() != lead.src.dtype() {
                    return Err(batch_error(
                        "fusion",
                        &f.name,
                        format!(
                            "members of one buffer share a dtype, but `{}` is {} and `{}` is {}",
                            lead.name,
                            lead.src.dtype(),
                            t.name,
                            t.src.dtype()
                        ),
                    ));
                }
            }
        }
        let mut packs: BTreeMap<Rank, Vec<usize>> = BTreeMap::new();
        for (i, t) in tensors.iter().enumerate() {
            let whole_everywhere = t.src.replication() == t.src.mesh().size();
            let src_fused = fused.contains(&(i, true));
            if options.pack_below > 0
                && t.src.total_bytes() < options.pack_below
                && whole_everywhere
                && !src_fused
            {
                packs.entry(t.src.mesh().ranks()[0]).or_default().push(i);
            }
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
        Ok(Batch {
            tensors,
            fusions,
            options,
            packs,
            world,
            schedule,
        })
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

    /// `rank`'s buffers on `side`, in a fixed order: tensors in batch order, a fused buffer
    /// where its first member comes. Fails if a fusion's members disagree on this rank.
    pub fn buffers(&self, side: Side, rank: Rank) -> Result<Vec<Buffer>> {
        fn layout(t: &Tensor, side: Side) -> &Layout {
            if side == Side::Src { &t.src } else { &t.dst }
        }
        let fusion_of: BTreeMap<usize, &Fusion> = self
            .fusions
            .iter()
            .filter(|f| f.side == side)
            .flat_map(|f| f.members.iter().map(move |&m| (m, f)))
            .collect();
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
                    let l = layout(t, side);
                    if let Some(region) = l.local_region(rank) {
                        let len = l.local_bytes(rank) as usize;
                        out.push(Buffer {
                            name: t.name.clone(),
                            len,
                            pieces: vec![Piece {
                                tensor: i,
                                region,
                                bytes: 0..len,
                            }],
                        });
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
            .map(|&m| {
                let t = &self.tensors[m];
                if side == Side::Src { &t.src } else { &t.dst }.local_region(rank)
            })
            .collect();
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
        let elem = self.tensors[f.members[0]].src.dtype().size();
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

    /// Everything `rank` does in the batch, computed from the layouts alone.
    pub fn rank_batch(&self, rank: Rank) -> Result<RankBatch> {
        let mut cache = Pieces::new(self);
        let src = self.buffers(Side::Src, rank)?;
        let dst = self.buffers(Side::Dst, rank)?;
        let mut out = RankBatch {
            rank,
            moves: Vec::new(),
            packs: Vec::new(),
            src_buffers: src.len(),
            dst_buffers: dst.len(),
            src,
            dst,
        };
        for (i, t) in self.tensors.iter().enumerate() {
            if self.is_packed(i) {
                continue;
            }
            let plan = rank_plan(&t.src, &t.dst, rank, &self.options.plan)
                .map_err(|e| batch_error("tensor", &t.name, e.to_string()))?;
            for tr in plan.sends.iter().chain(&plan.recvs).chain(&plan.locals) {
                let src_pieces = cache.of(Side::Src, tr.src, i)?;
                let dst_pieces = cache.of(Side::Dst, tr.dst, i)?;
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
                            from: tr.src,
                            to: tr.dst,
                            region: part,
                            elem_bytes: t.src.dtype().size(),
                            src_box: sbox.clone(),
                            dst_box: dbox.clone(),
                            src_at,
                            dst_at,
                        });
                    }
                }
            }
        }
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
            if rank == root {
                let at = out.src_buffers + count(PackRole::Root);
                for &r in &receivers {
                    out.moves.push(Move {
                        tensor: self.tensors.len() + root,
                        from: root,
                        to: r,
                        region: blob.clone(),
                        elem_bytes: 1,
                        src_box: blob.clone(),
                        dst_box: blob.clone(),
                        src_at: Some((at, 0..offset)),
                        dst_at: None,
                    });
                }
                out.packs.push((pack, PackRole::Root));
            } else if receivers.contains(&rank) {
                let at = out.dst_buffers + count(PackRole::Receiver);
                out.moves.push(Move {
                    tensor: self.tensors.len() + root,
                    from: root,
                    to: rank,
                    region: blob.clone(),
                    elem_bytes: 1,
                    src_box: blob.clone(),
                    dst_box: blob.clone(),
                    src_at: None,
                    dst_at: Some((at, 0..offset)),
                });
                out.packs.push((pack, PackRole::Receiver));
            }
        }
        let schedule = &self.schedule;
        out.moves.sort_by(|a, b| {
            let key = |m: &Move| (schedule.step(m.from, m.to), m.from, m.to, m.tensor);
            key(a).cmp(&key(b)).then_with(|| a.region.cmp(&b.region))
        });
        Ok(out)
    }
}

/// Where a piece of a tensor is: buffer index, piece index, box.
type PieceAt = (usize, usize, Region);

/// Every rank's pieces of every tensor, computed once per (side, rank) as moves need them.
struct Pieces<'b> {
    batch: &'b Batch,
    by_rank: BTreeMap<(bool, Rank), BTreeMap<usize, Vec<PieceAt>>>,
}

impl<'b> Pieces<'b> {
    fn new(batch: &'b Batch) -> Pieces<'b> {
        Pieces {
            batch,
            by_rank: BTreeMap::new(),
        }
    }

    /// (buffer, piece, box) of tensor `i` on `rank`'s `side`.
    fn of(&mut self, side: Side, rank: Rank, i: usize) -> Result<Vec<PieceAt>> {
        let key = (side == Side::Src, rank);
        if !self.by_rank.contains_key(&key) {
            let mut map: BTreeMap<usize, Vec<PieceAt>> = BTreeMap::new();
            for (b, buffer) in self.batch.buffers(side, rank)?.into_iter().enumerate() {
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

/// One cut of a transfer: a region of one tensor between one source piece and one
/// destination piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// The tensor (or, past the batch's tensors, a packed blob).
    pub tensor: usize,
    pub from: Rank,
    pub to: Rank,
    pub region: Region,
    pub elem_bytes: usize,
    pub src_box: Region,
    pub dst_box: Region,
    /// Buffer and bytes of `src_box` on this rank, when it sends.
    pub src_at: Option<(usize, Range<usize>)>,
    /// Buffer and bytes of `dst_box` on this rank, when it receives.
    pub dst_at: Option<(usize, Range<usize>)>,
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
#[derive(Clone, Debug)]
pub struct RankBatch {
    pub rank: Rank,
    /// The rank's source buffers, then (in the runner) one blob per pack it roots.
    pub src: Vec<Buffer>,
    /// The rank's destination buffers, then one blob per pack it receives.
    pub dst: Vec<Buffer>,
    pub moves: Vec<Move>,
    pub packs: Vec<(Pack, PackRole)>,
    src_buffers: usize,
    dst_buffers: usize,
}

impl RankBatch {
    /// The steps the executor runs.
    pub fn steps(&self) -> Steps<'_, '_> {
        let mut steps = Steps {
            rank: self.rank,
            ..Steps::default()
        };
        for m in &self.moves {
            let step = Step {
                from: m.from,
                to: m.to,
                region: &m.region,
                elem_bytes: m.elem_bytes,
                src_box: &m.src_box,
                dst_box: &m.dst_box,
                src_at: m.src_at.clone(),
                dst_at: m.dst_at.clone(),
                // refit moves every tensor in its own dtype
                cast: None,
                // a batch's buffers are its own, never offered to senders to write into
                lands: crate::transport::Lands::Aside,
            };
            if m.from == m.to {
                steps.locals.push(step);
            } else if m.from == self.rank {
                steps.sends.push(step);
            } else {
                steps.recvs.push(step);
            }
        }
        steps
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
                    crate::memory::zeroed(p.len as u64, || format!("rank {rank}'s packed tensors"))
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
