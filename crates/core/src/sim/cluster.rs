//! A cluster as the cost model sees it: link bandwidths and latencies, and where ranks sit.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::SimError;
use crate::layout::{MAX_RANK, Rank};

/// The hardware a plan is priced on. Bandwidths are per GPU and per direction, in GB/s
/// (10^9 bytes per second); latencies are in microseconds.
///
/// Fields are public so that a caller can adjust a preset; [`super::price`] validates them
/// (with [`Cluster::validate`]) before using them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Cluster {
    /// How reports name it: `h100`, `gb200`, or the `name` of a cluster file.
    pub name: String,
    /// GPUs in one server (one compute tray of an NVL72 rack).
    pub gpus_per_node: usize,
    /// GPUs that reach each other over NVLink: consecutive GPU numbers
    /// `[k * nvlink_domain, (k + 1) * nvlink_domain)` form domain `k`.
    pub nvlink_domain: usize,
    /// NVLink bandwidth of one GPU, each way.
    pub nvlink_gb_s: f64,
    /// Network (NIC) bandwidth of one GPU, each way.
    pub nic_gb_s: f64,
    /// Memory (HBM) bandwidth of one GPU: what local copies use.
    pub memory_gb_s: f64,
    /// Cost of one message over NVLink that no bandwidth hides.
    pub nvlink_latency_us: f64,
    /// Cost of one message over the network that no bandwidth hides.
    pub net_latency_us: f64,
    /// The slice a pipelined broadcast forwards at a time.
    pub broadcast_chunk_bytes: u64,
    /// `ranks[r]` is the GPU rank `r` runs on; empty: rank `r` runs on GPU `r` (ranks packed
    /// node by node). Several ranks may share a GPU (training and inference processes of a
    /// colocated job).
    pub ranks: Vec<usize>,
}

/// The three kinds of path between two ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Link {
    /// Both ranks on one GPU: a copy through its memory.
    Memory,
    /// Different GPUs of one NVLink domain.
    Nvlink,
    /// GPUs in different NVLink domains: through both GPUs' NICs.
    Network,
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Link::Memory => "memory",
            Link::Nvlink => "NVLink",
            Link::Network => "network",
        })
    }
}

/// The names `--simulate` accepts besides a file.
pub const PRESETS: [&str; 2] = ["h100", "gb200"];

/// Reads the JSON file at `path` with `parse`, which takes the text and the name a file
/// without one goes by (the file's stem); a JSON error names the path.
pub(super) fn read_file<T>(
    path: &str,
    parse: impl FnOnce(&str, &str) -> Result<T, SimError>,
) -> Result<T, SimError> {
    let text = std::fs::read_to_string(path).map_err(|source| SimError::Read {
        path: path.to_string(),
        source,
    })?;
    let stem = Path::new(path)
        .file_stem()
        .map_or_else(|| path.to_string(), |s| s.to_string_lossy().into_owned());
    parse(&text, &stem).map_err(|e| match e {
        SimError::Json { source, .. } => SimError::Json {
            path: path.to_string(),
            source,
        },
        other => other,
    })
}

impl Cluster {
    /// DGX H100 / HGX H100 servers on an InfiniBand fabric.
    ///
    /// - 8 GPUs per server, all in one NVLink domain (NVSwitch): NVLink 4 gives each H100 SXM5
    ///   900 GB/s in both directions together, 450 GB/s each way (H100 datasheet; DGX H100
    ///   user guide);
    /// - 8 ConnectX-7 adapters at 400 Gb/s (NDR InfiniBand) per server, one per GPU: 50 GB/s
    ///   each way per GPU (DGX H100 user guide, network modules);
    /// - HBM3 at 3.35 TB/s per GPU (H100 SXM5 datasheet).
    ///
    /// ```
    /// let h100 = reshard_core::sim::Cluster::h100();
    /// assert_eq!((h100.nvlink_domain, h100.nic_gb_s), (8, 50.0));
    /// ```
    pub fn h100() -> Cluster {
        Cluster {
            name: "h100".into(),
            gpus_per_node: 8,
            nvlink_domain: 8,
            nvlink_gb_s: 450.0,
            nic_gb_s: 50.0,
            memory_gb_s: 3350.0,
            nvlink_latency_us: 5.0,
            net_latency_us: 10.0,
            broadcast_chunk_bytes: 512 << 10,
            ranks: Vec::new(),
        }
    }

