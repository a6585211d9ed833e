//! A refit while serving, as a stream of versions ([`RefitRun::run_staged`]): every tensor
//! evolves between versions ([`reshard_core::evolve`]) and each version is moved by every
//! method asked for, in turn, each into live shards of its own that an engine stand-in serves
//! from meanwhile ([`crate::rollout`]): in place (the engine stopped for the whole refit) or
//! staged beside the live shards and committed on every rank or on none, dense or as deltas.
//! Every version of every method is checked: its unquantized tensors against the evolution,
//! element by element, and every byte and scale against the other methods' of the same
//! version.

use std::collections::BTreeMap;

use serde::Serialize;

use super::RefitRun;
use super::check::QuantCheck;
use crate::batch::run_rank_batch;
use crate::exec::delta::{DeltaOptions, DeltaRefit, DeltaSession};
use crate::rollout::{Method, MethodSummary, Rollout, Standing, VersionServed, summarize};
use crate::serve::ServeOptions;
use crate::{Links, RunOptions, World};
use reshard_core::error::Error;
use reshard_core::evolve::Update;

/// How one method of a staged stream moves each version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageMethod {
    /// Staged beside the live shards and committed, rather than written in place.
    pub staged: bool,
    /// Moved as a delta refit, rather than dense.
    pub delta: bool,
}

impl StageMethod {
    /// How it reaches the live shards.
    pub fn method(self) -> Method {
        match self.staged {
            true => Method::Staged,
            false => Method::InPlace,
        }
    }

    /// Its name in reports: `in-place` or `staged`, with `-delta` for a delta refit.
    pub fn name(self) -> &'static str {
        match (self.staged, self.delta) {
            (false, false) => "in-place",
            (false, true) => "in-place-delta",
            (true, false) => "staged",
            (true, true) => "staged-delta",
        }
    }
}

/// What a staged stream is: its versions, how the tensors evolve, the methods compared and
/// how commits roll.
#[derive(Clone, Debug, PartialEq)]
pub struct StageStream {
    /// Versions in the stream.
    pub steps: u64,
    /// How the tensors change from one version to the next.
    pub update: Update,
    /// How the delta methods' refits run.
    pub delta: DeltaOptions,
    /// The methods compared: each moves every version, in turn.
    pub methods: Vec<StageMethod>,
    /// Commit groups, as many groups of whole inference replicas ([`RefitRun::rolling_groups`];
    /// `None`: all at once).
    pub rolling: Option<usize>,
    /// How the serving stand-ins serve meanwhile.
    pub serve: ServeOptions,
}

/// What `refit --run --stage` reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StagedRefitReport {
    /// The transport the ranks moved over.
    pub transport: String,
    /// Versions in the stream.
    pub steps: u64,
    /// How the tensors evolved, as [`Update`] prints it.
    pub update: String,
    /// Every version of every method checked on every rank.
    pub verified: bool,
    /// Bytes of the destination ranks' shards (values and scales), all ranks.
    pub dst_bytes: u64,
    /// Every version by every method, every rank's report combined.
    pub versions: Vec<VersionServed>,
    /// Each method summed up over the stream.
    pub methods: Vec<MethodSummary>,
}

impl RefitRun {
    /// Runs a staged stream ([`StageStream`]) on this rank, then hands its report to rank 0,
    /// which returns the job's. Every rank of the job calls it alike.
    pub fn run_staged(
        &self,
        world: &World,
        stream: &StageStream,
        options: &RunOptions,
    ) -> Result<Option<StagedRefitReport>, Error> {
        let outcome = self.run_staged_rank(world, stream, options, &mut Vec::new());
        let reports = world.finish(outcome)?;
        Ok(reports.map(|ranks| self.staged_report(stream, &ranks)))
    }

