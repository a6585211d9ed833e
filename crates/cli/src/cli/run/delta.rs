//! `reshard run --delta`: a stream of refits of one tensor, version after version, each after
//! a synthetic training step ([`reshard::evolve`]), moved by each method asked for
//! (`--delta-methods`): `delta` (the reshard carrying only what changed), `dense` (the
//! reshard moving everything) and `gather-broadcast` (the baseline, as a delta: the changed
//! elements gathered to one rank, then broadcast). Every method keeps its own destination
//! shards and its own state from version to version; the methods run in turn, their order
//! rotating, and every version is checked against the evolving fill with `--verify`.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use reshard::error::Field;
use reshard::evolve::Evolution;
use reshard::exec::ExecOptions;
use reshard::exec::delta::{DeltaOptions, DeltaRefit, DeltaReport, DeltaSession};
use reshard::fill::Fill;
use reshard::runtime::harness::in_turn;
use reshard::runtime::{RunOptions, World};
use reshard::{Error, Plan, Rank};

use super::args::RunArgs;
use crate::cli::Failure;
use crate::cli::exec_args::run_options;
use crate::cli::measure::conclude;
use crate::cli::units::bytes;

/// A method of a delta stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Method {
    Delta,
    Dense,
    GatherBroadcast,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Delta => "delta",
            Method::Dense => "dense",
            Method::GatherBroadcast => "gather-broadcast",
        }
    }
}

/// The methods `--delta-methods` lists.
fn methods(list: &str) -> Result<Vec<Method>, Error> {
    let mut out = Vec::new();
    for m in list.split(',').map(str::trim) {
        let method = match m {
            "delta" => Method::Delta,
            "dense" => Method::Dense,
            "gather-broadcast" => Method::GatherBroadcast,
            other => {
                return Err(Error::InvalidOption {
                    field: Field::Flag("--delta-methods"),
                    value: other.into(),
                    reason: "expected a list of delta, dense, gather-broadcast".into(),
                });
            }
        };
        if !out.contains(&method) {
            out.push(method);
        }
    }
    Ok(out)
}

/// One method's refit of one version, on one rank or on all.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
struct Refit {
    version: u64,
    method: String,
    seconds: f64,
    /// Bytes sent on the wire: values (encoded or dense), fences and headers.
    wire_bytes: u64,
    /// Of the delta transfers, elements and those changed.
    elems: u64,
    changed: u64,
    /// Receivers sent something dense, and why.
    dense_to: Vec<(Rank, String)>,
    /// The most bytes of bases and kept buffers one rank holds.
    base_bytes: u64,
    peak_encoded_bytes: u64,
    verified: bool,
}

impl Refit {
    fn absorb(&mut self, reports: &[DeltaReport]) {
        for r in reports {
            self.wire_bytes += r.wire_bytes();
            self.elems += r.sent.elems;
            self.changed += r.sent.changed;
            for &(to, why) in &r.dense_to {
                let why = why.to_string();
                if !self.dense_to.contains(&(to, why.clone())) {
                    self.dense_to.push((to, why));
                }
            }
            self.base_bytes = self.base_bytes.max(r.base_bytes + r.kept_scratch_bytes);
            self.peak_encoded_bytes = self.peak_encoded_bytes.max(r.peak_encoded_bytes);
        }
        self.dense_to.sort();
    }

    /// Every rank's part of one refit as one: the slowest rank's time, every rank's bytes.
    fn combine(parts: &[Refit]) -> Refit {
        let mut all = parts.first().cloned().unwrap_or_default();
        for p in parts.iter().skip(1) {
            all.seconds = all.seconds.max(p.seconds);
            all.wire_bytes += p.wire_bytes;
            all.elems += p.elems;
            all.changed += p.changed;
            all.dense_to.extend(p.dense_to.iter().cloned());
            all.base_bytes = all.base_bytes.max(p.base_bytes);
            all.peak_encoded_bytes = all.peak_encoded_bytes.max(p.peak_encoded_bytes);
            all.verified &= p.verified;
        }
        all.dense_to.sort();
        all.dense_to.dedup();
        all
    }
}

/// One method's state from version to version on the ranks this process runs.
struct Stream {
    method: Method,
    /// The plan it runs.
    plan: Plan,
    session: DeltaSession,
    shards: BTreeMap<Rank, Vec<u8>>,
}

