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
    /// A config, checkpoint file or folder that could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: String,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },

    /// A config that is not JSON, or whose keys do not make a [`crate::ModelConfig`].
    #[error("{path}: not a valid model config: {source}")]
    ConfigJson {
        /// The config's file, or the name given for JSON text.
        path: String,
        /// The parser's error, with its line and column.
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "{}: `{value}` is neither a file, a folder nor a shipped model (known: {})",
        Field::Model,
        .known.join(", ")
    )]
    /// A model argument that names no file, folder or shipped model.
    UnknownModel {
        /// The argument as given.
        value: String,
        /// The names of the shipped models.
        known: Vec<String>,
    },

    /// A config whose `architectures` and `model_type` name no family this crate lays out.
    #[error(
        "{path}: unsupported architecture (model_type `{model_type}`, architectures [{}]); a config alone lays out llama, qwen3, qwen3_moe, deepseek_v3 / kimi_k2: give the checkpoint folder (its safetensors headers name the tensors), or refit an engine from the trainer's own tensors (reshard.engine.refit_engine_(None, ...))",
        .architectures.join(", ")
    )]
    UnsupportedArchitecture {
        /// The config's file or name.
        path: String,
        /// The config's `model_type` (empty when it has none).
        model_type: String,
        /// The config's `architectures` (class names such as `LlamaForCausalLM`).
        architectures: Vec<String>,
    },

    /// A config key of the wrong type or value, a required one that is null, or dtypes that
    /// disagree or are missing.
    #[error("{path}: `{field}` is {value}: {reason}")]
    InvalidConfig {
        /// The config's file or name.
        path: String,
        /// The key, dotted when nested (`quantization_config.quant_method`); `config` for a
        /// config that is not a JSON object.
        field: &'static str,
        /// The value as written in the config, or `missing`.
        value: String,
        /// What was expected instead.
        reason: String,
    },

    /// A checkpoint that cannot be read as one: a path that is not a regular file, a
    /// malformed safetensors header or index, or a folder with neither a config nor weights.
    #[error("{path}: {reason}")]
    Checkpoint {
        /// The file or folder.
        path: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A refit total that does not fit in 64 bits: not a real model.
    #[error(
        "{} {model}: the refit's {field} would be {value}, more than 2^64-1: too large to report",
        Field::Model
    )]
    TotalOverflow {
        /// The model's name.
        model: String,
        /// The total, as the summary names it (`reshard.bytes_remote`).
        field: &'static str,
        /// The total, in decimal.
        value: String,
    },

    /// A side's parallelism (`--train` or `--infer`) with an unknown, repeated or bad key, a
    /// `world` that does not fit, or sizes the model cannot be split by (more stages than
    /// layers, a `tp` that does not divide or multiply the key/value heads).
    #[error("{side}: `{key}={value}`: {reason}")]
    Parallel {
        /// [`Field::Train`] or [`Field::Infer`].
        side: Field,
        /// The key (`tp`, `pp`, `world`, ...), lowercased.
        key: String,
        /// The value as written; empty for a bare key.
        value: String,
        /// What is wrong, and where it helps, the fix.
        reason: String,
    },

    /// An override (`[train:|infer:]GLOB=KIND`) whose pattern or kind does not parse.
    #[error("{}: `{value}`: {reason}", Field::Override)]
    Override {
        /// The override as given, or its pattern alone.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor's layout that the core refuses: its mesh or placements, or its shape in a
    /// side's dtype.
    #[error("tensor {tensor}: {side} layout: {source}")]
    Layout {
        /// The tensor's name.
        tensor: String,
        /// [`Field::Train`] or [`Field::Infer`].
        side: Field,
        /// The core's error.
        #[source]
        source: LayoutError,
    },

    /// An expert kind given to a tensor that is not a stack of experts (3-D).
    #[error(
        "tensor {tensor}: {side}: kind {kind} needs a stacked [E, out, in] tensor, this one is {ndim}-D"
    )]
    KindShape {
        /// The tensor's name.
        tensor: String,
        /// [`Field::Train`] or [`Field::Infer`].
        side: Field,
        /// The kind's name, as an override writes it.
        kind: &'static str,
        /// The tensor's number of dimensions.
        ndim: usize,
    },

    /// A tensor whose move from the training to the inference layout the core cannot plan.
    #[error("tensor {tensor}: {source}")]
    Plan {
        /// The tensor's name.
        tensor: String,
        /// The core's error.
        #[source]
        source: Error,
    },

    /// A fused parameter whose members cannot share one buffer: a wrong count, dim or
    /// shape, or (quantized) mixed dtypes or fp8 blocks that straddle two members.
    #[error("fused parameter {name}: {reason}")]
    Fused {
        /// The fused parameter's name (`mlp.gate_up_proj.weight`).
        name: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An inference quantization (`--infer-quant`) that does not parse.
    #[error("{}: `{value}`: {reason}", Field::InferQuant)]
    InferQuant {
        /// The text as given.
        value: String,
        /// What was expected instead.
        reason: String,
    },

    /// A refit side's dtype (`field`: [`Field::TrainDType`] or [`Field::InferDType`]) that is
    /// not a dtype, or not one a refit converts between.
    #[error("{field}: `{value}`: {reason}")]
    DType {
        /// [`Field::TrainDType`] or [`Field::InferDType`].
        field: Field,
        /// The dtype as given.
        value: String,
        /// Why it is refused.
        reason: String,
    },

    /// A quantized tensor whose inference shards would cut an fp8 block.
    #[error(
        "tensor {tensor}: {} layout: a shard boundary at {boundary} along dim {dim} cuts an fp8 block of {block} (an engine loads whole blocks on each rank, as vLLM does: choose an inference parallelism whose shards are multiples of the block)",
        Field::Infer
    )]
    QuantCut {
        /// The tensor's name.
        tensor: String,
        /// The dimension the boundary cuts.
        dim: usize,
        /// The boundary's index along `dim`, in elements.
        boundary: u64,
        /// The fp8 block's size along each dim.
        block: Dims,
    },

    /// A tensor the core cannot quantize, for a reason other than a cut block.
    #[error("tensor {tensor}: {source}")]
    Quant {
        /// The tensor's name.
        tensor: String,
        /// The core's error.
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
