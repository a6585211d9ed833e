//! Refits while serving: the destination ranks this process runs keep serving from their
//! live shards while each version travels, and the version is committed on every rank or on
//! none ([`Rollout`]).
//!
//! A version is moved either **in place** (today's refit: the engine stops serving for the
//! whole refit, since the shards are half-written until it ends) or **staged**: it is
//! prepared into shadows beside the live shards ([`crate::exec::stage`]) while the engine
//! serves, every rank votes in the job's two-phase decision ([`World::decide`]), and on
//! commit each rank applies its staging in place under the engine's lock: the only pause.
//! With a rolling commit the destination ranks commit one group (whole inference replicas,
//! [`rolling_groups`]) at a time, a barrier between groups, so that the other groups serve
//! meanwhile.
//!
//! Every destination rank runs a serving stand-in ([`crate::serve::Server`]) during each
//! version: its longest gap between passes is the pause an engine's users would see, and its
//! digests say whether any pass saw a mix of two versions (none may).

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

mod report;

pub use report::{MethodSummary, RankServed, Standing, VersionServed, summarize};
/// A rolling commit's groups, each of whole inference replicas.
pub use reshard_core::rolling::rolling_groups;

use crate::exec::delta::DeltaSession;
use crate::exec::delta::StageRefit;
use crate::exec::stage::CommitReport;
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
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Method::InPlace => "in-place",
            Method::Staged => "staged",
        }
    }
}

/// One destination rank of a stream: its live shards, its shadows, and its engine.
struct Shards {
    live: Live,
    shadows: Vec<Vec<u8>>,
    /// Whether the shadows hold what the live shards hold: after a commit they do (the
    /// commit made the live shards what was staged), after a prepare or an abort not.
    in_step: bool,
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
                            let mut s = reshard_core::memory::zeroed(b.len() as u64, || {
                                format!("rank {rank}'s staging shadow")
                            })?;
                            touch(&mut s);
                            Ok(s)
                        })
                        .collect::<Result<_>>()?,
                    Method::InPlace => Vec::new(),
                };
                // resident, as an engine's weights are (a first commit would fault them in)
                let mut bufs = bufs;
                for b in bufs.iter_mut() {
                    touch(b);
                }
                let live = Live::new(std::sync::RwLock::new(bufs));
                Ok((
                    rank,
                    Shards {
                        live,
                        shadows,
                        in_step: false,
                    },
                ))
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

    /// The session that keeps its ranks' versions and stagings.
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
            .map(|(&r, s)| Ok((r, Server::start(s.live.clone(), self.serve.clone())?)))
            .collect::<Result<_>>()?;
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
                .passes_by_mark
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
        // as a delta refit's executor says too; a failed one leaves them half-written, serving
        // nothing known
        let serving = result.is_ok().then_some(version);
        for &r in self.ranks.keys() {
            self.session.with_rank(r, |s| s.set_held(serving));
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
        // the shadows hold what the live shards hold (a delta applies over that version):
        // copied unless the last commit left them so
        for (&rank, s) in self.ranks.iter_mut().filter(|(_, s)| !s.in_step) {
            let live = read(&s.live);
            let bufs: Vec<&[u8]> = live.iter().map(Vec::as_slice).collect();
            let mut shadows: Vec<&mut [u8]> = s.shadows.iter_mut().map(|b| &mut b[..]).collect();
            crate::exec::stage::refresh_shadows(rank, &mut shadows, &bufs)?;
        }
        for s in self.ranks.values_mut() {
            s.in_step = false;
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
        // every rank has committed before any goes on (and its work does not slow another's
        // commit)
        if let Err(e) = world.barrier() {
            lost.get_or_insert(e);
        }
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
        let report = self.session.commit(rank, version, &shadows, &mut bufs)?;
        s.in_step = true;
        Ok(Some(report))
    }

    /// Drops what this process's ranks staged of `version`.
    fn drop_staged(&self, version: u64) {
        for r in self.session.staged_ranks(version) {
            let _ = self.session.abort(r, version);
        }
    }
}

/// Writes every page of `buf` (keeping its bytes), so that it is resident.
fn touch(buf: &mut [u8]) {
    for i in (0..buf.len()).step_by(4096) {
        buf[i] = std::hint::black_box(buf[i]);
    }
}

fn read(live: &Live) -> std::sync::RwLockReadGuard<'_, Vec<Vec<u8>>> {
    live.read().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests;
