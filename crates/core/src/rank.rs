//! Rank ids, at the bottom of the crate: layouts, plans, transports and errors all name ranks,
//! and none of them should have to depend on another for it.

/// A global rank: the process (or GPU) number in the whole job.
pub type Rank = usize;
