//! The transfer plan: which source rank sends which box to which destination rank.
//!
//! Pure and deterministic. Overlaps come from per-dimension interval intersection against the
//! other side's pieces, so the work grows with the number of pieces a rank touches, not with
//! M x N, and a rank can compute its own sends and receives ([`rank_plan`]) without the rest.
//!
//! Source choice, for every piece of a destination shard:
//! 1. if the destination rank holds the piece as a source, it is a local copy;
//! 2. otherwise the piece is split along its outermost splittable dim among the replicas that
//!    hold it (when it is large enough to be worth several messages, and into no more parts
//!    than the source replicas per destination replica), and the parts are dealt out starting
//!    at a rotation that depends on the destination and the source box, so that every replica
//!    serves an equal share: two data-parallel replicas each serve half.
//!
//! The work and the transfers grow linearly with the ranks: whether a destination rank holds
//! a piece is one lookup, and `r` destination replicas of a box held by `h` source replicas
//! make about `h + r` transfers, not `h x r`.

pub mod baseline;
pub mod hosts;
pub mod quant;
mod rank_plan;
pub mod report;
pub mod schedule;

use std::ops::Range;

pub use baseline::GatherBroadcast;
pub use hosts::{HostLinks, Topology};
pub use quant::{QuantPlan, QuantRankPlan, QuantRequest};
pub use rank_plan::RankPlan;
pub use report::{Overflow, PlanJson, Totals, TransferJson, gather_broadcast_bytes};
pub use schedule::Schedule;

use crate::error::{Dims, Error, Result};
use crate::layout::{Layout, Rank};
use crate::region::Region;

/// One box moved from one rank to another (`src == dst`: a local copy).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Transfer {
    pub src: Rank,
    pub dst: Rank,
    /// In global tensor coordinates.
    pub region: Region,
    /// A relayed transfer: the bytes cross to `via` (a rank on `dst`'s host that receives
    /// the same region from `src` in a transfer of its own), which forwards them to `dst`.
    /// `None`: straight from `src` to `dst`.
    pub via: Option<Rank>,
}

impl Transfer {
    /// A transfer straight from `src` to `dst`.
    pub fn direct(src: Rank, dst: Rank, region: Region) -> Transfer {
        Transfer {
            src,
            dst,
            region,
            via: None,
        }
    }

    pub fn is_local(&self) -> bool {
        self.src == self.dst
    }

    /// The rank that hands the bytes to `dst`: `via` for a relayed transfer, `src` otherwise.
    pub fn sender(&self) -> Rank {
        self.via.unwrap_or(self.src)
    }

    /// Bytes of the region for elements of `elem_bytes`.
    pub fn bytes(&self, elem_bytes: usize) -> u64 {
        self.region.volume() * elem_bytes as u64
    }
}

/// Knobs of the planner. The defaults suit every transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// A piece held by several replicas is split among them only into parts of at least this
    /// many bytes: below it, one message beats several. 0 splits every piece.
    pub min_split_bytes: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            min_split_bytes: 64 << 10,
        }
    }
}

/// A complete plan for one tensor: the layouts and every transfer.
#[derive(Clone, Debug)]
pub struct Plan {
    src: Layout,
    dst: Layout,
    options: PlanOptions,
    topology: Option<Topology>,
    transfers: Vec<Transfer>,
    /// With `--quant`: the scheme, its block grid, and so the amax and scale traffic.
    quant: Option<QuantPlan>,
}

impl Plan {
    /// Plans a reshard from `src` to `dst` with default options.
    ///
    /// ```
    /// use reshard::{Plan, layout::LayoutSpec, DType};
    /// let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&[8, 8], DType::Bf16, 0).unwrap();
    /// let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&[8, 8], DType::Bf16, 2).unwrap();
    /// let plan = Plan::new(src, dst).unwrap();
    /// // each of the 4 destinations gets a 4x2 block from each of the 2 sources
    /// assert_eq!(plan.transfers().len(), 8);
    /// assert!(plan.transfers().iter().all(|t| t.region.extent == [4, 2]));
    /// ```
    pub fn new(src: Layout, dst: Layout) -> Result<Plan> {
        Plan::with_options(src, dst, PlanOptions::default())
    }

