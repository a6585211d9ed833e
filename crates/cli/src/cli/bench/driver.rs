//! Running both methods of `reshard bench`, in turn on the same buffers, either with every
//! rank a thread of this process or with this process one rank of a job; rank 0 gathers what
//! every rank measured.

use indicatif::{ProgressBar, ProgressStyle};

use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, RankJob};
use reshard::fill::Fill;
use reshard::runtime::{AnyTransport, Destination, Links, TransportKind, World};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Plan, Rank, RankPlan};

use super::BenchArgs;
use super::suite::Case;
use super::{prequant, quant};
use crate::cli::Failure;
use crate::cli::measure::{Measured, Method, conclude};

/// One case's outcome on one run: both methods measured, both verified.
#[derive(Clone, Debug, Default)]
pub(super) struct CaseResult {
    pub(super) reshard: Measured,
    pub(super) gather_broadcast: Measured,
    /// With `--quant`: the reshard in the source's dtype, then quantized on the receivers
    /// (`gather_broadcast` then quantizes on the receivers too).
    pub(super) reshard_then_quantize: Option<Measured>,
    /// With an already-quantized source: the reshard of the values alone (`reshard` and
    /// `gather_broadcast` then move the values and the scales).
    pub(super) values_only: Option<Measured>,
    /// Whether every repetition of both methods was checked and matched the fill (on every
    /// rank); a mismatch fails the bench, so a report says false only if nothing was checked.
    pub(super) verified: bool,
}

/// A progress bar on a terminal, over every repetition of every case and method.
fn progress(args: &BenchArgs, cases: usize) -> ProgressBar {
    // quantizing and already quantized (--quant) both compare three methods
    let methods = if args.quant.is_some() { 3 } else { 2 };
    let bar = ProgressBar::new(cases as u64 * u64::from(args.repetitions()) * methods);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:24} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}

/// A pattern no fill produces everywhere: a destination that is not written fails to verify.
/// Written over the destination shards before every repetition, and over the baseline's
/// full-tensor buffers before each of its repetitions, so that no repetition can pass on the
/// bytes of the one before. Written around the caches, so that no repetition starts with the
/// poison dirty in them.
pub(super) fn poison(buf: &mut [u8]) {
    reshard::memory::fill_around_caches(buf, 0xA5);
}

/// Every rank a thread of this process.
pub(super) fn bench_threads(
    args: &BenchArgs,
    cases: &[Case],
    fill: Fill,
    options: &ExecOptions,
) -> Result<Option<(String, Vec<CaseResult>)>, Failure> {
    for case in cases {
        case.check_memory(None)?;
    }
    let bar = progress(args, cases.len());
    let mut results = Vec::new();
    for case in cases {
        bar.set_message(case.name.clone());
        if let Some(coupled) = &case.coupled {
            results.push(prequant::threads(args, case, coupled, fill, options, &bar)?);
            continue;
        }
        if let (Some(plain), Some(q)) = (&case.plain, case.plan.quant()) {
            results.push(quant::threads(args, case, (plain, q), fill, options, &bar)?);
            continue;
        }
        let (plan, gb) = (&case.plan, &case.baseline);
        let mut sources = fill.shards(plan.src())?;
        let mut shards = exec::zeroed_shards(plan.dst())?;
        let mut full = baseline::full_buffers(gb)?;
        let mut result = CaseResult::default();
        let mut checked = 0;
        for i in 0..args.repetitions() {
            let timed = i >= args.warmup;
            for method in Method::order(i) {
                shards.values_mut().for_each(|s| poison(s));
                if method == Method::GatherBroadcast {
                    full.values_mut().for_each(|f| poison(f));
                }
                let (stats, measured, extra) = match method {
                    Method::Reshard => (
                        exec::run_local(plan, &sources, &mut shards, options)?,
                        &mut result.reshard,
                        0,
                    ),
                    Method::GatherBroadcast => (
                        baseline::run_local_gather_broadcast(
                            gb,
                            &mut sources,
                            &mut shards,
                            &mut full,
                            options,
                        )?,
                        &mut result.gather_broadcast,
                        if full.is_empty() { 0 } else { gb.full_bytes() },
                    ),
                };
                bar.inc(1);
                fill.verify_shards_converted(plan.src().dtype(), plan.dst(), &shards)?;
                checked += 1;
                if timed {
                    measured.times.push(stats.elapsed.as_secs_f64());
                    measured.wire_bytes = stats.bytes_remote();
                    measured.peak_extra = stats.peak_staging_bytes().saturating_add(extra);
                }
            }
        }
        result.verified = checked == 2 * args.repetitions();
        results.push(result);
    }
    bar.finish_and_clear();
    Ok(Some(("local".into(), results)))
}

