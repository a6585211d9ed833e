//! Whole models: configs, parameters, parallelism, the per-parameter layout rules, and the
//! refit of every parameter from a training layout to an inference layout.
//!
//! Pure data and functions, like `layout` and `plan`: reading a config or checkpoint header is
//! the only I/O, and it sits at the edge ([`Model::load`]). Executing a refit is not this
//! module's job: it describes the tensors, their layouts and the fused destination buffers,
//! and plans them.

mod config;
mod error;
mod params;

pub use config::{Architecture, ModelConfig, SHIPPED, shipped};
pub use error::ModelError;
pub use params::{Heads, Model, Param, layer_of};
