//! What `run` and `bench` share: the transport choice and executor options, and the set-up of
//! one rank of a multi-process job (world check, memory check, links).

use std::collections::BTreeSet;
use std::time::Duration;

use clap::{Args, ValueEnum};

use reshard::agreement::Fingerprint;
use reshard::exec::ExecOptions;
use reshard::transport::group::{Group, GroupEnv};
use reshard::transport::segment::SharedBuffer;
use reshard::transport::shm::{Carrier, ShmTransport};
use reshard::transport::tcp::TcpTransport;
use reshard::transport::{Job, Transport};
use reshard::{Error, Plan, Rank, Region};

use super::Failure;
use super::units::{bytes, parse_bytes};

/// Which transport moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// Every rank a thread of this process; receivers copy straight from the senders' shards.
    Local,
    /// Processes and hosts over TCP (under `reshard launch`, `mpirun`, or hand-set RANK,
    /// WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    Tcp,
    /// Processes on one host: senders write straight into the receivers' shards in shared
    /// memory (or through shared-memory rings); notices over TCP, or over MPI under mpirun.
    Shm,
    /// The site's MPI for every peer, under mpirun (build with `--features mpi`).
    Mpi,
    /// The best transport for where the ranks are: local in one process; between processes,
    /// shm for peers on the same host and tcp for the others, or, under mpirun when built
    /// with MPI and no MASTER_PORT is set, mpi for the others.
    Auto,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Local => "local",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
            TransportKind::Auto => "auto",
        }
    }
}

/// How the bytes move: the transport and the executor's knobs.
#[derive(Args, Debug, Clone)]
pub struct ExecArgs {
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: TransportKind,
    /// Largest chunk a transfer is cut into.
    #[arg(long, value_name = "BYTES", default_value = "4MiB")]
    chunk_bytes: String,
    /// Bound on the staging memory of one rank.
    #[arg(long, value_name = "BYTES", default_value = "64MiB")]
    staging_bytes: String,
    /// Seconds a rank waits for a peer before failing.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 60.0,
        allow_hyphen_values = true
    )]
    timeout: f64,
    /// Checksum every transfer: its sender sums each chunk (CRC-32C) as it sends it, its
    /// receiver checks what landed, and a difference fails the job naming the transfer.
    #[arg(long)]
    pub checksum: bool,
}

impl ExecArgs {
    /// `fingerprint` with what the executor's options add to a job: the transport, the
    /// chunking, the staging bound and whether transfers are checksummed (the timeout may differ between ranks).
    pub fn agreed(&self, options: &ExecOptions, fingerprint: Fingerprint) -> Fingerprint {
        fingerprint
            .with("--transport", self.transport.name())
            .with("--chunk-bytes", options.chunk_bytes)
            .with("--staging-bytes", options.staging_bytes)
            .with("--checksum", options.checksum)
    }

    pub fn options(&self) -> Result<ExecOptions, Error> {
        let chunk = parse_bytes("--chunk-bytes", &self.chunk_bytes)?;
        let staging = parse_bytes("--staging-bytes", &self.staging_bytes)?;
        if !(self.timeout.is_finite() && self.timeout >= 1e-3 && self.timeout < 1e9) {
            return Err(Error::InvalidOption {
                field: "--timeout",
                value: self.timeout.to_string(),
                reason: "expected a number of seconds between 0.001 and 1e9".into(),
            });
        }
        let options = ExecOptions {
            chunk_bytes: usize::try_from(chunk).unwrap_or(usize::MAX),
            staging_bytes: usize::try_from(staging).unwrap_or(usize::MAX),
            timeout: Duration::from_secs_f64(self.timeout),
            checksum: self.checksum,
        };
        options.validate()?;
        Ok(options)
    }
}

/// `fingerprint` with a plan's tensor (`prefix` tells the tensors of a suite apart): shape,
/// dtype, both layouts as resolved, and the planning option.
pub fn with_plan(fingerprint: Fingerprint, prefix: &str, plan: &Plan) -> Fingerprint {
    let shape: Vec<String> = plan.src().shape().iter().map(u64::to_string).collect();
    fingerprint
        .with(format!("{prefix}--shape"), shape.join(","))
        .with(format!("{prefix}--dtype"), plan.src().dtype())
        .with(format!("{prefix}--dst-dtype"), plan.dst().dtype())
        .with_layout(&format!("{prefix}--src"), plan.src())
        .with_layout(&format!("{prefix}--dst"), plan.dst())
        .with(
            format!("{prefix}--min-split-bytes"),
            plan.options().min_split_bytes,
        )
}