    pub fn with_options(src: Layout, dst: Layout, options: PlanOptions) -> Result<Plan> {
        Plan::with_topology(src, dst, options, None)
    }

    /// Plans a reshard knowing which host each rank runs on ([`Topology`]): destinations
    /// are served from their own host where it holds the bytes, cross-host bytes are spread
    /// over the hosts' links, and (with relay) bytes that several ranks of one host need
    /// cross into it once. Without a topology, the plan of [`Plan::with_options`].
    pub fn with_topology(
        src: Layout,
        dst: Layout,
        options: PlanOptions,
        topology: Option<Topology>,
    ) -> Result<Plan> {
        check_compatible(&src, &dst)?;
        if let Some(t) = &topology {
            t.check(&src, &dst)?;
        }
        Ok(Plan::planned(src, dst, options, None, topology))
    }

    /// Plans a reshard into an fp8 destination quantized as `quant` says (checked against
    /// the layouts by [`QuantPlan::new`]): the transfers carry fp8 values, and the plan also
    /// holds the partial amax exchanges and scale transfers ([`QuantPlan`]).
    pub fn quantized(
        src: Layout,
        dst: Layout,
        options: PlanOptions,
        quant: QuantPlan,
    ) -> Result<Plan> {
        if src.shape() != dst.shape() {
            return Err(Error::ShapeMismatch {
                src: Dims(src.shape().to_vec()),
                dst: Dims(dst.shape().to_vec()),
            });
        }
        // the quantization was checked against both dtypes and the destination's boundaries
        let checked = QuantPlan::new(
            QuantRequest {
                scheme: quant.quant.scheme,
                scale_dtype: Some(quant.quant.scale_dtype),
            },
            &src,
            &dst,
        )?;
        Ok(Plan::planned(src, dst, options, Some(checked), None))
    }

    /// [`Plan::new`] or [`Plan::quantized`] as `request` says: `None` plans a plain (or
    /// cast) reshard.
    pub fn with_quant(
        src: Layout,
        dst: Layout,
        options: PlanOptions,
        request: Option<QuantRequest>,
    ) -> Result<Plan> {
        match request {
            None => Plan::with_options(src, dst, options),
            Some(r) => {
                let q = QuantPlan::new(r, &src, &dst)?;
                Plan::quantized(src, dst, options, q)
            }
        }
    }

    fn planned(
        src: Layout,
        dst: Layout,
        options: PlanOptions,
        quant: Option<QuantPlan>,
        topology: Option<Topology>,
    ) -> Plan {
        let holders = Holders::table(&src);
        let mut transfers = Vec::new();
        let chooser = Chooser {
            options: &options,
            topology: topology.as_ref(),
            forwards: false,
        };
        for &r in dst.mesh().ranks() {
            receives(&src, &dst, &holders, r, &chooser, &mut transfers);
        }
        transfers.sort_unstable();
        Plan {
            src,
            dst,
            options,
            topology,
            transfers,
            quant,
        }
    }

    /// `rank`'s part of this plan computed for it alone, as [`rank_plan`] does, for the
    /// layouts this plan checked (a quantizing plan's fp8 destination among them).
    pub fn rank_part(&self, rank: Rank) -> RankPlan {
        rank_part(
            &self.src,
            &self.dst,
            rank,
            &self.options,
            self.topology.as_ref(),
        )
    }

    /// The quantization, for a plan into fp8 with scales.
    pub fn quant(&self) -> Option<&QuantPlan> {
        self.quant.as_ref()
    }

    pub fn src(&self) -> &Layout {
        &self.src
    }

    pub fn dst(&self) -> &Layout {
        &self.dst
    }

    pub fn options(&self) -> PlanOptions {
        self.options
    }

    /// The hosts the plan was made for, if any.
    pub fn topology(&self) -> Option<&Topology> {
        self.topology.as_ref()
    }