/// Runs `run --delta`.
pub(super) fn main(
    args: &RunArgs,
    plan: &Plan,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<(), Failure> {
    let d = &args.delta;
    super::stream_of_one_tensor(plan, "--delta")?;
    let methods = methods(&args.delta_methods)?;
    let evolution = d.evolution(fill, plan.src().dtype())?;
    let delta = d.options()?;
    let ranks: Vec<Rank> = world.ranks(plan.dst()).collect();
    let mut streams: Vec<Stream> = methods
        .iter()
        .map(|&method| {
            let shards = ranks
                .iter()
                .map(|&r| Ok((r, vec![0u8; plan.dst().local_bytes(r) as usize])))
                .collect::<Result<_, Error>>()?;
            Ok(Stream {
                method,
                plan: plan.clone(),
                session: DeltaSession::new(),
                shards,
            })
        })
        .collect::<Result<_, Error>>()?;
    if let Some(job) = world.job() {
        let ready = world.check_size(super::highest(plan));
        // what `run` agrees on (the plan's tensor and layouts, the fill, the options), and
        // the stream
        world.agree("run", ready, || {
            super::fingerprint(args, plan, fill, options)
                .with("--delta", true)
                .with("--steps", d.steps())
                .with("--delta-update", format!("{:?}", d.update()))
                .with("--delta-anchor", format!("{:?}", d.delta_anchor))
                .with("--delta-methods", &args.delta_methods)
                .with("--delta-restart", args.delta_restart.join(","))
        })?;
        let outcome = versions(args, plan, &evolution, delta, options, world, &mut streams);
        let outcome = outcome.map(|refits| serde_json::json!({ "refits": refits }));
        if let Some(reports) = conclude(world, outcome)? {
            let per_rank: Vec<Vec<Refit>> = reports
                .ranks
                .iter()
                .map(|r| serde_json::from_value(r["refits"].clone()).unwrap_or_default())
                .collect();
            let n = per_rank.first().map_or(0, Vec::len);
            let combined: Vec<Refit> = (0..n)
                .map(|i| {
                    let parts: Vec<Refit> =
                        per_rank.iter().filter_map(|p| p.get(i).cloned()).collect();
                    Refit::combine(&parts)
                })
                .collect();
            print(args, plan, &evolution, &combined, job.world());
        }
        return Ok(());
    }
    let refits = versions(args, plan, &evolution, delta, options, world, &mut streams)?;
    print(args, plan, &evolution, &refits, plan.ranks().len());
    Ok(())
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
) -> Result<Vec<Refit>, Error> {
    let mut refits = Vec::new();
    let src_ranks: Vec<Rank> = world.ranks(plan.src()).collect();
    let restarts = restarts(&args.delta_restart)?;
    for version in 1..=args.delta.steps() {
        for stream in streams.iter_mut() {
            for &(rank, _) in restarts.iter().filter(|&&(_, v)| v == version) {
                if let Some(shard) = stream.shards.get_mut(&rank) {
                    shard.fill(0);
                    stream.session.with_rank(rank, |s| s.forget());
                }
            }
        }
        let mut sources = super::sources_at(plan, evolution, &src_ranks, version);
        // the methods in turn, each going first in turn
        for at in in_turn((0..streams.len()).collect(), version as u32) {
            let stream = &mut streams[at];
            let mut run = run_options(options);
            run.delta = match stream.method {
                Method::Dense => None,
                _ => Some(DeltaRefit {
                    session: stream.session.clone(),
                    version,
                    options: delta,
                }),
            };
            let refit = one(world, stream, &mut sources, &run, version)?;
            let mut refit = refit;
            if args.verify {
                for (&r, shard) in &stream.shards {
                    evolution.verify_shard_from(
                        plan.src().dtype(),
                        plan.dst(),
                        r,
                        shard,
                        version,
                    )?;
                }
            }
            refit.verified = args.verify;
            refits.push(refit);
        }
    }
    // one order for every rank's list: by version, then method
    refits.sort_by(|a, b| (a.version, &a.method).cmp(&(b.version, &b.method)));
    Ok(refits)
}

/// The ranks `--delta-restart` restarts, and before which version.
fn restarts(specs: &[String]) -> Result<Vec<(Rank, u64)>, Error> {
    specs
        .iter()
        .map(|spec| {
            let parsed = spec
                .split_once('@')
                .and_then(|(r, v)| Some((r.trim().parse().ok()?, v.trim().parse().ok()?)));
            parsed.ok_or_else(|| Error::InvalidOption {
                field: Field::Flag("--delta-restart"),
                value: spec.clone(),
                reason: "expected RANK@VERSION, e.g. 3@2".into(),
            })
        })
        .collect()
}

/// One method's refit of `version`, timed from a barrier.
fn one(
    world: &World,
    stream: &mut Stream,
    sources: &mut BTreeMap<Rank, Vec<u8>>,
    run: &RunOptions,
    version: u64,
) -> Result<Refit, Error> {
    // between processes, the reshard's links are opened before the clock starts, its
    // destination in shared memory (for same-host senders to write into) holding the shard
    let plan = &stream.plan;
    let mut prepared = match (world.job(), stream.method) {
        (Some(_), Method::Delta | Method::Dense) => Some(world.prepare(plan)?),
        _ => None,
    };
    if let Some(mine) = prepared.as_mut() {
        let rank = mine.rank();
        if let (Some(to), Some(from)) = (mine.destination_mut(), stream.shards.get(&rank)) {
            to.copy_from_slice(from);
        }
    }
    world.barrier()?;
    let started = Instant::now();
    let stats = match (prepared.as_mut(), stream.method) {
        (Some(mine), _) => {
            let source = sources.get(&mine.rank()).map(Vec::as_slice);
            let stats = mine.run(source, run)?;
            reshard::exec::RunStats {
                elapsed: started.elapsed(),
                ranks: vec![stats],
            }
        }
        (None, Method::GatherBroadcast) => {
            world.run_gather_broadcast(plan, sources, &mut stream.shards, run)?
        }
        (None, _) => world.run(plan, sources, &mut stream.shards, run)?,
    };
    let elapsed = started.elapsed();
    if let Some(mine) = prepared.as_ref()
        && let (Some(from), Some(to)) = (mine.destination(), stream.shards.get_mut(&mine.rank()))
    {
        to.copy_from_slice(from);
    }
    let seconds = match world.job() {
        Some(_) => elapsed.as_secs_f64(),
        None => stats.elapsed.as_secs_f64(),
    };
    let mut refit = Refit {
        version,
        method: stream.method.name().into(),
        seconds,
        ..Refit::default()
    };
    match stream.method {
        Method::Dense => {
            refit.wire_bytes = stats.ranks.iter().map(|r| r.bytes_sent).sum();
        }
        _ => refit.absorb(&stream.session.take_reports()),
    }
    Ok(refit)
}

#[derive(Serialize)]
struct DeltaJson<'a> {
    shape: Vec<u64>,
    dtype: String,
    dst_dtype: String,
    update: String,
    /// The fraction of elements changed in the wire dtype, per version after the first,
    /// sampled from the evolution.
    changed_fraction: f64,
    ranks: usize,
    refits: &'a [Refit],
    verified: bool,
}

