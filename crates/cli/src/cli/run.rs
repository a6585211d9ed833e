//! `reshard run`: execute a reshard on filled buffers; verify and dump the result.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use reshard::agreement::Fingerprint;
use reshard::error::Field;
use reshard::exec::{self, ExecOptions};
use reshard::fill::Fill;
use reshard::runtime::World;
use reshard::{Error, Plan, Rank};

use super::exec_args::{ExecArgs, check_memory, run_options, with_plan};
use super::measure::conclude;
use super::units::bytes;
use super::{Failure, TensorArgs, quant_check};

mod prequant;

pub(super) use prequant::check_fill as check_quantized_fill;

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    tensor: TensorArgs,
    /// Contents of the global tensor: hash or hash:SEED (a hash of each element's index, so
    /// that a block in the wrong place fails --verify, for every dtype), index (element i
    /// holds i mod 2^bits: readable in dumps, but it repeats every 2^bits elements), or
    /// normal or normal:SEED (float dtypes only: finite values of varied magnitude, with
    /// all-zero and tiny rows, for conversions).
    #[arg(long, default_value = "hash")]
    fill: String,
    /// Write each destination rank's local buffer, raw, to DIR/rank<R>.bin (DIR is created if
    /// missing and checked before any byte moves; each file appears whole or not at all).
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Write each source rank's local shard, raw, to DIR/src<R>.bin (as --dump does): the
    /// input a conversion (--dst-dtype) can be checked against.
    #[arg(long, value_name = "DIR")]
    dump_src: Option<PathBuf>,
    /// Check every destination byte against the fill after every repetition; exit non-zero
    /// on any mismatch.
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
    /// The destination's dtype (`--dst-dtype`); byte counts are in it (wire bytes).
    dst_dtype: String,
    transport: String,
    iters: usize,
    /// The median of the timed repetitions.
    seconds: f64,
    min_s: f64,
    max_s: f64,
    dst_bytes: u64,
    bytes_remote: u64,
    bytes_local: u64,
    /// Of `bytes_remote`, those written straight into the receivers' shards by same-host
    /// senders (shm direct writes), over the last repetition.
    bytes_direct: u64,
    messages: u64,
    gbps: f64,
    peak_staging_bytes_per_rank: u64,
    verified: bool,
    /// The host map the plan minded (`--hosts`, or learned at rendezvous), with `relay`.
    #[serde(skip_serializing_if = "Option::is_none")]
    hosts: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    relay: Option<bool>,
    /// The most bytes into or out of one host, when the plan knows the hosts.
    #[serde(skip_serializing_if = "Option::is_none")]
    busiest_link_bytes: Option<u64>,
}

