//! A cluster cost model: what a refit would take on hardware this machine cannot run.
//!
//! It prices a set of plans (one per tensor, all over one rank numbering) twice, as a reshard
//! and as the gather+broadcast baseline, on a [`Cluster`] (presets [`Cluster::h100`] and
//! [`Cluster::gb200`], or a JSON file). Pure arithmetic over the plans: no I/O besides reading
//! a cluster file, nothing fitted to a published measurement.
//!
//! ```
//! use reshard_core::{DType, Plan, layout::LayoutSpec, sim::{Cluster, simulate}};
//! let layout = |spec: &str, first| {
//!     LayoutSpec::parse(spec).unwrap().resolve(&[8192, 8192], DType::Bf16, first).unwrap()
//! };
//! // 8 training GPUs of one H100 node hand a 128 MiB matrix to 8 inference GPUs of another
//! let plan = Plan::new(layout("mesh=8 place=S(0)", 0), layout("mesh=8 place=S(1)", 8)).unwrap();
//! let sim = simulate(&[plan], &Cluster::h100()).unwrap();
//! // each GPU sends and receives 1/8 of the tensor over its own 50 GB/s NIC
//! assert!((sim.lower_bound_s - (128 << 20) as f64 / 8.0 / 50e9).abs() < 1e-9);
//! assert!(sim.speedup > 1.0);
//! ```
//!
//! # The model, and every assumption it makes
//!
//! **Where ranks sit.** Rank `r` runs on GPU `r` unless the cluster's `ranks` list says
//! otherwise; GPUs are numbered node by node, and GPUs `[k*D, (k+1)*D)` form NVLink domain `k`
//! (`D` = `nvlink_domain`: 8 on an H100 server, 72 on a GB200 NVL72 rack). Two ranks on one
//! GPU talk through its memory, two GPUs of one domain over NVLink, any other two over the
//! network. `gpus_per_node` describes the hardware and checks that a domain is made of whole
//! nodes; the links depend on domains alone.
//!
//! **Links.** Every GPU has five independent ports: NVLink send and receive, NIC send and
//! receive (each at the per-GPU, per-direction bandwidth), and its memory for copies between
//! two buffers on it. A copy reads and writes every byte, so it runs at half the memory
//! bandwidth. NVLink goes through NVSwitch, so any pair of GPUs in a domain gets the full
//! per-GPU bandwidth when it is the only traffic of both. The network is a non-blocking fat
//! tree (full bisection, rail-optimized as in DGX SuperPOD): only the NICs at both ends limit
//! a transfer, and each GPU uses its own NIC (no routing through a neighbour's NIC). The
//! memory traffic that NVLink and NIC transfers cause is not charged to the memory port: HBM
//! has 3.7x (H100) and 4.4x (GB200) the bandwidth of NVLink in both directions together.
//!
//! **Messages.** Every message costs its link's latency (`nvlink_latency_us`,
//! `net_latency_us`) on the sending and on the receiving port, once, in addition to its bytes:
//! the startup of a send that bandwidth cannot hide (a kernel launch, a handshake), paid one
//! message after another on one port. Local copies cost no latency (one kernel per tensor).
//! By default every transfer of the plans is one message ([`Messages::PerTransfer`]); an
//! executor that streams each peer pair's transfers across tensors pays one startup per pair
//! ([`Messages::PerPair`]), or one per chunk if its chunks do not overlap
//! ([`Messages::Chunked`]). The
//! latencies of the presets (5 us NVLink, 10 us network) are assumed, not taken from a spec
//! sheet: the order of magnitude of NCCL's point-to-point times for small messages. On the
//! published refits of `benches/sim.rs` (one message per transfer) they add 7–13% to
//! the bandwidth time; plans of many tiny tensors are where they dominate.
//!
//! **Reshard schedule.** Every transfer of every plan runs at once, and each port shares its
//! bandwidth fairly among its transfers, so a GPU is done when its busiest port is:
//! `time(port) = bytes / bandwidth + messages x latency`, and the reshard takes the largest
//! `time(port)` over all GPUs and ports. This is optimistic: a real executor does not keep
//! every port busy until the very end (a sender may wait on a receiver that is busy with
//! another sender). It is pessimistic only in paying every message's latency one after
//! another, where an executor may overlap a few. The **lower bound**
//! drops the latency: the largest, over GPUs and ports, of bytes over bandwidth. No schedule
//! of these plans' bytes over these links beats it; a different plan could: one that picks
//! other sources among replicas, or one that sends a byte into an NVLink domain once and fans
//! it out there over NVLink (NCCL's node-aware mode). The **domain bound**
//! ([`domain_bound`]) holds for every plan, relaying or not: per NVLink domain, the bytes its
//! destination ranks need that no source rank inside it holds must enter through its GPUs'
//! NICs, and the bytes only its source ranks hold that a destination outside needs must
//! leave through them, spread evenly over the NICs of the domain's GPUs that run a rank.
//!
//! **Gather+broadcast baseline**, as NeMo-RL runs it with NCCL collectives, tensor after
//! tensor with no overlap between tensors. For each tensor:
//! 1. a ring all-gather inside one source replica (the one
//!    [`crate::plan::baseline::gather_replica`] names; none when the source is fully
//!    replicated): the ring visits the replica in GPU order, so it crosses each NVLink domain
//!    boundary once;
//!    `k - 1` steps, each as long as the slowest ring edge takes for the largest shard plus its
//!    latency (NCCL pads uneven shards to equal sizes);
//! 2. a pipelined broadcast of the whole tensor from the first GPU of that replica to every
//!    destination rank outside it: a chain in GPU order starting at the root, forwarding
//!    `broadcast_chunk_bytes` (512 KiB, NCCL's default buffer over its 8 pipeline steps) at a
//!    time. With `n` chunks it takes the first chunk's trip down the chain (every edge's
//!    latency and chunk time) plus `n - 1` times the slowest edge's chunk time.
//!
//! Its bytes are the same as [`crate::plan::gather_broadcast_bytes`]: `(k - 1) x tensor`
//! for the gather, one tensor per receiving rank for the broadcast.
//!
//! **Colocated training and inference** (the same GPUs hold both sides). When a rank is both
//! a source and a destination, the plan turns what it already holds into local copies; they
//! cost memory bandwidth only (the memory port: 2 bytes of HBM traffic per byte), and run
//! alongside the NVLink and network transfers. When training and inference are different
//! processes (ranks) on the same GPUs, the cluster's `ranks` list puts both ranks on one GPU:
//! their transfers become copies through that GPU's memory, and the GPU's NVLink and NIC
//! ports are shared by every rank on it. The baseline skips the broadcast to destination
//! ranks inside the gathering replica, as [`crate::plan::gather_broadcast_bytes`] does.
//!
//! **Not modeled:** packing and unpacking kernels (they overlap with the transfers in a
//! pipelined executor), contention inside the NVSwitch or the fabric, congestion control,
//! PCIe between GPU and NIC, and the compute that training and inference do meanwhile.

