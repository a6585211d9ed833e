//! The one driver of many ranks as threads of this process (the `local` transport): runs
//! every rank's [`Program`] phase by phase, each phase of every rank together, on links of
//! its own, so that a buffer a phase writes is lent to the next one only once it is done.
//!
//! A rank that fails stops there: its links of the later phases open and close at once, so
//! that its peers stop too and report exactly what did not arrive, rather than wait for it.

use std::collections::BTreeSet;
use std::time::Instant;

use super::delta::{DeltaReport, DeltaRun};
use super::delta_phase::both_ways;
use super::executor::{RankState, check_delta, stage_of};
use super::options::ExecOptions;
use super::program::{Phase, PhaseKind, Program};
use super::stage::Staged;
use super::stats::{RankStats, RunStats};
use crate::exec::threads::{RankThread, joined};
use reshard_core::error::Result;
use reshard_core::layout::Rank;
use reshard_transport::{Fault, LocalFabric};

/// One rank's part of a run of many: its program and the buffers the job gives it.
pub struct RankRun<'a, 'p> {
    /// The rank's program.
    pub program: Program<'p>,
    /// Its source buffers, as the program's [`super::program::Buf::Src`] numbers them.
    pub src: Vec<&'a [u8]>,
    /// Its destination buffers, as the program's [`super::program::Buf::Dst`] numbers them.
    pub dst: Vec<&'a mut [u8]>,
}

/// Where a phase falls in the run: phases of every rank with the same key run together. A
/// plan's values and the first round of a relay plan are the same phase (a rank whose part
/// does not relay moves everything in round 0).
fn key(phase: &Phase<'_>) -> (usize, usize) {
    let at = match phase.kind {
        PhaseKind::Amax => 0,
        PhaseKind::Values => 1,
        PhaseKind::Round(j) => 1 + j,
        PhaseKind::Forward => usize::MAX - 1,
        PhaseKind::Keep => usize::MAX,
    };
    (phase.part, at)
}

/// A rank's state in the run, or how it failed.
struct Runner<'a, 'p> {
    program: Program<'p>,
    state: Result<RankState<'a>>,
}

impl Runner<'_, '_> {
    fn phase(&self, key_: (usize, usize)) -> Option<usize> {
        self.program.phases.iter().position(|p| key(p) == key_)
    }
}

