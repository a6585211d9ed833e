//! Whole models: configs, parameters, parallelism, the per-parameter layout rules, fused
//! buffers, and the refit of every parameter from a training layout to an inference layout.
//!
//! Pure data and functions, like `layout` and `plan`: reading a config or checkpoint headers
//! ([`Model::load`]) is the only I/O. Executing a refit is not this module's job: it describes
//! the tensors, their layouts and the fused buffers ([`Refit`]), and plans them.
//!
//! ```
//! use reshard_model::{Inference, Model, Ranks, Refit, Rules, Training};
//! let model = Model::load("qwen3-30b-a3b").unwrap();
//! let train = Training::parse("tp=2,ep=8,pp=2,dp=4").unwrap();
//! let infer = Inference::parse("tp=8,dp=2").unwrap();
//! let refit = Refit::new(&model, &train, &infer, &Rules::default(), Ranks::Disjoint).unwrap();
//! assert_eq!(refit.tensors.len(), model.params.len());
//! let expert = refit.tensors.iter().find(|t| t.name == "model.layers.0.mlp.experts.up_proj.weight").unwrap();
//! assert_eq!(expert.src.local_region(0).unwrap().extent, [16, 768, 2048]); // 128 experts / ep 8
//! assert_eq!(expert.dst.local_region(16).unwrap().extent, [128, 48, 2048]); // 768 / (tp 8 x dp 2)
//! ```

#![warn(missing_docs)]

mod config;
mod dtypes;
mod error;
mod file;
mod fused;
mod load;
mod parallel;
mod params;
mod quant;
mod refit;
pub mod rules;
mod safetensors;

pub use config::{Architecture, ModelConfig, SHIPPED, shipped};
pub use dtypes::{REFIT_DTYPES, refit_dtype};
pub use error::ModelError;
pub use fused::{Fused, megatron_fused, transformers5_fused, vllm_fused};
pub use parallel::{Inference, Training};
pub use params::{ExpertNames, Heads, Model, Param, layer_of};
pub use quant::{DEFAULT_BLOCK, InferQuant, scale_name};
pub use refit::{
    Ranks, Refit, RefitGatherBroadcastJson, RefitJson, RefitQuant, RefitQuantJson,
    RefitReshardJson, RefitScale, RefitTensor, RefitTotals,
};
pub use rules::{DEFAULT_RULES, Kind, ModelFacts, Rules, Which};
pub use safetensors::{read_checkpoint, read_header, stack_experts};
