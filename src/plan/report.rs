//! Plan summaries: totals, the gather+broadcast comparison, and the JSON of `reshard plan`.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::layout::{Layout, Rank};

use super::Plan;
use super::baseline::gather_replica;

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
/// whole tensor to every destination rank that does not hold it yet. The replica chosen is the
/// one that contains the most destination ranks; a fully replicated source needs no gather.
pub fn gather_broadcast_bytes(src: &Layout, dst: &Layout) -> u64 {
    let total = src.total_bytes();
    let holders: BTreeSet<Rank> = gather_replica(src, dst).into_iter().collect();
    let replica_size = (src.mesh().size() / src.replication().max(1)) as u64;
    let gather = (replica_size - 1).saturating_mul(total);
    let receivers = dst
        .mesh()
        .ranks()
        .iter()
        .filter(|r| !holders.contains(r))
        .count() as u64;
    gather.saturating_add(receivers.saturating_mul(total))
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
