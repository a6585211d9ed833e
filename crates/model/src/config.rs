//! Hugging Face `config.json`: the architecture facts a parameter list is derived from.
//!
//! Only the keys that fix parameter names and shapes are read; everything else in the file
//! (rope scaling, token ids, quantization notes) is ignored.

use std::path::Path;

use serde::Deserialize;

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
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: String,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    /// Defaults to `num_attention_heads` (plain multi-head attention).
    pub num_key_value_heads: Option<u64>,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<u64>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Older configs say `torch_dtype`, newer ones `dtype`; bf16 when neither is given.
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,

    // Qwen3-MoE
    pub num_experts: Option<u64>,
    pub moe_intermediate_size: Option<u64>,
    pub decoder_sparse_step: Option<u64>,
    #[serde(default)]
    pub mlp_only_layers: Vec<u64>,

    // DeepSeek-V3 / Kimi-K2
    pub n_routed_experts: Option<u64>,
    pub n_shared_experts: Option<u64>,
    pub first_k_dense_replace: Option<u64>,
    pub moe_layer_freq: Option<u64>,
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: Option<u64>,
    pub qk_nope_head_dim: Option<u64>,
    pub qk_rope_head_dim: Option<u64>,
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
        serde_json::from_str(text).map_err(|source| ModelError::ConfigJson {
            path: path.to_string(),
            source,
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
        let by_class = self.architectures.iter().find_map(|a| match a.as_str() {
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            "Qwen3MoeForCausalLM" => Some(Architecture::Qwen3Moe),
            "DeepseekV3ForCausalLM" => Some(Architecture::DeepseekV3),
            _ => None,
        });
        let by_type = || match self.model_type.as_str() {
            "llama" => Some(Architecture::Llama),
            "qwen3" => Some(Architecture::Qwen3),
            "qwen3_moe" => Some(Architecture::Qwen3Moe),
            "deepseek_v3" | "kimi_k2" => Some(Architecture::DeepseekV3),
            _ => None,
        };
        by_class
            .or_else(by_type)
            .ok_or_else(|| ModelError::UnsupportedArchitecture {
                path: path.to_string(),
                model_type: self.model_type.clone(),
                architectures: self.architectures.clone(),
            })
    }

    /// The parameter dtype (`torch_dtype`, or `dtype`, default bf16).
    pub fn param_dtype(&self, path: &str) -> Result<DType, ModelError> {
        let Some(name) = self.torch_dtype.as_ref().or(self.dtype.as_ref()) else {
            return Ok(DType::Bf16);
        };
        name.parse().map_err(|_| ModelError::InvalidConfig {
            path: path.to_string(),
            field: "torch_dtype",
            value: format!("{name:?}"),
            reason: "not a known dtype".into(),
        })
    }

    pub fn kv_heads(&self) -> u64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
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
mod tests {
    use super::*;

    #[test]
    fn every_shipped_config_parses_and_is_supported() {
        for (name, _) in SHIPPED {
            let (_, config) = shipped(name).unwrap();
            config.architecture(name).unwrap();
            assert_eq!(config.param_dtype(name).unwrap(), DType::Bf16);
        }
        assert!(shipped("DeepSeek-V3").is_some());
        assert!(shipped("gpt-5").is_none());
    }

    #[test]
    fn errors_name_the_field() {
        let err = ModelConfig::from_json(r#"{"vocab_size": 10}"#, "x.json").unwrap_err();
        assert!(
            err.to_string().contains("missing field `hidden_size`"),
            "{err}"
        );
        let json = r#"{"model_type": "gpt2", "vocab_size": 1, "hidden_size": 1,
            "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1}"#;
        let config = ModelConfig::from_json(json, "x.json").unwrap();
        let err = config.architecture("x.json").unwrap_err().to_string();
        assert!(err.contains("model_type `gpt2`"), "{err}");
        let json = json.replace("\"gpt2\"", "\"llama\", \"torch_dtype\": \"float7\"");
        let config = ModelConfig::from_json(&json, "x.json").unwrap();
        assert_eq!(
            config.param_dtype("x.json").unwrap_err().to_string(),
            "x.json: `torch_dtype` is \"float7\": not a known dtype"
        );
    }
}
