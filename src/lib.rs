//! `reshard` moves a distributed tensor from M source ranks in one layout to N destination
//! ranks in another, sending every destination exactly the regions of the source shards that
//! overlap its own, point to point, instead of all-gathering the tensor and broadcasting it.
//!
//! The crate is a pure core with thin edges:
//! - [`region`], [`copy`] and [`checksum`], the bottom layer: boxes of a tensor, the strided
//!   copy kernels that move a box between buffers and messages (converting on the way), and
//!   the CRC-32C of a box's bytes;
//! - [`layout`]: meshes, placements and the `torch.chunk` rule: which box each rank holds;
//! - [`plan`]: the transfers between two layouts, computed without communication;
//! - [`exec`]: runs a plan over a [`transport::Transport`], in bounded chunks;
//! - [`transport`]: moves chunks (`local`: ranks as threads of one process);
//! - [`runtime`]: a [`runtime::World`] joins a job of processes (torchrun variables, `mpirun`)
//!   or runs the ranks as threads, picks the transports, and runs a plan or a batch for its
//!   ranks with one call;
//! - [`convert`]: precision in flight: float casts, fp8, quantization schemes and their scales;
//! - [`fill`]: deterministic contents for running and verifying reshards;
//! - [`model`]: whole models (HF configs, checkpoint headers), training and inference
//!   parallelism, the per-parameter layout rules, and the plan of a whole-model refit;
//! - [`topology`]: which host each rank runs on, for plans that mind the links between hosts;
//! - [`sim`]: a cluster cost model that prices plans at scales this machine cannot run;
//! - [`topology`]: which host each rank runs on ([`topology::HostMap`]);
//! - [`limits`]: every bound on the size of the input, and why.
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

pub mod agreement;
pub mod batch;
pub mod checksum;
pub mod convert;
pub mod copy;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod fill;
pub mod layout;
pub mod limits;
pub mod memory;
pub mod model;
pub mod plan;
mod rank;
pub mod region;
pub mod runtime;
pub mod sim;
pub mod topology;
pub mod transport;

#[cfg(test)]
mod testing;

pub use dtype::DType;
pub use error::{Error, Result, Side};
pub use layout::{Layout, Mesh, Placement, Rank};
pub use plan::{Plan, PlanOptions, RankPlan, Transfer};
pub use region::Region;
