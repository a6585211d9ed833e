//! A stream of refits as a caller holds it: the [`RankDelta`] of every rank this process
//! runs, kept from one refit to the next ([`DeltaSession`]: delta bases, the version each
//! rank serves, what it holds staged), and one delta refit of it ([`DeltaRefit`]), which the
//! executor's options carry ([`crate::exec::ExecOptions::delta`]; a staged refit,
//! [`crate::exec::ExecOptions::stage`], names its session too).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{DeltaOptions, DeltaReport, RankDelta};
use crate::exec::stage::CommitReport;
use reshard_core::error::{Error, Field, Result};
use reshard_core::layout::Rank;

/// The delta state of the ranks a process runs, from one refit to the next: a handle, cheap
/// to clone, shared by its clones. Keep one per stream of refits of the same job (each
/// method a benchmark compares has its own).
#[derive(Clone, Debug, Default)]
pub struct DeltaSession(Arc<Mutex<Ranks>>);

#[derive(Debug, Default)]
struct Ranks {
    ranks: BTreeMap<Rank, RankDelta>,
    reports: Vec<DeltaReport>,
}

impl DeltaSession {
    /// A session in which no rank has taken part in a refit yet.
    pub fn new() -> DeltaSession {
        DeltaSession::default()
    }

    fn lock(&self) -> MutexGuard<'_, Ranks> {
        // a panic elsewhere leaves plain data behind: still usable
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the state of `rank` (a new one if it has none yet).
    pub fn with_rank<R>(&self, rank: Rank, f: impl FnOnce(&mut RankDelta) -> R) -> R {
        f(self.lock().ranks.entry(rank).or_default())
    }

    /// The version `rank`'s destination shards hold.
    pub fn held(&self, rank: Rank) -> Option<u64> {
        self.lock().ranks.get(&rank).and_then(RankDelta::held)
    }

    /// The version `rank`'s live shards serve ([`RankDelta::serving`]).
    pub fn serving(&self, rank: Rank) -> Option<u64> {
        self.lock().ranks.get(&rank).and_then(RankDelta::serving)
    }

    /// The version `rank` holds staged, not yet committed nor aborted.
    pub fn staged(&self, rank: Rank) -> Option<u64> {
        let s = self.lock();
        s.ranks
            .get(&rank)
            .and_then(|r| r.staged.as_ref().map(|st| st.version))
    }

    /// The ranks that hold `version` staged.
    pub fn staged_ranks(&self, version: u64) -> Vec<Rank> {
        let s = self.lock();
        s.ranks
            .iter()
            .filter(|(_, r)| r.staged.as_ref().is_some_and(|st| st.version == version))
            .map(|(&rank, _)| rank)
            .collect()
    }

    /// Commits `rank`'s staged `version`: applies it from `shadows` (the buffers it was
    /// staged into) onto `live` (its shards, which must still serve the version it was staged
    /// onto), in place; they then serve `version`. Refused, before a byte is written, when
    /// the rank holds no such staging, when the shards serve another version, or when the
    /// buffers are not those it was staged for.
    pub fn commit(
        &self,
        rank: Rank,
        version: u64,
        shadows: &[&[u8]],
        live: &mut [&mut [u8]],
    ) -> Result<CommitReport> {
        // taken out, so that other ranks' commits do not wait on this one's copy
        let staged = {
            let mut s = self.lock();
            let state = s.ranks.entry(rank).or_default();
            match &state.staged {
                Some(st) if st.version == version => {
                    if st.onto != state.serving {
                        return Err(Error::ServesOther {
                            rank,
                            version,
                            onto: st.onto,
                            serves: state.serving,
                        });
                    }
                    st.check(rank, shadows, live)?;
                }
                other => {
                    return Err(Error::NotStaged {
                        rank,
                        action: "commit",
                        asked: version,
                        staged: other.as_ref().map(|st| st.version),
                    });
                }
            }
            state.staged.take()
        };
        let Some(staged) = staged else {
            return Err(Error::Internal {
                rank,
                detail: "a staging vanished while checked".into(),
            });
        };
        let report = staged.apply(rank, shadows, live);
        let mut s = self.lock();
        let state = s.ranks.entry(rank).or_default();
        match &report {
            Ok(_) => {
                state.serving = Some(version);
                state.held = Some(version);
            }
            // the shards are half-written: they serve nothing known
            Err(_) => {
                state.serving = None;
                state.held = None;
            }
        }
        report
    }

