//! Which source rank serves each piece of a destination shard, and the walk over the pieces
//! of a layout that overlap a box: the source choice the module docs of [`super`] describe.

use crate::layout::{Layout, Rank};
use crate::region::Region;

use super::*;

/// Calls `f` with the per-dim piece indices and the overlap of every piece of `layout` that
/// overlaps `region`, last dim fastest. A callback rather than a list: a full plan visits
/// millions of pieces, and each would otherwise cost allocations it drops at once.
pub fn for_each_overlap(layout: &Layout, region: &Region, mut f: impl FnMut(&[usize], Region)) {
    if region.is_empty() {
        return;
    }
    let per_dim: Vec<Vec<(usize, Range<u64>)>> = (0..layout.ndim())
        .map(|d| {
            let want = region.range(d);
            let pieces = layout.dim_pieces(d);
            let first = pieces.partition_point(|p| p.end <= want.start);
            pieces[first..]
                .iter()
                .enumerate()
                .take_while(|(_, p)| p.start < want.end)
                .filter(|(_, p)| p.start < p.end)
                .map(|(i, p)| (first + i, p.start.max(want.start)..p.end.min(want.end)))
                .collect()
        })
        .collect();
    if per_dim.iter().any(Vec::is_empty) {
        return;
    }
    let n = per_dim.len();
    let mut pick = vec![0usize; n];
    let mut index = vec![0usize; n];
    loop {
        let mut offset = Vec::with_capacity(n);
        let mut extent = Vec::with_capacity(n);
        for d in 0..n {
            let (i, r) = &per_dim[d][pick[d]];
            index[d] = *i;
            offset.push(r.start);
            extent.push(r.end - r.start);
        }
        f(&index, Region { offset, extent });
        // odometer, last dim fastest
        let mut d = n;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            pick[d] += 1;
            if pick[d] < per_dim[d].len() {
                break;
            }
            pick[d] = 0;
        }
    }
}

/// Who holds each box of the source layout: looked up per box for one rank's plan, or
/// tabulated once by box id for a full plan, whose every destination asks again.
pub enum Holders<'a> {
    OnDemand(&'a Layout),
    Table(Vec<Vec<Rank>>),
}

impl Holders<'_> {
    /// Every box's holders, in mesh order as [`Layout::holders`] lists them.
    pub(super) fn table(layout: &Layout) -> Holders<'static> {
        let boxes = (0..layout.ndim())
            .map(|d| layout.dim_pieces(d).len())
            .product();
        let mesh = layout.mesh();
        let mut table = vec![Vec::new(); boxes];
        for (position, &rank) in mesh.ranks().iter().enumerate() {
            let index = layout.piece_index(&mesh.coords(position));
            table[layout.box_id(&index)].push(rank);
        }
        Holders::Table(table)
    }

    pub(super) fn of(&self, index: &[usize], box_id: usize) -> std::borrow::Cow<'_, [Rank]> {
        match self {
            Holders::OnDemand(layout) => layout.holders(index).into(),
            Holders::Table(table) => table[box_id].as_slice().into(),
        }
    }
}

/// How sources are chosen: the planner's options, the hosts when known, and whether a
/// relaying rank's receives come with the transfers it forwards (a rank's own part).
pub struct Chooser<'a> {
    pub options: &'a PlanOptions,
    pub topology: Option<&'a Topology>,
    pub forwards: bool,
}

impl Chooser<'_> {
    /// Chooses who sends `piece` to `receiver` (`group`: its host's replicas of its box, when
    /// the hosts are known).
    pub(super) fn assign(
        &self,
        piece: hosts::Piece<'_>,
        receiver: &Receiver,
        group: Option<&[Rank]>,
        elem_bytes: usize,
        forwards: bool,
        out: &mut Vec<Transfer>,
    ) {
        match (self.topology, group) {
            (Some(topology), Some(group)) => hosts::assign(
                piece,
                receiver,
                group,
                elem_bytes,
                self.options,
                topology,
                forwards,
                out,
            ),
            _ => assign(
                piece.region,
                piece.holders,
                piece.holds,
                receiver,
                piece.box_id,
                elem_bytes,
                self.options,
                out,
            ),
        }
    }
}

/// Every transfer into `rank`'s destination shard (local copies included), appended to `out`;
/// with `chooser.forwards`, also those it forwards.
pub fn receives(
    src: &Layout,
    dst: &Layout,
    holders: &Holders<'_>,
    rank: Rank,
    chooser: &Chooser<'_>,
    out: &mut Vec<Transfer>,
) {
    let Some(position) = dst.mesh().position(rank) else {
        return;
    };
    let target = dst.region_at(position);
    let receiver = Receiver::at(dst, position);
    let group = chooser.topology.map(|t| t.group(dst, position));
    for_each_overlap(src, &target, |index, region| {
        let box_id = src.box_id(index);
        let piece = hosts::Piece {
            region,
            holders: &holders.of(index, box_id),
            holds: src.holds(rank, index),
            box_id,
        };
        chooser.assign(
            piece,
            &receiver,
            group.as_deref(),
            dst.dtype().size(),
            chooser.forwards,
            out,
        );
    });
}

