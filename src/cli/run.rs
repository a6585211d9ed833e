//! `reshard run`: execute a reshard on filled buffers; verify and dump the result.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};

use std::time::Instant;

use reshard::exec::{self, ExecOptions, RankJob};
use reshard::fill::Fill;
use reshard::transport::group::{Group, GroupEnv};
use reshard::transport::segment::SharedBuffer;
use reshard::transport::shm::ShmTransport;
use reshard::transport::tcp::TcpTransport;
use reshard::transport::{Job, Transport};
use reshard::{Error, Plan, Rank};
use reshard::{RankPlan, Region};
use serde::Serialize;

use super::units::{bytes, parse_bytes};
use super::{Failure, TensorArgs};

/// Which transport moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// Every rank a thread of this process; receivers copy straight from the senders' shards.
    Local,
    /// Processes and hosts over TCP (under `reshard launch`, `mpirun`, or hand-set RANK,
    /// WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    Tcp,
    /// Processes on one host: receivers copy straight from the senders' memory
    /// (cross-memory attach), control over TCP.
    Shm,
    /// The site's MPI, under mpirun (build with `--features mpi`).
    Mpi,
    /// The best transport for where the ranks are: local in one process; between processes,
    /// shm for peers on the same host and tcp for the others; mpi under mpirun when built
    /// with MPI and no MASTER_PORT is set.
    Auto,
}

impl TransportKind {
    fn name(self) -> &'static str {
        match self {
            TransportKind::Local => "local",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
            TransportKind::Auto => "auto",
        }
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    tensor: TensorArgs,
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportKind,
    /// Contents of the global tensor: index (element i holds i mod 2^bits), hash or hash:SEED.
    #[arg(long, default_value = "index")]
    fill: String,
    /// Write each destination rank's local buffer, raw, to DIR/rank<R>.bin.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Check every destination byte against the fill; exit non-zero on any mismatch.
    #[arg(long)]
    verify: bool,
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
    /// Timed repetitions of the data phase (the report gives their median, min and max).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed repetitions before the timed ones (first-touch page faults, connection warm-up).
    #[arg(long, default_value_t = 0)]
    warmup: u32,
    /// Print a JSON report instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct RunJson {
    shape: Vec<u64>,
    dtype: String,
    transport: String,
    iters: usize,
    /// The median of the timed repetitions.
    seconds: f64,
    min_s: f64,
    max_s: f64,
    dst_bytes: u64,
    bytes_remote: u64,
    bytes_local: u64,
    messages: u64,
    gbps: f64,
    peak_staging_bytes_per_rank: u64,
    verified: bool,
}

impl RunArgs {
    fn options(&self) -> Result<ExecOptions, Error> {
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
        };
        options.validate()?;
        Ok(options)
    }
}

pub fn main(args: &RunArgs) -> Result<(), Failure> {
    // Everything the user typed is checked before a buffer is allocated or a byte moves.
    let plan = args.tensor.plan()?;
    let fill: Fill = args.fill.parse()?;
    let options = args.options()?;
    let env = GroupEnv::from_env()?;
    let mpi_auto = args.transport == TransportKind::Auto && cfg!(feature = "mpi") && under_mpirun();
    match (args.transport, env) {
        (TransportKind::Local | TransportKind::Auto, None) if !mpi_auto => {
            run_threads(args, &plan, fill, &options)
        }
        (TransportKind::Local, Some(env)) => Err(Failure::Input(Error::InvalidOption {
            field: "--transport",
            value: "local".into(),
            reason: format!(
                "local runs every rank as a thread of one process, but this is rank {} of {} \
                 processes; use tcp, shm or auto",
                env.rank, env.world
            ),
        })),
        (_, env) => run_process(args, &plan, fill, &options, env),
    }
}

