//! The pure core of reshard: plain functions over plain data, with no sockets and no threads
//! of its own, so that every rank computes the same answer from the same inputs without
//! talking to any other.
//!
//! - [`region`], [`crc`], [`copy`] and [`checksum`], the bottom: boxes of a tensor, the
//!   CRC-32C of bytes, the strided copy kernels that move a box between buffers and messages
//!   (converting and summing on the way), and the checksums of a transfer's chunks;
//! - [`layout`]: meshes, placements and the `torch.chunk` rule: which box each rank holds;
//! - [`topology`]: which host each rank runs on;
//! - [`plan`]: the transfers between two layouts, computed without communication;
//! - [`convert`]: precision in flight: float casts, fp8, quantization schemes and scales;
//! - [`fill`]: deterministic contents for running and verifying reshards;
//! - [`rolling`]: a rolling commit's groups, each of whole inference replicas;
//! - [`agreement`]: a rank's fingerprint of its job and the first difference between two;
//! - [`sim`]: a cluster cost model that prices plans at scales this machine cannot run;
//! - [`limits`]: every bound on the size of the input, and why;
//! - [`error`]: the errors every layer returns, each naming the field and the value.
//!
//! ```
//! use reshard_core::{DType, Plan, layout::LayoutSpec};
//! // Two training ranks hold 4x8 row shards; four inference ranks need 8x2 column shards.
//! let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&[8, 8], DType::Bf16, 0).unwrap();
//! let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&[8, 8], DType::Bf16, 2).unwrap();
//! let totals = Plan::new(src, dst).unwrap().totals();
//! assert_eq!(totals.bytes_remote, 128); // the tensor, once
//! assert_eq!(totals.gather_broadcast_bytes, 640); // all-gather, then 4 full copies
//! ```

#![warn(missing_docs)]

pub mod agreement;
pub mod checksum;
pub mod convert;
pub mod copy;
pub mod crc;
pub mod delta;
pub mod dtype;
pub mod error;
pub mod evolve;
pub mod fill;
pub mod layout;
pub mod limits;
pub mod memory;
pub mod plan;
mod rank;
pub mod region;
pub mod rolling;
pub mod sim;
pub mod topology;

/// Random layout pairs and the naive reference, for the tests of this crate and those above.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use dtype::DType;
pub use error::{Error, Result, Side};
pub use layout::{Layout, Mesh, Placement, Rank};
pub use plan::{Plan, PlanOptions, RankPlan, Transfer};
pub use region::Region;