    /// Drops `rank`'s staged `version`: its shards keep serving the version they serve.
    /// Refused when it holds no such staging.
    pub fn abort(&self, rank: Rank, version: u64) -> Result<()> {
        let mut s = self.lock();
        let state = s.ranks.entry(rank).or_default();
        match &state.staged {
            Some(st) if st.version == version => {
                let onto = st.onto;
                state.staged = None;
                // the kept scratch holds the version dropped: the next refit starts afresh
                // there, and sends deltas against what the shards serve elsewhere
                state.scratch.clear();
                state.held = onto;
                Ok(())
            }
            other => Err(Error::NotStaged {
                rank,
                action: "abort",
                asked: version,
                staged: other.as_ref().map(|st| st.version),
            }),
        }
    }

    /// Whether `other` is a handle to this same session.
    pub fn same(&self, other: &DeltaSession) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Bytes of every rank's bases.
    pub fn base_bytes(&self) -> u64 {
        self.lock().ranks.values().map(RankDelta::base_bytes).sum()
    }

    /// The reports of the refits run since the last call, every rank's, in rank order.
    pub fn take_reports(&self) -> Vec<DeltaReport> {
        let mut reports = std::mem::take(&mut self.lock().reports);
        reports.sort_by_key(|r| (r.version, r.rank));
        reports
    }

    /// Takes the states of `ranks` out of the session for a run.
    pub(crate) fn take(&self, ranks: impl IntoIterator<Item = Rank>) -> Vec<RankDelta> {
        let mut s = self.lock();
        ranks
            .into_iter()
            .map(|r| s.ranks.remove(&r).unwrap_or_default())
            .collect()
    }

    /// Gives back the states taken for a run, and its reports.
    pub(crate) fn give_back(
        &self,
        states: impl IntoIterator<Item = (Rank, RankDelta)>,
        reports: impl IntoIterator<Item = DeltaReport>,
    ) {
        let mut s = self.lock();
        s.ranks.extend(states);
        s.reports.extend(reports);
    }
}

/// One refit of a session: its version, and how it runs.
#[derive(Clone, Debug)]
pub struct DeltaRefit {
    /// The session that keeps every rank's state from this refit to the next.
    pub session: DeltaSession,
    /// The version this refit brings: its receivers hold it once the refit completes.
    pub version: u64,
    /// How it runs.
    pub options: DeltaOptions,
}

impl PartialEq for DeltaRefit {
    fn eq(&self, other: &DeltaRefit) -> bool {
        self.session.same(&other.session)
            && self.version == other.version
            && self.options == other.options
    }
}

impl Eq for DeltaRefit {}

/// One staged refit of a session: the version the run stages.
#[derive(Clone, Debug)]
pub struct StageRefit {
    /// The session that keeps the staging until its commit or abort.
    pub session: DeltaSession,
    /// The version the run stages.
    pub version: u64,
}

impl PartialEq for StageRefit {
    fn eq(&self, other: &StageRefit) -> bool {
        self.session.same(&other.session) && self.version == other.version
    }
}

impl Eq for StageRefit {}

impl StageRefit {
    /// Refuses a staged run whose delta refit (if any) is of another session or version: the
    /// staging and the delta's state live in one session.
    pub fn check(&self, delta: Option<&DeltaRefit>) -> Result<()> {
        match delta {
            Some(d) if !d.session.same(&self.session) || d.version != self.version => {
                Err(Error::InvalidOption {
                    field: Field::Flag("--stage"),
                    value: format!("version {}", self.version),
                    reason: format!(
                        "a staged delta refit runs in one session and one version; the delta \
                         is of version {}{}",
                        d.version,
                        if d.session.same(&self.session) {
                            ""
                        } else {
                            " in another session"
                        }
                    ),
                })
            }
            _ => Ok(()),
        }
    }
}
