//! The two prices: the reshard (every transfer at once, each GPU limited by its busiest port)
//! and the gather+broadcast baseline (collectives, one tensor after another). The
//! assumptions are in the module docs of [`crate::sim`].

use std::collections::BTreeMap;
use std::fmt;

use rayon::prelude::*;
use rustc_hash::FxHashMap;
use serde::Serialize;

use super::SimError;
use super::cluster::{Cluster, Link};
use crate::layout::{Layout, Rank};
use crate::plan::Plan;
use crate::plan::baseline::gather_replica;

/// How many messages the transfers between one pair of ranks make.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Messages {
    /// One per transfer of the plans, as an executor that sends every box on its own does.
    #[default]
    PerTransfer,
    /// One per pair of ranks, all tensors together: a batched executor that streams each peer
    /// pair's transfers, whose chunks follow each other without waiting, pays the startup
    /// once per stream.
    PerPair,
    /// The bytes between each pair of ranks, all tensors together, cut into messages of at
    /// most `chunk_bytes`, each paying the startup: a batched executor that does not overlap
    /// one chunk's startup with the previous chunk's bytes.
    Chunked {
        /// The most bytes one message carries.
        chunk_bytes: u64,
    },
}

impl Messages {
    fn count(self, load: Load) -> u64 {
        match self {
            Messages::PerTransfer => load.messages,
            Messages::PerPair => 1,
            Messages::Chunked { chunk_bytes } => load.bytes.div_ceil(chunk_bytes.max(1)),
        }
    }
}

/// One direction of one of a GPU's links: the resources a reshard competes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Port {
    /// Sending over NVLink, to GPUs of the same domain.
    NvlinkSend,
    /// Receiving over NVLink, from GPUs of the same domain.
    NvlinkRecv,
    /// Sending over the network, through the GPU's NIC.
    NicSend,
    /// Receiving over the network, through the GPU's NIC.
    NicRecv,
    /// Copies between two buffers on the GPU (local copies).
    Memory,
}

impl Port {
    const ALL: [Port; 5] = [
        Port::NvlinkSend,
        Port::NvlinkRecv,
        Port::NicSend,
        Port::NicRecv,
        Port::Memory,
    ];

    fn link(self) -> Link {
        match self {
            Port::NvlinkSend | Port::NvlinkRecv => Link::Nvlink,
            Port::NicSend | Port::NicRecv => Link::Network,
            Port::Memory => Link::Memory,
        }
    }
}

impl fmt::Display for Port {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Port::NvlinkSend => "NVLink send",
            Port::NvlinkRecv => "NVLink receive",
            Port::NicSend => "NIC send",
            Port::NicRecv => "NIC receive",
            Port::Memory => "memory copies",
        })
    }
}

/// Bytes and messages through one port (or between one pair of ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Load {
    /// Bytes carried.
    pub bytes: u64,
    /// Messages carried (between a pair of ranks: its transfers).
    pub messages: u64,
}

impl Load {
    fn add(&mut self, bytes: u64, messages: u64) {
        self.bytes = self.bytes.saturating_add(bytes);
        self.messages = self.messages.saturating_add(messages);
    }
}

/// The port that takes longest, and what it carries.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Busiest {
    /// The GPU, by its number in the cluster.
    pub gpu: usize,
    /// Which of its ports.
    pub port: Port,
    /// What the port carries.
    pub load: Load,
    /// Modeled seconds of the port: its bytes over its bandwidth plus its messages' latency.
    pub seconds: f64,
}

/// Bytes moved over each kind of link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LinkBytes {
    /// Copied through a GPU's memory: local copies, and between ranks that share a GPU.
    pub memory: u64,
    /// Over NVLink, between GPUs of one domain.
    pub nvlink: u64,
    /// Over the network, between domains.
    pub network: u64,
}

impl LinkBytes {
    fn add(&mut self, link: Link, bytes: u64) {
        let slot = match link {
            Link::Memory => &mut self.memory,
            Link::Nvlink => &mut self.nvlink,
            Link::Network => &mut self.network,
        };
        *slot = slot.saturating_add(bytes);
    }
}

