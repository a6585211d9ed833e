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
pub mod prequant;
pub mod quant;
pub mod report;
pub mod schedule;

use std::ops::Range;

pub use baseline::GatherBroadcast;
pub use prequant::QuantizedMove;
pub use quant::{QuantPlan, QuantRankPlan, QuantRequest};
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
}

impl Transfer {
    pub fn is_local(&self) -> bool {
        self.src == self.dst
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

/// The sends, receives and local copies of one rank, in the order it should run them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPlan {
    pub rank: Rank,
    /// Remote transfers this rank sends, in schedule order.
    pub sends: Vec<Transfer>,
    /// Remote transfers this rank receives, in schedule order.
    pub recvs: Vec<Transfer>,
    /// Copies from this rank's source buffer into its own destination buffer.
    pub locals: Vec<Transfer>,
}

impl RankPlan {
    pub fn new(rank: Rank) -> RankPlan {
        RankPlan {
            rank,
            ..RankPlan::default()
        }
    }

    /// Files `t` among this rank's sends, receives or local copies, if it concerns this rank
    /// (a local copy belongs to the rank that makes it).
    fn take(&mut self, t: &Transfer) {
        if t.is_local() {
            if t.src == self.rank {
                self.locals.push(t.clone());
            }
        } else if t.src == self.rank {
            self.sends.push(t.clone());
        } else if t.dst == self.rank {
            self.recvs.push(t.clone());
        }
    }

    /// The ranks this rank receives from (local copies aside).
    pub fn senders(&self) -> std::collections::BTreeSet<Rank> {
        self.recvs.iter().map(|t| t.src).collect()
    }

    /// The ranks this rank sends to (local copies aside).
    pub fn receivers(&self) -> std::collections::BTreeSet<Rank> {
        self.sends.iter().map(|t| t.dst).collect()
    }

    /// Every rank this rank exchanges data with.
    pub fn peers(&self) -> std::collections::BTreeSet<Rank> {
        &self.senders() | &self.receivers()
    }
}

/// A complete plan for one tensor: the layouts and every transfer.
#[derive(Clone, Debug)]
pub struct Plan {
    src: Layout,
    dst: Layout,
    options: PlanOptions,
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
        check_compatible(&src, &dst)?;
        Ok(Plan::planned(src, dst, options, None))
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
        Ok(Plan::planned(src, dst, options, Some(checked)))
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

    fn planned(src: Layout, dst: Layout, options: PlanOptions, quant: Option<QuantPlan>) -> Plan {
        let holders = Holders::table(&src);
        let mut transfers = Vec::new();
        for &r in dst.mesh().ranks() {
            receives(&src, &dst, &holders, r, &options, &mut transfers);
        }
        transfers.sort_unstable();
        Plan {
            src,
            dst,
            options,
            transfers,
            quant,
        }
    }

    /// `rank`'s part of this plan computed for it alone, as [`rank_plan`] does, for the
    /// layouts this plan checked (a quantizing plan's fp8 destination among them).
    pub fn rank_part(&self, rank: Rank) -> RankPlan {
        rank_part(&self.src, &self.dst, rank, &self.options)
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
        self.transfers.iter().for_each(|t| rp.take(t));
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
        for t in &self.transfers {
            let concerned = if t.is_local() {
                &[t.src][..]
            } else {
                &[t.src, t.dst][..]
            };
            for rank in concerned {
                if let Some(p) = plans.get_mut(rank) {
                    p.take(t);
                }
            }
        }
        let schedule = Schedule::of(&self.src, &self.dst);
        for p in plans.values_mut() {
            order_for_schedule(p, &schedule);
        }
        plans
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
    check_compatible(src, dst)?;
    Ok(rank_part(src, dst, rank, options))
}

/// [`rank_plan`] of layouts already checked (by a [`Plan`]'s constructor).
fn rank_part(src: &Layout, dst: &Layout, rank: Rank, options: &PlanOptions) -> RankPlan {
    let mut rp = RankPlan::new(rank);
    // local copies are among the receives; the sends repeat them
    let mut received = Vec::new();
    receives(
        src,
        dst,
        &Holders::OnDemand(src),
        rank,
        options,
        &mut received,
    );
    received.iter().for_each(|t| rp.take(t));
    let sends = sends(src, dst, rank, options);
    sends
        .iter()
        .filter(|t| !t.is_local())
        .for_each(|t| rp.take(t));
    rp.locals.sort_unstable();
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

/// Every transfer into `rank`'s destination shard (local copies included), appended to `out`.
fn receives(
    src: &Layout,
    dst: &Layout,
    holders: &Holders<'_>,
    rank: Rank,
    options: &PlanOptions,
    out: &mut Vec<Transfer>,
) {
    let Some(position) = dst.mesh().position(rank) else {
        return;
    };
    let target = dst.region_at(position);
    let receiver = Receiver::at(dst, position);
    for_each_overlap(src, &target, |index, piece| {
        let box_id = src.box_id(index);
        let holds = src.holds(rank, index);
        assign(
            piece,
            &holders.of(index, box_id),
            holds,
            &receiver,
            box_id,
            dst.dtype().size(),
            options,
            out,
        );
    });
}

/// Every transfer out of `rank`'s source shard (local copies included).
fn sends(src: &Layout, dst: &Layout, rank: Rank, options: &PlanOptions) -> Vec<Transfer> {
    let Some(position) = src.mesh().position(rank) else {
        return Vec::new();
    };
    let held = src.region_at(position);
    let index = src.piece_index(&src.mesh().coords(position));
    let holders = src.holders(&index);
    let box_id = src.box_id(&index);
    let mut all = Vec::new();
    for_each_overlap(dst, &held, |dst_index, piece| {
        for rank in dst.holders(dst_index) {
            let dst_position = dst.mesh().position(rank).unwrap_or_default();
            let elem = dst.dtype().size();
            assign(
                piece.clone(),
                &holders,
                src.holds(rank, &index),
                &Receiver::at(dst, dst_position),
                box_id,
                elem,
                options,
                &mut all,
            );
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
        out.push(Transfer {
            src: receiver.rank,
            dst: receiver.rank,
            region: piece,
        });
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
    let split = if wanted > 1 {
        match (0..piece.ndim()).find(|&d| piece.extent[d] >= wanted) {
            Some(d) => Some((d, wanted)),
            None => (0..piece.ndim())
                .max_by_key(|&d| (piece.extent[d], std::cmp::Reverse(d)))
                .filter(|&d| piece.extent[d] > 1)
                .map(|d| (d, piece.extent[d])),
        }
    } else {
        None
    };
    let Some((dim, parts)) = split else {
        out.push(Transfer {
            src: holders[rotation],
            dst: receiver.rank,
            region: piece,
        });
        return;
    };
    let lo = piece.offset[dim];
    let len = piece.extent[dim];
    for p in 0..parts {
        // in u128: p * len overflows u64 for pieces near 2^64 bytes
        let cut = |p: u64| lo + (p as u128 * len as u128 / parts as u128) as u64;
        let (a, b) = (cut(p), cut(p + 1));
        let mut part = piece.clone();
        part.offset[dim] = a;
        part.extent[dim] = b - a;
        out.push(Transfer {
            src: holders[(rotation + p as usize) % h],
            dst: receiver.rank,
            region: part,
        });
    }
}

#[cfg(test)]
mod tests;
