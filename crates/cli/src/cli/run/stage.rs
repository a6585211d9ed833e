//! `reshard run --stage`: a stream of refits of one tensor while every destination rank
//! serves from its live shard ([`reshard::runtime::rollout`]), each version moved by every
//! method asked for (`--stage-methods`), in turn, into live shards of its own: in place (the
//! engine stopped for the whole refit) or staged beside them and committed on every rank or
//! none (dense, or as deltas with `--delta`). Every version is checked against the evolving
//! fill with `--verify`.

use std::collections::BTreeMap;

use reshard::evolve::Evolution;
use reshard::exec::ExecOptions;
use reshard::exec::delta::{DeltaOptions, DeltaRefit, DeltaSession};
use reshard::fill::Fill;
use reshard::runtime::harness::in_turn;
use reshard::runtime::refit::stage::StageMethod;
use reshard::runtime::rollout::{Rollout, Standing, VersionServed, rolling_groups, summarize};
use reshard::runtime::serve::ServeOptions;
use reshard::runtime::{PlanRank, World};
use reshard::{Error, Plan, Rank};

use super::args::RunArgs;
use crate::cli::Failure;
use crate::cli::exec_args::run_options;
use crate::cli::measure::conclude;

/// One method's stream on this process.
struct Stream {
    method: StageMethod,
    rollout: Rollout,
}