    /// `rank`'s part of this plan computed alone ([`rank_plan_on`]), with the plan's options
    /// and topology: what a rank of a job runs.
    pub fn own_part(&self, rank: Rank) -> Result<RankPlan> {
        Ok(self.rank_part(rank))
    }

    /// Every transfer, sorted by (src, dst, region).
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// Bytes per element on the wire: the destination dtype's, since senders convert while
    /// they pack (`--dst-dtype`). Every byte count of a plan (transfers, totals) uses it.
    pub fn elem_bytes(&self) -> usize {
        self.dst.dtype().size()
    }

    /// Every rank that sends or receives anything (sources and destinations), sorted.
    pub fn ranks(&self) -> Vec<Rank> {
        let mut ranks: Vec<Rank> = self
            .src
            .mesh()
            .ranks()
            .iter()
            .chain(self.dst.mesh().ranks())
            .copied()
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// `rank`'s part of this plan, taken from the full plan.
    pub fn for_rank(&self, rank: Rank) -> RankPlan {
        let mut rp = RankPlan::new(rank);
        let mut relayed = Vec::new();
        self.transfers.iter().for_each(|t| rp.take(t, &mut relayed));
        rp.mark_hops(&relayed);
        order_for_schedule(&mut rp, &Schedule::of(&self.src, &self.dst));
        rp
    }

    /// Every rank's part of this plan, in one pass over the transfers.
    pub fn rank_plans(&self) -> std::collections::BTreeMap<Rank, RankPlan> {
        let mut plans: std::collections::BTreeMap<Rank, RankPlan> = self
            .ranks()
            .into_iter()
            .map(|rank| (rank, RankPlan::new(rank)))
            .collect();
        let mut relayed: std::collections::BTreeMap<Rank, Vec<Transfer>> = Default::default();
        for t in &self.transfers {
            let concerned = match (t.is_local(), t.via) {
                (true, _) => &[t.src][..],
                (false, None) => &[t.src, t.dst][..],
                (false, Some(v)) => &[t.src, t.dst, v][..],
            };
            for rank in concerned {
                if let Some(p) = plans.get_mut(rank) {
                    p.take(t, relayed.entry(*rank).or_default());
                }
            }
        }
        let schedule = Schedule::of(&self.src, &self.dst);
        for p in plans.values_mut() {
            p.mark_hops(relayed.get(&p.rank).map_or(&[][..], Vec::as_slice));
            order_for_schedule(p, &schedule);
        }
        plans
    }

    /// The bytes into and out of every host, when the plan knows the hosts.
    pub fn host_links(&self) -> Option<HostLinks> {
        let topology = self.topology.as_ref()?;
        Some(HostLinks::of(
            &topology.hosts,
            &self.transfers,
            self.elem_bytes(),
        ))
    }

    /// Byte and message counts, and what gather+broadcast would move instead.
    pub fn totals(&self) -> Totals {
        Totals::of(self)
    }
}

/// The sides must describe the same tensor; their dtypes may differ by a float cast
/// ([`crate::convert::cast_supported`]), refused here, before any byte moves, otherwise.
pub fn check_compatible(src: &Layout, dst: &Layout) -> Result<()> {
    if src.shape() != dst.shape() {
        return Err(Error::ShapeMismatch {
            src: Dims(src.shape().to_vec()),
            dst: Dims(dst.shape().to_vec()),
        });
    }
    // a destination of its own dtype is converted in flight; only float casts are
    crate::convert::cast_supported(src.dtype(), dst.dtype()).map_err(|source| Error::Convert {
        tensor: "tensor".into(),
        source,
    })?;
    Ok(())
}

/// `rank`'s sends, receives and local copies, computed from the layouts alone: the same result
/// as `Plan::new(src, dst).for_rank(rank)` at a cost that depends on this rank's pieces only.
pub fn rank_plan(
    src: &Layout,
    dst: &Layout,
    rank: Rank,
    options: &PlanOptions,
) -> Result<RankPlan> {
    rank_plan_on(src, dst, rank, options, None)
}

/// [`rank_plan`] knowing the hosts: the same result as
/// `Plan::with_topology(src, dst, options, topology).for_rank(rank)`, from this rank's pieces
/// and those of the ranks that share them on one host.
pub fn rank_plan_on(
    src: &Layout,
    dst: &Layout,
    rank: Rank,
    options: &PlanOptions,
    topology: Option<&Topology>,
) -> Result<RankPlan> {
    check_compatible(src, dst)?;
    if let Some(t) = topology {
        t.check(src, dst)?;
    }
    Ok(rank_part(src, dst, rank, options, topology))
}

/// [`rank_plan_on`] of layouts already checked (by a [`Plan`]'s constructor).
fn rank_part(
    src: &Layout,
    dst: &Layout,
    rank: Rank,
    options: &PlanOptions,
    topology: Option<&Topology>,
) -> RankPlan {
    let mut rp = RankPlan::new(rank);
    // local copies are among the receives; the sends repeat them
    let mut received = Vec::new();
    let chooser = Chooser {
        options,
        topology,
        forwards: true,
    };
    receives(
        src,
        dst,
        &Holders::OnDemand(src),
        rank,
        &chooser,
        &mut received,
    );
    let mut relayed = Vec::new();
    received.iter().for_each(|t| rp.take(t, &mut relayed));
    let sends = sends(src, dst, rank, &chooser);
    sends
        .iter()
        .filter(|t| !t.is_local())
        .for_each(|t| rp.take(t, &mut relayed));
    rp.locals.sort_unstable();
    rp.mark_hops(&relayed);
    order_for_schedule(&mut rp, &Schedule::of(src, dst));
    rp
}

fn order_for_schedule(rp: &mut RankPlan, schedule: &Schedule) {
    rp.sends
        .sort_by(|a, b| schedule.key(a).cmp(&schedule.key(b)));
    rp.recvs
        .sort_by(|a, b| schedule.key(a).cmp(&schedule.key(b)));
}

/// Calls `f` with the per-dim piece indices and the overlap of every piece of `layout` that
/// overlaps `region`, last dim fastest. A callback rather than a list: a full plan visits
/// millions of pieces, and each would otherwise cost allocations it drops at once.
fn for_each_overlap(layout: &Layout, region: &Region, mut f: impl FnMut(&[usize], Region)) {
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
enum Holders<'a> {
    OnDemand(&'a Layout),
    Table(Vec<Vec<Rank>>),
}

impl Holders<'_> {
    /// Every box's holders, in mesh order as [`Layout::holders`] lists them.
    fn table(layout: &Layout) -> Holders<'static> {
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

    fn of(&self, index: &[usize], box_id: usize) -> std::borrow::Cow<'_, [Rank]> {
        match self {
            Holders::OnDemand(layout) => layout.holders(index).into(),
            Holders::Table(table) => table[box_id].as_slice().into(),
        }
    }
}