/// This process is one rank of a job: it runs every case with the others; rank 0 gets every
/// rank's measurements and returns them.
pub(super) fn bench_processes(
    args: &BenchArgs,
    cases: &[Case],
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<Option<(String, Vec<CaseResult>)>, Failure> {
    let Some(job) = world.job() else {
        return bench_threads(args, cases, fill, options);
    };
    // MPI's datatypes cover every tensor the job's links will move
    let layouts: Vec<&reshard::Layout> = cases
        .iter()
        .flat_map(|c| {
            let scales = c.coupled.as_ref().map(|c| c.mv.scales.src());
            std::iter::once(c.plan.src()).chain(scales)
        })
        .collect();
    let connect = |links: &Links, destination: Destination<'_>| {
        world.connect(links, layouts.iter().copied(), destination)
    };
    let rank = job.rank();
    let bar = if rank == 0 {
        progress(args, cases.len())
    } else {
        ProgressBar::hidden()
    };
    let mut name = String::new();
    let outcome: Result<Vec<serde_json::Value>, Error> = cases
        .iter()
        .map(|case| {
            bar.set_message(case.name.clone());
            let (report, transport) = match (&case.coupled, &case.plain, case.plan.quant()) {
                (Some(coupled), _, _) => {
                    // as every rank of the job was asked: shared memory may carry some peers
                    let direct = matches!(
                        world.options().transport,
                        TransportKind::Shm | TransportKind::Auto
                    );
                    prequant::rank(
                        args, case, coupled, fill, options, job, &connect, direct, &bar,
                    )?
                }
                (None, Some(plain), Some(q)) => {
                    quant::rank(args, case, (plain, q), fill, options, job, &connect, &bar)?
                }
                _ => bench_rank(args, case, fill, options, job, &connect, &bar)?,
            };
            name = transport;
            Ok(report)
        })
        .collect();
    bar.finish_and_clear();
    let mine = outcome.map(|reports| serde_json::json!({ "transport": name, "cases": reports }));
    let Some(reports) = conclude(world, mine)? else {
        return Ok(None);
    };
    let name = reports.transport();
    let reports = reports.ranks;
    let results = (0..cases.len())
        .map(|c| {
            let method = |key: &str| {
                let per_rank: Vec<&serde_json::Value> =
                    reports.iter().map(|r| &r["cases"][c][key]).collect();
                Measured::combine(&per_rank)
            };
            CaseResult {
                reshard: method("reshard"),
                gather_broadcast: method("gather_broadcast"),
                reshard_then_quantize: cases[c]
                    .plain
                    .as_ref()
                    .map(|_| method("reshard_then_quantize")),
                values_only: cases[c].coupled.as_ref().map(|_| method("values_only")),
                verified: reports
                    .iter()
                    .all(|r| r["cases"][c]["verified"].as_bool() == Some(true)),
            }
        })
        .collect();
    Ok(Some((name, results)))
}

