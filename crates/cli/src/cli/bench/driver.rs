//! Running the methods of `reshard bench` on every case, either with every rank a thread of
//! this process or with this process one rank of a job; rank 0 gathers what every rank
//! measured. Each variant describes its methods to the harness
//! ([`reshard::runtime::harness`]): the plain reshard against gather+broadcast here,
//! the quantizing ones in [`super::quant`], an already-quantized source in [`super::prequant`].

use indicatif::{ProgressBar, ProgressStyle};

use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, RankJob};
use reshard::fill::Fill;
use reshard::plan::GatherBroadcast;
use reshard::runtime::harness::{Checked, Compare, Repeat, Sample, compare};
use reshard::runtime::{AnyTransport, Destination, Links, TransportKind, World};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Plan, Rank, RankPlan, Region};

use super::args::BenchArgs;
use super::result::{CaseResult, Method};
use super::suite::Case;
use super::{prequant, quant};
use crate::cli::Failure;
use crate::cli::measure::conclude;
use reshard::runtime::harness::poison;

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

/// The two methods of a plain case, in the order of the first repetition.
fn methods() -> Vec<Method> {
    vec![Method::Reshard, Method::GatherBroadcast]
}

/// A plain case between threads: every rank's buffers.
struct Threads<'a> {
    plan: &'a Plan,
    gb: &'a GatherBroadcast,
    fill: Fill,
    options: &'a ExecOptions,
    sources: std::collections::BTreeMap<Rank, Vec<u8>>,
    shards: std::collections::BTreeMap<Rank, Vec<u8>>,
    full: std::collections::BTreeMap<Rank, Vec<u8>>,
}

impl Compare for Threads<'_> {
    type Method = Method;
    fn methods(&self) -> Vec<Method> {
        methods()
    }
    fn poison(&mut self, m: Method) {
        self.shards.values_mut().for_each(|s| poison(s));
        if m == Method::GatherBroadcast {
            self.full.values_mut().for_each(|f| poison(f));
        }
    }
    fn run(&mut self, m: Method) -> Result<Sample, Error> {
        let stats = match m {
            Method::GatherBroadcast => baseline::run_local_gather_broadcast(
                self.gb,
                &mut self.sources,
                &mut self.shards,
                &mut self.full,
                self.options,
            )?,
            _ => exec::run_local(self.plan, &self.sources, &mut self.shards, self.options)?,
        };
        Ok(Sample::of_run(&stats))
    }
    fn verify(&mut self, _: Method) -> Result<Checked, Error> {
        let (from, dst) = (self.plan.src().dtype(), self.plan.dst());
        self.fill.verify_shards_converted(from, dst, &self.shards)?;
        let held: u64 = self.shards.values().map(|s| s.len() as u64).sum();
        Ok(Checked::new(held, held))
    }
    fn extra_bytes(&self, m: Method) -> u64 {
        match (m, self.full.is_empty()) {
            (Method::GatherBroadcast, false) => self.gb.full_bytes(),
            _ => 0,
        }
    }
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
    let repeat = args.repeat();
    let mut results = Vec::new();
    for case in cases {
        bar.set_message(case.name.clone());
        if let Some(coupled) = &case.coupled {
            results.push(prequant::threads(
                repeat, case, coupled, fill, options, &bar,
            )?);
            continue;
        }
        if let (Some(plain), Some(q)) = (&case.plain, case.plan.quant()) {
            results.push(quant::threads(
                repeat,
                case,
                (plain, q),
                fill,
                options,
                &bar,
            )?);
            continue;
        }
        let (plan, gb) = (&case.plan, &case.baseline);
        let mut subject = Threads {
            plan,
            gb,
            fill,
            options,
            sources: fill.shards(plan.src())?,
            shards: exec::zeroed_shards(plan.dst())?,
            full: baseline::full_buffers(gb)?,
        };
        let found = compare(&mut subject, repeat, None::<&dyn Job>, &mut || bar.inc(1))?;
        results.push(CaseResult::of(&found));
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
    let repeat = args.repeat();
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
                        repeat, case, coupled, fill, options, job, &connect, direct, &bar,
                    )?
                }
                (None, Some(plain), Some(q)) => {
                    quant::rank(repeat, case, (plain, q), fill, options, job, &connect, &bar)?
                }
                _ => bench_rank(repeat, case, fill, options, job, &connect, &bar)?,
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
    let results = (0..cases.len())
        .map(|c| {
            let per_rank: Vec<&serde_json::Value> =
                reports.ranks.iter().map(|r| &r["cases"][c]).collect();
            CaseResult::combine(&per_rank)
        })
        .collect();
    Ok(Some((name, results)))
}

/// Connects a rank's links to its peers ([`World::connect`]).
type Connect<'c, 'j> = &'c dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>;

/// This process's rank of a plain case: its shards and both methods' links.
struct OwnRank<'a, 'j> {
    rank: Rank,
    plan: &'a Plan,
    gb: &'a GatherBroadcast,
    fill: Fill,
    options: &'a ExecOptions,
    connect: Connect<'a, 'j>,
    mine: RankPlan,
    gather: Option<RankPlan>,
    broadcast: Option<RankPlan>,
    src_box: Option<Region>,
    dst_box: Option<Region>,
    source: Option<Vec<u8>>,
    shard: Option<SharedBuffer>,
    full: Option<SharedBuffer>,
    whole: Region,
    reshard: Option<AnyTransport<'j>>,
    baseline: Option<AnyTransport<'j>>,
}