    /// GB200 NVL72 racks on an InfiniBand fabric.
    ///
    /// - 72 Blackwell GPUs per rack in one NVLink domain (9 NVSwitch trays, 130 TB/s in
    ///   total); NVLink 5 gives each GPU 1.8 TB/s in both directions, 900 GB/s each way
    ///   (GB200 NVL72 product page and datasheet);
    /// - 18 compute trays of 4 GPUs (2 GB200 superchips) each;
    /// - one ConnectX-7 at 400 Gb/s per GPU: 50 GB/s each way. The GB200 NVL72 reference
    ///   design ships ConnectX-7 (400 Gb/s); the 800 Gb/s ConnectX-8 SuperNIC comes with
    ///   GB300 NVL72. A cluster file with `"base": "gb200", "nic_gb_s": 100` models the latter;
    /// - HBM3e at 8 TB/s per GPU (GB200 datasheet: 576 TB/s for 72 GPUs).
    pub fn gb200() -> Cluster {
        Cluster {
            name: "gb200".into(),
            gpus_per_node: 4,
            nvlink_domain: 72,
            nvlink_gb_s: 900.0,
            nic_gb_s: 50.0,
            memory_gb_s: 8000.0,
            nvlink_latency_us: 5.0,
            net_latency_us: 10.0,
            broadcast_chunk_bytes: 512 << 10,
            ranks: Vec::new(),
        }
    }

