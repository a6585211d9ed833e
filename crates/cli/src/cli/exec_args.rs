//! The transport and executor options `run`, `bench` and `refit --run` share, as typed: which
//! transport, its timeouts, chunking and staging, joining the job with them, what the ranks
//! must agree on, and the memory check before any buffer is allocated.

use std::time::Duration;

use clap::{Args, ValueEnum};

use reshard::agreement::Fingerprint;
use reshard::error::Field;
use reshard::exec::ExecOptions;
use reshard::runtime::{self, JoinOptions, RunOptions, World};
use reshard::{Error, Plan};

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
        self.runtime().name()
    }

    /// The library's name for the same choice.
    pub fn runtime(self) -> runtime::TransportKind {
        match self {
            TransportKind::Local => runtime::TransportKind::Local,
            TransportKind::Tcp => runtime::TransportKind::Tcp,
            TransportKind::Shm => runtime::TransportKind::Shm,
            TransportKind::Mpi => runtime::TransportKind::Mpi,
            TransportKind::Auto => runtime::TransportKind::Auto,
        }
    }
}

/// How the bytes move: the transport and the executor's knobs.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Transport")]
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
        let chunk = parse_bytes(Field::ChunkBytes, &self.chunk_bytes)?;
        let staging = parse_bytes(Field::Flag("--staging-bytes"), &self.staging_bytes)?;
        if !(self.timeout.is_finite() && self.timeout >= 1e-3 && self.timeout < 1e9) {
            return Err(Error::InvalidOption {
                field: Field::Timeout,
                value: self.timeout.to_string(),
                reason: "expected a number of seconds between 0.001 and 1e9".into(),
            });
        }
        let options = ExecOptions {
            chunk_bytes: usize::try_from(chunk).unwrap_or(usize::MAX),
            staging_bytes: usize::try_from(staging).unwrap_or(usize::MAX),
            timeout: Duration::from_secs_f64(self.timeout),
            checksum: self.checksum,
            delta: None,
            stage: None,
        };
        options.validate()?;
        Ok(options)
    }

    /// Joins the job the environment describes, with the transport options of `options`
    /// (from [`ExecArgs::options`]).
    pub fn join(&self, options: &ExecOptions) -> Result<World, Error> {
        World::join(JoinOptions {
            transport: self.transport.runtime(),
            timeout: options.timeout,
            staging_bytes: options.staging_bytes,
            token: None,
        })
    }
}

/// The per-run part of the executor's options.
pub fn run_options(options: &ExecOptions) -> RunOptions {
    RunOptions {
        chunk_bytes: options.chunk_bytes,
        checksum: options.checksum,
        delta: options.delta.clone(),
        stage: options.stage.clone(),
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
        .with(
            format!("{prefix}--quant"),
            plan.quant()
                .map_or("none".to_string(), |q| q.quant.scheme.to_string()),
        )
        .with(
            format!("{prefix}--scale-dtype"),
            plan.quant()
                .map_or("none".to_string(), |q| q.quant.scale_dtype.to_string()),
        )
        .with(
            format!("{prefix}--hosts"),
            plan.topology()
                .map_or("(none)".to_string(), |t| t.hosts.to_string()),
        )
        .with(
            format!("{prefix}--relay"),
            plan.topology()
                .map_or("(none)", |t| if t.relay { "on" } else { "off" }),
        )
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
            field: Field::Shape,
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