mod bound;
mod cluster;
mod cost;
mod testbed;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use bound::domain_bound;
pub use cluster::{Cluster, Link, PRESETS};
pub use cost::{
    BaselineCost, Busiest, LinkBytes, Load, Messages, Port, ReshardCost, price_gather_broadcast,
    price_gather_broadcast_layouts, price_pairs, price_reshard,
};
pub use testbed::{Testbed, TestbedCost, is_testbed, price_baseline_on, price_on_testbed};

use rayon::prelude::*;

use crate::layout::Rank;
use crate::plan::Plan;

/// Why a cluster cannot be used: every variant names the field or the rank.
#[derive(Debug, Error)]
pub enum SimError {
    /// The name is no preset, and no file of that name can be read.
    #[error("`{path}` is neither a preset (h100, gb200) nor a readable cluster file: {source}")]
    Read {
        /// The name given, read as a path.
        path: String,
        /// Why reading it failed.
        #[source]
        source: std::io::Error,
    },

    /// The file is not the JSON of a cluster or testbed.
    #[error("cluster file `{path}`: {source}")]
    Json {
        /// The file's path (the name the text goes by, when parsed without a file).
        path: String,
        /// What the JSON parser found wrong.
        #[source]
        source: serde_json::Error,
    },

    /// A field that neither the file nor its base preset gives.
    #[error(
        "cluster field `{field}` is missing (give it, or start from a preset with \"base\": \"h100\" or \"gb200\")"
    )]
    MissingField {
        /// The field, as the file names it.
        field: &'static str,
    },

    /// A field whose value cannot describe a machine.
    #[error("cluster field `{field}`: {value} is invalid: {reason}")]
    InvalidField {
        /// The field, as the file names it.
        field: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        reason: String,
    },

    /// A rank of the plans beyond the cluster's `ranks` list.
    #[error("rank {rank} has no GPU: the cluster's `ranks` places only ranks 0..{placed}")]
    RankNotPlaced {
        /// The rank.
        rank: Rank,
        /// How many ranks the list places.
        placed: usize,
    },

    /// A rank of the plans beyond the testbed's hosts.
    #[error("rank {rank} is on no host: the testbed has ranks 0..{placed}")]
    RankOffTestbed {
        /// The rank.
        rank: Rank,
        /// How many ranks the testbed's hosts run.
        placed: usize,
    },

    /// More bytes than the model's 64-bit counts hold.
    #[error(
        "the plans and their gather+broadcast move {bytes} bytes, more than 2^64-1: too many to price"
    )]
    TooLarge {
        /// The bytes the plans and their baseline move together.
        bytes: u128,
    },
}

