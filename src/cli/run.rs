//! `reshard run`: execute a reshard on filled buffers; verify and dump the result.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use reshard::exec::{self, ExecOptions, RunStats};
use reshard::fill::Fill;
use reshard::{Error, Plan, Rank};
use serde::Serialize;

use super::units::{bytes, parse_bytes};
use super::{Failure, TensorArgs};

/// Which transport moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// Every rank a thread of this process; receivers copy straight from the senders' shards.
    Local,
    /// The best transport for where the ranks are (in one process: local).
    Auto,
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
    /// Print a JSON report instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct RunJson {
    shape: Vec<u64>,
    dtype: String,
    transport: &'static str,
    seconds: f64,
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
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout < 1e9) {
            return Err(Error::InvalidOption {
                field: "--timeout",
                value: self.timeout.to_string(),
                reason: "expected a positive number of seconds".into(),
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
    check_memory(&plan)?;
    let transport = match args.transport {
        TransportKind::Local | TransportKind::Auto => "local",
    };
    let sources = fill.shards(plan.src());
    let mut shards = exec::zeroed_shards(plan.dst());
    let stats = exec::run_local(&plan, &sources, &mut shards, &options)?;
    let verified = if args.verify {
        fill.verify_shards(plan.dst(), &shards)?;
        true
    } else {
        false
    };
    if let Some(dir) = &args.dump {
        dump(dir, &shards)?;
    }
    report(args, &plan, &stats, transport, verified);
    Ok(())
}

/// Refuses a run whose buffers cannot fit in this machine's available memory, instead of
/// letting the allocator abort half-way.
fn check_memory(plan: &Plan) -> Result<(), Error> {
    let side =
        |l: &reshard::Layout| -> u64 { l.mesh().ranks().iter().map(|&r| l.local_bytes(r)).sum() };
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

fn dump(dir: &Path, shards: &std::collections::BTreeMap<Rank, Vec<u8>>) -> Result<(), Error> {
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

fn report(args: &RunArgs, plan: &Plan, stats: &RunStats, transport: &'static str, verified: bool) {
    let totals = plan.totals();
    let dst_bytes: u64 = plan
        .dst()
        .mesh()
        .ranks()
        .iter()
        .map(|&r| plan.dst().local_bytes(r))
        .sum();
    let seconds = stats.elapsed.as_secs_f64();
    let gbps = dst_bytes as f64 / seconds.max(1e-12) / 1e9;
    if args.json {
        let json = RunJson {
            shape: plan.src().shape().to_vec(),
            dtype: plan.src().dtype().to_string(),
            transport,
            seconds,
            dst_bytes,
            bytes_remote: stats.bytes_remote(),
            bytes_local: stats.bytes_local(),
            messages: totals.messages,
            gbps,
            peak_staging_bytes_per_rank: stats.peak_staging_bytes(),
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
        bytes(stats.bytes_remote()),
        totals.messages,
        bytes(stats.bytes_local())
    );
    println!(
        "  time    {:.3} ms, {gbps:.2} GB/s of destination data ({})",
        seconds * 1e3,
        bytes(dst_bytes)
    );
    println!(
        "  staging {} per rank at most",
        bytes(stats.peak_staging_bytes())
    );
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
