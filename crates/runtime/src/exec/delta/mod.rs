//! Delta refit: after a first refit, each transfer of a phase of values carries only the
//! elements that changed since the version its receiver holds, and the receiver writes them
//! over that version in place ([`reshard_core::delta`] encodes and applies them).
//!
//! A rank keeps what it needs across refits in its [`RankDelta`]: the version its
//! destination shards hold and, as a sender, the base of each of its transfers (what it last
//! sent, in the wire dtype: after any cast or quantization, so a change that vanishes in the
//! wire dtype sends nothing). A phase of values then runs in three exchanges on the same
//! links (the executor's `delta_phase`):
//!
//! 1. **Fence**: every receiver tells each of its senders the version it holds (16 bytes a
//!    peer, [`wire::Fence`]).
//! 2. **Headers**: every sender encodes each transfer against its base when the receiver holds
//!    that base, and tells the receiver what the transfer carries (24 bytes a transfer,
//!    [`wire::Header`]): a delta of so many bytes against a named version, or dense and why
//!    ([`Dense`]: no base yet, a receiver on another version, an anchor version, or an encoding
//!    no smaller than the values).
//! 3. **Values**: the dense transfers move as they would without delta; each delta moves as a
//!    run of bytes beside the shard and is applied once it has landed, its whole region then
//!    checked against the sender's CRC with `--checksum`.
//!
//! A rank whose refit fails holds no version afterwards, so the next refit sends it
//! everything dense. Phases that stage bytes for a later round (relay rounds, the amax
//! exchange) always move dense.

mod session;
pub mod wire;

use std::collections::BTreeMap;

use serde::Serialize;

use reshard_core::delta::BLOCK_ELEMS;
use reshard_core::error::{Error, Field, Result};
use reshard_core::layout::Rank;
use reshard_core::region::Region;

pub use session::{DeltaRefit, DeltaSession, StageRefit};
pub use wire::Dense;

/// How a delta refit runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaOptions {
    /// Every version that is a multiple of this is sent dense everywhere (`--delta-anchor`).
    pub anchor: Option<u64>,
    /// Elements per block of the encoding.
    pub block_elems: usize,
}

impl Default for DeltaOptions {
    fn default() -> Self {
        DeltaOptions {
            anchor: None,
            block_elems: BLOCK_ELEMS,
        }
    }
}

