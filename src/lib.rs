//! `reshard` moves a distributed tensor from M source ranks in one layout to N destination
//! ranks in another, sending every destination exactly the regions of the source shards that
//! overlap its own, point to point, instead of all-gathering the tensor and broadcasting it.
//!
//! This crate is the library's surface. At its root are the types a program holds:
//! - a tensor's distribution: [`Layout`] (parsed from a spec by [`LayoutSpec`]), its
//!   [`Mesh`] and [`Placement`]s, the [`Region`]s (boxes) ranks hold, the element [`DType`];
//! - what moves: the [`Plan`] between two layouts ([`PlanOptions`]), its [`Transfer`]s and
//!   each rank's part ([`RankPlan`]);
//! - moving it: a [`World`] joins a job of processes (torchrun variables, `mpirun`) or runs
//!   the ranks as threads, with [`JoinOptions`] (among them the [`TransportKind`]), and runs a
//!   plan or a [`Batch`] (many tensors in one schedule: a whole-model refit) for its ranks
//!   with [`RunOptions`]; [`PlanRank`] is one rank's plan prepared for repeated runs;
//! - whole models: a [`Model`], its [`Training`] and [`Inference`] parallelism, the layout
//!   [`Rules`] and the [`Refit`] of every parameter, whose batch
//!   [`runtime::refit::batch_of`] builds;
//! - the [`Error`] every layer returns ([`Result`]), naming the [`Side`] and the field.
//!
//! The layers are crates of their own, each depending only on those below it, and their
//! modules are here by name: from `reshard-core`, [`region`], [`copy`], [`checksum`],
//! [`layout`], [`topology`], [`plan`], [`convert`], [`delta`], [`agreement`], the cost model
//! [`sim`], [`limits`], [`memory`], [`dtype`] and [`error`]; `reshard-model` as [`model`];
//! `reshard-transport` as [`transport`] (the [`Transport`] trait and its kinds); from
//! `reshard-runtime`, the executor ([`exec`]), batches ([`batch`]) and the [`runtime`].
//!
//! The scaffolding of benchmarks and tests is not part of this surface by default: the fills
//! and evolutions that give tensors checkable contents (`fill`, `evolve`), the comparison
//! harness (`runtime::harness`), the measured refit and refits while serving
//! (`runtime::refit::RefitRun`, `runtime::rollout`), the serving stand-in (`runtime::serve`),
//! the CPU testbeds of the cost model (`sim::Testbed`, ...) and the executor's thin drivers
//! that benchmarks time directly (`exec::run_local`, `exec::run_rank`,
//! `batch::run_local_batch`, ...). The `bench` feature exports them; the command line and the
//! benchmarks enable it.
//!
//! ```
//! use reshard::{DType, LayoutSpec, Plan};
//! // Two training ranks hold 4x8 row shards; four inference ranks need 8x2 column shards.
//! let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&[8, 8], DType::Bf16, 0).unwrap();
//! let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&[8, 8], DType::Bf16, 2).unwrap();
//! let totals = Plan::new(src, dst).unwrap().totals();
//! assert_eq!(totals.bytes_remote, 128); // the tensor, once
//! assert_eq!(totals.gather_broadcast_bytes, 640); // all-gather, then 4 full copies
//! ```

#![warn(missing_docs)]

pub use reshard_core::layout::LayoutSpec;
pub use reshard_core::{
    DType, Error, Layout, Mesh, Placement, Plan, PlanOptions, Rank, RankPlan, Region, Result, Side,
    Transfer,
};
pub use reshard_model::{Inference, Model, Ranks, Refit, Rules, Training};
pub use reshard_runtime::batch::Batch;
pub use reshard_runtime::{JoinOptions, PlanRank, RunOptions, TransportKind, World};
pub use reshard_transport::Transport;

pub use reshard_core::{
    agreement, checksum, convert, copy, delta, dtype, error, layout, limits, memory, plan, region,
    topology,
};
pub use reshard_model as model;
pub use reshard_runtime::{batch, exec};
pub use reshard_transport as transport;

/// Deterministic tensor contents, for running and verifying reshards (`bench` feature).
#[cfg(feature = "bench")]
pub use reshard_core::fill;

/// A tensor's contents across versions, for delta refits (`bench` feature).
#[cfg(feature = "bench")]
pub use reshard_core::evolve;

pub mod sim {
    //! A cluster cost model: what a refit would take on hardware this machine cannot run
    //! ([`simulate`], [`price`] on a [`Cluster`]). The CPU testbeds that `reshard launch
    //! --hosts` emulates (`Testbed`, `price_on_testbed`, ...) come with the `bench` feature.

    pub use reshard_core::sim::{
        BaselineCost, Busiest, Cluster, Link, LinkBytes, Load, Messages, PRESETS, Port, Pricing,
        ReshardCost, SimError, SimOptions, Simulation, domain_bound, price, price_gather_broadcast,
        price_gather_broadcast_layouts, price_pairs, price_reshard, simulate,
    };

    #[cfg(feature = "bench")]
    pub use reshard_core::sim::{
        Testbed, TestbedCost, is_testbed, price_baseline_on, price_on_testbed,
    };
}

pub mod runtime {
    //! Joining a job and running this process's ranks ([`World`]): the runtime's options, the
    //! links a rank opens ([`Links`], [`AnyTransport`]) and the refit's batch
    //! ([`refit::batch_of`]). With the `bench` feature, also the comparison harness
    //! (`harness`), the measured refit (`refit::RefitRun`), refits while serving (`rollout`)
    //! and the serving stand-in (`serve`).

    pub use reshard_runtime::{
        AnyTransport, Decision, Destination, JoinOptions, Links, PlanRank, RunOptions,
        TransportKind, World, check_world, in_mpi_job, under_mpirun,
    };
    pub use reshard_runtime::{batch, exec};

    #[cfg(feature = "bench")]
    pub use reshard_runtime::{harness, rollout, serve};

    pub mod refit {
        //! A whole-model refit as one batch ([`batch_of`]), run by
        //! [`World::run_batch`](crate::World::run_batch) or
        //! [`World::run_batch_quantized`](crate::World::run_batch_quantized). With the `bench`
        //! feature, also the measured refit (`RefitRun`: fills, moves by both methods,
        //! checks and reports) and its delta and staged variants.

        pub use reshard_runtime::refit::batch_of;

        #[cfg(feature = "bench")]
        pub use reshard_runtime::refit::*;
    }
}
