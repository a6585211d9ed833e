//! What `reshard run` prints: the text or the JSON report of one process's run, or of a
//! job's, which rank 0 combines from every rank's.

use serde::Serialize;

use reshard::runtime::World;
use reshard::runtime::harness::{Measured, spread};
use reshard::{Error, Plan};

use super::args::RunArgs;
use crate::cli::Failure;
use crate::cli::measure::conclude;
use crate::cli::units::bytes;

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

/// Hands this rank's outcome to rank 0, which prints the job's report: per repetition the
/// slowest rank's time, the bytes of every rank, verified if every rank's checks covered
/// every byte it holds.
pub(super) fn process_report(
    args: &RunArgs,
    plan: &Plan,
    world: &World,
    outcome: Result<serde_json::Value, Error>,
) -> Result<(), Failure> {
    if let Some(reports) = conclude(world, outcome)? {
        let name = reports.transport();
        let per_rank: Vec<&serde_json::Value> = reports.ranks.iter().map(|r| &r["run"]).collect();
        let measured = Measured::combine(&per_rank);
        let verified = reports
            .ranks
            .iter()
            .all(|r| r["verified"].as_bool() == Some(true));
        report(args, plan, &measured, &name, verified);
    }
    Ok(())
}

/// Prints what a run did, from one process or combined over all (`stats.peak_extra` is the
/// staging: a run holds nothing else); `verified` as the harness found it.
pub(super) fn report(
    args: &RunArgs,
    plan: &Plan,
    stats: &Measured,
    transport: &str,
    verified: bool,
) {
    let totals = plan.totals();
    let dst_bytes = plan.dst().shard_bytes();
    let (seconds, min_s, max_s) = spread(&stats.times);
    let repetitions = stats.times.len();
    let gbps = dst_bytes as f64 / seconds.max(1e-12) / 1e9;
    if args.json {
        let json = RunJson {
            shape: plan.src().shape().to_vec(),
            dtype: plan.src().dtype().to_string(),
            dst_dtype: plan.dst().dtype().to_string(),
            transport: transport.to_string(),
            iters: repetitions,
            seconds,
            min_s,
            max_s,
            dst_bytes,
            bytes_remote: stats.wire_bytes,
            bytes_local: stats.bytes_local,
            bytes_direct: stats.bytes_direct,
            messages: totals.messages,
            gbps,
            peak_staging_bytes_per_rank: stats.peak_extra,
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
        bytes(stats.wire_bytes),
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
    let spread = if repetitions > 1 {
        format!(
            " (median of {}; min {:.3} ms, max {:.3} ms)",
            repetitions,
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
    println!("  staging {} per rank at most", bytes(stats.peak_extra));
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
