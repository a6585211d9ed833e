//! Refits while serving: the destination ranks this process runs keep serving from their
//! live shards while each version travels, and the version is committed on every rank or on
//! none ([`Rollout`]).
//!
//! A version is moved either **in place** (today's refit: the engine stops serving for the
//! whole refit, since the shards are half-written until it ends) or **staged**: it is
//! prepared into shadows beside the live shards ([`crate::exec::stage`]) while the engine
//! serves, every rank votes in the job's two-phase decision ([`World::decide`]), and on
//! commit each rank applies its staging in place under the engine's lock: the only pause.
//! With a rolling commit the destination ranks commit one group (an inference replica) at a
//! time, a barrier between groups, so that the other groups serve meanwhile.
//!
//! Every destination rank runs a serving stand-in ([`crate::serve::Server`]) during each
//! version: its longest gap between passes is the pause an engine's users would see, and its
//! digests say whether any pass saw a mix of two versions (none may).

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::exec::delta::DeltaSession;
use crate::exec::stage::{CommitReport, StageRefit};
use crate::serve::{Live, ServeOptions, Served, Server};
use crate::{Decision, RunOptions, World};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

/// How a version reaches the live shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Written into the live shards directly, the engine stopped meanwhile.
    InPlace,
    /// Staged beside them, then committed in place.
    Staged,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::InPlace => "in-place",
            Method::Staged => "staged",
        }
    }
}

/// What one destination rank saw of one version.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankServed {
    pub rank: Rank,
    /// The version its shards serve afterwards.
    pub serving: Option<u64>,
    /// How long its commit held the shards (0 in place: the whole refit held them).
    pub commit_s: f64,
    /// The serving stand-in's longest gap between passes, and how many passes it served:
    /// in all, and while the version was being moved (prepared, or written in place).
    pub pause_s: f64,
    pub passes: u64,
    pub passes_during_refit: u64,
    /// Whether a pass saw anything but the version before or the version after, whole.
    pub mixed: bool,
    /// Bytes of its shadows (staged), of the patches its commit applied, and of what it
    /// copied from the shadows.
    pub staging_bytes: u64,
    pub patch_bytes: u64,
    pub copied_bytes: u64,
    /// Which commit group it is in (rolling commit), from 0.
    pub group: usize,
}

/// One version by one method, on the ranks of this process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VersionServed {
    pub version: u64,
    pub method: String,
    /// Seconds to move the version: prepared (staged) or written (in place).
    pub refit_s: f64,
    /// Seconds of the two-phase decision, and of the commit, from the decision to the last
    /// group's end.
    pub decide_s: f64,
    pub commit_s: f64,
    /// `commit`, `in place`, or `abort (why)`.
    pub outcome: String,
    pub ranks: Vec<RankServed>,
}

impl VersionServed {
    /// The longest pause any destination rank saw.
    pub fn pause_s(&self) -> f64 {
        self.ranks.iter().map(|r| r.pause_s).fold(0.0, f64::max)
    }

    /// Whether any pass on any rank saw a mix of versions.
    pub fn mixed(&self) -> bool {
        self.ranks.iter().any(|r| r.mixed)
    }

    /// Every rank's part of one version as one: the slowest rank's times, every rank's
    /// entries.
    pub fn combine(parts: &[VersionServed]) -> VersionServed {
        let mut all = parts.first().cloned().unwrap_or_default();
        all.ranks.clear();
        for p in parts {
            all.refit_s = all.refit_s.max(p.refit_s);
            all.decide_s = all.decide_s.max(p.decide_s);
            all.commit_s = all.commit_s.max(p.commit_s);
            if p.outcome != all.outcome && p.outcome.starts_with("abort") {
                all.outcome = p.outcome.clone();
            }
            all.ranks.extend(p.ranks.iter().cloned());
        }
        all.ranks.sort_by_key(|r| r.rank);
        all.ranks.dedup_by_key(|r| r.rank);
        all
    }

    /// Each commit group's pause (the longest of its ranks') and its ranks, in commit order.
    pub fn groups(&self) -> Vec<(Vec<Rank>, f64)> {
        let mut groups: BTreeMap<usize, (Vec<Rank>, f64)> = BTreeMap::new();
        for r in &self.ranks {
            let g = groups.entry(r.group).or_default();
            g.0.push(r.rank);
            g.1 = g.1.max(r.pause_s);
        }
        groups.into_values().collect()
    }
}