/// This rank's share of one case: both methods, in turn, on the same buffers. Returns the
/// report for rank 0 and the transport's name.
fn bench_rank<'j, J: Job + ?Sized>(
    args: &BenchArgs,
    case: &Case,
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    bar: &ProgressBar,
) -> Result<(serde_json::Value, String), Error> {
    let rank = job.rank();
    let (plan, gb) = (&case.plan, &case.baseline);
    let (src, dst) = (plan.src(), plan.dst());
    let mine = plan.rank_part(rank);
    let (gather, broadcast) = gb.rank_parts(rank);

    let src_box = src.local_region(rank);
    let dst_box = dst.local_region(rank);
    let source = fill.shard(src, rank)?;
    let shared = |len: u64| SharedBuffer::new(len as usize);
    let mut shard = dst_box
        .as_ref()
        .map(|_| shared(dst.local_bytes(rank)))
        .transpose()?;
    let mut full = gb
        .needs_full_buffer(rank)
        .then(|| shared(gb.full_bytes()))
        .transpose()?;
    let whole = reshard::Region::full(dst.shape());

    // Both methods' links, opened one after the other by every rank.
    job.barrier()?;
    let reshard_links = Links {
        senders: mine.senders(),
        receivers: mine.receivers(),
    };
    // a relaying rank receives hops into its staging: senders must not write into its shard
    let reshard_transport = connect(
        &reshard_links,
        dst_box
            .as_ref()
            .and_then(|b| shard.as_ref().map(|s| (s, b)))
            .filter(|_| !mine.relays()),
    )?;
    job.barrier()?;
    let baseline_links = Links::of_plans([&gather, &broadcast].into_iter().flatten());
    // the whole tensor lands in the full buffer, or in the shard of a rank that keeps it all
    let tensor = full
        .as_ref()
        .or(shard.as_ref().filter(|_| gb.gets_tensor(rank)));
    // (not where a phase relays: its hops land in staging, past the shared buffer)
    let relays = [&gather, &broadcast]
        .into_iter()
        .flatten()
        .any(RankPlan::relays);
    let baseline_transport = connect(
        &baseline_links,
        tensor.map(|f| (f, &whole)).filter(|_| !relays),
    )?;

    let mut reshard = Measured::default();
    let mut gather_broadcast = Measured::default();
    let mut checked = 0;
    for i in 0..args.repetitions() {
        let timed = i >= args.warmup;
        for method in Method::order(i) {
            if let Some(s) = shard.as_deref_mut() {
                poison(s);
            }
            if let (Method::GatherBroadcast, Some(f)) = (method, full.as_deref_mut()) {
                poison(f);
            }
            match method {
                Method::Reshard => reshard.repeat(job, timed, 0, || {
                    let work = RankJob {
                        plan: &mine,
                        src_layout: src,
                        src: src_box.as_ref().zip(source.as_deref()),
                        dst: dst_box.as_ref().zip(shard.as_deref_mut()),
                        dst_dtype: dst.dtype(),
                        quant: None,
                    };
                    exec::run_rank_any(work, &*reshard_transport, options)
                })?,
                Method::GatherBroadcast => {
                    let full_bytes = full.as_ref().map_or(0, |f| f.len() as u64);
                    gather_broadcast.repeat(job, timed, full_bytes, || {
                        let work = BaselineJob {
                            baseline: gb,
                            gather: gather.as_ref(),
                            broadcast: broadcast.as_ref(),
                            src: src_box.as_ref().zip(source.as_deref()),
                            full: full.as_deref_mut(),
                            dst: dst_box.as_ref().zip(shard.as_deref_mut()),
                        };
                        baseline::run_rank_gather_broadcast(
                            rank,
                            work,
                            &*baseline_transport,
                            options,
                        )
                    })?
                }
            }
            bar.inc(1);
            verify(fill, plan, rank, shard.as_deref())?;
            checked += 1;
        }
    }
    let report = serde_json::json!({
        "reshard": reshard.report(),
        "gather_broadcast": gather_broadcast.report(),
        "verified": checked == 2 * args.repetitions(),
    });
    Ok((report, reshard_transport.name().to_string()))
}

/// Checks this rank's destination shard against the fill.
fn verify(fill: Fill, plan: &Plan, rank: Rank, shard: Option<&[u8]>) -> Result<(), Error> {
    match (plan.dst().local_region(rank), shard) {
        (Some(region), Some(buf)) => {
            fill.verify_converted(plan.src().dtype(), plan.dst(), &region, buf, (rank, 0))
        }
        _ => Ok(()),
    }
}