/// The modeled reshard.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReshardCost {
    /// Modeled seconds: the busiest port's bytes over its bandwidth plus its messages'
    /// latency.
    pub seconds: f64,
    /// The same without latency: no schedule of these bytes over these links can be faster.
    pub lower_bound_s: f64,
    /// The port that sets `seconds` (none when nothing moves).
    pub busiest: Option<Busiest>,
    /// Bytes over each kind of link, local copies included.
    pub bytes: LinkBytes,
    /// Remote messages (local copies aside).
    pub messages: u64,
    /// Pairs of distinct ranks that exchange bytes.
    pub pairs: usize,
}

/// Per-pair totals: a dense matrix when the ranks are few (no hashing in the hot loop), a
/// hash map otherwise.
enum Pairs {
    Dense { span: usize, loads: Vec<Load> },
    Sparse(FxHashMap<(Rank, Rank), Load>),
}

/// Up to this many ranks, per-pair totals live in a dense matrix (16 MiB at most).
const DENSE_SPAN: usize = 1024;

impl Pairs {
    fn new(span: usize) -> Pairs {
        if span <= DENSE_SPAN {
            Pairs::Dense {
                span,
                loads: vec![Load::default(); span * span],
            }
        } else {
            Pairs::Sparse(FxHashMap::default())
        }
    }

    fn add(&mut self, (src, dst): (Rank, Rank), load: Load) {
        match self {
            Pairs::Dense { span, loads } => loads[src * *span + dst].add(load.bytes, load.messages),
            Pairs::Sparse(map) => map
                .entry((src, dst))
                .or_default()
                .add(load.bytes, load.messages),
        }
    }

    fn merge(&mut self, other: Pairs) {
        for (k, load) in other.into_sorted() {
            self.add(k, load);
        }
    }

    /// The pairs that carry anything, in rank order.
    fn into_sorted(self) -> Vec<((Rank, Rank), Load)> {
        match self {
            Pairs::Dense { span, loads } => loads
                .into_iter()
                .enumerate()
                .filter(|(_, l)| l.messages > 0)
                .map(|(i, l)| ((i / span, i % span), l))
                .collect(),
            Pairs::Sparse(map) => {
                let mut v: Vec<_> = map.into_iter().collect();
                v.sort_unstable_by_key(|&(k, _)| k);
                v
            }
        }
    }
}

/// The bytes and transfer counts between every pair of ranks, all plans together, in rank
/// order. Reading millions of transfers is bound by memory latency (every region's extent is
/// its own allocation), so the plans are split among the cores (rayon's pool).
fn pair_loads(plans: &[Plan]) -> Vec<((Rank, Rank), Load)> {
    let span = plans
        .iter()
        .flat_map(|p| p.src().mesh().ranks().iter().chain(p.dst().mesh().ranks()))
        .max()
        .map_or(0, |&r| r + 1);
    // one dense matrix per core at most: split the plans into as many parts
    let parts = rayon::current_num_threads().max(1);
    let per_part = plans.len().div_ceil(parts).max(1);
    plans
        .par_chunks(per_part)
        .map(|part| plan_pairs(part, span))
        .reduce_with(|mut a, b| {
            a.merge(b);
            a
        })
        .unwrap_or_else(|| Pairs::new(span))
        .into_sorted()
}

fn plan_pairs(plans: &[Plan], span: usize) -> Pairs {
    let mut pairs = Pairs::new(span);
    for plan in plans {
        let elem = plan.elem_bytes();
        // transfers come sorted by (src, dst): add each run of one pair at once. A relayed
        // transfer's bytes reach its destination from the relaying rank (`via`); the hop that
        // brings them to that rank is a transfer of its own.
        let mut run: Option<((Rank, Rank), Load)> = None;
        for t in plan.transfers() {
            let key = (t.sender(), t.dst);
            match &mut run {
                Some((k, load)) if *k == key => load.add(t.bytes(elem), 1),
                _ => {
                    if let Some((k, load)) = run.take() {
                        pairs.add(k, load);
                    }
                    run = Some((
                        key,
                        Load {
                            bytes: t.bytes(elem),
                            messages: 1,
                        },
                    ));
                }
            }
        }
        if let Some((k, load)) = run {
            pairs.add(k, load);
        }
    }
    pairs
}

/// Prices the reshard of `plans`, all of them at once.
pub fn price_reshard(
    plans: &[Plan],
    cluster: &Cluster,
    messages: Messages,
) -> Result<ReshardCost, SimError> {
    // in rank order, so that an unplaced rank is always reported the same way
    price_pairs(&pair_loads(plans), cluster, messages)
}