fn print(args: &RunArgs, plan: &Plan, evolution: &Evolution, refits: &[Refit], ranks: usize) {
    let dst = plan.dst();
    let changed = if args.delta.steps() > 1 {
        evolution.changed_fraction(dst.shape(), dst.dtype(), 2, 1 << 16)
    } else {
        0.0
    };
    let update = evolution.update.to_string();
    let verified = !refits.is_empty() && refits.iter().all(|r| r.verified);
    if args.json {
        let json = DeltaJson {
            shape: dst.shape().to_vec(),
            dtype: plan.src().dtype().to_string(),
            dst_dtype: dst.dtype().to_string(),
            update,
            changed_fraction: changed,
            ranks,
            refits,
            verified,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json).unwrap_or_default()
        );
        return;
    }
    println!(
        "delta refit of {} {}: {} versions, {update} ({:.3}% of the elements change per version in {}), {ranks} ranks",
        reshard::error::Dims(dst.shape().to_vec()),
        dst.dtype(),
        args.delta.steps(),
        100.0 * changed,
        dst.dtype(),
    );
    println!("version  method            seconds   wire bytes     dense to");
    for r in refits {
        let dense = match r.dense_to.is_empty() {
            true => "-".to_string(),
            false => r
                .dense_to
                .iter()
                .map(|(rank, why)| format!("{rank} ({why})"))
                .collect::<Vec<_>>()
                .join(", "),
        };
        println!(
            "{:>7}  {:<16}  {:>8.4}  {:>12}   {dense}",
            r.version,
            r.method,
            r.seconds,
            bytes(r.wire_bytes)
        );
    }
    let mut kept: Vec<String> = Vec::new();
    for method in ["delta", "gather-broadcast"] {
        let most = refits
            .iter()
            .filter(|r| r.method == method)
            .map(|r| r.base_bytes)
            .max();
        if let Some(most) = most {
            kept.push(format!("{method} {}", bytes(most)));
        }
    }
    println!(
        "kept between versions, most on one rank (bases: one copy of what it sends, in the wire dtype): {}; verified: {}",
        kept.join(", "),
        if verified { "yes" } else { "no (add --verify)" }
    );
}
