//! The one executor: runs a rank's [`Program`] on a transport, phase by phase (its local
//! copies before, its transfers ([`run_transfers`]), its local copies and scales after).

use super::buffers::Buffers;
use super::delta::{DeltaReport, DeltaRun, RankDelta};
use super::delta_phase::{Kept, PhaseWork};
use super::options::ExecOptions;
use super::program::{Buf, Phase, PhaseKind, Program};
use super::scaling::{self, Casts};
use super::stage::{Patch, Staged};
use super::stats::RankStats;
use super::transfers::run_transfers;
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_transport::Transport;

/// Runs one rank's program over `transport`: `src` and `dst` are the buffers the job gives
/// it ([`super::program::Buf::Src`], [`super::program::Buf::Dst`]); the scratch is allocated
/// here. A failure breaks every link, so that the peers stop now rather than at their
/// timeouts.
pub(crate) fn run_program<T>(
    program: &Program<'_>,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    if let Some(session) = options.session() {
        let rank = program.rank;
        let mut states = session.take([rank]);
        let mut state = states.pop().unwrap_or_default();
        let outcome = run_in_session(program, src, dst, transport, options, &mut state);
        let (stats, report) = match outcome {
            Ok((stats, report, staged)) => {
                if staged.is_some() {
                    state.staged = staged;
                }
                (Ok(stats), report)
            }
            Err(e) => (Err(e), None),
        };
        session.give_back([(rank, state)], report);
        return stats;
    }
    let mut state = RankState::new(
        program,
        src.to_vec(),
        dst.iter_mut().map(|b| &mut **b).collect(),
    )?;
    run_phases(program, &mut state, transport, options)?;
    Ok(state.finish(program))
}

/// A run whose rank keeps state in a session (a delta refit, a staged refit, or both):
/// returns its stats, its delta report and what it staged.
fn run_in_session<T>(
    program: &Program<'_>,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
    state: &mut RankDelta,
) -> Result<(RankStats, Option<DeltaReport>, Option<Staged>)>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let stage = stage_of(program.rank, options, state)?;
    let delta = options.delta.as_ref();
    if delta.is_some() {
        check_delta(program)?;
    }
    let run = delta.map(|refit| DeltaRun::new(state, refit));
    let mut rank = RankState::with_delta(
        program,
        src.to_vec(),
        dst.iter_mut().map(|b| &mut **b).collect(),
        run,
        stage,
    )?;
    run_phases(program, &mut rank, transport, options)?;
    Ok(rank.finish_all(program))
}

/// What a staged run stages (its version, and the version the rank serves, which it is
/// staged onto), or nothing for a run in place; a rank that still holds a staged version is
/// refused before any byte moves.
pub(crate) fn stage_of(
    rank: Rank,
    options: &ExecOptions,
    state: &RankDelta,
) -> Result<Option<(u64, Option<u64>)>> {
    let Some(stage) = &options.stage else {
        return Ok(None);
    };
    stage.check(options.delta.as_ref())?;
    if let Some(st) = &state.staged {
        return Err(Error::StillStaged {
            rank,
            version: stage.version,
            staged: st.version,
        });
    }
    Ok(Some((stage.version, state.serving)))
}

/// Runs every phase of `program` on `transport`.
fn run_phases<T>(
    program: &Program<'_>,
    state: &mut RankState<'_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<()>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let chunk = program.chunk_bytes;
    for (i, phase) in program.phases.iter().enumerate() {
        state.before(phase).inspect_err(|_| transport.abort())?;
        if phase.moves() && state.is_delta(phase) {
            state
                .delta_fence(i, phase, chunk, transport, options)
                .and_then(|()| state.delta_headers(phase, chunk, transport, options))
                .and_then(|()| state.delta_values(phase, chunk, transport, options))
                .inspect_err(|_| transport.abort())?;
        } else if phase.moves() {
            state.transfer(phase, chunk, transport, options)?;
        }
        state.after(phase).inspect_err(|_| transport.abort())?;
    }
    Ok(())
}