    /// A preset by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Option<Cluster> {
        match name {
            "h100" => Some(Cluster::h100()),
            "gb200" => Some(Cluster::gb200()),
            _ => None,
        }
    }

    /// What `--simulate` accepts: a preset name or the path of a cluster file.
    pub fn load(arg: &str) -> Result<Cluster, SimError> {
        if let Some(c) = Cluster::preset(arg) {
            return Ok(c);
        }
        read_file(arg, Cluster::from_json)
    }

    /// A cluster file: every field of [`Cluster`] by name, or `"base": "h100"` (or `"gb200"`)
    /// and the fields that differ from it. `default_name` names it when the file has no
    /// `name`. Unknown fields are errors, so a misspelt field never passes silently.
    ///
    /// ```
    /// use reshard_core::sim::Cluster;
    /// let slow = Cluster::from_json(r#"{"base": "h100", "nic_gb_s": 25}"#, "slow").unwrap();
    /// assert_eq!((slow.name.as_str(), slow.nic_gb_s, slow.nvlink_gb_s), ("slow", 25.0, 450.0));
    /// let typo = Cluster::from_json(r#"{"base": "h100", "nic_gbs": 25}"#, "x").unwrap_err();
    /// assert!(typo.to_string().contains("nic_gbs"));
    /// ```
    pub fn from_json(text: &str, default_name: &str) -> Result<Cluster, SimError> {
        let file: ClusterFile = serde_json::from_str(text).map_err(|source| SimError::Json {
            path: default_name.to_string(),
            source,
        })?;
        let base = match &file.base {
            None => None,
            Some(b) => Some(Cluster::preset(b).ok_or_else(|| SimError::InvalidField {
                field: "base",
                value: b.clone(),
                reason: "not a preset (expected h100 or gb200)".into(),
            })?),
        };
        macro_rules! field {
            ($name:ident) => {
                match (file.$name, &base) {
                    (Some(v), _) => v,
                    (None, Some(b)) => b.$name.clone(),
                    (None, None) => {
                        return Err(SimError::MissingField {
                            field: stringify!($name),
                        })
                    }
                }
            };
        }
        let cluster = Cluster {
            name: file.name.unwrap_or_else(|| default_name.to_string()),
            gpus_per_node: field!(gpus_per_node),
            nvlink_domain: field!(nvlink_domain),
            nvlink_gb_s: field!(nvlink_gb_s),
            nic_gb_s: field!(nic_gb_s),
            memory_gb_s: field!(memory_gb_s),
            nvlink_latency_us: field!(nvlink_latency_us),
            net_latency_us: field!(net_latency_us),
            broadcast_chunk_bytes: field!(broadcast_chunk_bytes),
            ranks: file.ranks.unwrap_or_default(),
        };
        cluster.validate()?;
        Ok(cluster)
    }

    /// Checks every field; the error names the first bad one and its value.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field: &'static str, value: String, reason: &str| {
            Err(SimError::InvalidField {
                field,
                value,
                reason: reason.to_string(),
            })
        };
        if self.gpus_per_node == 0 {
            return bad("gpus_per_node", "0".into(), "must be at least 1");
        }
        if self.nvlink_domain == 0 || !self.nvlink_domain.is_multiple_of(self.gpus_per_node) {
            return bad(
                "nvlink_domain",
                self.nvlink_domain.to_string(),
                &format!(
                    "must be a positive multiple of gpus_per_node ({})",
                    self.gpus_per_node
                ),
            );
        }
        let rates = [
            ("nvlink_gb_s", self.nvlink_gb_s),
            ("nic_gb_s", self.nic_gb_s),
            ("memory_gb_s", self.memory_gb_s),
        ];
        for (field, v) in rates {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, v.to_string(), "must be a positive number of GB/s");
            }
        }
        let latencies = [
            ("nvlink_latency_us", self.nvlink_latency_us),
            ("net_latency_us", self.net_latency_us),
        ];
        for (field, v) in latencies {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, v.to_string(), "must be zero or a positive number");
            }
        }
        if self.broadcast_chunk_bytes == 0 {
            return bad("broadcast_chunk_bytes", "0".into(), "must be at least 1");
        }
        if let Some((r, &g)) = self.ranks.iter().enumerate().find(|(_, g)| **g >= MAX_RANK) {
            return bad(
                "ranks",
                format!("[{r}] = {g}"),
                "GPU numbers must be below 2^31",
            );
        }
        Ok(())
    }

    /// The GPU `rank` runs on.
    pub fn gpu(&self, rank: Rank) -> Result<usize, SimError> {
        if self.ranks.is_empty() {
            return Ok(rank);
        }
        self.ranks
            .get(rank)
            .copied()
            .ok_or(SimError::RankNotPlaced {
                rank,
                placed: self.ranks.len(),
            })
    }

    /// The NVLink domain of each of ranks `0..ranks` as a host map (domains numbered in the
    /// order of their first rank): what a topology-aware plan relays by on this cluster.
    ///
    /// ```
    /// let map = reshard_core::sim::Cluster::h100().domain_map(20).unwrap();
    /// assert_eq!((map.num_hosts(), map.host_of(7), map.host_of(8)), (3, 0, 1));
    /// ```
    pub fn domain_map(&self, ranks: usize) -> Result<crate::topology::HostMap, SimError> {
        let domains = (0..ranks)
            .map(|r| self.gpu(r).map(|g| self.domain(g)))
            .collect::<Result<Vec<usize>, SimError>>()?;
        let mut dense: rustc_hash::FxHashMap<usize, usize> = Default::default();
        let hosts: Vec<usize> = domains
            .iter()
            .map(|d| {
                let next = dense.len();
                *dense.entry(*d).or_insert(next)
            })
            .collect();
        crate::topology::HostMap::from_indices(&hosts).map_err(|e| SimError::InvalidField {
            field: "ranks",
            value: format!("{ranks} ranks"),
            reason: e.to_string(),
        })
    }

    /// The NVLink domain of a GPU.
    pub fn domain(&self, gpu: usize) -> usize {
        gpu / self.nvlink_domain
    }

    /// The path between two GPUs.
    pub fn link(&self, a_gpu: usize, b_gpu: usize) -> Link {
        if a_gpu == b_gpu {
            Link::Memory
        } else if self.domain(a_gpu) == self.domain(b_gpu) {
            Link::Nvlink
        } else {
            Link::Network
        }
    }

    /// Bytes per second one GPU moves over `link`, each way. A local copy reads and writes
    /// every byte, so it gets half the memory bandwidth.
    pub fn bandwidth(&self, link: Link) -> f64 {
        1e9 * match link {
            Link::Memory => self.memory_gb_s / 2.0,
            Link::Nvlink => self.nvlink_gb_s,
            Link::Network => self.nic_gb_s,
        }
    }

    /// Seconds one message over `link` costs beyond its bytes. Local copies are batched into
    /// one kernel per tensor, so they cost none.
    pub fn latency(&self, link: Link) -> f64 {
        1e-6 * match link {
            Link::Memory => 0.0,
            Link::Nvlink => self.nvlink_latency_us,
            Link::Network => self.net_latency_us,
        }
    }

    /// One line for reports: the preset's shape and speeds.
    pub fn summary(&self) -> String {
        format!(
            "{}: NVLink domains of {} GPUs at {} GB/s, NIC {} GB/s, memory {} GB/s per GPU",
            self.name, self.nvlink_domain, self.nvlink_gb_s, self.nic_gb_s, self.memory_gb_s
        )
    }
}

/// A cluster file as written: every field optional, so that errors can say which is missing.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    base: Option<String>,
    name: Option<String>,
    gpus_per_node: Option<usize>,
    nvlink_domain: Option<usize>,
    nvlink_gb_s: Option<f64>,
    nic_gb_s: Option<f64>,
    memory_gb_s: Option<f64>,
    nvlink_latency_us: Option<f64>,
    net_latency_us: Option<f64>,
    broadcast_chunk_bytes: Option<u64>,
    ranks: Option<Vec<usize>>,
}
