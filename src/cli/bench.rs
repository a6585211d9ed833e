//! `reshard bench`: reshard against gather+broadcast on the same transport, the same data and
//! the same buffers, repetition after repetition in turn, every repetition's result verified.

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use reshard::agreement::Fingerprint;
use reshard::error::Dims;
use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, RankJob};
use reshard::fill::Fill;
use reshard::plan::GatherBroadcast;
use reshard::runtime::{AnyTransport, Destination, Links, World};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Plan, Rank, RankPlan};

use super::exec_args::{ExecArgs, check_memory, with_plan};
use super::measure::{Measured, Method, MethodJson, conclude};
use super::units::{bytes, parse_bytes};
use super::{Failure, TensorArgs};

/// A named set of layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Suite {
    /// Refit-like layouts of training and inference parallelism, on at most 8 ranks.
    Refit,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Global tensor shape (not with --suite).
    #[arg(long, value_name = "D0,D1,...", required_unless_present = "suite")]
    shape: Option<String>,
    /// Element type.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Destination element type (default: --dtype), converted by the senders as they pack.
    #[arg(long, value_name = "DTYPE")]
    dst_dtype: Option<String>,
    /// Source layout, e.g. "mesh=4 place=S(0)" (not with --suite).
    #[arg(long, value_name = "SPEC", required_unless_present = "suite")]
    src: Option<String>,
    /// Destination layout, e.g. "mesh=2 place=S(1)" (not with --suite).
    #[arg(long, value_name = "SPEC", required_unless_present = "suite")]
    dst: Option<String>,
    /// Run a named suite of layouts instead of one.
    #[arg(long, value_enum, conflicts_with_all = ["shape", "src", "dst"])]
    suite: Option<Suite>,
    /// Size of each tensor of the suite (its shapes scale to it).
    #[arg(
        long,
        value_name = "BYTES",
        default_value = "128MiB",
        requires = "suite"
    )]
    suite_bytes: String,
    /// Split a piece among the replicas that hold it only into parts of at least this size.
    #[arg(long, value_name = "BYTES", default_value = "64KiB")]
    min_split_bytes: String,
    #[command(flatten)]
    exec: ExecArgs,
    /// Contents of the global tensor: hash or hash:SEED (location-sensitive for every dtype),
    /// index (element i holds i mod 2^bits, which repeats every 2^bits elements), or normal
    /// or normal:SEED (float dtypes only: finite values of varied magnitude).
    #[arg(long, default_value = "hash")]
    fill: String,
    /// Timed repetitions of each method (the report gives their median, min and max).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed repetitions of each method first.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Print a JSON report instead of text.
    #[arg(long)]
    json: bool,
}

/// One layout pair to measure.
struct Case {
    name: String,
    src_spec: String,
    dst_spec: String,
    plan: Plan,
    baseline: GatherBroadcast,
    /// The `--suite-bytes` text a suite case's shape was scaled from: the option to blame when
    /// the case is too large, since the user never wrote its `--shape`.
    sized_by: Option<String>,
}

impl Case {
    fn new(name: &str, tensor: TensorArgs) -> Result<Case, Error> {
        let plan = tensor.plan()?;
        let baseline = GatherBroadcast::new(plan.src(), plan.dst())?;
        Ok(Case {
            name: name.to_string(),
            src_spec: tensor.src,
            dst_spec: tensor.dst,
            plan,
            baseline,
            sized_by: None,
        })
    }

    /// [`check_memory`] for this case's buffers on `rank` (all ranks: `None`); a suite case
    /// names `--suite-bytes` and the case rather than a `--shape` nobody gave.
    fn check_memory(&self, rank: Option<Rank>) -> Result<(), Error> {
        let shape = self.plan.src().shape();
        check_memory(self.memory(rank), shape).map_err(|e| match (e, &self.sized_by) {
            (Error::InvalidOption { reason, .. }, Some(text)) => Error::InvalidOption {
                field: "--suite-bytes",
                value: text.clone(),
                reason: format!(
                    "case {} (shape {}): {reason}",
                    self.name,
                    Dims(shape.to_vec())
                ),
            },
            (e, _) => e,
        })
    }

    fn dst_bytes(&self) -> u64 {
        self.plan.dst().shard_bytes()
    }

    fn highest_rank(&self) -> Rank {
        self.plan
            .ranks()
            .into_iter()
            .chain(self.baseline.ranks())
            .max()
            .unwrap_or(0)
    }

