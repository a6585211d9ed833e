//! The job's own links as a carrier of short notices: what the shm transport rides on (TCP,
//! or MPI under `mpirun`), below the shm transport and the transports that carry it.

use serde::Serialize;
use serde::de::DeserializeOwned;

use reshard_core::error::Result;
use reshard_core::layout::Rank;

/// The job's links that the shm transport rides on: they carry its short notices (where a
/// ring or a destination lives, which bytes were written) and, as a [`Transport`](crate::Transport), the data to
/// peers on other hosts.
pub trait Carrier: Sync {
    /// This rank.
    fn rank(&self) -> Rank;
    /// Sends `notice` to `peer`; `what` says what it is for, in an error.
    fn tell<T: Serialize>(&self, peer: Rank, notice: &T, what: &str) -> Result<()>;
    /// Waits for `peer`'s next notice; `what` says what was awaited, in an error.
    fn hear<T: DeserializeOwned>(&self, peer: Rank, what: &str) -> Result<T>;
}
