//! Plan summaries: totals, the gather+broadcast comparison, and the JSON of `reshard plan`.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::layout::{Layout, Placement, Rank};

use super::Plan;

/// Byte and message counts of a plan (the `totals` object of the plan JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Bytes that cross from one rank to another.
    pub bytes_remote: u64,
    /// Bytes copied inside a rank (source and destination on the same rank).
    pub bytes_local: u64,
    /// Remote transfers.
    pub messages: u64,
    pub max_rank_send_bytes: u64,
    pub max_rank_recv_bytes: u64,
    /// What gather+broadcast moves for the same layouts (see [`gather_broadcast_bytes`]).
    pub gather_broadcast_bytes: u64,
}

impl Totals {
    pub fn of(plan: &Plan) -> Totals {
        let elem = plan.elem_bytes();
        let mut totals = Totals {
            gather_broadcast_bytes: gather_broadcast_bytes(plan.src(), plan.dst()),
            ..Totals::default()
        };
        let mut sent: BTreeMap<Rank, u64> = BTreeMap::new();
        let mut received: BTreeMap<Rank, u64> = BTreeMap::new();
        for t in plan.transfers() {
            // saturating: replicated destinations of a near-2^64-byte tensor overflow u64
            let bytes = t.bytes(elem);
            let add = |total: &mut u64| *total = total.saturating_add(bytes);
            if t.is_local() {
                add(&mut totals.bytes_local);
            } else {
                add(&mut totals.bytes_remote);
                totals.messages += 1;
                add(sent.entry(t.src).or_default());
                add(received.entry(t.dst).or_default());
            }
        }
        totals.max_rank_send_bytes = sent.values().copied().max().unwrap_or(0);
        totals.max_rank_recv_bytes = received.values().copied().max().unwrap_or(0);
        totals
    }
}

/// Wire bytes of the gather+broadcast baseline: a ring all-gather inside one source replica
/// (each of its `k` ranks receives what it lacks: `(k - 1) x total`), then a broadcast of the
/// whole tensor to every destination rank that does not hold it yet (see [`gather_replica`]).
pub fn gather_broadcast_bytes(src: &Layout, dst: &Layout) -> u64 {
    let total = src.total_bytes();
    let replica_size = src.mesh().size() / src.replication();
    let full_holders: BTreeSet<Rank> = gather_replica(src, dst).into_iter().collect();
    let gather = (replica_size as u64 - 1).saturating_mul(total);
    let receivers = dst
        .mesh()
        .ranks()
        .iter()
        .filter(|r| !full_holders.contains(r))
        .count() as u64;
    gather.saturating_add(receivers.saturating_mul(total))
}

/// The source ranks that hold the whole tensor once the gather+broadcast baseline has
/// gathered it, in mesh order: the replica that contains the most destination ranks (the
/// first one on a tie), or every source rank when the source is fully replicated (no gather).
pub fn gather_replica(src: &Layout, dst: &Layout) -> Vec<Rank> {
    let mesh = src.mesh();
    let replicated_axes: Vec<usize> = src
        .placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| **p == Placement::Replicate)
        .map(|(a, _)| a)
        .collect();
    let replica_size = mesh.size() / src.replication();
    if replica_size == 1 {
        return mesh.ranks().to_vec();
    }
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
            // the first replica wins ties
            (inside, std::cmp::Reverse(members[0]))
        })
        .unwrap_or_default()
}

/// One transfer in the plan JSON.
#[derive(Clone, Debug, Serialize)]
pub struct TransferJson {
    pub src: Rank,
    pub dst: Rank,
    pub offset: Vec<u64>,
    pub extent: Vec<u64>,
    pub bytes: u64,
}

/// The plan JSON of `reshard plan --json` (the design notes fix its fields).
#[derive(Clone, Debug, Serialize)]
pub struct PlanJson {
    pub shape: Vec<u64>,
    pub dtype: String,
    pub elem_bytes: usize,
    pub transfers: Vec<TransferJson>,
    pub totals: Totals,
}

impl PlanJson {
    pub fn of(plan: &Plan) -> PlanJson {
        let elem = plan.elem_bytes();
        PlanJson {
            shape: plan.src().shape().to_vec(),
            dtype: plan.src().dtype().to_string(),
            elem_bytes: elem,
            transfers: plan
                .transfers()
                .iter()
                .map(|t| TransferJson {
                    src: t.src,
                    dst: t.dst,
                    offset: t.region.offset.clone(),
                    extent: t.region.extent.clone(),
                    bytes: t.bytes(elem),
                })
                .collect(),
            totals: plan.totals(),
        }
    }
}