/// Runs every rank's program with the ranks as threads of this process. Buffers are lent
/// back on return, also on error; the error lists every rank that did not complete.
pub(crate) fn run_threads(
    runs: Vec<RankRun<'_, '_>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<RunStats> {
    let Some(session) = options.session() else {
        return run_all(runs, None, Vec::new(), options, faults).map(|(stats, _, _)| stats);
    };
    if options.delta.is_some() {
        for r in &runs {
            check_delta(&r.program)?;
        }
    }
    let ranks: Vec<Rank> = runs.iter().map(|r| r.program.rank).collect();
    let mut states = session.take(ranks.iter().copied());
    let stages: Result<Vec<_>> = ranks
        .iter()
        .zip(&states)
        .map(|(&rank, state)| stage_of(rank, options, state))
        .collect();
    let outcome = stages.and_then(|stages| {
        let deltas = options.delta.as_ref().map(|refit| {
            states
                .iter_mut()
                .map(|state| DeltaRun::new(state, refit))
                .collect()
        });
        run_all(runs, deltas, stages, options, faults)
    });
    let (stats, reports) = match outcome {
        Ok((stats, reports, staged)) => {
            for (state, staged) in states.iter_mut().zip(staged) {
                if staged.is_some() {
                    state.staged = staged;
                }
            }
            (Ok(stats), reports)
        }
        Err(e) => {
            if options.stage.is_some() {
                // nothing is staged anywhere: the scratch that ranks which completed keep
                // holds the version dropped
                for state in &mut states {
                    state.scratch.clear();
                }
            }
            (Err(e), Vec::new())
        }
    };
    session.give_back(ranks.into_iter().zip(states), reports);
    stats
}

/// Every rank's run; `stages` (empty: in place) say what each rank stages. Returns the
/// stats, the delta reports and each rank's staging, in the order of `runs`.
fn run_all<'a>(
    runs: Vec<RankRun<'a, '_>>,
    deltas: Option<Vec<DeltaRun<'a>>>,
    stages: Vec<Option<(u64, Option<u64>)>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<(RunStats, Vec<DeltaReport>, Vec<Option<Staged>>)> {
    let started = Instant::now();
    let mut runners = Vec::with_capacity(runs.len());
    let mut deltas = deltas.map(Vec::into_iter);
    let mut stages = stages.into_iter();
    for r in runs {
        let run = deltas.as_mut().and_then(Iterator::next);
        let stage = stages.next().flatten();
        let state = RankState::with_delta(&r.program, r.src, r.dst, run, stage)?;
        runners.push(Runner {
            program: r.program,
            state: Ok(state),
        });
    }
    let keys: BTreeSet<(usize, usize)> = runners
        .iter()
        .flat_map(|r| r.program.phases.iter().map(key))
        .collect();
    for k in keys {
        // each rank's work before the transfers runs on its transfer thread
        let delta = runners.iter().any(|r| {
            r.phase(k).is_some_and(|p| {
                let phase = &r.program.phases[p];
                phase.moves() && r.state.as_ref().is_ok_and(|s| s.is_delta(phase))
            })
        });
        if delta {
            for stage in [Stage::Fence, Stage::Headers, Stage::Values] {
                transfers(&mut runners, k, options, faults, stage);
            }
        } else {
            transfers(&mut runners, k, options, faults, Stage::Dense);
        }
        each(&mut runners, k, (has_after, after_bytes), |state, phase| {
            state.after(phase)
        });
    }
    let (mut reports, mut staged) = (Vec::new(), Vec::new());
    let results: Vec<Result<RankStats>> = runners
        .into_iter()
        .map(|r| {
            r.state.map(|s| {
                let (stats, report, st) = s.finish_all(&r.program);
                reports.extend(report);
                staged.push(st);
                stats
            })
        })
        .collect();
    let stats = RunStats::gather(started.elapsed(), results)?;
    Ok((stats, reports, staged))
}

/// Which exchange of a phase the driver runs: a phase's transfers, or one of the three
/// exchanges of a delta phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Dense,
    Fence,
    Headers,
    Values,
}

/// Which side of a phase's transfers some local work is on: whether a phase has such work,
/// and about how many bytes it touches.
type Side = (fn(&Phase<'_>) -> bool, fn(&Phase<'_>) -> u64);

fn has_before(p: &Phase<'_>) -> bool {
    !(p.before.is_empty() && p.scaling.is_empty())
}

fn has_after(p: &Phase<'_>) -> bool {
    !(p.after.is_empty() && p.scaling.is_empty())
}

/// Below this many bytes of local work in a phase, all ranks', the driver does it on its own
/// thread: starting threads would cost more than the copies.
const THREADED_WORK_BYTES: u64 = 1 << 20;

fn copied_bytes(copies: &[super::program::LocalCopy<'_>]) -> u64 {
    copies
        .iter()
        .map(|c| c.region.volume() * c.elem_bytes as u64)
        .sum()
}

/// About how many bytes a phase's work before its transfers reads: its copies and the shards
/// it takes the amax of.
fn before_bytes(p: &Phase<'_>) -> u64 {
    let scaled: u64 = p
        .scaling
        .iter()
        .map(|s| s.shard.volume() * s.src_dtype.size() as u64)
        .sum();
    copied_bytes(&p.before) + scaled
}

/// About how many bytes a phase's work after its transfers touches: its copies and the
/// scales it settles (a few bytes per block).
fn after_bytes(p: &Phase<'_>) -> u64 {
    let scales: u64 = p.scaling.iter().map(|s| s.blocks.volume() * 4).sum();
    copied_bytes(&p.after) + scales
}

/// Records the failures of a phase's threads.
fn record(runners: &mut [Runner<'_, '_>], outcomes: Vec<(usize, Result<()>)>) {
    for (i, o) in outcomes {
        if let Err(e) = o {
            runners[i].state = Err(e);
        }
    }
}

/// Runs `work` on every rank with phase `k` that has work there and has not failed, each on
/// a thread of its own, as separate processes would (or one after the other on this thread
/// when there is little of it).
fn each(
    runners: &mut [Runner<'_, '_>],
    k: (usize, usize),
    (has_work, weight): Side,
    work: impl Fn(&mut RankState<'_>, &Phase<'_>) -> Result<()> + Sync,
) {
    let work = &work;
    let total: u64 = runners
        .iter()
        .filter_map(|r| Some(weight(&r.program.phases[r.phase(k)?])))
        .sum();
    if total < THREADED_WORK_BYTES {
        let outcomes = runners
            .iter_mut()
            .enumerate()
            .filter_map(|(i, r)| {
                let p = r.phase(k)?;
                let Runner { program, state } = r;
                let phase = &program.phases[p];
                let state = state.as_mut().ok().filter(|_| has_work(phase))?;
                Some((i, work(state, phase)))
            })
            .collect();
        return record(runners, outcomes);
    }
    let outcomes: Vec<(usize, Result<()>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = runners
            .iter_mut()
            .enumerate()
            .filter_map(|(i, r)| {
                let p = r.phase(k)?;
                let Runner { program, state } = r;
                let phase = &program.phases[p];
                let state = state.as_mut().ok().filter(|_| has_work(phase))?;
                let rank = state.rank;
                let h = std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(scope, move || work(state, phase));
                Some((i, rank, h))
            })
            .collect();
        handles
            .into_iter()
            .map(|(i, rank, h)| (i, joined(h, rank, RankThread::Rank)))
            .collect()
    });
    record(runners, outcomes);
}