impl Compare for OwnRank<'_, '_> {
    type Method = Method;
    fn methods(&self) -> Vec<Method> {
        methods()
    }
    fn connect(&mut self, m: Method) -> Result<(), Error> {
        match m {
            Method::GatherBroadcast => {
                let links = Links::of_plans([&self.gather, &self.broadcast].into_iter().flatten());
                // the whole tensor lands in the full buffer, or in the shard of a rank that
                // keeps it all (not where a phase relays: its hops land in staging, past the
                // shared buffer)
                let tensor = self.full.as_ref().or(self
                    .shard
                    .as_ref()
                    .filter(|_| self.gb.gets_tensor(self.rank)));
                let relays = [&self.gather, &self.broadcast]
                    .into_iter()
                    .flatten()
                    .any(RankPlan::relays);
                let destination = tensor.map(|f| (f, &self.whole)).filter(|_| !relays);
                self.baseline = Some((self.connect)(&links, destination)?);
            }
            _ => {
                let links = Links {
                    senders: self.mine.senders(),
                    receivers: self.mine.receivers(),
                };
                // a relaying rank receives hops into its staging: senders must not write into
                // its shard
                let destination = self
                    .dst_box
                    .as_ref()
                    .and_then(|b| self.shard.as_ref().map(|s| (s, b)))
                    .filter(|_| !self.mine.relays());
                self.reshard = Some((self.connect)(&links, destination)?);
            }
        }
        Ok(())
    }
    fn poison(&mut self, m: Method) {
        if let Some(s) = self.shard.as_deref_mut() {
            poison(s);
        }
        if let (Method::GatherBroadcast, Some(f)) = (m, self.full.as_deref_mut()) {
            poison(f);
        }
    }
    fn run(&mut self, m: Method) -> Result<Sample, Error> {
        let rank = self.rank;
        let not_connected = || Error::Internal {
            rank,
            detail: "a bench method ran before its links were opened".into(),
        };
        let (src, dst) = (self.plan.src(), self.plan.dst());
        let stats = match m {
            Method::GatherBroadcast => {
                let transport = self.baseline.as_ref().ok_or_else(not_connected)?;
                let work = BaselineJob {
                    baseline: self.gb,
                    gather: self.gather.as_ref(),
                    broadcast: self.broadcast.as_ref(),
                    src: self.src_box.as_ref().zip(self.source.as_deref()),
                    full: self.full.as_deref_mut(),
                    dst: self.dst_box.as_ref().zip(self.shard.as_deref_mut()),
                };
                baseline::run_rank_gather_broadcast(rank, work, &**transport, self.options)?
            }
            _ => {
                let transport = self.reshard.as_ref().ok_or_else(not_connected)?;
                let work = RankJob {
                    plan: &self.mine,
                    src_layout: src,
                    src: self.src_box.as_ref().zip(self.source.as_deref()),
                    dst: self.dst_box.as_ref().zip(self.shard.as_deref_mut()),
                    dst_dtype: dst.dtype(),
                    quant: None,
                };
                exec::run_rank_any(work, &**transport, self.options)?
            }
        };
        Ok(Sample::of_rank(&stats))
    }
    fn verify(&mut self, _: Method) -> Result<Checked, Error> {
        let (plan, rank) = (self.plan, self.rank);
        let held = self.shard.as_ref().map_or(0, |s| s.len() as u64);
        match (plan.dst().local_region(rank), self.shard.as_deref()) {
            (Some(region), Some(buf)) => {
                let from = plan.src().dtype();
                self.fill
                    .verify_converted(from, plan.dst(), &region, buf, (rank, 0))?;
                Ok(Checked::new(buf.len() as u64, held))
            }
            _ => Ok(Checked::new(0, held)),
        }
    }
    fn extra_bytes(&self, m: Method) -> u64 {
        match m {
            Method::GatherBroadcast => self.full.as_ref().map_or(0, |f| f.len() as u64),
            _ => 0,
        }
    }
}

/// This rank's share of one case: both methods, in turn, on the same buffers. Returns the
/// report for rank 0 and the transport's name.
fn bench_rank<'j, J: Job + ?Sized>(
    repeat: Repeat,
    case: &Case,
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: Connect<'_, 'j>,
    bar: &ProgressBar,
) -> Result<(serde_json::Value, String), Error> {
    let rank = job.rank();
    let (plan, gb) = (&case.plan, &case.baseline);
    let (src, dst) = (plan.src(), plan.dst());
    let (gather, broadcast) = gb.rank_parts(rank);
    let dst_box = dst.local_region(rank);
    let shared = |len: u64| SharedBuffer::new(len as usize);
    let mut subject = OwnRank {
        rank,
        plan,
        gb,
        fill,
        options,
        connect,
        mine: plan.rank_part(rank),
        gather,
        broadcast,
        src_box: src.local_region(rank),
        source: fill.shard(src, rank)?,
        shard: dst_box
            .as_ref()
            .map(|_| shared(dst.local_bytes(rank)))
            .transpose()?,
        dst_box,
        full: gb
            .needs_full_buffer(rank)
            .then(|| shared(gb.full_bytes()))
            .transpose()?,
        whole: Region::full(dst.shape()),
        reshard: None,
        baseline: None,
    };
    let found = compare(&mut subject, repeat, Some(job), &mut || bar.inc(1))?;
    let name = subject
        .reshard
        .as_ref()
        .map_or("?", |t| t.name())
        .to_string();
    Ok((CaseResult::rank_report(&found), name))
}
