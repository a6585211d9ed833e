//! A testbed of CPU hosts as the cost model sees it: hosts joined by one network link each,
//! ranks of a host exchanging through shared memory, every copy done by a CPU core.
//!
//! This is the machine `reshard launch --hosts` emulates (and a small cluster of real
//! servers): unlike a GPU of [`super::Cluster`], whose NIC is its own, a host's link is **one
//! port shared by all its ranks**, each way. A plan ([`crate::plan::Plan`], relaying or not)
//! is priced as every transfer running at once, each resource shared fairly, so the plan
//! takes as long as its busiest resource:
//!
//! - **a host's link, each way**: the bytes that leave (enter) the host over its link, at
//!   `link_gbit` times the share TCP payload gets of a frame (`link_payload`), plus
//!   `link_latency_us` per message that crosses it;
//! - **a rank's core**: a rank runs its copies on one core. A transfer to another host costs
//!   each end `1 / tcp_gb_s` per byte (packing or unpacking, and the kernel's socket copy);
//!   a transfer to a rank of the same host costs its sender `1 / memory_gb_s` per byte (it
//!   writes straight into the receiver's shard), and the receiver as much again when the
//!   receiver relays (it takes such bytes through a ring, not into its shard); a local copy
//!   costs `1 / memory_gb_s`;
//! - **the cores**: the ranks of a host (of the whole testbed when `shared_cpu`, as on one
//!   machine that emulates several hosts) share `cores` cores: the sum of their copy time
//!   over `cores`.
//!
//! A relayed transfer (`via`) is priced on its last leg, from the relaying rank to the
//! destination over memory; the hop that brings its bytes into the host is a transfer of the
//! plan of its own, priced once. The relay's pipeline fill (one slab crosses before the first
//! forward) is left out.
//!
//! `memory_gb_s` and `tcp_gb_s` are measured, not taken from a data sheet: the rate of a
//! shared-memory and of a TCP transfer between two ranks of one host, each end on a core of
//! its own (`reshard bench` of one source rank to one destination rank, `benches/
//! costmodel.sh`), on the machine and under the load of the runs the model predicts.
//!
//! **Gather+broadcast** ([`price_baseline_on`]) is its two phases, each a plan on the hosts
//! with relay (a byte crosses into a host once), one after the other, and then each
//! destination rank's copy of its box out of the whole tensor.

use serde::{Deserialize, Serialize};

use super::SimError;
use crate::layout::Rank;
use crate::plan::{GatherBroadcast, Plan};
use crate::topology::HostMap;

/// A testbed of hosts: what `{"kind": "hosts", ...}` cluster files describe.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Testbed {
    /// How reports name it: the file's `name`, or its stem.
    pub name: String,
    /// Number of hosts.
    pub hosts: usize,
    /// Consecutive ranks per host: ranks `[h * k, (h + 1) * k)` run on host `h`.
    pub ranks_per_host: usize,
    /// The rate of a host's link, each way, in Gbit/s (10^9 bits per second on the wire).
    pub link_gbit: f64,
    /// The share of the link's rate a TCP stream's payload gets (headers take the rest):
    /// 1448 / 1514 for 1500-byte frames with TCP timestamps.
    pub link_payload: f64,
    /// Cost of one message across a link that no bandwidth hides.
    pub link_latency_us: f64,
    /// One core copying through shared memory, GB/s (measured).
    pub memory_gb_s: f64,
    /// One end of a TCP stream on one core, GB/s (measured).
    pub tcp_gb_s: f64,
    /// Cores of a host (of the machine when `shared_cpu`).
    pub cores: usize,
    /// Every host runs on one machine's `cores` (emulated hosts).
    pub shared_cpu: bool,
}

/// Payload share of a 1514-byte Ethernet frame carrying 1448 bytes of TCP payload.
const TCP_PAYLOAD: f64 = 1448.0 / 1514.0;

/// The file, every field optional so that errors can name the missing one.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TestbedFile {
    kind: String,
    name: Option<String>,
    hosts: Option<usize>,
    ranks_per_host: Option<usize>,
    link_gbit: Option<f64>,
    link_payload: Option<f64>,
    link_latency_us: Option<f64>,
    memory_gb_s: Option<f64>,
    tcp_gb_s: Option<f64>,
    cores: Option<usize>,
    shared_cpu: Option<bool>,
}

/// What a plan costs on a testbed, resource by resource.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TestbedCost {
    /// Modeled seconds: the busiest resource's.
    pub seconds: f64,
    /// Seconds of the busiest host link (either way), latency included.
    pub link_s: f64,
    /// Seconds of the busiest rank's core.
    pub rank_cpu_s: f64,
    /// Seconds of the busiest pool of shared cores.
    pub cores_s: f64,
    /// The most bytes into or out of one host.
    pub busiest_link_bytes: u64,
}

impl TestbedCost {
    fn finish(mut self) -> TestbedCost {
        self.seconds = self.link_s.max(self.rank_cpu_s).max(self.cores_s);
        self
    }
}