/// Whichever transport a multi-process run uses.
pub type AnyTransport<'a> = Box<dyn for<'b> Transport<'b> + 'a>;

/// This rank's destination buffer in shared memory, and its box, when it has one: same-host
/// senders may write straight into it.
pub type Destination<'a> = Option<(&'a SharedBuffer, &'a Region)>;

/// The peers one rank exchanges data with, in each direction.
#[derive(Clone, Debug, Default)]
pub struct Links {
    pub senders: BTreeSet<Rank>,
    pub receivers: BTreeSet<Rank>,
}

impl Links {
    pub fn peers(&self) -> BTreeSet<Rank> {
        self.senders.union(&self.receivers).copied().collect()
    }
}

/// Opens this rank's links for `kind` (tcp, shm or auto) to `links`' peers. Every rank of the
/// job must call it at the same point (it connects to peers and waits for them).
pub fn connect<'g>(
    kind: TransportKind,
    group: &'g Group,
    links: &Links,
    destination: Destination<'_>,
    options: &ExecOptions,
) -> Result<AnyTransport<'g>, Error> {
    let peers = links.peers();
    let tcp = TcpTransport::new(group.rank(), group.connect_peers(&peers)?, options.timeout)?;
    if kind == TransportKind::Tcp {
        return Ok(Box::new(tcp));
    }
    let near = |p: Rank| group.same_host(p).then(|| group.pid(p));
    let shm = over_shm(kind, tcp, links, near, destination, options, "tcp")?;
    Ok(Box::new(shm))
}

/// Opens this rank's links for `kind` in an MPI job: MPI itself for `mpi`; for `auto` (and
/// `shm`, where every peer must be on this host) shared memory for the peers on this host and
/// MPI for the others. `layouts` are every tensor the links will move. Every rank of the job
/// must call it at the same point.
#[cfg(feature = "mpi")]
pub fn connect_mpi<'j, 'l>(
    kind: TransportKind,
    job: &'j reshard::transport::mpi::MpiJob,
    layouts: impl IntoIterator<Item = &'l reshard::Layout>,
    links: &Links,
    destination: Destination<'_>,
    options: &ExecOptions,
) -> Result<AnyTransport<'j>, Error> {
    let mpi = job.transport(layouts);
    let neighbours = job.same_host_peers();
    // what every rank decides alike, so that none waits on a rank that stopped here
    if kind == TransportKind::Shm && neighbours.len() + 1 < job.world() {
        return Err(Error::InvalidOption {
            field: "--transport",
            value: "shm".into(),
            reason: "the ranks of this job run on more than one host; use mpi or auto".into(),
        });
    }
    let near = |p: Rank| neighbours.get(&p).copied();
    let alone = links.peers().iter().all(|&p| near(p).is_none());
    if kind == TransportKind::Mpi || (kind == TransportKind::Auto && alone) {
        return Ok(Box::new(mpi));
    }
    match over_shm(kind, mpi, links, near, destination, options, "mpi") {
        Ok(shm) => Ok(Box::new(shm)),
        // the peers wait on this rank in MPI calls that no timeout ends: end the job
        Err(e) => job.abort(&e),
    }
}

/// `carrier` with the peers for which `near` gives a process id (those on this host) moved
/// to shared memory. With `--transport shm`, a peer elsewhere is an error that suggests
/// `other` (the carrier's own transport) or auto.
fn over_shm<C: Carrier>(
    kind: TransportKind,
    carrier: C,
    links: &Links,
    near: impl Fn(Rank) -> Option<u32>,
    destination: Destination<'_>,
    options: &ExecOptions,
    other: &str,
) -> Result<ShmTransport<C>, Error> {
    let peers = links.peers();
    if let (TransportKind::Shm, Some(&far)) = (kind, peers.iter().find(|&&p| near(p).is_none())) {
        return Err(Error::InvalidOption {
            field: "--transport",
            value: "shm".into(),
            reason: format!("rank {far} runs on another host; use {other} or auto"),
        });
    }
    let near = peers.iter().filter_map(|&p| near(p).map(|pid| (p, pid)));
    let mut shm = ShmTransport::new(
        carrier,
        near.collect(),
        options.staging_bytes,
        options.timeout,
    );
    // RESHARD_SHM_DIRECT=0 keeps senders out of the receivers' shards: rings only
    let direct = std::env::var("RESHARD_SHM_DIRECT").map_or(true, |v| v != "0");
    let destination = destination.filter(|_| direct);
    shm.exchange_destinations(destination, &links.senders, &links.receivers)?;
    Ok(shm)
}

