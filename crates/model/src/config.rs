//! Hugging Face `config.json`: the architecture facts a parameter list is derived from.
//!
//! Only the keys that fix parameter names and shapes are read; everything else in the file
//! (rope scaling, token ids, quantization notes) is ignored.
//!
//! Configs as transformers 4 and 5 write them both load:
//! - a JSON `null` is what transformers writes for a key it leaves unset, so a null optional
//!   key reads as absent (`architectures: null` is no architectures, `head_dim: null` the
//!   default head size); a null required key (`hidden_size`) is refused naming it;
//! - the routed experts of Qwen3-MoE are `num_experts` (transformers 4) or
//!   `num_local_experts` (transformers 5); DeepSeek-V3's `n_routed_experts` may also be
//!   written `num_local_experts`;
//! - the dtype is `torch_dtype` (transformers 4) or `dtype` (transformers 5). transformers 5
//!   leaves it out of a fresh config (whose weights are f32), so a config written by
//!   transformers (one naming `transformers_version`) without a dtype is refused naming
//!   `dtype`, unless the caller gives one ([`ModelConfig::param_dtype_or`]: a refit's
//!   training dtype). A hand-written config without `transformers_version` keeps the bf16
//!   default; every shipped config names its dtype.
//!
//! A key of the wrong type is refused naming the key and the value.

use std::path::Path;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use reshard_core::dtype::DType;

use crate::error::ModelError;

/// The model families whose parameter lists this module knows how to derive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3: grouped-query attention, SwiGLU MLP.
    Llama,
    /// Qwen3 dense: Llama plus per-head RMS norms on queries and keys (`q_norm`, `k_norm`).
    Qwen3,
    /// Qwen3-MoE: Qwen3 attention, routed experts without shared experts.
    Qwen3Moe,
    /// DeepSeek-V3 and Kimi-K2: multi-head latent attention, dense first layers, routed and
    /// shared experts, a router score-correction bias.
    DeepseekV3,
}

/// The subset of an HF `config.json` that fixes the parameters.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelConfig {
    /// The model classes (`LlamaForCausalLM`): the first known one decides the family.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// The family's short name (`llama`, `qwen3_moe`), read when no class is known.
    #[serde(default)]
    pub model_type: String,
    /// Rows of the token embedding and of the output head.
    pub vocab_size: u64,
    /// The model's width: the size of every hidden state.
    pub hidden_size: u64,
    /// The width of a dense layer's MLP.
    pub intermediate_size: u64,
    /// Decoder layers.
    pub num_hidden_layers: u64,
    /// Query heads per layer.
    pub num_attention_heads: u64,
    /// Defaults to `num_attention_heads` (plain multi-head attention).
    pub num_key_value_heads: Option<u64>,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<u64>,
    /// The output head shares the embedding's weights, so there is no `lm_head.weight`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Older configs say `torch_dtype`, newer ones `dtype` (see [`ModelConfig::param_dtype`]).
    pub torch_dtype: Option<String>,
    /// The parameter dtype, as transformers 5 names it (`bfloat16`).
    pub dtype: Option<String>,
    /// The transformers release that wrote the config, if it says: a config written by
    /// transformers must name its dtype, and 5 and later name stacked experts their own way.
    pub transformers_version: Option<String>,
    /// The query, key and value projections (and Llama's output projection) have biases.
    #[serde(default)]
    pub attention_bias: bool,

    // Qwen3-MoE
    /// Routed experts per MoE layer (Qwen3-MoE, transformers 4).
    pub num_experts: Option<u64>,
    /// transformers 5's name for `num_experts` (and for DeepSeek's `n_routed_experts`).
    pub num_local_experts: Option<u64>,
    /// The width of one expert's MLP (a shared expert's too); required by a MoE model.
    pub moe_intermediate_size: Option<u64>,
    /// Every how many layers one has experts (Qwen3-MoE): layer `i` does when `i + 1` is a
    /// multiple. Defaults to 1.
    pub decoder_sparse_step: Option<u64>,
    /// Layers kept dense whatever `decoder_sparse_step` says (Qwen3-MoE).
    #[serde(default)]
    pub mlp_only_layers: Vec<u64>,

    // DeepSeek-V3 / Kimi-K2
    /// Routed experts per MoE layer (DeepSeek-V3).
    pub n_routed_experts: Option<u64>,
    /// Shared experts per MoE layer, held as one MLP that many times as wide; defaults to 0.
    pub n_shared_experts: Option<u64>,
    /// How many leading layers are dense; defaults to 0.
    pub first_k_dense_replace: Option<u64>,
    /// Every how many layers (past the dense ones) one has experts: layer `i` does when `i`
    /// is a multiple. Defaults to 1.
    pub moe_layer_freq: Option<u64>,
    /// The rank of the low-rank query projection; without it, queries are projected at
    /// full rank (`q_proj`).
    pub q_lora_rank: Option<u64>,
    /// The rank of the compressed key/value projection; required by DeepSeek-V3.
    pub kv_lora_rank: Option<u64>,
    /// The per-head query/key size without rotary embedding; required by DeepSeek-V3.
    pub qk_nope_head_dim: Option<u64>,
    /// The per-head query/key size with rotary embedding; required by DeepSeek-V3.
    pub qk_rope_head_dim: Option<u64>,
    /// The per-head value size; required by DeepSeek-V3.
    pub v_head_dim: Option<u64>,
    /// Multi-token-prediction layers: not part of the refit (inference does not load them).
    pub num_nextn_predict_layers: Option<u64>,

    /// How the checkpoint (and so the inference engine) holds its weights, read by
    /// [`super::InferQuant::from_config`].
    pub quantization_config: Option<serde_json::Value>,
}

