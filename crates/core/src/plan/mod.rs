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

mod assign;
pub mod baseline;
pub mod hosts;
pub mod prequant;
pub mod quant;
mod rank_plan;
pub mod report;
pub mod schedule;
mod sources;

use std::ops::Range;

pub use assign::{Receiver, assign, split_dim, split_part};
pub use baseline::GatherBroadcast;
pub use hosts::{HostLinks, Topology};
pub use prequant::QuantizedMove;
pub use quant::{QuantPlan, QuantRankPlan, QuantRequest};
pub use rank_plan::RankPlan;
pub use report::{Overflow, PlanJson, Totals, TransferJson, gather_broadcast_bytes};
pub use schedule::Schedule;
pub use sources::{Chooser, Holders, receives, sends};

use crate::error::{Dims, Error, Result};
use crate::layout::{Layout, Rank};
use crate::region::Region;

/// One box moved from one rank to another (`src == dst`: a local copy).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Transfer {
    /// The source rank, which holds the region.
    pub src: Rank,
    /// The destination rank, which receives it.
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

    /// Whether the transfer is a copy within one rank (`src == dst`).
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
    /// use reshard_core::{Plan, layout::LayoutSpec, DType};
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

    /// Plans a reshard from `src` to `dst` with `options`, not knowing the hosts.
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

    /// The source layout.
    pub fn src(&self) -> &Layout {
        &self.src
    }

    /// The destination layout.
    pub fn dst(&self) -> &Layout {
        &self.dst
    }

    /// The options the plan was made with.
    pub fn options(&self) -> PlanOptions {
        self.options
    }

    /// The hosts the plan was made for, if any.
    pub fn topology(&self) -> Option<&Topology> {
        self.topology.as_ref()
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

/// [`rank_plan`] of a quantizing reshard into an fp8 destination: the same result as
/// `Plan::quantized(src, dst, options, quant).rank_part(rank)`, from this rank's pieces only.
/// `quant` is checked against both layouts first ([`QuantPlan::new`] with its own request), as
/// a plain cast into fp8 is refused by [`rank_plan`].
pub fn rank_plan_quantized(
    src: &Layout,
    dst: &Layout,
    rank: Rank,
    options: &PlanOptions,
    quant: &QuantPlan,
) -> Result<RankPlan> {
    if src.shape() != dst.shape() {
        return Err(Error::ShapeMismatch {
            src: Dims(src.shape().to_vec()),
            dst: Dims(dst.shape().to_vec()),
        });
    }
    QuantPlan::new(
        QuantRequest {
            scheme: quant.quant.scheme,
            scale_dtype: Some(quant.quant.scale_dtype),
        },
        src,
        dst,
    )?;
    Ok(rank_part(src, dst, rank, options, None))
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

#[cfg(test)]
mod tests;