/// One destination rank of a stream: its live shards, its shadows, and its engine.
struct Shards {
    live: Live,
    shadows: Vec<Vec<u8>>,
}

/// A stream of refits of the destination ranks this process runs, by one method, each
/// rank serving meanwhile.
pub struct Rollout {
    method: Method,
    session: DeltaSession,
    ranks: BTreeMap<Rank, Shards>,
    serve: ServeOptions,
    /// The commit groups, in commit order (one group of every rank: all at once).
    groups: Vec<Vec<Rank>>,
}

impl Rollout {
    /// A stream by `method` whose live shards start as `live` (each rank's destination
    /// buffers), kept in `session`; `groups` commit one after the other (empty: all at
    /// once). Staged, the shadows are allocated here, one per buffer: their size
    /// ([`Rollout::staging_bytes`]) is known before any byte moves.
    pub fn new(
        method: Method,
        session: DeltaSession,
        live: BTreeMap<Rank, Vec<Vec<u8>>>,
        serve: ServeOptions,
        groups: Vec<Vec<Rank>>,
    ) -> Result<Rollout> {
        let ranks = live
            .into_iter()
            .map(|(rank, bufs)| {
                let shadows = match method {
                    Method::Staged => bufs
                        .iter()
                        .map(|b| {
                            reshard_core::memory::zeroed(b.len() as u64, || {
                                format!("rank {rank}'s staging shadow")
                            })
                        })
                        .collect::<Result<_>>()?,
                    Method::InPlace => Vec::new(),
                };
                let live = Live::new(std::sync::RwLock::new(bufs));
                Ok((rank, Shards { live, shadows }))
            })
            .collect::<Result<_>>()?;
        Ok(Rollout {
            method,
            session,
            ranks,
            serve,
            groups,
        })
    }

    pub fn method(&self) -> Method {
        self.method
    }

    pub fn session(&self) -> &DeltaSession {
        &self.session
    }

    /// Bytes of `rank`'s shadows (nothing in place).
    pub fn staging_bytes(&self, rank: Rank) -> u64 {
        self.ranks
            .get(&rank)
            .map_or(0, |s| s.shadows.iter().map(|b| b.len() as u64).sum::<u64>())
    }

    /// `rank`'s live shards (a clone of the handle its engine reads through).
    pub fn live(&self, rank: Rank) -> Option<Live> {
        self.ranks.get(&rank).map(|s| s.live.clone())
    }

    /// Where `rank` stands: the version its shards serve, and any it holds staged.
    pub fn standing(&self, rank: Rank) -> Standing {
        Standing {
            rank,
            method: self.method.name().into(),
            serving: self.session.serving(rank),
            staged: self.session.staged(rank),
        }
    }

    /// The group `rank` commits in.
    fn group_of(&self, rank: Rank) -> usize {
        self.groups
            .iter()
            .position(|g| g.contains(&rank))
            .unwrap_or(0)
    }

