//! Runs a rank's part of a job: every kind of move takes one path, job -> program -> executor
//! -> transport.
//!
//! 1. **Lowering** ([`lower`], and [`crate::batch::lower`] for batches) turns a rank's part of
//!    a job (a plan, plain or cast; a quantizing plan; a relay plan; the gather+broadcast
//!    baseline; a batch, quantized or already quantized) into its [`Program`]: plain data, an
//!    ordered list of [`Phase`]s (the amax exchange, the values, relay rounds, the baseline's
//!    gather, broadcast and keep), each a set of steps in the plan's schedule order (one total
//!    order on rank pairs, so blocking transports cannot deadlock), each step carrying what
//!    it converts and where its bytes land, with the chunk size decided once for both ends
//!    ([`cut_chunk`]). Pure, without buffers or I/O.
//! 2. **The executor** (`run_program`) runs a program on a [`Transport`](reshard_transport::Transport), phase
//!    by phase: the local copies before, the transfers (`run_transfers`: sends on one
//!    thread, local copies and receives on another; the receives as one batch,
//!    [`Transport::recv_all`](reshard_transport::Transport::recv_all)), the local copies and
//!    the scales after, and the report of what did not arrive.
//! 3. **The driver** (`driver::run_threads`) runs many ranks' programs as threads of this
//!    process over the local fabric, each phase of every rank together.
//!
//! The executor and the driver are this crate's own: a program reaches them through
//! [`World`](crate::World)'s calls. The thin drivers below them (`run_rank`, `run_rank_any`,
//! `run_local`, `run_local_quantized`, `baseline::run_rank_gather_broadcast`, ...: they check
//! the buffers, lower, and run the program) are public only with the `bench` feature, for the
//! benchmarks and the command line's measurements, which time them directly.
//!
//! ```
//! use reshard_core::{DType, Plan, layout::LayoutSpec};
//! use reshard_runtime::exec::{ExecOptions, PhaseKind, RankJob};
//! let layout = |spec: &str, first| LayoutSpec::parse(spec).unwrap().resolve(&[8, 8], DType::Bf16, first).unwrap();
//! let plan = Plan::new(layout("mesh=2 place=S(0)", 0), layout("mesh=4 place=S(1)", 2)).unwrap();
//! // rank 2, a destination: its part of the plan, lowered with its shard
//! let part = plan.rank_part(2);
//! let region = plan.dst().local_region(2).unwrap();
//! let mut shard = vec![0u8; plan.dst().local_bytes(2) as usize];
//! let job = RankJob {
//!     plan: &part,
//!     src_layout: plan.src(),
//!     src: None,
//!     dst: Some((&region, &mut shard[..])),
//!     dst_dtype: DType::Bf16,
//!     quant: None,
//! };
//! let program = job.program(&ExecOptions::default()).unwrap();
//! // one phase of values: a 4x2 block from each of the two sources, in schedule order
//! assert_eq!(program.phases.len(), 1);
//! assert_eq!(program.phases[0].kind, PhaseKind::Values);
//! assert_eq!(program.phases[0].steps.recvs.len(), 2);
//! assert!(program.phases[0].steps.recvs.iter().all(|s| s.bytes() == 4 * 2 * 2));
//! ```
//!
//! The files split by job: [`ExecOptions`] (`options`), the program's types ([`program`]),
//! lowering ([`lower`]), a rank's part of a plan as the caller holds it (`jobs`), the checks of
//! steps against buffers (`steps`), the executor (`executor`, with the buffers it lends,
//! `buffers`, and the arithmetic of quantization, `scaling`), the driver ([`driver`]), the
//! bookkeeping of what is due and what arrived, without I/O ([`progress`]), the counts
//! ([`RankStats`], [`RunStats`]), relay rounds ([`relay`]), the baseline ([`baseline`]), delta
//! refit ([`delta`]) and staged refit ([`stage`]).

pub mod baseline;
mod buffers;
pub mod delta;
mod delta_phase;
pub mod driver;
mod executor;
mod jobs;
mod local;
pub mod lower;
mod options;
pub mod program;
pub mod progress;
mod quant;
pub mod relay;
mod scaling;
pub mod stage;
mod stats;
mod steps;
pub(crate) mod threads;
mod transfers;

pub(crate) use executor::run_program;
pub use jobs::RankJob;
bench_use!(jobs::{run_rank, run_rank_any});
pub use local::{MAX_LOCAL_RANKS, zeroed_scale_shards, zeroed_shards};
bench_use!(local::{run_local, run_local_quantized, run_local_with_faults});
pub use options::ExecOptions;
pub use program::{Phase, PhaseKind, Program};
pub use quant::QuantJob;
pub use scaling::Casts;
pub use stats::{RankStats, RunStats};
pub use steps::{Step, Steps, check_buffers, cut_chunk};

#[cfg(test)]
mod tests;