    /// Bytes of every buffer the case allocates on `rank` (or on all ranks).
    fn memory(&self, rank: Option<Rank>) -> u64 {
        let (src, dst) = (self.plan.src(), self.plan.dst());
        let full = self.baseline.full_bytes();
        let ranks = match rank {
            Some(r) => vec![r],
            None => self.baseline.ranks(),
        };
        let fulls = ranks
            .iter()
            .filter(|&&r| self.baseline.needs_full_buffer(r))
            .count() as u64;
        let shards = match rank {
            Some(r) => src.local_bytes(r).saturating_add(dst.local_bytes(r)),
            None => src.shard_bytes().saturating_add(dst.shard_bytes()),
        };
        shards.saturating_add(fulls.saturating_mul(full))
    }
}

/// The layouts of `--suite refit`: training-to-inference moves scaled to `bytes` per tensor.
fn refit_suite(
    bytes: u64,
    bytes_text: &str,
    (dtype, dst_dtype): (&str, Option<&str>),
    min_split_bytes: &str,
) -> Result<Vec<Case>, Error> {
    let elem = dtype.parse::<reshard::DType>()?.size() as u64;
    let elements = (bytes / elem).max(64 * 64);
    // a square matrix of about `elements`, and 16 stacked experts [16, m, 2m]
    let side = round_down((elements as f64).sqrt() as u64, 64).max(64);
    let m = round_down(((elements / 32) as f64).sqrt() as u64, 16).max(16);
    let square = format!("{side},{side}");
    let experts = format!("16,{m},{}", 2 * m);
    let cases: [(&str, &str, &str, &str); 9] = [
        (
            "tp4-to-tp2",
            &square,
            "mesh=4 place=S(0)",
            "mesh=2 place=S(1)",
        ),
        (
            "dp2xtp2-to-tp4",
            &square,
            "mesh=2x2 place=R,S(0)",
            "mesh=4 place=S(1)",
        ),
        (
            "ep4-experts-to-tp2",
            &experts,
            "mesh=4 place=S(0)",
            "mesh=2 place=S(1)",
        ),
        (
            "fsdp2xtp2-to-tp4",
            &square,
            "mesh=2x2 place=S(0),S(1)",
            "mesh=4 place=S(0)",
        ),
        (
            "tp2-to-dp2xtp2",
            &square,
            "mesh=2 place=S(0)",
            "mesh=2x2 place=R,S(0)",
        ),
        (
            "colocated-tp4-to-tp2",
            &square,
            "mesh=4 place=S(0)",
            "mesh=2 ranks=0..2 place=S(1)",
        ),
        (
            "seed-2-to-4",
            &square,
            "mesh=2 place=S(0)",
            "mesh=4 place=S(1)",
        ),
        (
            "replicated-2-to-4",
            &square,
            "mesh=2 place=R",
            "mesh=4 place=R",
        ),
        (
            "tp4-s0-to-tp4-s1",
            &square,
            "mesh=4 place=S(0)",
            "mesh=4 place=S(1)",
        ),
    ];
    cases
        .iter()
        .map(|(name, shape, src, dst)| {
            let tensor = TensorArgs {
                shape: shape.to_string(),
                dtype: dtype.to_string(),
                dst_dtype: dst_dtype.map(str::to_string),
                src: src.to_string(),
                dst: dst.to_string(),
                min_split_bytes: min_split_bytes.to_string(),
            };
            Case::new(name, tensor).map(|case| Case {
                sized_by: Some(bytes_text.to_string()),
                ..case
            })
        })
        .collect()
}

fn round_down(n: u64, to: u64) -> u64 {
    n / to * to
}

impl BenchArgs {
    fn cases(&self) -> Result<Vec<Case>, Error> {
        if self.suite.is_some() {
            let bytes = parse_bytes("--suite-bytes", &self.suite_bytes)?;
            return refit_suite(
                bytes,
                &self.suite_bytes,
                (&self.dtype, self.dst_dtype.as_deref()),
                &self.min_split_bytes,
            );
        }
        let tensor = TensorArgs {
            shape: self.shape.clone().unwrap_or_default(),
            dtype: self.dtype.clone(),
            dst_dtype: self.dst_dtype.clone(),
            src: self.src.clone().unwrap_or_default(),
            dst: self.dst.clone().unwrap_or_default(),
            min_split_bytes: self.min_split_bytes.clone(),
        };
        Ok(vec![Case::new("", tensor)?])
    }