/// The `simulation` object of the refit JSON (see the design notes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Simulation {
    /// The cluster's name.
    pub cluster: String,
    /// Modeled seconds of the reshard.
    pub reshard_s: f64,
    /// Modeled seconds of gather+broadcast.
    pub gather_broadcast_s: f64,
    /// No schedule of the reshard's bytes over the cluster's links is faster.
    pub lower_bound_s: f64,
    /// `gather_broadcast_s / reshard_s` (1 when both are 0).
    pub speedup: f64,
}

/// Options of the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimOptions {
    /// How the reshard's transfers become messages.
    pub messages: Messages,
}

/// Both prices, in detail.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Pricing {
    /// The cluster's name.
    pub cluster: String,
    /// The reshard's price.
    pub reshard: ReshardCost,
    /// No plan of these tensors, relaying or not, is faster (see [`domain_bound`]).
    pub domain_bound_s: f64,
    /// The gather+broadcast baseline's price.
    pub gather_broadcast: BaselineCost,
}

impl Pricing {
    /// The summary the refit JSON reports.
    pub fn simulation(&self) -> Simulation {
        let (r, g) = (self.reshard.seconds, self.gather_broadcast.seconds);
        let speedup = if r > 0.0 {
            g / r
        } else if g > 0.0 {
            f64::INFINITY
        } else {
            1.0
        };
        Simulation {
            cluster: self.cluster.clone(),
            reshard_s: r,
            gather_broadcast_s: g,
            lower_bound_s: self.reshard.lower_bound_s,
            speedup,
        }
    }
}

/// Prices `plans` (one per tensor, all over one rank numbering) on `cluster`, as a reshard
/// and as gather+broadcast. Fails on an invalid cluster or a rank it does not place.
pub fn price(plans: &[Plan], cluster: &Cluster, options: &SimOptions) -> Result<Pricing, SimError> {
    cluster.validate()?;
    // the cost model counts bytes per port and link in u64: past 2^64 they would saturate, and
    // the times would look real while being wrong
    let bytes: u128 = plans.par_iter().map(bytes_moved).sum();
    if bytes > u128::from(u64::MAX) {
        return Err(SimError::TooLarge { bytes });
    }
    // the bounds and the baseline alongside the reshard
    let (reshard, (bound, baseline)) = rayon::join(
        || price_reshard(plans, cluster, options.messages),
        || {
            (
                domain_bound(plans, cluster),
                price_gather_broadcast(plans, cluster),
            )
        },
    );
    Ok(Pricing {
        cluster: cluster.name.clone(),
        reshard: reshard?,
        domain_bound_s: bound?,
        gather_broadcast: baseline?,
    })
}

/// Every byte a plan moves (local copies too) and its gather+broadcast moves: a bound on any
/// count the cost model keeps.
fn bytes_moved(plan: &Plan) -> u128 {
    let elem = plan.elem_bytes();
    let reshard: u128 = plan
        .transfers()
        .iter()
        .map(|t| u128::from(t.bytes(elem)))
        .sum();
    reshard + crate::plan::report::gather_broadcast_bytes_wide(plan.src(), plan.dst())
}

/// [`price`] with default options, summarized.
pub fn simulate(plans: &[Plan], cluster: &Cluster) -> Result<Simulation, SimError> {
    price(plans, cluster, &SimOptions::default()).map(|p| p.simulation())
}

#[cfg(test)]
mod tests;
