//! What a rank and a whole run did: the counts the command line and the benchmarks report.

use std::time::Duration;

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

/// What one rank did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankStats {
    /// The rank counted.
    pub rank: Rank,
    /// Bytes sent to other ranks.
    pub bytes_sent: u64,
    /// Bytes received from other ranks.
    pub bytes_received: u64,
    /// Bytes copied within the rank, off the wire.
    pub bytes_local: u64,
    /// Chunks handed to the transport.
    pub chunks_sent: u64,
    /// Chunks received from other ranks.
    pub chunks_received: u64,
    /// The most staging memory it held at once, in bytes: the transport's and its program's.
    pub peak_staging_bytes: u64,
    /// Of `bytes_sent`, those the transport wrote straight into their receivers' shards
    /// (shm direct writes): one copy per byte instead of two.
    pub bytes_direct: u64,
}

impl RankStats {
    /// Adds `other`'s counts to these, as one rank's phases add up; the peak is the larger.
    pub fn absorb(&mut self, other: &RankStats) {
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.bytes_local += other.bytes_local;
        self.chunks_sent += other.chunks_sent;
        self.chunks_received += other.chunks_received;
        self.bytes_direct += other.bytes_direct;
        self.peak_staging_bytes = self.peak_staging_bytes.max(other.peak_staging_bytes);
    }
}

/// What a whole run did.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Wall time of the run, every rank's part.
    pub elapsed: Duration,
    /// Every rank's counts.
    pub ranks: Vec<RankStats>,
}

impl RunStats {
    /// The run's stats from every rank's outcome, or every rank's failure.
    pub fn gather(
        elapsed: Duration,
        results: impl IntoIterator<Item = Result<RankStats>>,
    ) -> Result<RunStats> {
        let mut stats = RunStats {
            elapsed,
            ranks: Vec::new(),
        };
        let mut failures = Vec::new();
        for r in results {
            match r {
                Ok(s) => stats.ranks.push(s),
                // a rank's own list of failures joins the run's, not nested inside it
                Err(Error::Incomplete { failures: theirs }) => failures.extend(theirs),
                Err(e) => failures.push(e),
            }
        }
        if failures.is_empty() {
            Ok(stats)
        } else {
            Err(Error::Incomplete { failures })
        }
    }

    /// Bytes received from other ranks, all ranks together.
    pub fn bytes_remote(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes_received).sum()
    }

    /// Bytes copied within a rank, all ranks together.
    pub fn bytes_local(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes_local).sum()
    }

    /// Bytes written straight into receivers' shards, by every rank.
    pub fn bytes_direct(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes_direct).sum()
    }

    /// The most staging memory of one rank, in bytes.
    pub fn peak_staging_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .map(|r| r.peak_staging_bytes)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout(peer: usize) -> Error {
        Error::Timeout {
            rank: 4,
            peer,
            waited: Duration::from_secs(1),
            detail: "chunk".into(),
        }
    }

    #[test]
    fn a_ranks_failures_join_the_runs_without_nesting() {
        let results = vec![
            Err(Error::Incomplete {
                failures: vec![timeout(0), timeout(1)],
            }),
            Err(timeout(2)),
        ];
        let err = RunStats::gather(Duration::ZERO, results).unwrap_err();
        let Error::Incomplete { failures } = &err else {
            panic!("{err}");
        };
        assert_eq!(failures.len(), 3);
        assert_eq!(
            err.to_string().matches("did not complete").count(),
            1,
            "{err}"
        );
    }
}