impl ModelConfig {
    /// Parses a config from JSON text; `path` only names the source in errors.
    ///
    /// ```
    /// use reshard_model::{Architecture, ModelConfig};
    /// let json = r#"{"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ///   "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32}"#;
    /// let config = ModelConfig::from_json(json, "llama-2-7b").unwrap();
    /// assert_eq!(config.architecture("llama-2-7b").unwrap(), Architecture::Llama);
    /// ```
    pub fn from_json(text: &str, path: &str) -> Result<ModelConfig, ModelError> {
        let json = |source| ModelError::ConfigJson {
            path: path.to_string(),
            source,
        };
        let value: Value = serde_json::from_str(text).map_err(json)?;
        let Value::Object(mut map) = value else {
            return Err(ModelError::InvalidConfig {
                path: path.to_string(),
                field: "config",
                value: shown(&value),
                reason: "expected a JSON object of config keys".into(),
            });
        };
        // each key on its own, so that a wrong type names the key (serde would say only
        // "invalid type: null, expected a sequence at line 1 column 56")
        for &(field, check, required) in FIELDS {
            let Some(v) = map.get(field) else { continue };
            if v.is_null() {
                if required {
                    return Err(ModelError::InvalidConfig {
                        path: path.to_string(),
                        field,
                        value: "null".into(),
                        reason: "required: a positive integer".into(),
                    });
                }
                map.remove(field);
                continue;
            }
            if let Err(e) = check(v) {
                return Err(ModelError::InvalidConfig {
                    path: path.to_string(),
                    field,
                    value: shown(v),
                    reason: expected_of(&e),
                });
            }
        }
        let named = unsupported(&map, path);
        serde_json::from_value(Value::Object(map)).map_err(|e| match named {
            // a field it lacks is the family's, not the config's: name the architecture
            Some(arch) if e.to_string().starts_with("missing field") => arch,
            _ => json(e),
        })
    }

    /// Reads and parses a `config.json` file.
    pub fn read(path: &Path) -> Result<ModelConfig, ModelError> {
        // a regular file only: a FIFO named config.json would block the read for ever
        let (mut file, _) = crate::file::open_regular(path)?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        ModelConfig::from_json(&text, &path.display().to_string())
    }