    /// Refits `version` by the stream's method: `run` moves it for this process's ranks into
    /// the buffers it is given (each destination rank's, in place or shadows) with the
    /// options it is given; every rank of the job calls it alike. Returns what this process
    /// saw; a version that was aborted is reported as such, the shards serving the version
    /// before. A rank in doubt ([`Error::InDoubt`]) keeps its staging, and the error is
    /// returned.
    pub fn refit<F>(
        &mut self,
        world: &World,
        version: u64,
        options: &RunOptions,
        run: F,
    ) -> Result<VersionServed>
    where
        F: FnOnce(&mut BTreeMap<Rank, Vec<Vec<u8>>>, &RunOptions) -> Result<()>,
    {
        let sample = self.serve.sample_bytes;
        let before: BTreeMap<Rank, u32> = self
            .ranks
            .iter()
            .map(|(&r, s)| (r, Served::digest(&read(&s.live), sample)))
            .collect();
        let servers: BTreeMap<Rank, Server> = self
            .ranks
            .iter()
            .map(|(&r, s)| (r, Server::start(s.live.clone(), self.serve.clone())))
            .collect();
        // each engine serving before the version starts, so that its first gap counts
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while servers.values().any(|s| s.passes() == 0) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        let mut out = VersionServed {
            version,
            method: self.method.name().into(),
            ..VersionServed::default()
        };
        let mut reports: BTreeMap<Rank, CommitReport> = BTreeMap::new();
        let outcome = match self.method {
            Method::InPlace => self.in_place(world, version, options, run, &servers, &mut out),
            Method::Staged => self.staged(
                world,
                version,
                options,
                run,
                &servers,
                &mut out,
                &mut reports,
            ),
        };
        for s in servers.values() {
            s.mark("after");
        }
        let served: BTreeMap<Rank, Served> =
            servers.into_iter().map(|(r, s)| (r, s.stop())).collect();
        outcome?;
        for (&rank, shards) in &self.ranks {
            let after = Served::digest(&read(&shards.live), sample);
            let seen = served.get(&rank).cloned().unwrap_or_default();
            let commit = reports.get(&rank).cloned().unwrap_or_default();
            let during = seen
                .passes_by_stage
                .iter()
                .filter(|(stage, _)| stage == "refit")
                .map(|(_, n)| n)
                .sum();
            out.ranks.push(RankServed {
                rank,
                serving: self.session.serving(rank),
                commit_s: commit.seconds,
                pause_s: seen.longest_gap_s,
                passes: seen.passes,
                passes_during_refit: during,
                mixed: !seen.only(&[before[&rank], after]),
                staging_bytes: self.staging_bytes(rank),
                patch_bytes: commit.patch_bytes,
                copied_bytes: commit.copied_bytes,
                group: self.group_of(rank),
            });
        }
        Ok(out)
    }

    /// The version written into the live shards, every engine stopped until it is done.
    fn in_place<F>(
        &mut self,
        world: &World,
        version: u64,
        options: &RunOptions,
        run: F,
        servers: &BTreeMap<Rank, Server>,
        out: &mut VersionServed,
    ) -> Result<()>
    where
        F: FnOnce(&mut BTreeMap<Rank, Vec<Vec<u8>>>, &RunOptions) -> Result<()>,
    {
        world.barrier()?;
        let lives: Vec<(Rank, Live)> = self
            .ranks
            .iter()
            .map(|(&r, s)| (r, s.live.clone()))
            .collect();
        let mut guards: Vec<_> = lives
            .iter()
            .map(|(r, l)| (*r, l.write().unwrap_or_else(|e| e.into_inner())))
            .collect();
        for s in servers.values() {
            s.mark("refit");
        }
        let started = Instant::now();
        let mut bufs: BTreeMap<Rank, Vec<Vec<u8>>> = guards
            .iter_mut()
            .map(|(r, g)| (*r, std::mem::take(&mut **g)))
            .collect();
        let result = run(&mut bufs, options);
        for (r, g) in &mut guards {
            **g = bufs.remove(r).unwrap_or_default();
        }
        // the passes that waited resume after the refit
        for s in servers.values() {
            s.mark("after");
        }
        drop(guards);
        out.refit_s = started.elapsed().as_secs_f64();
        out.outcome = "in place".into();
        match &result {
            Ok(()) if options.delta.is_none() => {
                for &r in self.ranks.keys() {
                    self.session.with_rank(r, |s| s.set_held(Some(version)));
                }
            }
            Ok(()) => {}
            // half-written: the shards serve nothing known
            Err(_) => {
                for &r in self.ranks.keys() {
                    self.session.with_rank(r, |s| s.set_held(None));
                }
            }
        }
        result
    }