pub fn main(args: &RunArgs) -> Result<(), Failure> {
    // Everything the user typed is checked before a buffer is allocated or a byte moves.
    if args.tensor.source_is_quantized()? {
        let mv = args.tensor.quantized_move()?;
        let fill: Fill = args.fill.parse()?;
        let options = args.exec.options()?;
        for dir in [&args.dump, &args.dump_src].into_iter().flatten() {
            check_dump_dir(dir)?;
        }
        let world = args.exec.join(&options)?;
        return prequant::main(args, &mv, fill, &options, &world);
    }
    let plan = args.tensor.plan()?;
    let fill: Fill = args.fill.parse()?;
    fill.check_dtype(plan.src().dtype())?;
    let options = args.exec.options()?;
    // every process of a job checks, before it joins the others
    for dir in [&args.dump, &args.dump_src].into_iter().flatten() {
        check_dump_dir(dir)?;
    }
    let world = args.exec.join(&options)?;
    let plan = match world.hosts() {
        Some(learned) => args.tensor.plan_on(Some(learned))?,
        None => plan,
    };
    match world.job() {
        None => run_threads(args, &plan, fill, &options),
        Some(_) => run_process(args, &plan, fill, &options, &world),
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
    let sources = fill.shards(plan.src())?;
    if let Some(dir) = &args.dump_src {
        dump_named(dir, "src", sources.iter().map(|(&r, b)| (r, b.as_slice())))?;
    }
    let mut shards = exec::zeroed_shards(plan.dst())?;
    let mut scales = exec::zeroed_scale_shards(plan)?;
    let reference = match args.verify {
        true => quant_check::reference(plan, fill)?,
        false => None,
    };
    let mut times = Vec::new();
    let mut last = None;
    let mut verified = false;
    for i in 0..args.warmup + args.iters {
        if args.verify {
            shards.values_mut().for_each(|s| poison(s));
            scales.values_mut().for_each(|s| poison(s));
        }
        let stats = match plan.quant() {
            Some(_) => {
                exec::run_local_quantized(plan, &sources, &mut shards, &mut scales, options)?
            }
            None => exec::run_local(plan, &sources, &mut shards, options)?,
        };
        if i >= args.warmup {
            times.push(stats.elapsed.as_secs_f64());
        }
        last = Some(stats);
        if args.verify {
            match &reference {
                Some(reference) => {
                    for (&r, values) in &shards {
                        let scale = scales.get(&r).map_or(&[][..], Vec::as_slice);
                        quant_check::verify(plan, reference, r, values, scale)?;
                    }
                }
                None => fill.verify_shards_converted(plan.src().dtype(), plan.dst(), &shards)?,
            }
            verified = true;
        }
    }
    let stats = last.expect("at least one iteration");
    if let Some(dir) = &args.dump {
        dump(dir, shards.iter().map(|(&r, b)| (r, b.as_slice())))?;
        dump_scales(dir, scales.iter().map(|(&r, b)| (r, b.as_slice())))?;
    }
    let summary = Summary {
        times,
        bytes_remote: stats.bytes_remote(),
        bytes_local: stats.bytes_local(),
        bytes_direct: stats.bytes_direct(),
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
    world: &World,
) -> Result<(), Failure> {
    let rank = world.rank().unwrap_or(0);
    let ready = world
        .check_size(highest(plan))
        .and_then(|()| check_memory(rank_bytes(plan, rank), plan.src().shape()));
    world.agree("run", ready, || fingerprint(args, plan, fill, options))?;
    process_rank(args, plan, fill, options, world)
}

/// What every rank of the job must run alike.
fn fingerprint(args: &RunArgs, plan: &Plan, fill: Fill, options: &ExecOptions) -> Fingerprint {
    let fingerprint = with_plan(Fingerprint::new("run"), "", plan)
        .with("--fill", fill)
        .with("--iters", args.iters)
        .with("--warmup", args.warmup)
        .with("--verify", args.verify);
    args.exec.agreed(options, fingerprint)
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

/// Runs this rank's part of the job, then reports; rank 0 prints the job's report.
fn process_rank(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<(), Failure> {
    let outcome = rank_part(args, plan, fill, options, world);
    process_report(args, plan, world, outcome)
}

/// Hands this rank's outcome to rank 0, which prints the job's report.
fn process_report(
    args: &RunArgs,
    plan: &Plan,
    world: &World,
    outcome: Result<serde_json::Value, Error>,
) -> Result<(), Failure> {
    if let Some(reports) = conclude(world, outcome)? {
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
            bytes_direct: reports
                .iter()
                .map(|r| field(r, "bytes_direct") as u64)
                .sum(),
            peak_staging: reports
                .iter()
                .map(|r| field(r, "peak_staging") as u64)
                .max()
                .unwrap_or(0),
        };
        // what every rank's own check found (a failed check fails the job before this)
        let verified = reports
            .iter()
            .all(|r| r["verified"].as_bool() == Some(true));
        report(args, plan, &summary, &name, verified);
    }
    Ok(())
}

/// This rank's share of a multi-process run: its shards, its links, its transfers, its check.
/// Returns the report it sends to rank 0.
fn rank_part(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<serde_json::Value, Error> {
    // its destination shard in shared memory, so that senders on this host write into it
    let mut mine = world.prepare(plan)?;
    let rank = mine.rank();
    let reference = match args.verify && mine.destination().is_some() {
        true => quant_check::reference(plan, fill)?,
        false => None,
    };
    let source = fill.shard(plan.src(), rank)?;
    let run = run_options(options);
    if let (Some(dir), Some(buf)) = (&args.dump_src, &source) {
        dump_named(dir, "src", [(rank, &buf[..])])?;
    }

    // Only the data phase is timed: every rank starts each repetition together.
    let mut times = Vec::new();
    let mut stats = None;
    // a rank with no destination shard has nothing to check: its part of the check passes
    let mut verified = args.verify && mine.destination().is_none();
    for i in 0..args.warmup + args.iters {
        if let (true, Some(s)) = (args.verify, mine.destination_mut()) {
            poison(s);
        }
        if let (true, Some(s)) = (args.verify, mine.scales_mut()) {
            poison(s);
        }
        world.barrier()?;
        let started = Instant::now();
        stats = Some(mine.run(source.as_deref(), &run)?);
        if i >= args.warmup {
            times.push(started.elapsed().as_secs_f64());
        }
        if let (true, Some(b), Some(buf)) =
            (args.verify, mine.destination_box(), mine.destination())
        {
            match &reference {
                Some(reference) => {
                    let scales = mine.scales().unwrap_or_default();
                    quant_check::verify(plan, reference, rank, buf, scales)?;
                }
                None => fill.verify_converted(plan.src().dtype(), plan.dst(), b, buf, (rank, 0))?,
            }
            verified = true;
        }
    }
    let stats = stats.expect("at least one iteration");
    if let (Some(dir), Some(buf)) = (&args.dump, mine.destination()) {
        dump(dir, [(rank, buf)])?;
    }
    if let (Some(dir), Some(buf)) = (&args.dump, mine.scales()) {
        dump_scales(dir, [(rank, buf)])?;
    }
    Ok(serde_json::json!({
        "transport": mine.transport_name(),
        "times": times,
        "bytes_remote": stats.bytes_received,
        "bytes_local": stats.bytes_local,
        "bytes_direct": stats.bytes_direct,
        "peak_staging": stats.peak_staging_bytes,
        "verified": verified,
    }))
}

/// A pattern written over a destination shard before each verified repetition, so that only
/// the bytes this repetition moved can make it verify, not those of the one before.
fn poison(buf: &mut [u8]) {
    reshard::memory::fill_around_caches(buf, 0xA5);
}

/// Makes sure `--dump DIR` can take the files before any byte moves: creates DIR when it is
/// missing, and refuses a path that is not a directory or one where no file can be created
/// (checked by creating one: permission bits alone miss read-only mounts and root).
pub(super) fn check_dump_dir(dir: &Path) -> Result<(), Error> {
    let refuse = |reason: String| Error::InvalidOption {
        field: Field::Flag("--dump"),
        value: dir.display().to_string(),
        reason,
    };
    match std::fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => {
            return Err(refuse("it exists and is not a directory".into()));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(dir)
            .map_err(|e| refuse(format!("the directory cannot be created: {e}")))?,
        Err(e) => return Err(refuse(format!("it cannot be read: {e}"))),
    }
    // removed again when dropped
    tempfile::Builder::new()
        .prefix(".reshard-probe-")
        .tempfile_in(dir)
        .map_err(|e| refuse(format!("no file can be created in it: {e}")))?;
    Ok(())
}

/// Writes `DIR/rank<R>.bin` for every shard (DIR checked by [`check_dump_dir`]).
pub(super) fn dump<'a>(
    dir: &Path,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
    dump_named(dir, "rank", shards)
}

/// Writes `DIR/rank<R>.scale.bin` for every scale shard (row-major, in the scale dtype).
pub(super) fn dump_scales<'a>(
    dir: &Path,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
    for (rank, buf) in shards {
        write_whole(dir, &format!("rank{rank}.scale.bin"), |file| {
            file.write_all(buf)
        })?;
    }
    Ok(())
}

/// Writes `DIR/<prefix><R>.bin` for every shard: `rank` for destinations, `src` for sources.
pub(super) fn dump_named<'a>(
    dir: &Path,
    prefix: &str,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
    for (rank, buf) in shards {
        write_whole(dir, &format!("{prefix}{rank}.bin"), |file| {
            file.write_all(buf)
        })?;
    }
    Ok(())
}

/// Writes `DIR/name` whole or not at all: `write` fills a temporary file in the same directory
/// (so that the rename cannot cross file systems), which is flushed to disk and then renamed
/// over `name`. On any error (a full disk), the temporary is removed and `name` is untouched.
fn write_whole(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), Error> {
    let path = dir.join(name);
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let mut temp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io)?;
    // a write error, or one the file system only reports on flushing, drops (removes) `temp`
    write(temp.as_file_mut())
        .and_then(|()| temp.as_file().sync_all())
        .map_err(io)?;
    temp.persist(&path).map_err(|e| io(e.error))?;
    Ok(())
}