/// How sources are chosen: the planner's options, the hosts when known, and whether a
/// relaying rank's receives come with the transfers it forwards (a rank's own part).
struct Chooser<'a> {
    options: &'a PlanOptions,
    topology: Option<&'a Topology>,
    forwards: bool,
}

impl Chooser<'_> {
    /// Chooses who sends `piece` to `receiver` (`group`: its host's replicas of its box, when
    /// the hosts are known).
    fn assign(
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
fn receives(
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
fn sends(src: &Layout, dst: &Layout, rank: Rank, chooser: &Chooser<'_>) -> Vec<Transfer> {
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
struct Receiver {
    rank: Rank,
    /// Its position among the ranks of one destination replica ([`Layout::shard_position`]).
    shard_position: usize,
    /// Which destination replica it belongs to, in `0..replicas`.
    replica: usize,
    /// How many destination ranks hold the same box (the destination's replication).
    replicas: usize,
}

impl Receiver {
    fn at(dst: &Layout, position: usize) -> Receiver {
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
fn assign(
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
pub(crate) fn split_dim(piece: &Region, wanted: u64) -> Option<(usize, u64)> {
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
pub(crate) fn split_part(piece: &Region, dim: usize, parts: u64, p: u64) -> Region {
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

#[cfg(test)]
mod tests;