/// Whether a file's text describes a testbed (`"kind": "hosts"`) rather than a GPU cluster.
pub fn is_testbed(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.get("kind").and_then(|k| k.as_str().map(|s| s == "hosts")))
        .unwrap_or(false)
}

impl Testbed {
    /// Reads a testbed file (see [`Testbed::from_json`]).
    pub fn load(path: &str) -> Result<Testbed, SimError> {
        super::cluster::read_file(path, Testbed::from_json)
    }

    /// `{"kind": "hosts", "hosts": 2, "ranks_per_host": 4, "link_gbit": 2, "memory_gb_s": ..,
    /// "tcp_gb_s": .., "cores": 2, "shared_cpu": true}`; `link_payload` (default 1448/1514)
    /// and `link_latency_us` (default 0) may be left out. Unknown fields are errors.
    ///
    /// ```
    /// use reshard_core::sim::Testbed;
    /// let t = Testbed::from_json(r#"{"kind": "hosts", "hosts": 2, "ranks_per_host": 4,
    ///     "link_gbit": 2, "memory_gb_s": 4, "tcp_gb_s": 1, "cores": 2, "shared_cpu": true}"#,
    ///     "bed").unwrap();
    /// assert_eq!((t.name.as_str(), t.hosts * t.ranks_per_host), ("bed", 8));
    /// assert!(Testbed::from_json(r#"{"kind": "hosts", "hosts": 2}"#, "x").is_err());
    /// ```
    pub fn from_json(text: &str, default_name: &str) -> Result<Testbed, SimError> {
        let file: TestbedFile = serde_json::from_str(text).map_err(|source| SimError::Json {
            path: default_name.to_string(),
            source,
        })?;
        if file.kind != "hosts" {
            return Err(SimError::InvalidField {
                field: "kind",
                value: file.kind,
                reason: "a testbed file has \"kind\": \"hosts\"".into(),
            });
        }
        macro_rules! need {
            ($name:ident) => {
                file.$name.ok_or(SimError::MissingField {
                    field: stringify!($name),
                })?
            };
        }
        let bed = Testbed {
            name: file.name.unwrap_or_else(|| default_name.to_string()),
            hosts: need!(hosts),
            ranks_per_host: need!(ranks_per_host),
            link_gbit: need!(link_gbit),
            link_payload: file.link_payload.unwrap_or(TCP_PAYLOAD),
            link_latency_us: file.link_latency_us.unwrap_or(0.0),
            memory_gb_s: need!(memory_gb_s),
            tcp_gb_s: need!(tcp_gb_s),
            cores: need!(cores),
            shared_cpu: need!(shared_cpu),
        };
        bed.validate()?;
        Ok(bed)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field: &'static str, value: String, reason: &str| {
            Err(SimError::InvalidField {
                field,
                value,
                reason: reason.to_string(),
            })
        };
        for (field, v) in [
            ("hosts", self.hosts),
            ("ranks_per_host", self.ranks_per_host),
            ("cores", self.cores),
        ] {
            if v == 0 || v >= crate::layout::MAX_RANK {
                return bad(field, v.to_string(), "must be between 1 and 2^31");
            }
        }
        if self
            .hosts
            .checked_mul(self.ranks_per_host)
            .is_none_or(|n| n >= crate::layout::MAX_RANK)
        {
            return bad(
                "ranks_per_host",
                self.ranks_per_host.to_string(),
                "hosts x ranks_per_host must be below 2^31",
            );
        }
        for (field, v) in [
            ("link_gbit", self.link_gbit),
            ("memory_gb_s", self.memory_gb_s),
            ("tcp_gb_s", self.tcp_gb_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, v.to_string(), "must be a positive number");
            }
        }
        if !(self.link_payload > 0.0 && self.link_payload <= 1.0) {
            return bad(
                "link_payload",
                self.link_payload.to_string(),
                "must be in (0, 1]",
            );
        }
        if !(self.link_latency_us.is_finite() && self.link_latency_us >= 0.0) {
            return bad(
                "link_latency_us",
                self.link_latency_us.to_string(),
                "must be zero or a positive number",
            );
        }
        Ok(())
    }

    /// The host of every rank: consecutive ranks per host.
    pub fn host_map(&self) -> HostMap {
        HostMap::uniform(self.hosts, self.ranks_per_host).expect("a validated testbed's ranks")
    }

    /// Payload bytes per second of a host's link, each way.
    pub fn link_bytes_s(&self) -> f64 {
        self.link_gbit * 1e9 / 8.0 * self.link_payload
    }

    /// One line for reports.
    pub fn summary(&self) -> String {
        format!(
            "{}: {} hosts x {} ranks, links {} Gbit/s each way, per core {} GB/s through memory and {} GB/s per TCP end, {} cores{}",
            self.name,
            self.hosts,
            self.ranks_per_host,
            self.link_gbit,
            self.memory_gb_s,
            self.tcp_gb_s,
            self.cores,
            if self.shared_cpu {
                " shared by every host"
            } else {
                " per host"
            }
        )
    }

    fn host_of(&self, rank: Rank) -> Result<usize, SimError> {
        let placed = self.hosts * self.ranks_per_host;
        if rank >= placed {
            return Err(SimError::RankOffTestbed { rank, placed });
        }
        Ok(rank / self.ranks_per_host)
    }
}

