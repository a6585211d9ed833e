//! The threads a rank runs on, started fallibly: one that the system refuses or that panics is
//! an error naming it, never an abort.

use std::thread::ScopedJoinHandle;

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

/// Which of a rank's threads: names it in the error when it cannot start or panics.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RankThread {
    /// The thread that runs the whole rank (ranks as threads of one process).
    Rank,
    /// A rank's send thread.
    Sender,
}

/// The outcome of a rank's thread that `std::thread::Builder::spawn_scoped` started (or
/// could not start).
pub(crate) fn joined<T>(
    handle: std::io::Result<ScopedJoinHandle<'_, Result<T>>>,
    rank: Rank,
    thread: RankThread,
) -> Result<T> {
    let (panicked, what) = match thread {
        RankThread::Rank => ("the rank's thread panicked", format!("rank {rank}")),
        RankThread::Sender => ("the send thread panicked", format!("rank {rank}'s sender")),
    };
    match handle {
        Ok(h) => h.join().unwrap_or_else(|_| {
            Err(Error::Internal {
                rank,
                detail: panicked.into(),
            })
        }),
        Err(source) => Err(Error::ThreadStart { what, source }),
    }
}
