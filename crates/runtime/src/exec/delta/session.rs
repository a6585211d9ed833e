//! A stream of delta refits as a caller holds it: the [`RankDelta`] of every rank this
//! process runs, kept from one refit to the next ([`DeltaSession`]), and one refit of it
//! ([`DeltaRefit`]), which the executor's options carry ([`crate::exec::ExecOptions::delta`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{DeltaOptions, DeltaReport, RankDelta};
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
    pub session: DeltaSession,
    pub version: u64,
    pub options: DeltaOptions,
}

impl PartialEq for DeltaRefit {
    fn eq(&self, other: &DeltaRefit) -> bool {
        Arc::ptr_eq(&self.session.0, &other.session.0)
            && self.version == other.version
            && self.options == other.options
    }
}

impl Eq for DeltaRefit {}