    /// The version staged beside the live shards, decided by the job, then committed group
    /// by group (or dropped).
    #[allow(clippy::too_many_arguments)]
    fn staged<F>(
        &mut self,
        world: &World,
        version: u64,
        options: &RunOptions,
        run: F,
        servers: &BTreeMap<Rank, Server>,
        out: &mut VersionServed,
        reports: &mut BTreeMap<Rank, CommitReport>,
    ) -> Result<()>
    where
        F: FnOnce(&mut BTreeMap<Rank, Vec<Vec<u8>>>, &RunOptions) -> Result<()>,
    {
        // the shadows hold what the live shards hold (a delta applies over that version)
        for (&rank, s) in &mut self.ranks {
            let live = read(&s.live);
            let bufs: Vec<&[u8]> = live.iter().map(Vec::as_slice).collect();
            let mut shadows: Vec<&mut [u8]> = s.shadows.iter_mut().map(|b| &mut b[..]).collect();
            crate::exec::stage::refresh_shadows(rank, &mut shadows, &bufs)?;
        }
        world.barrier()?;
        for s in servers.values() {
            s.mark("refit");
        }
        let mut staged_options = options.clone();
        staged_options.stage = Some(StageRefit {
            session: self.session.clone(),
            version,
        });
        let started = Instant::now();
        let mut shadows: BTreeMap<Rank, Vec<Vec<u8>>> = self
            .ranks
            .iter_mut()
            .map(|(&r, s)| (r, std::mem::take(&mut s.shadows)))
            .collect();
        let prepared = run(&mut shadows, &staged_options);
        for (r, s) in &mut self.ranks {
            s.shadows = shadows.remove(r).unwrap_or_default();
        }
        out.refit_s = started.elapsed().as_secs_f64();
        for s in servers.values() {
            s.mark("decide");
        }
        let started = Instant::now();
        let vote = prepared.as_ref().map(|_| ()).map_err(ToString::to_string);
        let decision = world.decide(vote);
        out.decide_s = started.elapsed().as_secs_f64();
        match decision {
            Ok(Decision::Commit) => {}
            Ok(Decision::Abort { ranks }) => {
                self.drop_staged(version);
                let why: Vec<String> = ranks
                    .iter()
                    .map(|(r, e)| format!("rank {r}: {e}"))
                    .collect();
                out.outcome = format!("abort ({})", why.join("; "));
                // this rank's own failure is its error; the others report the abort
                return prepared;
            }
            Err(e @ Error::InDoubt { .. }) => return Err(e),
            Err(e) => {
                self.drop_staged(version);
                return Err(e);
            }
        }
        for s in servers.values() {
            s.mark("commit");
        }
        let started = Instant::now();
        let groups = match self.groups.is_empty() {
            true => vec![self.ranks.keys().copied().collect()],
            false => self.groups.clone(),
        };
        // ranks without destination shards (senders) have nothing to write
        for rank in self.session.staged_ranks(version) {
            if !self.ranks.contains_key(&rank) {
                self.session.commit(rank, version, &[], &mut [])?;
            }
        }
        // the decision is final: every group commits, even if a barrier between them fails
        let mut lost = None;
        for group in &groups {
            for rank in group {
                if let Some(report) = self.commit_rank(*rank, version)? {
                    reports.insert(*rank, report);
                }
            }
            if groups.len() > 1
                && let Err(e) = world.barrier()
            {
                lost.get_or_insert(e);
            }
        }
        out.commit_s = started.elapsed().as_secs_f64();
        out.outcome = "commit".into();
        lost.map_or(Ok(()), Err)
    }

    /// Commits `rank`'s staging, if this process runs it, under its engine's lock.
    fn commit_rank(&mut self, rank: Rank, version: u64) -> Result<Option<CommitReport>> {
        let Some(s) = self.ranks.get_mut(&rank) else {
            return Ok(None);
        };
        let shadows: Vec<&[u8]> = s.shadows.iter().map(Vec::as_slice).collect();
        let mut live = s.live.write().unwrap_or_else(|e| e.into_inner());
        let mut bufs: Vec<&mut [u8]> = live.iter_mut().map(Vec::as_mut_slice).collect();
        self.session
            .commit(rank, version, &shadows, &mut bufs)
            .map(Some)
    }

    /// Drops what this process's ranks staged of `version`.
    fn drop_staged(&self, version: u64) {
        for r in self.session.staged_ranks(version) {
            let _ = self.session.abort(r, version);
        }
    }
}

/// Where a destination rank of a stream stands, as it says when the stream stops.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standing {
    pub rank: Rank,
    pub method: String,
    pub serving: Option<u64>,
    /// A version still staged: only a rank in doubt keeps one.
    pub staged: Option<u64>,
}

impl std::fmt::Display for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.serving {
            Some(v) => write!(f, "rank {} serves version {v}", self.rank)?,
            None => write!(f, "rank {} serves no known version", self.rank)?,
        }
        write!(f, " ({})", self.method)?;
        if let Some(v) = self.staged {
            write!(f, ", version {v} staged (in doubt)")?;
        }
        Ok(())
    }
}

