//! `reshard run`: execute a reshard on filled buffers; verify and dump the result.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use reshard::exec::{self, ExecOptions, RankJob};
use reshard::fill::Fill;
use reshard::transport::Job;
use reshard::transport::group::{Group, GroupEnv};
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Plan, Rank, RankPlan};

use super::processes::{
    AnyTransport, Destination, ExecArgs, Links, TransportKind, check_memory, check_world, conclude,
    connect, in_mpi_job, not_in_a_job,
};
use super::units::bytes;
use super::{Failure, TensorArgs};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    tensor: TensorArgs,
    /// Contents of the global tensor: index (element i holds i mod 2^bits), hash or hash:SEED.
    #[arg(long, default_value = "index")]
    fill: String,
    /// Write each destination rank's local buffer, raw, to DIR/rank<R>.bin.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Check every destination byte against the fill; exit non-zero on any mismatch.
    #[arg(long)]
    verify: bool,
    #[command(flatten)]
    exec: ExecArgs,
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

pub fn main(args: &RunArgs) -> Result<(), Failure> {
    // Everything the user typed is checked before a buffer is allocated or a byte moves.
    let plan = args.tensor.plan()?;
    let fill: Fill = args.fill.parse()?;
    let options = args.exec.options()?;
    let env = GroupEnv::from_env()?;
    match (args.exec.transport, env) {
        (kind, env) if in_mpi_job(kind, env.as_ref()) => run_mpi(args, &plan, fill, &options),
        (TransportKind::Local | TransportKind::Auto, None) => {
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
    check_memory(
        plan.src()
            .shard_bytes()
            .saturating_add(plan.dst().shard_bytes()),
        plan.src().shape(),
    )?;
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

/// This process is one rank of a job; rank 0 reports for all.
fn run_process(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    env: Option<GroupEnv>,
) -> Result<(), Failure> {
    let Some(env) = env else {
        return Err(Failure::Input(not_in_a_job(args.exec.transport)));
    };
    check_world(highest(plan), env.world)?;
    check_memory(rank_bytes(plan, env.rank), plan.src().shape())?;
    let group = Group::join(env, options.timeout)?;
    let kind = args.exec.transport;
    process_rank(args, plan, fill, options, &group, |mine, destination| {
        let links = Links {
            senders: mine.senders(),
            receivers: mine.receivers(),
        };
        connect(kind, &group, &links, destination, options)
    })
}

/// The highest rank a plan uses.
fn highest(plan: &Plan) -> Rank {
    plan.ranks().last().copied().unwrap_or(0)
}

/// The shard bytes one rank holds.
fn rank_bytes(plan: &Plan, rank: Rank) -> u64 {
    plan.src()
        .local_bytes(rank)
        .saturating_add(plan.dst().local_bytes(rank))
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &RunArgs, plan: &Plan, fill: Fill, options: &ExecOptions) -> Result<(), Failure> {
    use super::processes::connect_mpi;
    use reshard::transport::mpi::MpiJob;
    let job = MpiJob::init()?;
    check_world(highest(plan), job.world())?;
    check_memory(rank_bytes(plan, job.rank()), plan.src().shape())?;
    let kind = args.exec.transport;
    process_rank(args, plan, fill, options, &job, |mine, destination| {
        let links = Links {
            senders: mine.senders(),
            receivers: mine.receivers(),
        };
        connect_mpi(kind, &job, [plan.src()], &links, destination, options)
    })
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &RunArgs, _: &Plan, _: Fill, _: &ExecOptions) -> Result<(), Failure> {
    Err(Failure::Input(super::processes::no_mpi()))
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
    let outcome = rank_part(args, plan, fill, options, job, connect);
    if let Some(reports) = conclude(job, outcome)? {
        let name = reports.transport();
        let reports = reports.ranks;
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
        report(args, plan, &summary, &name, args.verify);
    }
    Ok(())
}

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
    let source = fill.shard(plan.src(), rank);
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
    if let (true, Some(b), Some(buf)) = (args.verify, &dst_box, &shard) {
        fill.verify_region(plan.dst(), b, buf, (rank, 0))?;
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

/// Writes `DIR/rank<R>.bin` for every shard.
pub(super) fn dump<'a>(
    dir: &Path,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
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
    if args.exec.checksum {
        println!("  checksum every chunk landed as its sender summed it (crc32c)");
    }
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
