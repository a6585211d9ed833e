//! The one method of a run.

/// The one method of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Move;
