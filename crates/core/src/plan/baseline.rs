//! The gather+broadcast baseline, planned as two reshards and a local slice, so that it runs on
//! the same executor and transports as the reshard it is compared with.
//!
//! 1. **All-gather** inside one source replica: every rank of the replica sends its shard to
//!    every other one (a shift all-to-all: step `s` pairs rank `i` with rank `i + s`, like a
//!    ring all-gather it moves `(k - 1) x total` for `k` ranks), so each ends with the tensor.
//! 2. **Broadcast** of the whole tensor from those `k` holders to every destination rank that
//!    does not hold it: each receiver takes an equal part from every holder, in parallel
//!    (scatter-from-holders; every receiver gets the full tensor once, as in a chain or tree).
//! 3. **Keep**: every destination rank copies its own box out of the full tensor.
//!
//! The wire bytes are exactly [`super::report::gather_broadcast_bytes`].

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result, Side};
use crate::layout::{Layout, Mesh, Placement, Rank};
use crate::region::Region;

use super::{Plan, PlanOptions, RankPlan, check_compatible};

/// The source replica that gathers the tensor: the one with the most destination ranks (the
/// first on ties), or every source rank when the source is fully replicated (each already
/// holds the whole tensor). In mesh order.
pub fn gather_replica(src: &Layout, dst: &Layout) -> Vec<Rank> {
    let mesh = src.mesh();
    let replica_size = mesh.size() / src.replication().max(1);
    if replica_size == 1 {
        return mesh.ranks().to_vec();
    }
    let replicated_axes: Vec<usize> = src
        .placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| **p == Placement::Replicate)
        .map(|(a, _)| a)
        .collect();
    // Group the source ranks into replicas by their coordinates on the replicated axes.
    let mut replicas: BTreeMap<Vec<usize>, Vec<Rank>> = BTreeMap::new();
    for (position, &rank) in mesh.ranks().iter().enumerate() {
        let coords = mesh.coords(position);
        let key = replicated_axes.iter().map(|&a| coords[a]).collect();
        replicas.entry(key).or_default().push(rank);
    }
    replicas
        .into_values()
        .max_by_key(|members| {
            let inside = members.iter().filter(|&&r| dst.mesh().contains(r)).count();
            (inside, std::cmp::Reverse(members[0]))
        })
        .unwrap_or_default()
}

/// The baseline for one source and destination layout.
#[derive(Clone, Debug)]
pub struct GatherBroadcast {
    /// Shards of the chosen replica to the full tensor on each of its ranks; `None` when the
    /// source is fully replicated.
    pub gather: Option<Plan>,
    /// The full tensor from the holders to every destination rank lacking it; `None` when every
    /// destination rank is a holder.
    pub broadcast: Option<Plan>,
    /// Ranks holding the full tensor after the gather, sorted.
    pub holders: Vec<Rank>,
    dst: Layout,
    /// The dtype the tensor moves in: the source's. With `--dst-dtype`, each destination rank
    /// converts its box as it keeps it (what an engine does when it receives the training
    /// dtype and converts afterwards).
    src_dtype: crate::DType,
}

impl GatherBroadcast {
    /// `rank`'s parts of the gather and of the broadcast, each computed for it alone
    /// ([`Plan::rank_part`]); `None` for a phase the rank takes no part in.
    pub fn rank_parts(&self, rank: Rank) -> (Option<RankPlan>, Option<RankPlan>) {
        let part = |p: &Option<Plan>| {
            p.as_ref()
                .filter(|p| p.ranks().contains(&rank))
                .map(|p| p.rank_part(rank))
        };
        (part(&self.gather), part(&self.broadcast))
    }

    /// Plans the baseline for moving a tensor from `src` to `dst`.
    ///
    /// ```
    /// use reshard_core::{DType, layout::LayoutSpec, plan::{GatherBroadcast, report}};
    /// let src = LayoutSpec::parse("mesh=4 place=S(0)").unwrap().resolve(&[64, 64], DType::F32, 0).unwrap();
    /// let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&[64, 64], DType::F32, 4).unwrap();
    /// let gb = GatherBroadcast::new(&src, &dst).unwrap();
    /// // three quarters of the tensor to each of 4 gatherers, then 4 full copies
    /// assert_eq!(gb.wire_bytes(), 7 * 64 * 64 * 4);
    /// assert_eq!(gb.wire_bytes(), report::gather_broadcast_bytes(&src, &dst));
    /// ```
    pub fn new(src: &Layout, dst: &Layout) -> Result<GatherBroadcast> {
        GatherBroadcast::on_hosts(src, dst, None)
    }