/// The plan agreement at rendezvous ([`Job::agree`]): this rank's fingerprint, or, when its
/// own checks (`ready`) failed, its refusal, so that every rank fails at once naming it
/// instead of waiting for it until the timeout. A rank that refused returns its own error.
pub fn agree_or_refuse<J: Job>(
    job: &J,
    command: &str,
    ready: Result<(), Error>,
    fingerprint: impl FnOnce() -> Fingerprint,
) -> Result<(), Error> {
    match ready {
        Ok(()) => job.agree(&fingerprint()),
        Err(e) => {
            let _ = job.agree(&Fingerprint::refusal(command, &e));
            Err(e)
        }
    }
}

/// Checks that the job has a process for every rank the layouts use (`highest`).
pub fn check_world(highest: Rank, world: usize) -> Result<(), Error> {
    if highest >= world {
        return Err(Error::Env {
            var: "WORLD_SIZE",
            value: world.to_string(),
            reason: format!(
                "the layouts use ranks up to {highest}, so the job needs at least {} processes",
                highest + 1
            ),
        });
    }
    Ok(())
}

/// Refuses a run whose buffers (`needed` bytes) cannot fit in this machine's available memory,
/// instead of letting the allocator abort half-way. `shape` names the tensor in the error.
pub fn check_memory(needed: u64, shape: &[u64]) -> Result<(), Error> {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    match available {
        Some(available) if needed > available => Err(Error::InvalidOption {
            field: "--shape",
            value: shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            reason: format!(
                "running it here needs {} of buffers, but only {} of memory is available",
                bytes(needed),
                bytes(available)
            ),
        }),
        _ => Ok(()),
    }
}

/// Whether this process was started by OpenMPI's or another PMI launcher.
pub fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Whether this process runs as a rank of an MPI job for `kind`: always for `mpi`, and for
/// `auto` and `shm` when `mpirun` started it (in a build with MPI) and no rendezvous of our
/// own (`env`) is set.
pub fn in_mpi_job(kind: TransportKind, env: Option<&GroupEnv>) -> bool {
    kind == TransportKind::Mpi
        || (env.is_none()
            && cfg!(feature = "mpi")
            && under_mpirun()
            && matches!(kind, TransportKind::Auto | TransportKind::Shm))
}

/// The error for a multi-process transport started as a lone process.
pub fn not_in_a_job(kind: TransportKind) -> Error {
    Error::InvalidOption {
        field: "--transport",
        value: kind.name().into(),
        reason: "it runs one rank per process: start it with `reshard launch --nproc N -- \
                 run ...`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (also \
                 under mpirun, with -x)"
            .into(),
    }
}

/// The error for `--transport mpi` in a build without MPI.
#[cfg(not(feature = "mpi"))]
pub fn no_mpi() -> Error {
    Error::InvalidOption {
        field: "--transport",
        value: "mpi".into(),
        reason: "this reshard was built without MPI; build it with `cargo build --release --features mpi` \
                 (needs an MPI library such as Debian's libopenmpi-dev, and libclang-dev)"
            .into(),
    }
}

/// Seconds of `times`: (median, min, max).
pub fn spread(times: &[f64]) -> (f64, f64, f64) {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    (
        sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
        sorted.first().copied().unwrap_or(0.0),
        sorted.last().copied().unwrap_or(0.0),
    )
}

/// Timings and counts of one method over the repetitions: one rank's, or the job's.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub times: Vec<f64>,
    pub wire_bytes: u64,
    pub peak_extra: u64,
}

