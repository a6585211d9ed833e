//! `reshard run`: execute a reshard on filled buffers; verify and dump the result.
//!
//! A run is a comparison of one method ([`reshard::runtime::harness`]): the harness
//! repeats it, poisons the destinations before and checks every byte after each repetition
//! with `--verify`, and times only the move, every rank's clock started from a barrier after
//! the poison. Ranks are threads of this process ([`Threads`]) or this process is one rank of
//! a job ([`OwnRank`]); an already-quantized source moves its values and scales together
//! ([`prequant`]).
//!
//! Its parts import one way: [`args`], [`method`] and [`dump`](mod@dump) stand alone, [`report`](mod@report) reads
//! the arguments, [`prequant`] uses all four, and this module dispatches to them.

use reshard::agreement::Fingerprint;
use reshard::convert::reference::QuantizedTensor;
use reshard::exec::{self, ExecOptions};
use reshard::fill::Fill;
use reshard::runtime::harness::{Checked, Compare, Sample, compare};
use reshard::runtime::refit::check;
use reshard::runtime::{PlanRank, RunOptions, World};
use reshard::{Error, Plan, Rank};

use super::Failure;
use super::exec_args::{check_memory, run_options, with_plan};

mod args;
mod delta;
mod dump;
mod method;
mod prequant;
mod report;
mod stage;

pub use args::RunArgs;
pub(super) use dump::check_dump_dir;
use dump::{dump, dump_named, dump_scales};
use method::Move;
pub(super) use prequant::check_fill as check_quantized_fill;
use report::{process_report, report};
use reshard::runtime::harness::poison;

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
    args.delta.check()?;
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
    if args.delta.stage {
        return stage::main(args, &plan, fill, &options, &world);
    }
    if args.delta.delta {
        return delta::main(args, &plan, fill, &options, &world);
    }
    match world.job() {
        None => run_threads(args, &plan, fill, &options),
        Some(_) => run_process(args, &plan, fill, &options, &world),
    }
}

/// The reference a destination is checked against: the fill itself, or, for a quantizing
/// plan, the fill quantized whole.
struct Reference {
    fill: Fill,
    quantized: Option<QuantizedTensor>,
}

impl Reference {
    /// With `--verify` (and, between processes, on a destination rank only: `needed`).
    fn new(args: &RunArgs, plan: &Plan, fill: Fill, needed: bool) -> Result<Reference, Error> {
        let quantized = match args.verify && needed {
            true => check::reference(plan, fill)?,
            false => None,
        };
        Ok(Reference { fill, quantized })
    }

    /// Checks `rank`'s destination shard (and its scales, for a quantizing plan); returns the
    /// bytes checked.
    fn verify(&self, plan: &Plan, rank: Rank, values: &[u8], scales: &[u8]) -> Result<u64, Error> {
        if let Some(reference) = &self.quantized {
            return check::verify_quantized(plan, reference, rank, values, scales);
        }
        let Some(region) = plan.dst().local_region(rank) else {
            return Ok(0);
        };
        let from = plan.src().dtype();
        self.fill
            .verify_converted(from, plan.dst(), &region, values, (rank, 0))?;
        Ok(values.len() as u64)
    }
}

/// Every rank a thread of this process: every rank's shards.
struct Threads<'a> {
    plan: &'a Plan,
    options: &'a ExecOptions,
    reference: Reference,
    sources: std::collections::BTreeMap<Rank, Vec<u8>>,
    shards: std::collections::BTreeMap<Rank, Vec<u8>>,
    scales: std::collections::BTreeMap<Rank, Vec<u8>>,
}