/// Prices a reshard given as the bytes and transfer counts between pairs of ranks
/// (`(src, dst)`, each pair once; `src == dst`: local copies), for planners and executors
/// that do not hand over [`Plan`]s.
pub fn price_pairs(
    pairs: &[((Rank, Rank), Load)],
    cluster: &Cluster,
    messages: Messages,
) -> Result<ReshardCost, SimError> {
    let mut ports: BTreeMap<usize, [Load; 5]> = BTreeMap::new();
    let mut bytes = LinkBytes::default();
    let mut total_messages = 0u64;
    let mut remote_pairs = 0usize;
    for &((src, dst), load) in pairs {
        let (gs, gd) = (cluster.gpu(src)?, cluster.gpu(dst)?);
        let link = cluster.link(gs, gd);
        let count = messages.count(load);
        bytes.add(link, load.bytes);
        if src != dst {
            total_messages = total_messages.saturating_add(count);
            remote_pairs += 1;
        }
        let (out, inward) = match link {
            Link::Memory => (Port::Memory, None),
            Link::Nvlink => (Port::NvlinkSend, Some(Port::NvlinkRecv)),
            Link::Network => (Port::NicSend, Some(Port::NicRecv)),
        };
        ports.entry(gs).or_default()[out as usize].add(load.bytes, count);
        if let Some(p) = inward {
            ports.entry(gd).or_default()[p as usize].add(load.bytes, count);
        }
    }
    let mut seconds = 0.0f64;
    let mut lower_bound_s = 0.0f64;
    let mut busiest: Option<Busiest> = None;
    for (&gpu, loads) in &ports {
        for port in Port::ALL {
            let load = loads[port as usize];
            let link = port.link();
            let transfer = load.bytes as f64 / cluster.bandwidth(link);
            let total = transfer + load.messages as f64 * cluster.latency(link);
            lower_bound_s = lower_bound_s.max(transfer);
            seconds = seconds.max(total);
            // strictly greater: the first GPU and port in order win ties
            let better = match &busiest {
                None => load.bytes > 0 || load.messages > 0,
                Some(b) => total > b.seconds,
            };
            if better {
                busiest = Some(Busiest {
                    gpu,
                    port,
                    load,
                    seconds: total,
                });
            }
        }
    }
    Ok(ReshardCost {
        seconds,
        lower_bound_s,
        busiest,
        bytes,
        messages: total_messages,
        pairs: remote_pairs,
    })
}

/// The modeled gather+broadcast baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct BaselineCost {
    /// Modeled seconds: `gather_s + broadcast_s`.
    pub seconds: f64,
    /// Of which ring all-gathers.
    pub gather_s: f64,
    /// Of which pipelined broadcasts.
    pub broadcast_s: f64,
    /// Bytes received over all links, all-gathers and broadcasts together.
    pub bytes: u64,
    /// `bytes` by kind of link.
    pub bytes_by_link: LinkBytes,
}

/// Prices gather+broadcast for `plans`: per tensor, a ring all-gather inside one source
/// replica, then a pipelined broadcast of the whole tensor, one tensor after another.
pub fn price_gather_broadcast(plans: &[Plan], cluster: &Cluster) -> Result<BaselineCost, SimError> {
    price_gather_broadcast_layouts(plans.iter().map(|p| (p.src(), p.dst())), cluster)
}

/// [`price_gather_broadcast`] from each tensor's source and destination layouts.
pub fn price_gather_broadcast_layouts<'a>(
    tensors: impl IntoIterator<Item = (&'a Layout, &'a Layout)>,
    cluster: &Cluster,
) -> Result<BaselineCost, SimError> {
    let mut cost = BaselineCost::default();
    for (src, dst) in tensors {
        let holders = gather_replica(src, dst);
        let gather = ring_all_gather(src, &holders, cluster, &mut cost.bytes_by_link)?;
        let broadcast = chain_broadcast(src, dst, &holders, cluster, &mut cost.bytes_by_link)?;
        cost.gather_s += gather.0;
        cost.broadcast_s += broadcast.0;
        cost.bytes = cost
            .bytes
            .saturating_add(gather.1)
            .saturating_add(broadcast.1);
    }
    cost.seconds = cost.gather_s + cost.broadcast_s;
    Ok(cost)
}