/// A rank's delta refit while it runs: its state, what it reports, and the work of the
/// phase under way.
pub(crate) struct DeltaCtx<'a> {
    run: DeltaRun<'a>,
    /// What this rank received as deltas, kept for a phase of forwards that follows (when
    /// `forwards`: it relays).
    kept: Kept,
    forwards: bool,
    report: DeltaReport,
    work: Option<PhaseWork>,
    held: Option<u64>,
}

/// A rank's buffers and what its program has settled so far, between its phases.
pub(crate) struct RankState<'a> {
    pub rank: Rank,
    pub bufs: Buffers<'a>,
    pub casts: Casts,
    /// The amax of the phase's quantized tensors, between the exchange's two halves.
    grids: Vec<reshard_core::convert::AmaxGrid>,
    stats: RankStats,
    delta: Option<DeltaCtx<'a>>,
    stage: Option<StageCtx>,
}

/// A staged run while it runs: the version it stages, onto which, and the patches it keeps.
struct StageCtx {
    version: u64,
    onto: Option<u64>,
    patches: Vec<Patch>,
}

impl<'a> RankState<'a> {
    /// The rank's buffers, its scratch allocated ([`Error::OutOfMemory`] when it does not fit).
    pub fn new(program: &Program<'_>, src: Vec<&'a [u8]>, dst: Vec<&'a mut [u8]>) -> Result<Self> {
        Self::with_delta(program, src, dst, None, None)
    }

    /// [`RankState::new`] for one refit of a delta refit, when `run` is given: the scratch
    /// its phases of values receive into is the one the last refit left (it holds that
    /// version), the rest zeroed; the version held is taken from its state until the refit
    /// completes, so that a failed one leaves none. With `stage` (the version staged, and the
    /// version served, which it is staged onto), `dst` are shadows of the live shards, and
    /// the run ends with what a commit applies ([`super::stage`]).
    pub fn with_delta(
        program: &Program<'_>,
        src: Vec<&'a [u8]>,
        dst: Vec<&'a mut [u8]>,
        run: Option<DeltaRun<'a>>,
        stage: Option<(u64, Option<u64>)>,
    ) -> Result<Self> {
        let rank = program.rank;
        let lens: Vec<usize> = program.scratch.iter().map(|s| s.len).collect();
        let mut run = run;
        let kept = run.as_mut().and_then(|r| r.state.take_scratch(&lens));
        let scratch = match kept {
            Some(mut kept) => {
                let received = received_scratch(program);
                for (k, s) in kept.iter_mut().enumerate() {
                    if !received.contains(&k) {
                        s.fill(0);
                    }
                }
                kept
            }
            None => {
                if let Some(r) = run.as_mut() {
                    // a new scratch holds no version
                    r.state.held = None;
                }
                program
                    .scratch
                    .iter()
                    .map(|s| {
                        reshard_core::memory::zeroed(s.len as u64, || {
                            format!("rank {rank}'s {}", s.what)
                        })
                    })
                    .collect::<Result<_>>()?
            }
        };
        let delta = run.map(|run| {
            let held = run.state.held.take();
            if stage.is_none() {
                // written in place: until it completes, the shards serve nothing known
                run.state.serving = None;
            }
            DeltaCtx {
                report: DeltaReport {
                    rank,
                    version: run.version,
                    held,
                    ..DeltaReport::default()
                },
                run,
                kept: Kept::new(),
                forwards: forwards_hops(program),
                work: None,
                held,
            }
        });
        Ok(RankState {
            rank,
            bufs: Buffers { src, dst, scratch },
            casts: Casts::default(),
            grids: Vec::new(),
            stats: RankStats {
                rank,
                ..RankStats::default()
            },
            delta,
            stage: stage.map(|(version, onto)| StageCtx {
                version,
                onto,
                patches: Vec::new(),
            }),
        })
    }