    /// The family, from `architectures` first, then `model_type`.
    pub fn architecture(&self, path: &str) -> Result<Architecture, ModelError> {
        family(&self.architectures, &self.model_type).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                path: path.to_string(),
                model_type: self.model_type.clone(),
                architectures: self.architectures.clone(),
            }
        })
    }

    /// The parameter dtype: `torch_dtype` or `dtype` (both given must agree); without either,
    /// bf16 for a hand-written config and an error naming `dtype` for one written by
    /// transformers (see the module docs).
    pub fn param_dtype(&self, path: &str) -> Result<DType, ModelError> {
        self.param_dtype_or(path, None)
    }

    /// [`ModelConfig::param_dtype`], with `given` (a refit's training dtype) standing for a
    /// dtype the config does not say.
    pub fn param_dtype_or(&self, path: &str, given: Option<DType>) -> Result<DType, ModelError> {
        let parse = |field: &'static str, name: &String| {
            name.parse::<DType>()
                .map_err(|_| ModelError::InvalidConfig {
                    path: path.to_string(),
                    field,
                    value: format!("{name:?}"),
                    reason: "not a known dtype".into(),
                })
        };
        let old = self
            .torch_dtype
            .as_ref()
            .map(|n| parse("torch_dtype", n))
            .transpose()?;
        let new = self.dtype.as_ref().map(|n| parse("dtype", n)).transpose()?;
        match (old, new, given) {
            (Some(a), Some(b), _) if a != b => Err(ModelError::InvalidConfig {
                path: path.to_string(),
                field: "dtype",
                value: format!("{b}"),
                reason: format!("differs from `torch_dtype` {a}: give one"),
            }),
            (Some(d), _, _) | (None, Some(d), _) | (None, None, Some(d)) => Ok(d),
            (None, None, None) => match &self.transformers_version {
                None => Ok(DType::Bf16),
                Some(version) => Err(ModelError::InvalidConfig {
                    path: path.to_string(),
                    field: "dtype",
                    value: "missing".into(),
                    reason: format!(
                        "a config written by transformers {version} without a dtype holds f32 \
                         weights if fresh, bf16 if converted: add `\"dtype\": \"bfloat16\"` (or \
                         the model's) to it, or give the training dtype \
                         (--train-dtype, Refit(..., train_dtype=...), Model::load_with_dtype)"
                    ),
                }),
            },
        }
    }

    /// The routed experts of a Qwen3-MoE config (`num_experts`, or transformers 5's
    /// `num_local_experts`); both given must agree.
    pub fn qwen3_experts(&self, path: &str) -> Result<Option<u64>, ModelError> {
        both(
            path,
            ("num_experts", self.num_experts),
            self.num_local_experts,
        )
    }

    /// The routed experts of a DeepSeek-V3 config (`n_routed_experts`, or
    /// `num_local_experts`); both given must agree.
    pub fn deepseek_experts(&self, path: &str) -> Result<Option<u64>, ModelError> {
        both(
            path,
            ("n_routed_experts", self.n_routed_experts),
            self.num_local_experts,
        )
    }

    /// Whether transformers 5 or later wrote the config (`transformers_version`).
    pub fn transformers_5(&self) -> bool {
        self.transformers_version
            .as_deref()
            .and_then(|v| v.trim().split('.').next())
            .and_then(|major| major.parse::<u64>().ok())
            .is_some_and(|major| major >= 5)
    }

    /// Key/value heads per layer: `num_key_value_heads`, or one per query head.
    pub fn kv_heads(&self) -> u64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
}

/// The family a config's `architectures` (first) or `model_type` names, if any.
fn family(architectures: &[String], model_type: &str) -> Option<Architecture> {
    let by_class = architectures.iter().find_map(|a| match a.as_str() {
        "LlamaForCausalLM" => Some(Architecture::Llama),
        "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
        "Qwen3MoeForCausalLM" => Some(Architecture::Qwen3Moe),
        "DeepseekV3ForCausalLM" => Some(Architecture::DeepseekV3),
        _ => None,
    });
    by_class.or(match model_type {
        "llama" => Some(Architecture::Llama),
        "qwen3" => Some(Architecture::Qwen3),
        "qwen3_moe" => Some(Architecture::Qwen3Moe),
        "deepseek_v3" | "kimi_k2" => Some(Architecture::DeepseekV3),
        _ => None,
    })
}

/// A config of an architecture no family lays out, that names its architecture: its
/// [`ModelError::UnsupportedArchitecture`] (the cause a missing field would hide: GPT-2's
/// config has `n_embd`, not `hidden_size`).
fn unsupported(map: &serde_json::Map<String, Value>, path: &str) -> Option<ModelError> {
    let model_type = map.get("model_type").and_then(Value::as_str).unwrap_or("");
    let architectures: Vec<String> = map
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    if (model_type.is_empty() && architectures.is_empty())
        || family(&architectures, model_type).is_some()
    {
        return None;
    }
    Some(ModelError::UnsupportedArchitecture {
        path: path.to_string(),
        model_type: model_type.to_string(),
        architectures,
    })
}

