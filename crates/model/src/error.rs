//! What can go wrong between a model description and a refit plan. Every variant names the
//! field (a config key, a parallelism key, a tensor) and the value that caused it.
//!
//! The model layer's own error: it wraps the core's [`Error`] where a plan fails, and becomes
//! one ([`Error::Model`], which holds it without the core knowing this crate) where a caller
//! of both layers returns the core's errors.

use reshard_core::Error;
use reshard_core::convert::ConvertError;
use reshard_core::error::{Dims, Field, LayoutError};

/// An error of the model layer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not a valid model config: {source}")]
    ConfigJson {
        path: String,
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "{}: `{value}` is neither a file, a folder nor a shipped model (known: {})",
        Field::Model,
        .known.join(", ")
    )]
    UnknownModel { value: String, known: Vec<String> },

    #[error(
        "{path}: unsupported architecture (model_type `{model_type}`, architectures [{}]); supported: llama, qwen3, qwen3_moe, deepseek_v3 / kimi_k2",
        .architectures.join(", ")
    )]
    UnsupportedArchitecture {
        path: String,
        model_type: String,
        architectures: Vec<String>,
    },

    #[error("{path}: `{field}` is {value}: {reason}")]
    InvalidConfig {
        path: String,
        field: &'static str,
        value: String,
        reason: String,
    },

    #[error("{path}: {reason}")]
    Checkpoint { path: String, reason: String },

    #[error(
        "{} {model}: the refit's {field} would be {value}, more than 2^64-1: too large to report",
        Field::Model
    )]
    TotalOverflow {
        model: String,
        field: &'static str,
        value: String,
    },

    #[error("{side}: `{key}={value}`: {reason}")]
    Parallel {
        side: Field,
        key: String,
        value: String,
        reason: String,
    },

    #[error("{}: `{value}`: {reason}", Field::Override)]
    Override { value: String, reason: String },

    #[error("tensor {tensor}: {side} layout: {source}")]
    Layout {
        tensor: String,
        side: Field,
        #[source]
        source: LayoutError,
    },

    #[error(
        "tensor {tensor}: {side}: kind {kind} needs a stacked [E, out, in] tensor, this one is {ndim}-D"
    )]
    KindShape {
        tensor: String,
        side: Field,
        kind: &'static str,
        ndim: usize,
    },

    #[error("tensor {tensor}: {source}")]
    Plan {
        tensor: String,
        #[source]
        source: Error,
    },

    #[error("fused parameter {name}: {reason}")]
    Fused { name: String, reason: String },

    #[error("{}: `{value}`: {reason}", Field::InferQuant)]
    InferQuant { value: String, reason: String },

    /// A refit side's dtype (`field`: [`Field::TrainDType`] or [`Field::InferDType`]) that is
    /// not a dtype, or not one a refit converts between.
    #[error("{field}: `{value}`: {reason}")]
    DType {
        field: Field,
        value: String,
        reason: String,
    },

    #[error(
        "tensor {tensor}: {} layout: a shard boundary at {boundary} along dim {dim} cuts an fp8 block of {block} (an engine loads whole blocks on each rank, as vLLM does: choose an inference parallelism whose shards are multiples of the block)",
        Field::Infer
    )]
    QuantCut {
        tensor: String,
        dim: usize,
        boundary: u64,
        block: Dims,
    },

    #[error("tensor {tensor}: {source}")]
    Quant {
        tensor: String,
        #[source]
        source: ConvertError,
    },
}

/// Callers that return the core's errors (the runtime, the command line) take a model error
/// with `?`.
impl From<ModelError> for Error {
    fn from(e: ModelError) -> Error {
        Error::Model(Box::new(e))
    }
}