/// Every rank a thread of this process.
fn run_threads(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
) -> Result<(), Failure> {
    check_memory(plan, None)?;
    let sources = fill.shards(plan.src());
    let mut shards = exec::zeroed_shards(plan.dst());
    let mut times = Vec::new();
    let mut last = None;
    for i in 0..args.warmup + args.iters {
        let stats = exec::run_local(plan, &sources, &mut shards, options)?;
        if i >= args.warmup {
            times.push(stats.elapsed.as_secs_f64());
        }
        last = Some(stats);
    }
    let stats = last.expect("at least one iteration");
    let verified = if args.verify {
        fill.verify_shards(plan.dst(), &shards)?;
        true
    } else {
        false
    };
    if let Some(dir) = &args.dump {
        dump(dir, shards.iter().map(|(&r, b)| (r, b.as_slice())))?;
    }
    let summary = Summary {
        times,
        bytes_remote: stats.bytes_remote(),
        bytes_local: stats.bytes_local(),
        peak_staging: stats.peak_staging_bytes(),
    };
    report(args, plan, &summary, "local", verified);
    Ok(())
}

/// Checks that the job has a process for every rank the layouts use.
fn check_world(plan: &Plan, world: usize) -> Result<(), Error> {
    let highest = plan.ranks().last().copied().unwrap_or(0);
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

/// This process is one rank of a job; rank 0 reports for all.
fn run_process(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    env: Option<GroupEnv>,
) -> Result<(), Failure> {
    let env = match (args.transport, env) {
        (TransportKind::Mpi, _) => return run_mpi(args, plan, fill, options),
        (TransportKind::Auto, None) if cfg!(feature = "mpi") && under_mpirun() => {
            return run_mpi(args, plan, fill, options);
        }
        (_, Some(env)) => env,
        (kind, None) => {
            return Err(Failure::Input(Error::InvalidOption {
                field: "--transport",
                value: kind.name().into(),
                reason: "it runs one rank per process: start it with `reshard launch --nproc N -- \
                         run ...`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (also \
                         under mpirun, with -x)"
                    .into(),
            }));
        }
    };
    check_world(plan, env.world)?;
    check_memory(plan, Some(env.rank))?;
    let group = Group::join(env, options.timeout)?;
    let kind = args.transport;
    process_rank(args, plan, fill, options, &group, |mine, destination| {
        let links = TcpTransport::new(
            group.rank(),
            group.connect_peers(&mine.peers())?,
            options.timeout,
        )?;
        if kind == TransportKind::Tcp {
            return Ok(Box::new(links) as AnyTransport<'_>);
        }
        let far = mine.peers().into_iter().find(|&p| !group.same_host(p));
        if let (TransportKind::Shm, Some(far)) = (kind, far) {
            return Err(Error::InvalidOption {
                field: "--transport",
                value: "shm".into(),
                reason: format!("rank {far} runs on another host; use tcp or auto"),
            });
        }
        // shm (or auto) for the peers on this host
        let near = mine.peers().into_iter().filter(|&p| group.same_host(p));
        let near = near.map(|p| (p, group.pid(p))).collect();
        let mut shm = ShmTransport::new(links, near, options.staging_bytes, options.timeout);
        // RESHARD_SHM_DIRECT=0 keeps senders out of the receivers' shards: rings only
        let direct = std::env::var("RESHARD_SHM_DIRECT").map_or(true, |v| v != "0");
        let destination = destination.filter(|_| direct);
        shm.exchange_destinations(destination, &mine.senders(), &mine.receivers())?;
        Ok(Box::new(shm) as AnyTransport<'_>)
    })
}

/// Whether this process was started by OpenMPI's or another PMI launcher.
fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &RunArgs, plan: &Plan, fill: Fill, options: &ExecOptions) -> Result<(), Failure> {
    use reshard::transport::mpi::MpiJob;
    let job = MpiJob::init()?;
    check_world(plan, job.world())?;
    check_memory(plan, Some(job.rank()))?;
    process_rank(args, plan, fill, options, &job, |_, _| {
        let transport = job.transport(plan.src().shape(), plan.elem_bytes());
        Ok(Box::new(transport) as AnyTransport<'_>)
    })
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &RunArgs, _: &Plan, _: Fill, _: &ExecOptions) -> Result<(), Failure> {
    Err(Failure::Input(Error::InvalidOption {
        field: "--transport",
        value: "mpi".into(),
        reason: "this reshard was built without MPI; build it with `cargo build --release --features mpi` \
                 (needs an MPI library such as Debian's libopenmpi-dev, and libclang-dev)"
            .into(),
    }))
}

/// Runs this rank's part under `job`, then reports; rank 0 prints the job's report.
fn process_rank<'j, J: Job>(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: impl FnOnce(&RankPlan, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
) -> Result<(), Failure> {
    let rank = job.rank();
    let outcome = rank_part(args, plan, fill, options, job, connect);
    if let Err(e) = &outcome {
        eprintln!("error: {e}");
        if matches!(e, Error::JobFailed { .. }) {
            // the verdict is already out: rank 0 told everyone at the barrier
            return Err(Failure::Run(outcome.unwrap_err()));
        }
    }
    let reports = job.finish(outcome.map_err(|e| e.to_string()))?;
    if rank == 0 {
        let field = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(0.0);
        // per repetition, the slowest rank's time
        let iters = args.iters as usize;
        let times = (0..iters)
            .map(|i| {
                reports
                    .iter()
                    .map(|r| r["times"][i].as_f64().unwrap_or(0.0))
                    .fold(0.0, f64::max)
            })
            .collect();
        let summary = Summary {
            times,
            bytes_remote: reports
                .iter()
                .map(|r| field(r, "bytes_remote") as u64)
                .sum(),
            bytes_local: reports.iter().map(|r| field(r, "bytes_local") as u64).sum(),
            peak_staging: reports
                .iter()
                .map(|r| field(r, "peak_staging") as u64)
                .max()
                .unwrap_or(0),
        };
        let name = reports
            .first()
            .and_then(|r| r["transport"].as_str())
            .unwrap_or("?")
            .to_string();
        report(args, plan, &summary, &name, args.verify);
    }
    Ok(())
}

/// Whichever transport a multi-process run uses.
type AnyTransport<'a> = Box<dyn for<'b> Transport<'b> + 'a>;

/// This rank's destination shard in shared memory, and its box, when it has one.
type Destination<'a> = Option<(&'a SharedBuffer, &'a Region)>;

/// This rank's share of a multi-process run: its shards, its links, its transfers, its check.
/// Returns the report it sends to rank 0.
fn rank_part<'j, J: Job>(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: impl FnOnce(&RankPlan, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
) -> Result<serde_json::Value, Error> {
    let rank = job.rank();
    let rank_plan = reshard::plan::rank_plan(plan.src(), plan.dst(), rank, &plan.options())?;
    let src_box = plan.src().local_region(rank);
    let dst_box = plan.dst().local_region(rank);
    let source = src_box.as_ref().map(|b| {
        let mut buf = vec![0u8; plan.src().local_bytes(rank) as usize];
        fill.fill_region(plan.src(), b, &mut buf);
        buf
    });
    // in shared memory, so that senders on this host can write into it directly
    let mut shard = match &dst_box {
        Some(_) => Some(SharedBuffer::new(plan.dst().local_bytes(rank) as usize)?),
        None => None,
    };
    let transport = connect(
        &rank_plan,
        dst_box
            .as_ref()
            .and_then(|b| shard.as_ref().map(|s| (s, b))),
    )?;

    // Only the data phase is timed: every rank starts each repetition together.
    let mut times = Vec::new();
    let mut stats = None;
    for i in 0..args.warmup + args.iters {
        job.barrier()?;
        let started = Instant::now();
        let work = RankJob {
            plan: &rank_plan,
            src_layout: plan.src(),
            src: src_box.as_ref().zip(source.as_deref()),
            dst: dst_box.as_ref().zip(shard.as_deref_mut()),
        };
        stats = Some(exec::run_rank(work, &*transport, options)?);
        if i >= args.warmup {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    let stats = stats.expect("at least one iteration");
    let mismatch = match (args.verify, &dst_box, &shard) {
        (true, Some(b), Some(buf)) => fill.check_region(plan.dst(), b, buf),
        _ => None,
    };
    if let Some((offset, expected, found, mismatches)) = mismatch {
        return Err(Error::VerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    if let (Some(dir), Some(buf)) = (&args.dump, &shard) {
        dump(dir, [(rank, &buf[..])])?;
    }
    Ok(serde_json::json!({
        "transport": transport.name(),
        "times": times,
        "bytes_remote": stats.bytes_received,
        "bytes_local": stats.bytes_local,
        "peak_staging": stats.peak_staging_bytes,
    }))
}

/// Refuses a run whose buffers cannot fit in this machine's available memory, instead of
/// letting the allocator abort half-way.
fn check_memory(plan: &Plan, only: Option<Rank>) -> Result<(), Error> {
    let side = |l: &reshard::Layout| match only {
        Some(rank) => l.local_bytes(rank),
        None => l.shard_bytes(),
    };
    let needed = side(plan.src()).saturating_add(side(plan.dst()));
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    match available {
        Some(available) if needed > available => Err(Error::InvalidOption {
            field: "--shape",
            value: plan
                .src()
                .shape()
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            reason: format!(
                "running it here needs {} of shard buffers, but only {} of memory is available",
                bytes(needed),
                bytes(available)
            ),
        }),
        _ => Ok(()),
    }
}

/// Writes `DIR/rank<R>.bin` for every shard.
fn dump<'a>(dir: &Path, shards: impl IntoIterator<Item = (Rank, &'a [u8])>) -> Result<(), Error> {
    let io = |path: &Path, source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    for (rank, buf) in shards {
        let path = dir.join(format!("rank{rank}.bin"));
        std::fs::write(&path, buf).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// What a run did, from one process or summed over all.
struct Summary {
    /// Seconds of every timed repetition (the slowest rank's, between processes).
    times: Vec<f64>,
    bytes_remote: u64,
    bytes_local: u64,
    peak_staging: u64,
}

fn report(args: &RunArgs, plan: &Plan, stats: &Summary, transport: &str, verified: bool) {
    let totals = plan.totals();
    let dst_bytes = plan.dst().shard_bytes();
    let mut sorted = stats.times.clone();
    sorted.sort_by(f64::total_cmp);
    let seconds = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    let (min_s, max_s) = (
        sorted.first().copied().unwrap_or(0.0),
        sorted.last().copied().unwrap_or(0.0),
    );
    let gbps = dst_bytes as f64 / seconds.max(1e-12) / 1e9;
    if args.json {
        let json = RunJson {
            shape: plan.src().shape().to_vec(),
            dtype: plan.src().dtype().to_string(),
            transport: transport.to_string(),
            iters: sorted.len(),
            seconds,
            min_s,
            max_s,
            dst_bytes,
            bytes_remote: stats.bytes_remote,
            bytes_local: stats.bytes_local,
            messages: totals.messages,
            gbps,
            peak_staging_bytes_per_rank: stats.peak_staging,
            verified,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json).expect("run JSON serializes")
        );
        return;
    }
    let shape: Vec<String> = plan.src().shape().iter().map(u64::to_string).collect();
    println!(
        "reshard {} {}: {} -> {} ranks over {transport}",
        shape.join("x"),
        plan.src().dtype(),
        plan.src().mesh().size(),
        plan.dst().mesh().size()
    );
    println!(
        "  moved   {} remote in {} messages, {} by local copy",
        bytes(stats.bytes_remote),
        totals.messages,
        bytes(stats.bytes_local)
    );
    let spread = if sorted.len() > 1 {
        format!(
            " (median of {}; min {:.3} ms, max {:.3} ms)",
            sorted.len(),
            min_s * 1e3,
            max_s * 1e3
        )
    } else {
        String::new()
    };
    println!(
        "  time    {:.3} ms, {gbps:.2} GB/s of destination data ({}){spread}",
        seconds * 1e3,
        bytes(dst_bytes)
    );
    println!("  staging {} per rank at most", bytes(stats.peak_staging));
    if verified {
        println!(
            "  verify  every destination byte matches the {} fill",
            args.fill
        );
    }
    if let Some(dir) = &args.dump {
        println!(
            "  dump    {} files rank<R>.bin in {}",
            plan.dst().mesh().size(),
            dir.display()
        );
    }
}