/// One method over a stream, as the report sums it up.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MethodSummary {
    pub method: String,
    /// Versions it moved, and those committed (or written in place).
    pub versions: usize,
    pub served: usize,
    /// Medians over the versions after the first (the first has no base for a delta):
    /// seconds to move a version, of the longest pause any rank's engine saw, and of the
    /// commit.
    pub refit_s: f64,
    pub pause_s: f64,
    pub commit_s: f64,
    /// The median pause over the median refit in place (when `in-place` ran too).
    pub pause_over_in_place: Option<f64>,
    /// Passes the engines served while versions were moved, after the first.
    pub passes_during_refit: u64,
    /// The most bytes of shadows, and of patches, one rank held.
    pub staging_bytes_per_rank: u64,
    pub patch_bytes_per_rank: u64,
    /// Whether any pass of any engine saw a mix of versions.
    pub mixed: bool,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// Each method's summary over `versions` (every rank's, combined), in the order the methods
/// first appear.
pub fn summarize(versions: &[VersionServed]) -> Vec<MethodSummary> {
    let mut methods: Vec<String> = Vec::new();
    for v in versions {
        if !methods.contains(&v.method) {
            methods.push(v.method.clone());
        }
    }
    let later = |m: &str| -> Vec<&VersionServed> {
        let all: Vec<&VersionServed> = versions.iter().filter(|v| v.method == m).collect();
        match all.len() > 1 {
            true => all.into_iter().filter(|v| v.version > 1).collect(),
            false => all,
        }
    };
    let in_place = median(later("in-place").iter().map(|v| v.refit_s).collect());
    methods
        .iter()
        .map(|m| {
            let all: Vec<&VersionServed> = versions.iter().filter(|v| &v.method == m).collect();
            let after = later(m);
            let pause_s = median(after.iter().map(|v| v.pause_s()).collect());
            let most = |f: fn(&RankServed) -> u64| {
                all.iter()
                    .flat_map(|v| v.ranks.iter().map(f))
                    .max()
                    .unwrap_or(0)
            };
            MethodSummary {
                method: m.clone(),
                versions: all.len(),
                served: all
                    .iter()
                    .filter(|v| v.outcome == "commit" || v.outcome == "in place")
                    .count(),
                refit_s: median(after.iter().map(|v| v.refit_s).collect()),
                pause_s,
                commit_s: median(after.iter().map(|v| v.commit_s).collect()),
                pause_over_in_place: (in_place > 0.0).then(|| pause_s / in_place),
                passes_during_refit: after
                    .iter()
                    .flat_map(|v| v.ranks.iter().map(|r| r.passes_during_refit))
                    .sum(),
                staging_bytes_per_rank: most(|r| r.staging_bytes),
                patch_bytes_per_rank: most(|r| r.patch_bytes),
                mixed: all.iter().any(|v| v.mixed()),
            }
        })
        .collect()
}

fn read(live: &Live) -> std::sync::RwLockReadGuard<'_, Vec<Vec<u8>>> {
    live.read().unwrap_or_else(|e| e.into_inner())
}