/// Runs the work before the transfers and the transfers of phase `k` of every rank, each on a
/// thread of its own, on links of their own. A rank that failed before has its links opened
/// and closed at once, so that its peers stop now.
fn transfers(
    runners: &mut [Runner<'_, '_>],
    k: (usize, usize),
    options: &ExecOptions,
    faults: &[Fault],
    stage: Stage,
) {
    let mut ranks: Vec<Rank> = Vec::new();
    let mut pairs: BTreeSet<(Rank, Rank)> = BTreeSet::new();
    for r in runners.iter() {
        if let Some(p) = r
            .phase(k)
            .map(|p| &r.program.phases[p])
            .filter(|p| p.moves())
        {
            ranks.push(r.program.rank);
            match stage {
                Stage::Dense => pairs.extend(p.pairs()),
                // the fences go from receivers to senders
                _ => pairs.extend(both_ways(p.pairs())),
            }
        }
    }
    if ranks.is_empty() {
        return each(runners, k, (has_before, before_bytes), |state, phase| {
            state.before(phase)
        });
    }
    let fabric = LocalFabric {
        timeout: options.timeout,
        faults: faults.to_vec(),
    };
    tracing::debug!(ranks = ranks.len(), links = pairs.len(), "local phase");
    let outcomes: Vec<(usize, Result<()>)> = std::thread::scope(|scope| {
        let mut endpoints = fabric.endpoints(&ranks, pairs);
        let handles: Vec<_> = runners
            .iter_mut()
            .enumerate()
            .filter_map(|(i, r)| {
                let p = r.phase(k)?;
                let Runner { program, state } = r;
                let phase = &program.phases[p];
                let chunk = program.chunk_bytes;
                // the endpoint lives as long as the thread: a rank that fails closes its links
                let endpoint = endpoints.remove(&program.rank);
                let state = state.as_mut().ok()?;
                let first = matches!(stage, Stage::Dense | Stage::Fence);
                if endpoint.is_none() && !(first && has_before(phase)) {
                    return None;
                }
                let rank = state.rank;
                let h = std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(scope, move || {
                        if first {
                            state.before(phase)?;
                        }
                        let Some(endpoint) = endpoint else {
                            return Ok(());
                        };
                        match stage {
                            Stage::Dense => state.transfer(phase, chunk, &endpoint, options),
                            Stage::Fence => state.delta_fence(p, phase, chunk, &endpoint, options),
                            Stage::Headers => state.delta_headers(phase, chunk, &endpoint, options),
                            Stage::Values => state.delta_values(phase, chunk, &endpoint, options),
                        }
                    });
                Some((i, rank, h))
            })
            .collect();
        // the links of the ranks that failed before close now
        drop(endpoints);
        handles
            .into_iter()
            .map(|(i, rank, h)| (i, joined(h, rank, RankThread::Rank)))
            .collect()
    });
    record(runners, outcomes);
}