    fn repetitions(&self) -> u32 {
        self.warmup + self.iters
    }
}

/// What every rank of the job must run alike: every case's tensor and layouts (a suite's
/// named by case), the fill, the repetitions and the executor's options.
fn fingerprint(args: &BenchArgs, cases: &[Case], fill: Fill, options: &ExecOptions) -> Fingerprint {
    let fingerprint = Fingerprint::new("bench").with(
        "--suite",
        args.suite.map_or("(none)", |s| match s {
            Suite::Refit => "refit",
        }),
    );
    let fingerprint = cases.iter().fold(fingerprint, |fp, case| {
        let prefix = match case.name.as_str() {
            "" => String::new(),
            name => format!("case {name}: "),
        };
        with_plan(fp, &prefix, &case.plan)
    });
    let fingerprint = fingerprint
        .with("--fill", fill)
        .with("--iters", args.iters)
        .with("--warmup", args.warmup);
    args.exec.agreed(options, fingerprint)
}

#[derive(Serialize)]
struct CaseJson {
    #[serde(skip_serializing_if = "String::is_empty")]
    name: String,
    shape: Vec<u64>,
    dtype: String,
    /// The destination's dtype (`--dst-dtype`): `dst_bytes` and the reshard's `wire_bytes`
    /// count it; gather+broadcast moves the source's dtype and converts as ranks keep boxes.
    dst_dtype: String,
    src: String,
    dst: String,
    transport: String,
    iters: u32,
    verified: bool,
    /// Whether both methods ran with `--checksum`; left out when not.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    checksummed: bool,
    dst_bytes: u64,
    reshard: MethodJson,
    gather_broadcast: MethodJson,
    speedup: f64,
    /// Wire bytes of gather+broadcast over those of the reshard: the speedup a machine whose
    /// time follows bytes would show.
    byte_ratio: f64,
}

#[derive(Serialize)]
struct SuiteJson {
    suite: String,
    transport: String,
    cases: Vec<CaseJson>,
}

pub fn main(args: &BenchArgs) -> Result<(), Failure> {
    // Everything the user typed is checked before a buffer is allocated or a byte moves.
    let cases = args.cases()?;
    let fill: Fill = args.fill.parse()?;
    for case in &cases {
        fill.check_dtype(case.plan.src().dtype())?;
    }
    let options = args.exec.options()?;
    let world = args.exec.join(&options)?;
    let results = match world.rank() {
        None => bench_threads(args, &cases, fill, &options)?,
        Some(rank) => {
            let highest = cases.iter().map(Case::highest_rank).max().unwrap_or(0);
            let ready = world.check_size(highest).and_then(|()| {
                cases
                    .iter()
                    .try_for_each(|case| case.check_memory(Some(rank)))
            });
            world.agree("bench", ready, || fingerprint(args, &cases, fill, &options))?;
            bench_processes(args, &cases, fill, &options, &world)?
        }
    };
    if let Some((name, results)) = results {
        report(args, &cases, &name, &results);
    }
    Ok(())
}

/// One case's outcome on one run: both methods measured, both verified.
#[derive(Clone, Debug, Default)]
struct CaseResult {
    reshard: Measured,
    gather_broadcast: Measured,
    /// Whether every repetition of both methods was checked and matched the fill (on every
    /// rank); a mismatch fails the bench, so a report says false only if nothing was checked.
    verified: bool,
}