/// Commit groups of `ranks` (the destination ranks, in rank order) cut into `count`
/// contiguous groups of equal size, as inference engines number their replicas' ranks.
pub fn rolling_groups(ranks: &[Rank], count: usize) -> Result<Vec<Vec<Rank>>> {
    if count == 0 || ranks.is_empty() || !ranks.len().is_multiple_of(count) {
        return Err(Error::InvalidOption {
            field: reshard_core::error::Field::Flag("--rolling"),
            value: count.to_string(),
            reason: format!(
                "must divide the {} destination ranks into groups of equal size",
                ranks.len()
            ),
        });
    }
    let size = ranks.len() / count;
    Ok(ranks.chunks(size).map(<[Rank]>::to_vec).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JoinOptions;
    use crate::exec::delta::{DeltaOptions, DeltaRefit};
    use reshard_core::dtype::DType;
    use reshard_core::evolve::{Evolution, Update};
    use reshard_core::fill::Fill;
    use reshard_core::layout::LayoutSpec;
    use reshard_core::plan::Plan;

    fn plan() -> Plan {
        let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap();
        let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap();
        let shape = [256, 256];
        Plan::new(
            src.resolve(&shape, DType::Bf16, 0).unwrap(),
            dst.resolve(&shape, DType::Bf16, 2).unwrap(),
        )
        .unwrap()
    }

    /// A stream of `versions` by `method` (deltas when `delta`), committed in `groups`.
    fn stream(
        method: Method,
        delta: bool,
        groups: Vec<Vec<Rank>>,
        fail_at: Option<u64>,
    ) -> Vec<Result<VersionServed>> {
        let plan = plan();
        let world = World::join(JoinOptions::default()).unwrap();
        let evolution = Evolution::new(
            Fill::Hash { seed: 1 },
            Update::Density(0.01),
            1,
            DType::Bf16,
        )
        .unwrap();
        let live = plan
            .dst()
            .mesh()
            .ranks()
            .iter()
            .map(|&r| (r, vec![vec![0u8; plan.dst().local_bytes(r) as usize]]))
            .collect();
        let session = DeltaSession::new();
        let mut rollout = Rollout::new(
            method,
            session.clone(),
            live,
            ServeOptions::default(),
            groups,
        )
        .unwrap();
        let mut out = Vec::new();
        for version in 1..=3 {
            let mut sources = evolution.shards(plan.src(), version).unwrap();
            if fail_at == Some(version) {
                sources.get_mut(&0).unwrap().pop();
            }
            let mut options = RunOptions::default();
            options.delta = delta.then(|| DeltaRefit {
                session: session.clone(),
                version,
                options: DeltaOptions::default(),
            });
            let served = rollout.refit(&world, version, &options, |bufs, options| {
                let mut dst: BTreeMap<Rank, Vec<u8>> = bufs
                    .iter_mut()
                    .map(|(&r, b)| (r, std::mem::take(&mut b[0])))
                    .collect();
                let result = world.run(&plan, &sources, &mut dst, options).map(|_| ());
                for (r, b) in dst {
                    bufs.get_mut(&r).unwrap()[0] = b;
                }
                result
            });
            let expected = match (&served, fail_at) {
                (Ok(_), _) => Some(version),
                (Err(_), Some(f)) if method == Method::Staged => Some(f - 1),
                _ => None,
            };
            for &r in plan.dst().mesh().ranks() {
                let live = rollout.live(r).unwrap();
                let live = read(&live);
                match expected {
                    Some(v) if v > 0 => evolution
                        .verify_shard_from(DType::Bf16, plan.dst(), r, &live[0], v)
                        .unwrap(),
                    _ => {}
                }
                assert_eq!(session.serving(r), expected.filter(|&v| v > 0), "rank {r}");
            }
            out.push(served);
        }
        out
    }

    #[test]
    fn a_staged_stream_commits_every_version_whole_and_no_pass_sees_a_mix() {
        for delta in [false, true] {
            for served in stream(Method::Staged, delta, Vec::new(), None) {
                let served = served.unwrap();
                assert_eq!(served.outcome, "commit");
                assert_eq!(served.ranks.len(), 4);
                assert!(!served.mixed(), "{served:?}");
                assert!(
                    served
                        .ranks
                        .iter()
                        .all(|r| r.serving == Some(served.version))
                );
                assert!(served.ranks.iter().all(|r| r.staging_bytes == 256 * 64 * 2));
            }
        }
    }

    #[test]
    fn a_rolling_commit_reports_each_group() {
        let groups = vec![vec![2, 3], vec![4, 5]];
        for served in stream(Method::Staged, true, groups, None) {
            let served = served.unwrap();
            let groups = served.groups();
            assert_eq!(groups.len(), 2);
            assert_eq!(groups[0].0, vec![2, 3]);
            assert!(!served.mixed());
        }
        assert!(rolling_groups(&[2, 3, 4, 5], 3).is_err());
        assert_eq!(
            rolling_groups(&[2, 3, 4, 5], 2).unwrap(),
            vec![vec![2, 3], vec![4, 5]]
        );
    }

    #[test]
    fn in_place_the_engine_waits_for_the_whole_refit() {
        for served in stream(Method::InPlace, false, Vec::new(), None) {
            let served = served.unwrap();
            assert_eq!(served.outcome, "in place");
            assert_eq!(
                served
                    .ranks
                    .iter()
                    .map(|r| r.passes_during_refit)
                    .sum::<u64>(),
                0
            );
            assert!(served.pause_s() >= served.refit_s * 0.99, "{served:?}");
        }
    }

    #[test]
    fn a_version_that_fails_to_prepare_leaves_every_rank_on_the_one_before() {
        let out = stream(Method::Staged, true, Vec::new(), Some(2));
        assert!(out[0].is_ok());
        let e = out[1].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 0"), "{e}");
        // the stream goes on from the version served
        assert!(out[2].is_ok());
    }
}