/// What a run did, from one process or summed over all.
struct Summary {
    /// Seconds of every timed repetition (the slowest rank's, between processes).
    times: Vec<f64>,
    bytes_remote: u64,
    bytes_local: u64,
    bytes_direct: u64,
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
            dst_dtype: plan.dst().dtype().to_string(),
            transport: transport.to_string(),
            iters: sorted.len(),
            seconds,
            min_s,
            max_s,
            dst_bytes,
            bytes_remote: stats.bytes_remote,
            bytes_local: stats.bytes_local,
            bytes_direct: stats.bytes_direct,
            messages: totals.messages,
            gbps,
            peak_staging_bytes_per_rank: stats.peak_staging,
            verified,
            hosts: plan.topology().map(|t| t.hosts.to_string()),
            relay: plan.topology().map(|t| t.relay),
            busiest_link_bytes: plan.host_links().map(|l| l.busiest()),
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json).expect("run JSON serializes")
        );
        return;
    }
    let shape: Vec<String> = plan.src().shape().iter().map(u64::to_string).collect();
    let dtypes = match (plan.src().dtype(), plan.dst().dtype()) {
        (src, dst) if src == dst => src.to_string(),
        (src, dst) => format!("{src} -> {dst}"),
    };
    println!(
        "reshard {} {dtypes}: {} -> {} ranks over {transport}",
        shape.join("x"),
        plan.src().mesh().size(),
        plan.dst().mesh().size()
    );
    println!(
        "  moved   {} remote in {} messages, {} by local copy",
        bytes(stats.bytes_remote),
        totals.messages,
        bytes(stats.bytes_local)
    );
    if stats.bytes_direct > 0 {
        println!(
            "  direct  {} written straight into the receivers' shards",
            bytes(stats.bytes_direct)
        );
    }
    if let (Some(topology), Some(links)) = (plan.topology(), plan.host_links()) {
        println!(
            "  hosts   {} (relay {}): busiest host link {}",
            topology.hosts,
            if topology.relay { "on" } else { "off" },
            bytes(links.busiest())
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("reshard-{name}-"))
            .tempdir()
            .unwrap()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn dumps_leave_whole_files_and_no_temporaries() {
        let dir = scratch("dump");
        dump(dir.path(), [(2, &[1u8, 2][..]), (3, &[3u8][..])]).unwrap();
        assert_eq!(names(dir.path()), ["rank2.bin", "rank3.bin"]);
        assert_eq!(std::fs::read(dir.path().join("rank2.bin")).unwrap(), [1, 2]);
        // a second dump replaces the first
        dump(dir.path(), [(2, &[9u8][..])]).unwrap();
        assert_eq!(std::fs::read(dir.path().join("rank2.bin")).unwrap(), [9]);
    }

    /// A write that fails half-way (as on a full disk) leaves neither the file nor its
    /// temporary, and an older file of that name untouched.
    #[test]
    fn a_failed_write_leaves_nothing_partial() {
        let dir = scratch("full");
        std::fs::write(dir.path().join("rank5.bin"), b"old").unwrap();
        for name in ["rank4.bin", "rank5.bin"] {
            let err = write_whole(dir.path(), name, |file| {
                file.write_all(&[7; 4096])?;
                Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
            })
            .unwrap_err();
            assert!(
                matches!(&err, Error::Io { path, .. } if path.ends_with(name)),
                "{err}"
            );
        }
        assert_eq!(names(dir.path()), ["rank5.bin"]);
        assert_eq!(std::fs::read(dir.path().join("rank5.bin")).unwrap(), b"old");
    }

    #[test]
    fn the_dump_dir_is_created_or_refused_by_name() {
        let dir = scratch("check");
        let nested = dir.path().join("a/b");
        check_dump_dir(&nested).unwrap();
        assert!(nested.is_dir());
        assert!(names(&nested).is_empty(), "the probe is removed");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        for bad in [file.clone(), file.join("below")] {
            let err = check_dump_dir(&bad).unwrap_err();
            let text = err.to_string();
            assert!(
                text.starts_with(&format!("--dump: {} is invalid", bad.display())),
                "{text}"
            );
        }
    }
}
