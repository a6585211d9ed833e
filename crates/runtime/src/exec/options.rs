//! The executor's knobs, checked before a run starts.

use reshard_core::error::Field;
use std::time::Duration;

use reshard_core::error::{Error, Result};

/// Knobs of the executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecOptions {
    /// Largest chunk a transfer is cut into.
    pub chunk_bytes: usize,
    /// Bound on the staging memory of one rank; at least two chunks (one in, one out).
    pub staging_bytes: usize,
    /// How long a rank waits for a peer before failing.
    pub timeout: Duration,
    /// Whether every transfer is checksummed by its sender and checked by its receiver
    /// ([`reshard_core::checksum`]): a byte changed on the way fails the job, naming the transfer.
    pub checksum: bool,
    /// A delta refit: the phases of values move only what changed since the version each
    /// receiver holds ([`super::delta`]).
    pub delta: Option<super::delta::DeltaRefit>,
    /// A staged refit: the destination buffers are shadows of the live shards, and the
    /// session keeps what a commit applies ([`super::stage`]).
    pub stage: Option<super::delta::StageRefit>,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            chunk_bytes: 4 << 20,
            staging_bytes: 64 << 20,
            timeout: Duration::from_secs(60),
            checksum: false,
            delta: None,
            stage: None,
        }
    }
}

impl ExecOptions {
    /// Rejects options that cannot hold their promises.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_bytes == 0 {
            return Err(Error::InvalidOption {
                field: Field::ChunkBytes,
                value: "0".into(),
                reason: "a chunk must hold at least one byte".into(),
            });
        }
        if self.chunk_bytes.saturating_mul(2) > self.staging_bytes {
            return Err(Error::InvalidOption {
                field: Field::ChunkBytes,
                value: self.chunk_bytes.to_string(),
                reason: format!(
                    "two chunks must fit in the staging bound of {} bytes",
                    self.staging_bytes
                ),
            });
        }
        if self.timeout.is_zero() {
            return Err(Error::InvalidOption {
                field: Field::Timeout,
                value: "0".into(),
                reason: "must be positive".into(),
            });
        }
        if let Some(d) = &self.delta {
            d.options.validate()?;
        }
        if let Some(s) = &self.stage {
            s.check(self.delta.as_ref())?;
        }
        Ok(())
    }
}

impl ExecOptions {
    /// The session a run keeps its ranks' state in: a delta refit's, or a staged refit's.
    pub fn session(&self) -> Option<&super::delta::DeltaSession> {
        (self.stage.as_ref().map(|s| &s.session)).or(self.delta.as_ref().map(|d| &d.session))
    }
}
