//! A rank's part of a batch, planned from the layouts alone ([`Batch::rank_batch`]): every
//! transfer of every tensor cut at the pieces of both sides, with the scales it carries, the
//! packed broadcasts and the partial amax exchanges, in one schedule.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use super::{Batch, Buffer, batch_error};
use crate::exec::program::{Convert, Step};
use reshard_core::dtype::DType;
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::plan::quant::AMAX_BYTES;
use reshard_core::plan::{rank_plan, rank_plan_quantized};
use reshard_core::region::Region;
use reshard_transport::Lands;

impl Batch {
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
    /// What it carries.
    pub kind: MoveKind,
    /// The sending rank.
    pub from: Rank,
    /// The receiving rank.
    pub to: Rank,
    /// In tensor coordinates, or block grid coordinates for scales and amax.
    pub region: Region,
    /// Bytes per element on the wire (the destination's).
    pub elem_bytes: usize,
    /// The source piece that holds `region`.
    pub src_box: Region,
    /// The destination piece that holds `region`.
    pub dst_box: Region,
    /// Buffer and bytes of `src_box` on this rank, when it sends.
    pub src_at: Option<(usize, Range<usize>)>,
    /// Buffer and bytes of `dst_box` on this rank, when it receives.
    pub dst_at: Option<(usize, Range<usize>)>,
}

impl Move {
    /// The executor's step of this move, converting as `convert` says and landing where
    /// `lands` says.
    pub fn step(&self, convert: Convert, lands: Lands) -> Step<'_> {
        Step {
            from: self.from,
            to: self.to,
            region: std::borrow::Cow::Borrowed(&self.region),
            elem_bytes: self.elem_bytes,
            src_box: std::borrow::Cow::Borrowed(&self.src_box),
            dst_box: std::borrow::Cow::Borrowed(&self.dst_box),
            src_at: self.src_at.clone(),
            dst_at: self.dst_at.clone(),
            convert,
            lands,
        }
    }
}

/// A quantized tensor this rank holds a source shard of: it computes the amax of the blocks
/// its shard touches, exchanges partial amax where a block straddles source shards, and
/// stages those blocks' scales for its scale moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantSource {
    /// The tensor, as an index into the batch's tensors.
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
    /// The rank that packs the blob and sends it: the first rank of the tensors' source mesh.
    pub root: Rank,
    /// Bytes of the blob.
    pub len: usize,
    /// Each tensor and its bytes in the blob.
    pub tensors: Vec<(usize, Range<usize>)>,
}

/// What a rank does with a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackRole {
    /// Packs the blob from its source buffers, sends it to every receiver, and unpacks its
    /// own boxes from it.
    Root,
    /// Receives the blob and unpacks its own boxes from it.
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
    /// The rank whose part it is.
    pub rank: Rank,
    /// The rank's source buffers.
    pub src: Vec<Buffer>,
    /// The rank's destination buffers.
    pub dst: Vec<Buffer>,
    /// The rank's scale buffers ([`Batch::scale_buffers`]).
    pub scales: Vec<Buffer>,
    /// Every value and scale move, in schedule order.
    pub moves: Vec<Move>,
    /// The packs it roots or receives, each with its role, in order of their roots.
    pub packs: Vec<(Pack, PackRole)>,
    /// The quantized tensors it holds a source shard of, in tensor order.
    pub quant: Vec<QuantSource>,
    /// Its partial amax sends and receives, in the amax schedule's order.
    pub amax: Vec<Move>,
    pub(crate) src_buffers: usize,
    pub(crate) dst_buffers: usize,
    /// [`super::BatchOptions::direct`]: the tensor whose value moves land in the receiver's
    /// shard.
    pub(crate) direct: Option<usize>,
}

impl RankBatch {
    /// Where move `m` lands on its receiver: in its shard when it carries values of the
    /// batch's direct tensor ([`super::BatchOptions::direct`]), aside otherwise (other tensors,
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
}