/// A progress bar on a terminal, over every repetition of every case and method.
fn progress(args: &BenchArgs, cases: usize) -> ProgressBar {
    let bar = ProgressBar::new(cases as u64 * u64::from(args.repetitions()) * 2);
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
fn poison(buf: &mut [u8]) {
    reshard::exec::copy::fill_around_caches(buf, 0xA5);
}

/// Every rank a thread of this process.
fn bench_threads(
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
fn bench_processes(
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
    let connect = |links: &Links, destination: Destination<'_>| {
        world.connect(links, cases.iter().map(|c| c.plan.src()), destination)
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
            let (report, transport) = bench_rank(args, case, fill, options, job, &connect, &bar)?;
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
    let mine = reshard::plan::rank_plan(src, dst, rank, &plan.options())?;
    let part = |p: &Option<Plan>| -> Result<Option<RankPlan>, Error> {
        p.as_ref()
            .filter(|p| p.ranks().contains(&rank))
            .map(|p| reshard::plan::rank_plan(p.src(), p.dst(), rank, &p.options()))
            .transpose()
    };
    let (gather, broadcast) = (part(&gb.gather)?, part(&gb.broadcast)?);

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
    let reshard_transport = connect(
        &reshard_links,
        dst_box
            .as_ref()
            .and_then(|b| shard.as_ref().map(|s| (s, b))),
    )?;
    job.barrier()?;
    let mut baseline_links = Links::default();
    for p in [&gather, &broadcast].into_iter().flatten() {
        baseline_links.senders.extend(p.senders());
        baseline_links.receivers.extend(p.receivers());
    }
    // the whole tensor lands in the full buffer, or in the shard of a rank that keeps it all
    let tensor = full
        .as_ref()
        .or(shard.as_ref().filter(|_| gb.gets_tensor(rank)));
    let baseline_transport = connect(&baseline_links, tensor.map(|f| (f, &whole)))?;

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
                    };
                    exec::run_rank(work, &*reshard_transport, options)
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

fn report(args: &BenchArgs, cases: &[Case], transport: &str, results: &[CaseResult]) {
    let json_of = |case: &Case, r: &CaseResult| {
        let dst_bytes = case.dst_bytes();
        let reshard = MethodJson::of(&r.reshard, dst_bytes);
        let gather_broadcast = MethodJson::of(&r.gather_broadcast, dst_bytes);
        CaseJson {
            name: case.name.clone(),
            shape: case.plan.src().shape().to_vec(),
            dtype: case.plan.src().dtype().to_string(),
            dst_dtype: case.plan.dst().dtype().to_string(),
            src: case.src_spec.clone(),
            dst: case.dst_spec.clone(),
            transport: transport.to_string(),
            iters: args.iters,
            verified: r.verified,
            checksummed: args.exec.checksum,
            dst_bytes,
            speedup: gather_broadcast.median_s / reshard.median_s.max(1e-12),
            byte_ratio: r.gather_broadcast.wire_bytes as f64 / r.reshard.wire_bytes.max(1) as f64,
            reshard,
            gather_broadcast,
        }
    };
    let all: Vec<CaseJson> = cases
        .iter()
        .zip(results)
        .map(|(c, r)| json_of(c, r))
        .collect();
    if args.json {
        let text = match (args.suite, all.len()) {
            (None, 1) => serde_json::to_string_pretty(&all[0]),
            _ => serde_json::to_string_pretty(&SuiteJson {
                suite: "refit".into(),
                transport: transport.to_string(),
                cases: all,
            }),
        };
        println!("{}", text.expect("bench JSON serializes"));
        return;
    }
    println!(
        "reshard vs gather+broadcast over {transport}, median of {} (after {} warm-up), every destination byte verified{}",
        args.iters,
        args.warmup,
        if args.exec.checksum {
            ", every transfer checksummed"
        } else {
            ""
        }
    );
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>11} {:>11}",
        "case",
        "dst",
        "reshard",
        "g+b",
        "reshard",
        "GB/s",
        "g+b GB/s",
        "speedup",
        "bytes",
        "extra mem",
        "g+b extra"
    );
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>11} {:>11}",
        "", "bytes", "ms", "ms", "wire", "", "", "", "ratio", "reshard", "per rank"
    );
    for (case, j) in cases.iter().zip(&all) {
        let name = if case.name.is_empty() {
            println!(
                "{}: {} -> {}",
                j.shape
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join("x"),
                case.src_spec,
                case.dst_spec
            );
            format!("{}-D {}", j.shape.len(), j.dtype)
        } else {
            case.name.clone()
        };
        println!(
            "{:<22} {:>10} {:>10.2} {:>10.2} {:>10} {:>9.2} {:>9.2} {:>7.2}x {:>6.2}x {:>11} {:>11}",
            name,
            bytes(j.dst_bytes),
            j.reshard.median_s * 1e3,
            j.gather_broadcast.median_s * 1e3,
            bytes(j.reshard.wire_bytes),
            j.reshard.gbps,
            j.gather_broadcast.gbps,
            j.speedup,
            j.byte_ratio,
            bytes(j.reshard.peak_extra_bytes_per_rank),
            bytes(j.gather_broadcast.peak_extra_bytes_per_rank),
        );
    }
}