    /// The baseline as NCCL runs it across hosts, when the hosts are known: both phases are
    /// planned on them with relay, so a byte crosses into each host once (in the all-gather
    /// and in the broadcast) and fans out inside over shared memory; a receiver on a host
    /// that holds the tensor takes it from there. Without hosts, [`GatherBroadcast::new`].
    pub fn on_hosts(
        src: &Layout,
        dst: &Layout,
        hosts: Option<&super::Topology>,
    ) -> Result<GatherBroadcast> {
        let topology = hosts.map(|t| super::Topology {
            hosts: t.hosts.clone(),
            relay: true,
        });
        let plan = |a: Layout, b: Layout| {
            Plan::with_topology(a, b, PlanOptions::default(), topology.clone())
        };
        check_compatible(src, dst)?;
        let members = gather_replica(src, dst);
        let gathered = src.mesh().size() / src.replication().max(1) > 1;
        let gather = if gathered {
            let replica = replica_layout(src, &members)?;
            let full = replicated(src, &members, Side::Src)?;
            Some(plan(replica, full)?)
        } else {
            None
        };
        let holding: BTreeSet<Rank> = members.iter().copied().collect();
        let receivers: Vec<Rank> = dst
            .mesh()
            .ranks()
            .iter()
            .copied()
            .filter(|r| !holding.contains(r))
            .collect();
        let broadcast = if receivers.is_empty() {
            None
        } else {
            Some(plan(
                replicated(src, &members, Side::Src)?,
                replicated(src, &receivers, Side::Dst)?,
            )?)
        };
        Ok(GatherBroadcast {
            gather,
            broadcast,
            holders: holding.into_iter().collect(),
            dst: dst.clone(),
            src_dtype: src.dtype(),
        })
    }

    /// The bytes on every host's link over both phases, when the hosts are known.
    pub fn host_links(&self) -> Option<super::HostLinks> {
        let mut total: Option<super::HostLinks> = None;
        for p in [&self.gather, &self.broadcast].into_iter().flatten() {
            if let Some(links) = p.host_links() {
                total.get_or_insert_with(Default::default).add(&links);
            }
        }
        total
    }

    /// Bytes that cross between ranks, both phases together.
    pub fn wire_bytes(&self) -> u64 {
        [&self.gather, &self.broadcast]
            .into_iter()
            .flatten()
            .map(|p| p.totals().bytes_remote)
            .sum()
    }

    /// Whether `rank` gathers or receives the whole tensor.
    pub fn gets_tensor(&self, rank: Rank) -> bool {
        [&self.gather, &self.broadcast]
            .into_iter()
            .flatten()
            .any(|p| p.dst().mesh().contains(rank))
    }

    /// Whether `rank` keeps the whole tensor: its destination box is all of it, so the tensor
    /// lands straight in its destination shard.
    /// Not when the destination has a dtype of its own: the tensor arrives in the source's
    /// and is converted into the shard.
    pub fn keeps_all(&self, rank: Rank) -> bool {
        self.dst.dtype() == self.src_dtype
            && self
                .dst
                .local_region(rank)
                .is_some_and(|b| b.extent == self.dst.shape())
    }

    /// Bytes of the whole tensor as it moves (in the source's dtype): the size of a rank's
    /// full-tensor buffer.
    pub fn full_bytes(&self) -> u64 {
        Region::full(self.dst.shape()).volume() * self.src_dtype.size() as u64
    }

    /// The conversion each destination rank applies as it keeps its box, if the dtypes
    /// differ (checked when the baseline was planned).
    pub fn cast(&self) -> Option<crate::copy::Cast> {
        crate::copy::Cast::between(self.src_dtype, self.dst.dtype())
            .ok()
            .flatten()
    }

    /// Whether `rank` needs a buffer for the whole tensor besides its shards: it gathers or
    /// receives the tensor and keeps only part of it. (A rank of a fully replicated source
    /// holds the tensor in its source shard.)
    pub fn needs_full_buffer(&self, rank: Rank) -> bool {
        self.gets_tensor(rank) && !self.keeps_all(rank)
    }

    /// The destination layout whose boxes the ranks keep at the end.
    pub fn dst(&self) -> &Layout {
        &self.dst
    }

    /// Every rank taking part, sorted.
    pub fn ranks(&self) -> Vec<Rank> {
        let mut ranks: BTreeSet<Rank> = self.dst.mesh().ranks().iter().copied().collect();
        for p in [&self.gather, &self.broadcast].into_iter().flatten() {
            ranks.extend(p.ranks());
        }
        ranks.into_iter().collect()
    }
}

/// The chosen replica alone: the source layout without its replicated mesh axes, over `members`
/// (which are in mesh order, so the shard axes keep their nesting).
fn replica_layout(src: &Layout, members: &[Rank]) -> Result<Layout> {
    let (dims, placements): (Vec<usize>, Vec<Placement>) = src
        .mesh()
        .dims()
        .iter()
        .zip(src.placements())
        .filter(|(_, p)| **p != Placement::Replicate)
        .map(|(&d, &p)| (d, p))
        .unzip();
    let mesh = Mesh::new(dims, members.to_vec()).map_err(|source| Error::Layout {
        side: Side::Src,
        source,
    })?;
    Layout::new(src.shape().to_vec(), src.dtype(), mesh, placements).map_err(|source| {
        Error::Layout {
            side: Side::Src,
            source,
        }
    })
}

/// The whole tensor on every rank of `ranks`.
fn replicated(like: &Layout, ranks: &[Rank], side: Side) -> Result<Layout> {
    let mesh = Mesh::new(vec![ranks.len()], ranks.to_vec())
        .map_err(|source| Error::Layout { side, source })?;
    Layout::new(
        like.shape().to_vec(),
        like.dtype(),
        mesh,
        vec![Placement::Replicate],
    )
    .map_err(|source| Error::Layout { side, source })
}