    /// Whether `phase` runs as a delta phase: a phase of values of a delta refit.
    pub fn is_delta(&self, phase: &Phase<'_>) -> bool {
        self.delta.is_some() && matches!(phase.kind, PhaseKind::Values | PhaseKind::Forward)
    }

    fn delta_ctx<'c>(
        rank: Rank,
        delta: &'c mut Option<DeltaCtx<'a>>,
    ) -> Result<&'c mut DeltaCtx<'a>> {
        delta.as_mut().ok_or_else(|| Error::Internal {
            rank,
            detail: "a delta phase in a refit without delta".into(),
        })
    }

    /// The delta phase under way, after its fence (`what` names the exchange, for the error).
    fn started<'c>(
        rank: Rank,
        work: &'c mut Option<PhaseWork>,
        what: &str,
    ) -> Result<&'c mut PhaseWork> {
        work.as_mut().ok_or_else(|| Error::Internal {
            rank,
            detail: format!("the {what} of a delta phase before its fence"),
        })
    }

    /// The first exchange of a delta phase ([`PhaseWork::fence`]).
    pub fn delta_fence<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        index: usize,
        phase: &'buf Phase<'_>,
        chunk: usize,
        transport: &T,
        options: &ExecOptions,
    ) -> Result<()> {
        let RankState {
            rank,
            bufs,
            casts,
            delta,
            ..
        } = self;
        let ctx = Self::delta_ctx(*rank, delta)?;
        let (src, _) = bufs.lend(*rank, &phase.src, &phase.dst)?;
        let buffers = (phase.src.len(), phase.dst.len());
        let work = ctx
            .work
            .insert(PhaseWork::new(index, &phase.steps, buffers, ctx.held));
        work.fence(
            (&phase.steps, &phase.forwards, &ctx.kept),
            &src,
            casts,
            &mut ctx.run,
            &mut ctx.report,
            transport,
            chunk,
            options,
        )
    }

    /// The second exchange of a delta phase ([`PhaseWork::headers`]).
    pub fn delta_headers<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        phase: &'buf Phase<'_>,
        chunk: usize,
        transport: &T,
        options: &ExecOptions,
    ) -> Result<()> {
        let rank = self.rank;
        let ctx = Self::delta_ctx(rank, &mut self.delta)?;
        let work = Self::started(rank, &mut ctx.work, "headers")?;
        work.headers(
            &phase.steps,
            &ctx.run,
            &mut ctx.report,
            transport,
            chunk,
            options,
        )
    }

    /// The third exchange of a delta phase ([`PhaseWork::values`]).
    pub fn delta_values<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        phase: &'buf Phase<'_>,
        chunk: usize,
        transport: &T,
        options: &ExecOptions,
    ) -> Result<()> {
        let RankState {
            rank,
            bufs,
            casts,
            delta,
            stats,
            stage,
            ..
        } = self;
        let ctx = Self::delta_ctx(*rank, delta)?;
        let work = Self::started(*rank, &mut ctx.work, "values")?;
        let (src, mut dst) = bufs.lend(*rank, &phase.src, &phase.dst)?;
        let keep = (ctx.forwards && phase.kind == PhaseKind::Values).then_some(&mut ctx.kept);
        let patches = stage.as_mut().map(|s| (&phase.dst[..], &mut s.patches));
        let moved = work.values(
            (&phase.steps, keep, patches),
            &src,
            &mut dst,
            casts,
            &ctx.run,
            &mut ctx.report,
            transport,
            chunk,
            options,
        )?;
        if phase.counted {
            stats.absorb(&moved);
        }
        Ok(())
    }

    /// The phase's work before its transfers: its copies, and the amax of its quantized
    /// tensors, staged for the exchange.
    pub fn before(&mut self, phase: &Phase<'_>) -> Result<()> {
        for c in &phase.before {
            let n = self.bufs.copy(self.rank, c)?;
            if c.counted && phase.counted {
                self.stats.bytes_local += n;
            }
        }
        if !phase.scaling.is_empty() {
            self.grids = scaling::amax(self.rank, &phase.scaling, &mut self.bufs)?;
        }
        Ok(())
    }

    /// The phase's transfers over `transport`.
    pub fn transfer<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        phase: &'buf Phase<'_>,
        chunk: usize,
        transport: &T,
        options: &ExecOptions,
    ) -> Result<()> {
        let (src, mut dst) = self.bufs.lend(self.rank, &phase.src, &phase.dst)?;
        let stats = run_transfers(
            &phase.steps,
            &src,
            &mut dst,
            transport,
            chunk,
            &self.casts,
            options,
        )?;
        if phase.counted {
            self.stats.absorb(&stats);
        }
        Ok(())
    }

    /// The phase's work after its transfers: the scales of its quantized tensors from the
    /// merged amax, then its copies.
    pub fn after(&mut self, phase: &Phase<'_>) -> Result<()> {
        if !phase.scaling.is_empty() {
            let grids = std::mem::take(&mut self.grids);
            scaling::settle(
                self.rank,
                &phase.scaling,
                grids,
                &mut self.bufs,
                &mut self.casts,
            )?;
        }
        for c in &phase.after {
            let n = self.bufs.copy(self.rank, c)?;
            if c.counted && phase.counted {
                self.stats.bytes_local += n;
            }
        }
        Ok(())
    }

    /// The rank's stats, with the program's own staging.
    pub fn finish(self, program: &Program<'_>) -> RankStats {
        self.finish_all(program).0
    }

    /// [`RankState::finish`] of a refit that completed, its delta report and what it staged.
    /// Its delta state keeps the scratch for the next refit and now holds the new version,
    /// or, staged, still the one it was staged onto (a commit moves it on).
    pub fn finish_all(
        self,
        program: &Program<'_>,
    ) -> (RankStats, Option<DeltaReport>, Option<Staged>) {
        let mut stats = self.stats;
        stats.rank = program.rank;
        stats.peak_staging_bytes += program.staging_bytes;
        let staged = self.stage.map(|st| {
            let lens = self.bufs.dst.iter().map(|b| b.len()).collect();
            Staged::new(st.version, st.onto, lens, st.patches)
        });
        let report = self.delta.map(|ctx| {
            let DeltaCtx {
                run,
                mut report,
                held,
                ..
            } = ctx;
            match &staged {
                Some(_) => run.state.held = held,
                None => {
                    run.state.held = Some(run.version);
                    run.state.serving = Some(run.version);
                }
            }
            run.state.scratch = self.bufs.scratch;
            report.base_bytes = run.state.base_bytes();
            report.kept_scratch_bytes = run.state.kept_scratch_bytes();
            report
        });
        (stats, report, staged)
    }
}