/// Accumulated work of one plan (or several in a row is not this: see [`price_baseline_on`]).
struct Work {
    link_out: Vec<(u64, u64)>,
    link_in: Vec<(u64, u64)>,
    /// Core-seconds per rank.
    rank_cpu: Vec<f64>,
}

/// Prices `plan` on `bed` (module docs): the busiest of the host links, the ranks' cores and
/// the shared cores.
pub fn price_on_testbed(plan: &Plan, bed: &Testbed) -> Result<TestbedCost, SimError> {
    bed.validate()?;
    let ranks = bed.hosts * bed.ranks_per_host;
    let mut work = Work {
        link_out: vec![(0, 0); bed.hosts],
        link_in: vec![(0, 0); bed.hosts],
        rank_cpu: vec![0.0; ranks],
    };
    let elem = plan.elem_bytes();
    // ranks that take part in a relay receive their same-host bytes through a ring
    let mut relaying = vec![false; ranks];
    for t in plan.transfers().iter().filter(|t| t.via.is_some()) {
        for r in [t.src, t.dst, t.sender()] {
            bed.host_of(r)?;
            relaying[r] = true;
        }
    }
    let memory = 1.0 / (bed.memory_gb_s * 1e9);
    let tcp = 1.0 / (bed.tcp_gb_s * 1e9);
    for t in plan.transfers() {
        let (from, to) = (t.sender(), t.dst);
        let (hf, ht) = (bed.host_of(from)?, bed.host_of(to)?);
        let bytes = t.bytes(elem);
        let b = bytes as f64;
        if from == to {
            work.rank_cpu[from] += b * memory;
        } else if hf == ht {
            work.rank_cpu[from] += b * memory;
            if relaying[to] {
                work.rank_cpu[to] += b * memory;
            }
        } else {
            work.rank_cpu[from] += b * tcp;
            work.rank_cpu[to] += b * tcp;
            let add = |slot: &mut (u64, u64)| {
                slot.0 = slot.0.saturating_add(bytes);
                slot.1 += 1;
            };
            add(&mut work.link_out[hf]);
            add(&mut work.link_in[ht]);
        }
    }
    Ok(cost_of(&work, bed))
}

fn cost_of(work: &Work, bed: &Testbed) -> TestbedCost {
    let rate = bed.link_bytes_s();
    let latency = bed.link_latency_us * 1e-6;
    let mut cost = TestbedCost::default();
    for &(bytes, messages) in work.link_out.iter().chain(&work.link_in) {
        cost.link_s = cost
            .link_s
            .max(bytes as f64 / rate + messages as f64 * latency);
        cost.busiest_link_bytes = cost.busiest_link_bytes.max(bytes);
    }
    cost.rank_cpu_s = work.rank_cpu.iter().copied().fold(0.0, f64::max);
    let cores = bed.cores as f64;
    cost.cores_s = if bed.shared_cpu {
        work.rank_cpu.iter().sum::<f64>() / cores
    } else {
        work.rank_cpu
            .chunks(bed.ranks_per_host)
            .map(|host| host.iter().sum::<f64>() / cores)
            .fold(0.0, f64::max)
    };
    cost.finish()
}

/// Prices gather+broadcast on `bed`: its gather, then its broadcast (each as
/// [`price_on_testbed`]), then each destination rank's copy of its box out of the whole
/// tensor, one after the other. Link bytes are the busiest link's over both phases.
pub fn price_baseline_on(gb: &GatherBroadcast, bed: &Testbed) -> Result<TestbedCost, SimError> {
    let mut total = TestbedCost::default();
    for phase in [&gb.gather, &gb.broadcast].into_iter().flatten() {
        let c = price_on_testbed(phase, bed)?;
        total.seconds += c.seconds;
        total.link_s += c.link_s;
        total.rank_cpu_s += c.rank_cpu_s;
        total.cores_s += c.cores_s;
    }
    total.busiest_link_bytes = gb.host_links().map_or(0, |l| l.busiest());
    // the keep: every destination rank copies its box out of the whole tensor
    let dst = gb.dst();
    let mut keep = Work {
        link_out: Vec::new(),
        link_in: Vec::new(),
        rank_cpu: vec![0.0; bed.hosts * bed.ranks_per_host],
    };
    for &r in dst.mesh().ranks() {
        bed.host_of(r)?;
        keep.rank_cpu[r] += dst.local_bytes(r) as f64 / (bed.memory_gb_s * 1e9);
    }
    let k = cost_of(&keep, bed);
    total.seconds += k.seconds;
    total.rank_cpu_s += k.rank_cpu_s;
    total.cores_s += k.cores_s;
    Ok(total)
}

#[cfg(test)]
mod tests;