/// `ranks` with their GPUs, in GPU order: the order a topology-aware ring or chain visits them,
/// crossing each NVLink domain boundary once.
fn by_gpu(ranks: &[Rank], cluster: &Cluster) -> Result<Vec<(usize, Rank)>, SimError> {
    let mut placed = ranks
        .iter()
        .map(|&r| cluster.gpu(r).map(|g| (g, r)))
        .collect::<Result<Vec<_>, _>>()?;
    placed.sort_unstable();
    Ok(placed)
}

/// Seconds and bytes of a ring all-gather of the whole tensor inside `replica` (when the
/// source is fully replicated, `replica` lists every source rank and nothing is gathered).
/// `k - 1` steps; in each, every rank forwards one shard to the next one on the ring, so a step
/// lasts as long as the slowest edge takes for the largest shard (NCCL pads to equal sizes).
fn ring_all_gather(
    src: &Layout,
    replica: &[Rank],
    cluster: &Cluster,
    links: &mut LinkBytes,
) -> Result<(f64, u64), SimError> {
    let k = src.mesh().size() / src.replication();
    let total = src.total_bytes();
    if k <= 1 || total == 0 {
        return Ok((0.0, 0));
    }
    let shards: Vec<u64> = replica.iter().map(|&r| src.local_bytes(r)).collect();
    let largest = shards.iter().copied().max().unwrap_or(0) as f64;
    let ring = by_gpu(replica, cluster)?;
    let mut step = 0.0f64;
    for (i, &(g, _)) in ring.iter().enumerate() {
        let (next, _) = ring[(i + 1) % ring.len()];
        let link = cluster.link(g, next);
        step = step.max(cluster.latency(link) + largest / cluster.bandwidth(link));
        // the receiver of this edge gets every shard but its own
        let own = src.local_bytes(ring[(i + 1) % ring.len()].1);
        links.add(link, total - own);
    }
    // each rank receives every shard it lacks
    let bytes = shards
        .iter()
        .fold(0u64, |acc, own| acc.saturating_add(total - own));
    Ok(((k - 1) as f64 * step, bytes))
}

/// Seconds and bytes of a pipelined broadcast of the whole tensor from one of `holders` to
/// every destination rank outside `holders`: a chain through the ranks in GPU order, starting
/// at the root, forwarding `broadcast_chunk_bytes` at a time. With `n` chunks it takes the
/// first chunk's trip down the chain (every edge's latency and chunk time) plus `n - 1` times
/// the slowest edge's chunk time.
fn chain_broadcast(
    src: &Layout,
    dst: &Layout,
    holders: &[Rank],
    cluster: &Cluster,
    links: &mut LinkBytes,
) -> Result<(f64, u64), SimError> {
    let total = src.total_bytes();
    let mut sorted = holders.to_vec();
    sorted.sort_unstable();
    let receivers: Vec<Rank> = dst
        .mesh()
        .ranks()
        .iter()
        .copied()
        .filter(|r| sorted.binary_search(r).is_err())
        .collect();
    let Some(&(_, root)) = by_gpu(holders, cluster)?.first() else {
        return Ok((0.0, 0));
    };
    if receivers.is_empty() || total == 0 {
        return Ok((0.0, 0));
    }
    let mut members = receivers.clone();
    members.push(root);
    let order = by_gpu(&members, cluster)?;
    let start = order.iter().position(|&(_, r)| r == root).unwrap_or(0);
    let chain: Vec<usize> = order[start..]
        .iter()
        .chain(&order[..start])
        .map(|&(g, _)| g)
        .collect();
    let chunk = cluster.broadcast_chunk_bytes.min(total) as f64;
    let chunks = total.div_ceil(cluster.broadcast_chunk_bytes);
    let (mut first, mut slowest) = (0.0f64, 0.0f64);
    for edge in chain.windows(2) {
        let link = cluster.link(edge[0], edge[1]);
        let per_chunk = chunk / cluster.bandwidth(link);
        first += cluster.latency(link) + per_chunk;
        slowest = slowest.max(per_chunk);
        links.add(link, total);
    }
    let bytes = (receivers.len() as u64).saturating_mul(total);
    Ok((first + (chunks - 1) as f64 * slowest, bytes))
}