/// The scratch buffers a program's phases of values receive into (a batch's blobs, the
/// baseline's full tensor): they hold the last version between delta refits.
fn received_scratch(program: &Program<'_>) -> std::collections::BTreeSet<usize> {
    program
        .phases
        .iter()
        .filter(|p| p.kind == PhaseKind::Values)
        .flat_map(|p| p.dst.iter())
        .filter_map(|b| match b {
            Buf::Scratch(k) => Some(*k),
            _ => None,
        })
        .collect()
}

/// Refuses a delta refit of a program lowered without it: a relay plan's rounds stage bytes
/// on the way, where a delta refit's lowering forwards them ([`PhaseKind::Forward`]).
pub(crate) fn check_delta(program: &Program<'_>) -> Result<()> {
    if program
        .phases
        .iter()
        .any(|p| matches!(p.kind, PhaseKind::Round(_)))
    {
        return Err(Error::InvalidOption {
            field: reshard_core::error::Field::Relay,
            value: "delta".into(),
            reason: "a delta refit does not relay: its encodings would be staged on the way".into(),
        });
    }
    Ok(())
}

/// Whether a rank forwards hops in a phase of forwards (it then keeps the deltas it receives).
fn forwards_hops(program: &Program<'_>) -> bool {
    program
        .phases
        .iter()
        .any(|p| p.kind == PhaseKind::Forward && !p.forwards.is_empty())
}