/// One count written under two names: the one given, or both if they agree.
fn both(
    path: &str,
    (field, value): (&'static str, Option<u64>),
    local: Option<u64>,
) -> Result<Option<u64>, ModelError> {
    match (value, local) {
        (Some(a), Some(b)) if a != b => Err(ModelError::InvalidConfig {
            path: path.to_string(),
            field: "num_local_experts",
            value: b.to_string(),
            reason: format!("differs from `{field}` {a}: give one"),
        }),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

type Check = fn(&Value) -> Result<(), serde_json::Error>;

fn check<T: DeserializeOwned>(v: &Value) -> Result<(), serde_json::Error> {
    T::deserialize(v).map(drop)
}

/// Every key [`ModelConfig`] reads, how to check its value, and whether it is required (a
/// null required key is refused; a null optional one is absent).
const FIELDS: &[(&str, Check, bool)] = &[
    ("architectures", check::<Vec<String>>, false),
    ("model_type", check::<String>, false),
    ("vocab_size", check::<u64>, true),
    ("hidden_size", check::<u64>, true),
    ("intermediate_size", check::<u64>, true),
    ("num_hidden_layers", check::<u64>, true),
    ("num_attention_heads", check::<u64>, true),
    ("num_key_value_heads", check::<u64>, false),
    ("head_dim", check::<u64>, false),
    ("tie_word_embeddings", check::<bool>, false),
    ("torch_dtype", check::<String>, false),
    ("dtype", check::<String>, false),
    ("transformers_version", check::<String>, false),
    ("attention_bias", check::<bool>, false),
    ("num_experts", check::<u64>, false),
    ("num_local_experts", check::<u64>, false),
    ("moe_intermediate_size", check::<u64>, false),
    ("decoder_sparse_step", check::<u64>, false),
    ("mlp_only_layers", check::<Vec<u64>>, false),
    ("n_routed_experts", check::<u64>, false),
    ("n_shared_experts", check::<u64>, false),
    ("first_k_dense_replace", check::<u64>, false),
    ("moe_layer_freq", check::<u64>, false),
    ("q_lora_rank", check::<u64>, false),
    ("kv_lora_rank", check::<u64>, false),
    ("qk_nope_head_dim", check::<u64>, false),
    ("qk_rope_head_dim", check::<u64>, false),
    ("v_head_dim", check::<u64>, false),
    ("num_nextn_predict_layers", check::<u64>, false),
    ("quantization_config", check::<Value>, false),
];

/// A value as an error shows it: its JSON, cut to 60 characters.
fn shown(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

/// serde's "invalid type: string \"x\", expected u64" as "expected u64".
fn expected_of(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let text = text.split(" at line ").next().unwrap_or(&text);
    match text.split_once(", expected ") {
        Some((_, want)) => format!("expected {want}"),
        None => text.to_string(),
    }
}

/// The configs shipped with the crate, by short name: what `--model deepseek-v3` means.
pub const SHIPPED: [(&str, &str); 8] = [
    (
        "deepseek-v3",
        include_str!("../../../models/deepseek-v3.config.json"),
    ),
    (
        "deepseek-v3-fp8",
        include_str!("../../../models/deepseek-v3-fp8.config.json"),
    ),
    (
        "kimi-k2",
        include_str!("../../../models/kimi-k2.config.json"),
    ),
    (
        "qwen3-235b-a22b",
        include_str!("../../../models/qwen3-235b-a22b.config.json"),
    ),
    (
        "qwen3-30b-a3b",
        include_str!("../../../models/qwen3-30b-a3b.config.json"),
    ),
    (
        "qwen3-32b",
        include_str!("../../../models/qwen3-32b.config.json"),
    ),
    (
        "qwen3-0.6b",
        include_str!("../../../models/qwen3-0.6b.config.json"),
    ),
    (
        "llama-3.1-8b",
        include_str!("../../../models/llama-3.1-8b.config.json"),
    ),
];

/// A shipped config by short name (case-insensitive).
pub fn shipped(name: &str) -> Option<(&'static str, ModelConfig)> {
    let key = name.trim().to_ascii_lowercase();
    SHIPPED.iter().find(|(n, _)| *n == key).map(|(n, text)| {
        let config = ModelConfig::from_json(text, n).expect("shipped configs parse");
        (*n, config)
    })
}

#[cfg(test)]
pub(crate) mod tests;
