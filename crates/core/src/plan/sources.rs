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
    /// Asks the layout for a box's holders each time ([`Layout::holders`]).
    OnDemand(&'a Layout),
    /// Every box's holders in mesh order, indexed by [`Layout::box_id`].
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
    /// The planner's options.
    pub options: &'a PlanOptions,
    /// The hosts, when known: sources are then chosen host by host.
    pub topology: Option<&'a Topology>,
    /// Whether a relaying rank's receives include the transfers it forwards.
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
