//! Runs a plan: cuts transfers into bounded chunks, hands them to a [`Transport`](reshard_transport::Transport), copies the
//! local parts straight from shard to shard, and reports what did not complete.
//!
//! Every rank runs [`run_rank`] with its own [`RankPlan`](reshard_core::RankPlan): sends on one thread, local copies and
//! receives on another, both in the plan's schedule order (one total order on rank pairs, so
//! blocking transports cannot deadlock). The receives go to the transport as one batch
//! ([`Transport::recv_all`](reshard_transport::Transport::recv_all)), which may take them as they come, each sender's in order.
//! [`run_local`] runs all ranks as threads of this process.
//!
//! The files split by job: [`ExecOptions`] (`options`), a rank's [`Steps`] and their checks
//! (`steps`), running them on a transport (`run`), the bookkeeping of what is due and what
//! arrived, without I/O ([`progress`]), the counts ([`RankStats`], [`RunStats`]) and the
//! all-ranks-as-threads run (`local`).

pub mod baseline;
mod local;
mod options;
pub mod progress;
mod quant;
pub mod relay;
mod run;
mod stats;
mod steps;
pub(crate) mod threads;

pub use local::{
    MAX_LOCAL_RANKS, run_local, run_local_quantized, run_local_with_faults, zeroed_scale_shards,
    zeroed_shards,
};
pub use options::ExecOptions;
pub use quant::QuantJob;
pub use relay::{run_rank_any, run_rank_relayed};
pub use run::{RankJob, run_rank, run_steps};
pub use stats::{RankStats, RunStats};
pub use steps::{Step, Steps, check_buffers, cut_chunk};

#[cfg(test)]
mod tests;