/// Runs `run --stage`.
pub(super) fn main(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<(), Failure> {
    let d = &args.delta;
    super::stream_of_one_tensor(plan, "--stage")?;
    let methods = d.stage_methods()?;
    let evolution = d.evolution(fill, plan.src().dtype())?;
    let delta = d.options()?;
    // each group whole replicas of the destination layout, refused before any byte moves
    let groups = match d.rolling {
        Some(g) => rolling_groups(&plan.dst().replicas(), g as usize)?,
        None => Vec::new(),
    };
    let mine: Vec<Rank> = world.ranks(plan.dst()).collect();
    let mut streams = Vec::new();
    for &method in &methods {
        let live = mine
            .iter()
            .map(|&r| (r, vec![vec![0u8; plan.dst().local_bytes(r) as usize]]))
            .collect();
        let rollout = Rollout::new(
            method.method(),
            DeltaSession::new(),
            live,
            ServeOptions::default(),
            groups.clone(),
        )?;
        streams.push(Stream { method, rollout });
    }
    let Some(job) = world.job() else {
        let versions = versions(args, plan, &evolution, delta, options, world, &mut streams);
        dump_live(args, &streams, &mine)?;
        print(args, plan, &evolution, &versions?, plan.ranks().len());
        return Ok(());
    };
    let ready = world.check_size(super::highest(plan));
    world.agree("run", ready, || {
        super::fingerprint(args, plan, fill, options)
            .with("--stage", true)
            .with("--delta", d.delta)
            .with("--steps", d.steps())
            .with("--delta-update", format!("{:?}", d.update()))
            .with("--delta-anchor", format!("{:?}", d.delta_anchor))
            .with("--stage-methods", format!("{:?}", d.stage_methods))
            .with("--rolling", format!("{:?}", d.rolling))
    })?;
    let outcome = versions(args, plan, &evolution, delta, options, world, &mut streams);
    // what every destination rank serves at the end, stopped short or not, as its bytes
    dump_live(args, &streams, &mine)?;
    let stopped = outcome.is_err();
    let outcome = outcome.map(|v| serde_json::json!({ "versions": v }));
    let concluded = conclude(world, outcome);
    // a stream that stopped short, or whose job failed at its end: say what is served
    if stopped || concluded.is_err() {
        for s in &streams {
            for &r in &mine {
                eprintln!("{}", standing(s, r));
            }
        }
    }
    if let Some(reports) = concluded? {
        let combined = VersionServed::of_job(&reports.ranks);
        print(args, plan, &evolution, &combined, job.world());
    }
    Ok(())
}

/// `--dump DIR`: each of this process's destination ranks writes the live shard it serves
/// at the end (the first method's), as `DIR/rank<R>.bin`, whole or not at all: after a
/// stream stopped short, the bytes say which version a rank serves.
fn dump_live(args: &RunArgs, streams: &[Stream], mine: &[Rank]) -> Result<(), Error> {
    let (Some(dir), Some(first)) = (&args.dump, streams.first()) else {
        return Ok(());
    };
    let live: Vec<(Rank, Vec<u8>)> = mine
        .iter()
        .filter_map(|&r| {
            let shard = first.rollout.live(r)?;
            let guard = shard.read().unwrap_or_else(|e| e.into_inner());
            Some((r, guard.first().cloned().unwrap_or_default()))
        })
        .collect();
    super::dump::dump(dir, live.iter().map(|(r, b)| (*r, b.as_slice())))
}

fn standing(s: &Stream, rank: Rank) -> Standing {
    Standing {
        method: s.method.name().into(),
        ..s.rollout.standing(rank)
    }
}

/// Every version, every method in turn: this process's part of each refit.
fn versions(
    args: &RunArgs,
    plan: &Plan,
    evolution: &Evolution,
    delta: DeltaOptions,
    options: &ExecOptions,
    world: &World,
    streams: &mut [Stream],
) -> Result<Vec<VersionServed>, Error> {
    let mut out = Vec::new();
    let src_ranks: Vec<Rank> = world.ranks(plan.src()).collect();
    for version in 1..=args.delta.steps() {
        let sources = super::sources_at(plan, evolution, &src_ranks, version);
        // the methods in turn, each going first in turn
        for at in in_turn((0..streams.len()).collect(), version as u32) {
            let stream = &mut streams[at];
            let mut run = run_options(options);
            run.delta = stream.method.delta.then(|| DeltaRefit {
                session: stream.rollout.session().clone(),
                version,
                options: delta,
            });
            // between processes, the links are opened before the clock starts (one method's
            // at a time: a rank's shared-memory destination belongs to one set of links)
            let mut prepared: Option<PlanRank<'_>> = match world.job() {
                Some(_) => Some(world.prepare(plan)?),
                None => None,
            };
            let mut served = stream.rollout.refit(world, version, &run, |bufs, run| {
                match prepared.as_mut() {
                    // between processes: this rank's part, on links opened before; its
                    // destination (in shared memory) holds the buffer it is given
                    Some(mine) => {
                        let rank = mine.rank();
                        let given = bufs.get_mut(&rank).and_then(|b| b.first_mut());
                        if let (Some(to), Some(from)) = (mine.destination_mut(), given.as_deref()) {
                            to.copy_from_slice(from);
                        }
                        // same-host senders write into that destination once they start
                        world.barrier()?;
                        let source = sources.get(&rank).map(Vec::as_slice);
                        mine.run(source, run)?;
                        if let (Some(from), Some(to)) = (mine.destination(), given) {
                            to.copy_from_slice(from);
                        }
                        Ok(())
                    }
                    None => {
                        let mut dst: BTreeMap<Rank, Vec<u8>> = bufs
                            .iter_mut()
                            .map(|(&r, b)| (r, std::mem::take(&mut b[0])))
                            .collect();
                        let result = world.run(plan, &sources, &mut dst, run).map(|_| ());
                        for (r, b) in dst {
                            if let Some(bufs) = bufs.get_mut(&r) {
                                bufs[0] = b;
                            }
                        }
                        result
                    }
                }
            })?;
            served.method = stream.method.name().into();
            if args.verify {
                for &r in served.ranks.iter().map(|r| &r.rank) {
                    let Some(live) = stream.rollout.live(r) else {
                        continue;
                    };
                    let live = live.read().unwrap_or_else(|e| e.into_inner());
                    evolution.verify_shard_from(
                        plan.src().dtype(),
                        plan.dst(),
                        r,
                        &live[0],
                        version,
                    )?;
                }
            }
            out.push(served);
        }
    }
    Ok(out)
}

#[derive(serde::Serialize)]
struct StageJson<'a> {
    shape: Vec<u64>,
    dtype: String,
    update: String,
    ranks: usize,
    versions: &'a [VersionServed],
    methods: Vec<reshard::runtime::rollout::MethodSummary>,
    verified: bool,
}

fn print(
    args: &RunArgs,
    plan: &Plan,
    evolution: &Evolution,
    versions: &[VersionServed],
    ranks: usize,
) {
    let dst = plan.dst();
    let update = evolution.update.to_string();
    let methods = summarize(versions);
    if args.json {
        let json = StageJson {
            shape: dst.shape().to_vec(),
            dtype: dst.dtype().to_string(),
            update,
            ranks,
            versions,
            methods,
            verified: args.verify,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json).unwrap_or_default()
        );
        return;
    }
    println!(
        "refit while serving of {} {}: {} versions, {update}, {ranks} ranks; verified: {}",
        reshard::error::Dims(dst.shape().to_vec()),
        dst.dtype(),
        args.delta.steps(),
        if args.verify {
            "yes"
        } else {
            "no (add --verify)"
        }
    );
    print!("{}", crate::cli::stage_report::describe(versions, &methods));
}