impl DeltaOptions {
    /// Refuses an anchor of 0 and a block size the encoder does not take.
    pub fn validate(&self) -> Result<()> {
        if self.anchor == Some(0) {
            return Err(Error::InvalidOption {
                field: Field::DeltaAnchor,
                value: "0".into(),
                reason: "must be at least 1 (every version dense)".into(),
            });
        }
        reshard_core::delta::DeltaEncoder::new(1, self.block_elems).map_err(|e| {
            Error::InvalidOption {
                field: Field::Flag("block_elems"),
                value: self.block_elems.to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(())
    }

    pub(crate) fn anchors(&self, version: u64) -> bool {
        self.anchor.is_some_and(|n| version.is_multiple_of(n))
    }
}

/// The base of one transfer on its sender: what it last sent, in the wire dtype.
#[derive(Debug)]
pub(crate) struct Base {
    pub to: Rank,
    pub region: Region,
    pub elem_bytes: usize,
    pub version: u64,
    pub bytes: Vec<u8>,
}

/// One rank's memory of its past refits, kept by the caller from one refit to the next.
#[derive(Debug, Default)]
pub struct RankDelta {
    /// The version its destination shards hold, as the base of the deltas sent to it (while
    /// a version is staged, the version its shadows were staged onto).
    pub(crate) held: Option<u64>,
    /// The version its live shards serve: set by a refit in place that completed, or by a
    /// commit; `None` after a refit in place that failed (the shards are half-written).
    pub(crate) serving: Option<u64>,
    /// The version it holds staged beside its live shards ([`crate::exec::stage`]).
    pub(crate) staged: Option<crate::exec::stage::Staged>,
    /// As a sender: each transfer's base, by (phase, transfer) of its program.
    pub(crate) bases: BTreeMap<(usize, usize), Base>,
    /// The program's scratch as the last refit left it (a receiving blob of a batch, the
    /// baseline's full tensor): it holds the last version too.
    pub(crate) scratch: Vec<Vec<u8>>,
    /// Buffers a job allocates for itself rather than the caller, kept between refits for
    /// the same reason (the baseline's full tensor, by name).
    kept: BTreeMap<String, Vec<u8>>,
}

impl RankDelta {
    /// A rank that has taken part in no refit (a new replica, a restarted process).
    pub fn new() -> RankDelta {
        RankDelta::default()
    }

    /// The version its destination shards hold: `None` before its first refit and after one
    /// that failed.
    pub fn held(&self) -> Option<u64> {
        self.held
    }

    /// Says that its shards hold `version` (or nothing): for a caller that restored them
    /// from elsewhere (a checkpoint of that version). Its senders then send it deltas against
    /// that version, or everything dense when they hold no such base.
    pub fn set_held(&mut self, version: Option<u64>) {
        self.held = version;
        self.serving = version;
    }

    /// The version its live shards serve (see [`RankDelta::held`] for the base of deltas).
    pub fn serving(&self) -> Option<u64> {
        self.serving
    }

    /// The version it holds staged, not yet committed nor aborted.
    pub fn staged(&self) -> Option<&crate::exec::stage::Staged> {
        self.staged.as_ref()
    }

    /// Forgets everything, as a restarted rank would: no version held or staged, no bases.
    pub fn forget(&mut self) {
        *self = RankDelta::default();
    }

    /// Bytes of its bases: one copy of every region it sends, in the wire dtype.
    pub fn base_bytes(&self) -> u64 {
        self.bases.values().map(|b| b.bytes.len() as u64).sum()
    }

    /// Bytes of the scratch and buffers it keeps between refits.
    pub fn kept_scratch_bytes(&self) -> u64 {
        let kept: u64 = self.kept.values().map(|k| k.len() as u64).sum();
        self.scratch.iter().map(|s| s.len() as u64).sum::<u64>() + kept
    }

    /// The buffer `name` of `len` bytes a job keeps between refits (the baseline's full
    /// tensor), as the last refit left it; a new one, zeroed, says that nothing is held.
    pub fn take_kept(&mut self, name: &str, len: usize, rank: Rank) -> Result<Vec<u8>> {
        match self.kept.remove(name) {
            Some(k) if k.len() == len => Ok(k),
            _ => {
                self.held = None;
                reshard_core::memory::zeroed(len as u64, || format!("rank {rank}'s {name}"))
            }
        }
    }

    /// Gives back a buffer taken with [`RankDelta::take_kept`].
    pub fn give_kept(&mut self, name: &str, buf: Vec<u8>) {
        self.kept.insert(name.into(), buf);
    }

    /// The scratch of `program` as the last refit left it, if it is the same program's;
    /// otherwise nothing is held any more (the scratch is new and zeroed).
    pub(crate) fn take_scratch(&mut self, lens: &[usize]) -> Option<Vec<Vec<u8>>> {
        let kept = std::mem::take(&mut self.scratch);
        if kept.len() == lens.len() && kept.iter().zip(lens).all(|(k, &l)| k.len() == l) {
            Some(kept)
        } else {
            None
        }
    }
}

/// One refit of a rank: its state, the version it brings, and how.
#[derive(Debug)]
pub struct DeltaRun<'d> {
    /// The rank's memory of its past refits, which this one updates.
    pub state: &'d mut RankDelta,
    /// The version this refit brings.
    pub version: u64,
    /// How it runs.
    pub options: DeltaOptions,
}

impl<'d> DeltaRun<'d> {
    /// The rank's part of `refit`, with its memory `state`.
    pub fn new(state: &'d mut RankDelta, refit: &DeltaRefit) -> DeltaRun<'d> {
        DeltaRun {
            state,
            version: refit.version,
            options: refit.options,
        }
    }
}

/// What a rank's transfers carried, one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeltaCounts {
    /// Transfers that moved as deltas.
    pub delta: u64,
    /// Transfers that moved dense.
    pub dense: u64,
    /// Bytes of values on the wire: the encodings and the dense transfers.
    pub bytes: u64,
    /// Bytes the same transfers would have moved dense.
    pub dense_bytes: u64,
    /// Elements of the transfers that moved as deltas.
    pub elems: u64,
    /// Of those elements, the ones that changed.
    pub changed: u64,
    /// Blocks per encoding: unchanged, bitmask, offsets, dense.
    pub blocks: [u64; 4],
}

/// What one rank's delta refit did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeltaReport {
    /// The rank it reports on.
    pub rank: Rank,
    /// The version the refit brought.
    pub version: u64,
    /// The version its destination shards held before.
    pub held: Option<u64>,
    /// What its transfers carried as a sender.
    pub sent: DeltaCounts,
    /// What its transfers carried as a receiver.
    pub received: DeltaCounts,
    /// Bytes of fences and headers it sent.
    pub control_bytes: u64,
    /// The receivers it sent something dense, and why (one entry per receiver and reason).
    pub dense_to: Vec<(Rank, Dense)>,
    /// The senders that sent it something dense, and why.
    pub dense_from: Vec<(Rank, Dense)>,
    /// Bytes of its bases after the refit.
    pub base_bytes: u64,
    /// Bytes of scratch it keeps between refits.
    pub kept_scratch_bytes: u64,
    /// The most bytes of encodings it held at once, sent or received.
    pub peak_encoded_bytes: u64,
}

impl DeltaReport {
    /// Bytes this rank sent on the wire: its values (encoded or dense), fences and headers.
    pub fn wire_bytes(&self) -> u64 {
        self.sent.bytes + self.control_bytes
    }

    pub(crate) fn note(list: &mut Vec<(Rank, Dense)>, peer: Rank, why: Dense) {
        if !list.contains(&(peer, why)) {
            list.push((peer, why));
            list.sort();
        }
    }
}

#[cfg(test)]
mod tests;