impl Measured {
    /// Runs one repetition of a method from a barrier, so that every rank starts together,
    /// and keeps its time and counts when `timed`; `extra` is memory the method holds besides
    /// its transport's staging.
    pub fn repeat<J: Job>(
        &mut self,
        job: &J,
        timed: bool,
        extra: u64,
        run: impl FnOnce() -> Result<reshard::exec::RankStats, Error>,
    ) -> Result<(), Error> {
        job.barrier()?;
        let started = std::time::Instant::now();
        let stats = run()?;
        if timed {
            self.times.push(started.elapsed().as_secs_f64());
            self.wire_bytes = stats.bytes_received;
            self.peak_extra = stats.peak_staging_bytes.saturating_add(extra);
        }
        Ok(())
    }

    /// This rank's measurements, for rank 0.
    pub fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "times": self.times,
            "wire_bytes": self.wire_bytes,
            "peak_extra": self.peak_extra,
        })
    }

    /// The job's measurements from every rank's [`Measured::report`]: per repetition the
    /// slowest rank's time, the bytes every rank received, the largest extra memory.
    pub fn combine(per_rank: &[&serde_json::Value]) -> Measured {
        let repetitions = per_rank
            .first()
            .and_then(|v| v["times"].as_array())
            .map_or(0, Vec::len);
        let u = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
        Measured {
            times: (0..repetitions)
                .map(|i| {
                    per_rank
                        .iter()
                        .map(|v| v["times"][i].as_f64().unwrap_or(0.0))
                        .fold(0.0, f64::max)
                })
                .collect(),
            wire_bytes: per_rank.iter().map(|v| u(v, "wire_bytes")).sum(),
            peak_extra: per_rank
                .iter()
                .map(|v| u(v, "peak_extra"))
                .max()
                .unwrap_or(0),
        }
    }
}

/// The two methods `bench` and `refit --run` compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Reshard,
    GatherBroadcast,
}

impl Method {
    /// The order of the two in repetition `i`: each goes first every other time, so that
    /// neither always inherits the machine from the other.
    pub fn order(i: u32) -> [Method; 2] {
        if i.is_multiple_of(2) {
            [Method::Reshard, Method::GatherBroadcast]
        } else {
            [Method::GatherBroadcast, Method::Reshard]
        }
    }
}

/// One method's line of a bench or refit report.
#[derive(Debug, serde::Serialize)]
pub struct MethodJson {
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    pub wire_bytes: u64,
    pub gbps: f64,
    pub peak_extra_bytes_per_rank: u64,
}

impl MethodJson {
    /// The summary of `m`, with GB/s of `dst_bytes` of destination data.
    pub fn of(m: &Measured, dst_bytes: u64) -> MethodJson {
        let (median_s, min_s, max_s) = spread(&m.times);
        MethodJson {
            median_s,
            min_s,
            max_s,
            wire_bytes: m.wire_bytes,
            gbps: dst_bytes as f64 / median_s.max(1e-12) / 1e9,
            peak_extra_bytes_per_rank: m.peak_extra,
        }
    }
}

/// What rank 0 hears from every rank at the end of a job.
pub struct Reports {
    /// Every rank's report, indexed by rank.
    pub ranks: Vec<serde_json::Value>,
}

impl Reports {
    /// The transport the ranks name in their reports' `transport` field.
    pub fn transport(&self) -> String {
        self.ranks
            .first()
            .and_then(|r| r["transport"].as_str())
            .unwrap_or("?")
            .to_string()
    }
}

/// Ends this rank's part of a job: prints its own failure, hands its report (or the failure)
/// to rank 0's verdict, and returns every rank's report on rank 0, `None` on the others.
pub fn conclude<J: Job>(
    job: &J,
    outcome: Result<serde_json::Value, Error>,
) -> Result<Option<Reports>, Failure> {
    if let Err(e) = &outcome {
        eprintln!("error: {e}");
        if matches!(e, Error::JobFailed { .. }) {
            // the verdict is already out: rank 0 told everyone at the barrier
            return Err(Failure::Run(outcome.unwrap_err()));
        }
    }
    let ranks = job.finish(outcome.map_err(|e| e.to_string()))?;
    Ok((job.rank() == 0).then_some(Reports { ranks }))
}