impl Compare for Threads<'_> {
    type Method = Move;
    fn methods(&self) -> Vec<Move> {
        vec![Move]
    }
    fn poison(&mut self, _: Move) {
        self.shards.values_mut().for_each(|s| poison(s));
        self.scales.values_mut().for_each(|s| poison(s));
    }
    fn run(&mut self, _: Move) -> Result<Sample, Error> {
        let (plan, options) = (self.plan, self.options);
        let stats = match plan.quant() {
            Some(_) => exec::run_local_quantized(
                plan,
                &self.sources,
                &mut self.shards,
                &mut self.scales,
                options,
            )?,
            None => exec::run_local(plan, &self.sources, &mut self.shards, options)?,
        };
        Ok(Sample::of_run(&stats))
    }
    fn verify(&mut self, _: Move) -> Result<Checked, Error> {
        let mut checked = Checked::default();
        for (&r, values) in &self.shards {
            let scales = self.scales.get(&r).map_or(&[][..], Vec::as_slice);
            let bytes = self.reference.verify(self.plan, r, values, scales)?;
            checked = checked + Checked::new(bytes, (values.len() + scales.len()) as u64);
        }
        Ok(checked)
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
    let mut threads = Threads {
        plan,
        options,
        reference: Reference::new(args, plan, fill, true)?,
        sources,
        shards: exec::zeroed_shards(plan.dst())?,
        scales: exec::zeroed_scale_shards(plan)?,
    };
    let found = compare(
        &mut threads,
        args.repeat(),
        None::<&dyn reshard::transport::Job>,
        &mut || {},
    )?;
    if let Some(dir) = &args.dump {
        dump(dir, threads.shards.iter().map(|(&r, b)| (r, b.as_slice())))?;
        dump_scales(dir, threads.scales.iter().map(|(&r, b)| (r, b.as_slice())))?;
    }
    report(args, plan, &found.of(Move), "local", found.verified);
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
    let outcome = rank_part(args, plan, fill, options, world);
    process_report(args, plan, world, outcome)
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
/// The source shards of `ranks` at `version` of `evolution`.
fn sources_at(
    plan: &Plan,
    evolution: &reshard::evolve::Evolution,
    ranks: &[Rank],
    version: u64,
) -> std::collections::BTreeMap<Rank, Vec<u8>> {
    let src = plan.src();
    ranks
        .iter()
        .map(|&r| {
            let mut buf = vec![0u8; src.local_bytes(r) as usize];
            if let Some(region) = src.local_region(r) {
                evolution.fill_region(src, &region, &mut buf, version);
            }
            (r, buf)
        })
        .collect()
}

/// Refuses a stream of refits (`flag`: `--delta`, `--stage`) of a quantizing plan: `run`'s
/// streams move one unquantized tensor; `refit --run` streams a quantized refit.
fn stream_of_one_tensor(plan: &Plan, flag: &'static str) -> Result<(), Error> {
    match plan.quant() {
        Some(q) => Err(Error::InvalidOption {
            field: reshard::error::Field::Flag(flag),
            value: q.quant.scheme.to_string(),
            reason: format!(
                "run {flag} moves one unquantized tensor; a quantized refit streams with \
                 refit --run {flag}"
            ),
        }),
        None => Ok(()),
    }
}

fn highest(plan: &Plan) -> Rank {
    plan.ranks().last().copied().unwrap_or(0)
}

/// The shard bytes one rank holds.
fn rank_bytes(plan: &Plan, rank: Rank) -> u64 {
    plan.src()
        .local_bytes(rank)
        .saturating_add(plan.dst().local_bytes(rank))
}

/// This process's rank: its own shards, over links opened once ([`World::prepare`]).
struct OwnRank<'a, 'w> {
    plan: &'a Plan,
    world: &'w World,
    run: RunOptions,
    reference: Reference,
    source: Option<Vec<u8>>,
    /// Its destination shard in shared memory, so that senders on this host write into it.
    mine: Option<PlanRank<'w>>,
}

impl Compare for OwnRank<'_, '_> {
    type Method = Move;
    fn methods(&self) -> Vec<Move> {
        vec![Move]
    }
    fn connect(&mut self, _: Move) -> Result<(), Error> {
        self.mine = Some(self.world.prepare(self.plan)?);
        Ok(())
    }
    fn poison(&mut self, _: Move) {
        if let Some(s) = self.mine.as_mut().and_then(PlanRank::destination_mut) {
            poison(s);
        }
        if let Some(s) = self.mine.as_mut().and_then(PlanRank::scales_mut) {
            poison(s);
        }
    }
    fn run(&mut self, _: Move) -> Result<Sample, Error> {
        let rank = self.world.rank().unwrap_or(0);
        let mine = self.mine.as_mut().ok_or_else(|| Error::Internal {
            rank,
            detail: "the run started before its links were opened".into(),
        })?;
        Ok(Sample::of_rank(
            &mine.run(self.source.as_deref(), &self.run)?,
        ))
    }
    fn verify(&mut self, _: Move) -> Result<Checked, Error> {
        let Some(mine) = self.mine.as_ref() else {
            return Ok(Checked::default());
        };
        let Some(values) = mine.destination() else {
            // no destination shard: nothing to check, nothing held
            return Ok(Checked::default());
        };
        let scales = mine.scales().unwrap_or_default();
        let bytes = self
            .reference
            .verify(self.plan, mine.rank(), values, scales)?;
        Ok(Checked::new(bytes, (values.len() + scales.len()) as u64))
    }
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
    let rank = world.rank().unwrap_or(0);
    let source = fill.shard(plan.src(), rank)?;
    if let (Some(dir), Some(buf)) = (&args.dump_src, &source) {
        dump_named(dir, "src", [(rank, &buf[..])])?;
    }
    let is_destination = plan.dst().local_region(rank).is_some();
    let mut own = OwnRank {
        plan,
        world,
        run: run_options(options),
        reference: Reference::new(args, plan, fill, is_destination)?,
        source,
        mine: None,
    };
    let found = compare(&mut own, args.repeat(), world.job(), &mut || {})?;
    let Some(mine) = own.mine.as_ref() else {
        return Err(Error::Internal {
            rank,
            detail: "the run ended without links".into(),
        });
    };
    if let (Some(dir), Some(buf)) = (&args.dump, mine.destination()) {
        dump(dir, [(rank, buf)])?;
    }
    if let (Some(dir), Some(buf)) = (&args.dump, mine.scales()) {
        dump_scales(dir, [(rank, buf)])?;
    }
    Ok(serde_json::json!({
        "transport": mine.transport_name(),
        "run": found.of(Move).report(),
        "verified": found.verified,
    }))
}
