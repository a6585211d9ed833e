//! What `reshard run` takes: the tensor and its layouts, the fill, the checks and dumps, the
//! repetitions.

use std::path::PathBuf;

use clap::Args;

use reshard::runtime::harness::Repeat;

use crate::cli::TensorArgs;
use crate::cli::exec_args::ExecArgs;

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub(super) tensor: TensorArgs,
    /// Contents of the global tensor: hash or hash:SEED (a hash of each element's index, so
    /// that a block in the wrong place fails --verify, for every dtype), index (element i
    /// holds i mod 2^bits: readable in dumps, but it repeats every 2^bits elements), or
    /// normal or normal:SEED (float dtypes only: finite values of varied magnitude, with
    /// all-zero and tiny rows, for conversions).
    #[arg(long, default_value = "hash", help_heading = "Data and checks")]
    pub(super) fill: String,
    /// Write each destination rank's local buffer, raw, to DIR/rank<R>.bin (DIR is created if
    /// missing and checked before any byte moves; each file appears whole or not at all).
    /// With --stage, the live shard each rank serves at the end, also when the stream stopped
    /// short (the first of --stage-methods).
    #[arg(long, value_name = "DIR", help_heading = "Data and checks")]
    pub(super) dump: Option<PathBuf>,
    /// Write each source rank's local shard, raw, to DIR/src<R>.bin (as --dump does): the
    /// input a conversion (--dst-dtype) can be checked against.
    #[arg(long, value_name = "DIR", help_heading = "Data and checks")]
    pub(super) dump_src: Option<PathBuf>,
    /// Check every destination byte against the fill after every repetition; exit non-zero
    /// on any mismatch.
    #[arg(long, help_heading = "Data and checks")]
    pub(super) verify: bool,
    #[command(flatten)]
    pub(super) exec: ExecArgs,
    /// Timed repetitions of the data phase (the report gives their median, min and max).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Repetitions and report")]
    pub(super) iters: u32,
    /// Untimed repetitions before the timed ones (first-touch page faults, connection warm-up).
    #[arg(long, default_value_t = 0, help_heading = "Repetitions and report")]
    pub(super) warmup: u32,
    /// Print a JSON report instead of text.
    #[arg(long, help_heading = "Repetitions and report")]
    pub(super) json: bool,
    #[command(flatten)]
    pub(super) delta: crate::cli::delta_args::DeltaArgs,
    /// With --delta: the methods compared, in turn: delta, dense, gather-broadcast (the
    /// baseline as a delta: the changed elements gathered to one rank, then broadcast).
    #[arg(
        long,
        default_value = "delta,dense",
        value_name = "LIST",
        requires = "delta",
        help_heading = "Delta and staged refit (--delta, --stage)"
    )]
    pub(super) delta_methods: String,
    /// With --delta: destination rank R restarts before version V (`R@V`, repeatable): its
    /// shard and its delta state are lost, as a new replica's, so its senders send it dense.
    #[arg(
        long,
        value_name = "R@V",
        requires = "delta",
        help_heading = "Delta and staged refit (--delta, --stage)"
    )]
    pub(super) delta_restart: Vec<String>,
}

impl RunArgs {
    /// The repetitions the harness runs.
    pub(super) fn repeat(&self) -> Repeat {
        Repeat {
            warmup: self.warmup,
            iters: self.iters,
            verify: self.verify,
        }
    }
}