    /// This rank's part of the stream; returns its report for rank 0. `standing` says, after
    /// every version and whatever happened, where this rank stands by each method (what its
    /// shards serve), for a caller to tell when the stream stops short.
    pub fn run_staged_rank(
        &self,
        world: &World,
        stream: &StageStream,
        options: &RunOptions,
        standing: &mut Vec<Standing>,
    ) -> Result<serde_json::Value, Error> {
        let job = self.job_of(world)?;
        stream.delta.validate()?;
        let rank = job.rank();
        let batch = &self.batch;
        let rb = batch.rank_batch(rank)?;
        let groups = match stream.rolling {
            Some(g) => self.rolling_groups(g)?,
            None => Vec::new(),
        };
        let evolutions = self.evolutions(stream.update)?;
        let zeroed = |bufs: &[crate::batch::Buffer]| super::zeroed_buffers(rank, bufs);
        let mut src = zeroed(&rb.src)?;
        let n_dst = rb.dst.len();
        let receives = rb.dst.iter().chain(&rb.scales).any(|b| b.len > 0);
        let mut rollouts = Vec::new();
        for m in &stream.methods {
            let mut live = BTreeMap::new();
            if receives {
                let mut bufs = zeroed(&rb.dst)?;
                bufs.extend(QuantCheck::scale_buffers(&rb)?);
                live.insert(rank, bufs);
            }
            let rollout = Rollout::new(
                m.method(),
                DeltaSession::new(),
                live,
                stream.serve.clone(),
                groups.clone(),
            )?;
            rollouts.push((*m, rollout));
        }
        let layouts = batch.tensors().iter().map(|t| &t.src);
        let transport = world.connect(&Links::of_batch(&rb), layouts, None)?;
        let mut versions = Vec::new();
        for version in 1..=stream.steps {
            self.fill_version(&rb, &mut src, &evolutions, version);
            // the methods in turn, each going first in turn
            for at in crate::harness::in_turn((0..rollouts.len()).collect(), version as u32) {
                let (method, rollout) = &mut rollouts[at];
                let method = *method;
                let mut run = options.clone();
                run.delta = method.delta.then(|| DeltaRefit {
                    session: rollout.session().clone(),
                    version,
                    options: stream.delta,
                });
                let srcs: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
                let served = rollout.refit(world, version, &run, |bufs, run| {
                    let mut mine: Vec<&mut [u8]> = bufs
                        .get_mut(&rank)
                        .map(|b| b.iter_mut().map(Vec::as_mut_slice).collect())
                        .unwrap_or_default();
                    let split = n_dst.min(mine.len());
                    let mut scales = mine.split_off(split);
                    let exec = world.exec_options(run);
                    run_rank_batch(
                        batch,
                        &rb,
                        &srcs,
                        &mut mine,
                        &mut scales,
                        &*transport,
                        &exec,
                    )
                    .map(|_| ())
                });
                *standing = rollouts
                    .iter()
                    .filter(|(_, r)| r.live(rank).is_some())
                    .map(|(m, r)| Standing {
                        method: m.name().into(),
                        ..r.standing(rank)
                    })
                    .collect();
                let mut served = served?;
                served.method = method.name().into();
                versions.push(served);
            }
            // every method serves this version now: each checked against the evolution, and
            // all alike, byte for byte
            let mut first: Option<Vec<Vec<u8>>> = None;
            for (method, rollout) in &rollouts {
                let Some(live) = rollout.live(rank) else {
                    continue;
                };
                let live = live.read().unwrap_or_else(|e| e.into_inner());
                if rollout.session().serving(rank) != Some(version) {
                    return Err(Error::Internal {
                        rank,
                        detail: format!(
                            "version {version} by {}: the shards serve {:?}",
                            method.name(),
                            rollout.session().serving(rank)
                        ),
                    });
                }
                match &first {
                    Some(f) if *f != *live => {
                        return Err(Error::Internal {
                            rank,
                            detail: format!(
                                "version {version}: {} left other bytes than {}",
                                method.name(),
                                rollouts[0].0.name()
                            ),
                        });
                    }
                    Some(_) => {}
                    None => first = Some(live.clone()),
                }
                self.verify_version(&rb, &live, &evolutions, version)?;
            }
        }
        let dst_bytes: u64 = rb.dst.iter().chain(&rb.scales).map(|b| b.len as u64).sum();
        Ok(serde_json::json!({
            "transport": transport.name(),
            "verified": true,
            "dst_bytes": dst_bytes,
            "versions": versions,
        }))
    }
}

impl RefitRun {
    /// The job's report from every rank's ([`RefitRun::run_staged_rank`]).
    pub fn staged_report(
        &self,
        stream: &StageStream,
        ranks: &[serde_json::Value],
    ) -> StagedRefitReport {
        let versions = VersionServed::of_job(ranks);
        StagedRefitReport {
            transport: crate::harness::reported_transport(ranks),
            steps: stream.steps,
            update: stream.update.to_string(),
            verified: crate::harness::all_verified(ranks),
            dst_bytes: ranks
                .iter()
                .map(|r| r["dst_bytes"].as_u64().unwrap_or(0))
                .sum(),
            methods: summarize(&versions),
            versions,
        }
    }
}