/// Every transfer out of `rank`'s source shard (local copies included).
pub fn sends(src: &Layout, dst: &Layout, rank: Rank, chooser: &Chooser<'_>) -> Vec<Transfer> {
    let Some(position) = src.mesh().position(rank) else {
        return Vec::new();
    };
    let held = src.region_at(position);
    let index = src.piece_index(&src.mesh().coords(position));
    let holders = src.holders(&index);
    let box_id = src.box_id(&index);
    let mut all = Vec::new();
    for_each_overlap(dst, &held, |dst_index, piece| {
        let replicas = dst.holders(dst_index);
        for &rank in &replicas {
            let dst_position = dst.mesh().position(rank).unwrap_or_default();
            let group = chooser
                .topology
                .map(|t| t.on_host(replicas.iter().copied(), t.hosts.host_of(rank)));
            let piece = hosts::Piece {
                region: piece.clone(),
                holders: &holders,
                holds: src.holds(rank, &index),
                box_id,
            };
            let start = all.len();
            chooser.assign(
                piece,
                &Receiver::at(dst, dst_position),
                group.as_deref(),
                dst.dtype().size(),
                false,
                &mut all,
            );
            debug_assert!(all[start..].iter().all(|t| t.dst == rank));
        }
    });
    all.retain(|t| t.src == rank);
    all
}

/// A destination rank as the source choice sees it.
pub struct Receiver {
    pub rank: Rank,
    /// Its position among the ranks of one destination replica ([`Layout::shard_position`]).
    pub shard_position: usize,
    /// Which destination replica it belongs to, in `0..replicas`.
    pub replica: usize,
    /// How many destination ranks hold the same box (the destination's replication).
    pub replicas: usize,
}

impl Receiver {
    pub(super) fn at(dst: &Layout, position: usize) -> Receiver {
        Receiver {
            rank: dst.mesh().ranks()[position],
            shard_position: dst.shard_position(position),
            replica: dst.replica_index(position),
            replicas: dst.replication().max(1),
        }
    }
}

/// Chooses who sends `piece` (held by `holders`; `holds`: the receiver is one of them) to
/// `receiver`; see the module docs.
///
/// A piece is split into at most `ceil(holders / receiver.replicas)` parts: the replicas of a
/// destination box all ask for the same piece, so with `r` of them each needs only that many
/// parts for every holder to serve its share. Splitting every copy among all holders would
/// make `holders x replicas` transfers: quadratic in the data-parallel size when both sides
/// replicate (dp=10000 on both sides made up to 10^8 transfers per tensor). Replica `k` starts
/// `k x parts` holders further on, so that the replicas draw on disjoint holders.
#[allow(clippy::too_many_arguments)]
pub fn assign(
    piece: Region,
    holders: &[Rank],
    holds: bool,
    receiver: &Receiver,
    box_id: usize,
    elem_bytes: usize,
    options: &PlanOptions,
    out: &mut Vec<Transfer>,
) {
    if holds {
        out.push(Transfer::direct(receiver.rank, receiver.rank, piece));
        return;
    }
    let h = holders.len();
    let cap = h.div_ceil(receiver.replicas) as u64;
    let bytes = piece.volume().saturating_mul(elem_bytes as u64);
    let wanted = bytes
        .checked_div(options.min_split_bytes)
        .map_or(cap, |parts| parts.clamp(1, cap));
    // positions, box ids, replica numbers and `wanted` are at most 2^24 (a side's ranks, see
    // `limits`): no overflow
    let rotation = (receiver.shard_position + box_id + receiver.replica * wanted as usize) % h;
    let Some((dim, parts)) = split_dim(&piece, wanted) else {
        out.push(Transfer::direct(holders[rotation], receiver.rank, piece));
        return;
    };
    for p in 0..parts {
        let part = split_part(&piece, dim, parts, p);
        out.push(Transfer::direct(
            holders[(rotation + p as usize) % h],
            receiver.rank,
            part,
        ));
    }
}

/// Where to split `piece` into `wanted` parts: the outermost dim long enough, else the
/// longest dim (into as many parts as it is long); `None` when one part it is.
pub fn split_dim(piece: &Region, wanted: u64) -> Option<(usize, u64)> {
    if wanted <= 1 {
        return None;
    }
    match (0..piece.ndim()).find(|&d| piece.extent[d] >= wanted) {
        Some(d) => Some((d, wanted)),
        None => (0..piece.ndim())
            .max_by_key(|&d| (piece.extent[d], std::cmp::Reverse(d)))
            .filter(|&d| piece.extent[d] > 1)
            .map(|d| (d, piece.extent[d])),
    }
}

/// Part `p` of `parts` of `piece` cut along `dim`.
pub fn split_part(piece: &Region, dim: usize, parts: u64, p: u64) -> Region {
    let lo = piece.offset[dim];
    let len = piece.extent[dim];
    // in u128: p * len overflows u64 for pieces near 2^64 bytes
    let cut = |p: u64| lo + (p as u128 * len as u128 / parts as u128) as u64;
    let (a, b) = (cut(p), cut(p + 1));
    let mut part = piece.clone();
    part.offset[dim] = a;
    part.extent[dim] = b - a;
    part
}
