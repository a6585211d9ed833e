//! The one method of a run, and the poison its checks see through.

/// The one method of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Move;

/// A pattern written over a destination shard before each verified repetition, so that only
/// the bytes this repetition moved can make it verify, not those of the one before.
pub(super) fn poison(buf: &mut [u8]) {
    reshard::memory::fill_around_caches(buf, 0xA5);
}
