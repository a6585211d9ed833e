//! `reshard` moves a distributed tensor from M source ranks in one layout to N destination
//! ranks in another, sending every destination exactly the regions of the source shards that
//! overlap its own, point to point, instead of all-gathering the tensor and broadcasting it.
//!
//! This crate is the facade: it re-exports the layers, each a crate of its own that depends
//! only on those below it:
//! - `reshard-core`, the pure core: [`region`], [`copy`], [`checksum`], [`layout`],
//!   [`topology`], [`plan`], [`convert`], [`fill`], [`agreement`], [`sim`], [`limits`] and
//!   the [`error`]s;
//! - `reshard-model`: whole models ([`model`]): HF configs, checkpoint headers, parallelism
//!   configs, the per-parameter layout rules and the plan of a whole-model refit;
//! - `reshard-transport`: the [`transport`]s behind one trait, rendezvous and the job's
//!   control protocol;
//! - `reshard-runtime`: the executor ([`exec`]), many tensors in one run ([`batch`]), and the
//!   [`runtime`]: a [`runtime::World`] joins a job of processes (torchrun variables,
//!   `mpirun`) or runs the ranks as threads, and runs a plan or a batch for its ranks.
//!
//! ```
//! use reshard::{DType, Plan, layout::LayoutSpec};
//! // Two training ranks hold 4x8 row shards; four inference ranks need 8x2 column shards.
//! let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&[8, 8], DType::Bf16, 0).unwrap();
//! let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&[8, 8], DType::Bf16, 2).unwrap();
//! let totals = Plan::new(src, dst).unwrap().totals();
//! assert_eq!(totals.bytes_remote, 128); // the tensor, once
//! assert_eq!(totals.gather_broadcast_bytes, 640); // all-gather, then 4 full copies
//! ```

pub use reshard_core::{
    DType, Error, Layout, Mesh, Placement, Plan, PlanOptions, Rank, RankPlan, Region, Result, Side,
    Transfer,
};
pub use reshard_core::{
    agreement, checksum, convert, copy, delta, dtype, error, evolve, fill, layout, limits, memory,
    plan, region, sim, topology,
};
pub use reshard_model as model;
pub use reshard_runtime::{batch, exec};
pub use reshard_transport as transport;

/// Joining a job and running this process's ranks ([`runtime::World`]).
pub mod runtime {
    pub use reshard_runtime::*;
}
