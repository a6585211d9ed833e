//! A model as the refit sees it: named parameters with shapes and dtypes, derived from an HF
//! config with the names HF checkpoints use.
//!
//! One deliberate difference from the checkpoints: the routed experts of a MoE layer are
//! stacked into one tensor per projection, `[E, out, in]`
//! (`model.layers.3.mlp.experts.gate_proj.weight`), as training frameworks hold them for
//! grouped GEMMs and inference engines for fused MoE kernels; a config written by
//! transformers 5 gets transformers 5's names for them ([`ExpertNames`]).
//! Multi-token-prediction layers are left out: inference does not load them.

use reshard_core::dtype::DType;
use reshard_core::limits::MAX_LAYERS;

use super::config::{Architecture, ModelConfig};
use crate::error::ModelError;

/// One named parameter tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// The name a checkpoint gives it (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// The size of each dimension, in elements.
    pub shape: Vec<u64>,
    /// Its element type, as the config or the checkpoint gives it.
    pub dtype: DType,
}

impl Param {
    /// A parameter `name` of `shape` and `dtype`.
    pub fn new(name: impl Into<String>, shape: &[u64], dtype: DType) -> Param {
        Param {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
        }
    }

    /// Number of elements (saturating: layouts refuse shapes over 2^64 bytes).
    pub fn numel(&self) -> u64 {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Size in bytes (saturating, as [`Param::numel`]).
    pub fn bytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size() as u64)
    }

    /// The decoder layer the parameter belongs to (`model.layers.N.`), if any.
    ///
    /// ```
    /// use reshard_core::DType;
    /// use reshard_model::Param;
    /// let p = Param::new("model.layers.12.mlp.down_proj.weight", &[8, 8], DType::Bf16);
    /// assert_eq!(p.layer(), Some(12));
    /// assert_eq!(Param::new("lm_head.weight", &[8, 8], DType::Bf16).layer(), None);
    /// ```
    pub fn layer(&self) -> Option<u64> {
        layer_of(&self.name)
    }
}

/// `model.layers.N.` anywhere in a name gives layer N.
pub fn layer_of(name: &str) -> Option<u64> {
    let (_, rest) = name.split_once("layers.")?;
    let digits = rest.split('.').next()?;
    digits.parse().ok()
}

/// Attention head counts: the layout rules keep heads whole when they shard attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub attention: u64,
    /// Key/value heads (grouped-query attention); equal to `attention` otherwise.
    pub kv: u64,
}

/// How the stacked routed experts are named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertNames {
    /// `mlp.experts.gate_proj.weight`, `up_proj.weight`, `down_proj.weight`, each
    /// `[E, out, in]`: what training frameworks and earlier transformers releases use.
    #[default]
    Split,
    /// transformers 5: `mlp.experts.gate_up_proj` (`[E, 2 x I, H]`, on the training side the
    /// fused buffer of the gate and up members) and `mlp.experts.down_proj`, without
    /// `.weight`. Chosen for a config whose `transformers_version` is 5 or later.
    Transformers5,
}

/// A model: its name, its decoder depth (for pipeline stages) and its parameters.
#[derive(Clone, Debug)]
pub struct Model {
    /// A shipped model's name, or the name of the config file or checkpoint folder.
    pub name: String,
    /// Decoder layers, from the config, or counted from the names without one.
    pub num_layers: u64,
    /// Unknown for a checkpoint read without its config.
    pub heads: Option<Heads>,
    /// Every parameter: one derived from a config lists the embedding, the layers in order,
    /// then the final norm and the head.
    pub params: Vec<Param>,
    /// The config's `quantization_config`: how the inference engine holds the weights
    /// (what `refit` quantizes unless `--infer-quant` says otherwise).
    pub quant: Option<super::quant::InferQuant>,
    /// How the stacked experts are named (the training side's fused buffers follow).
    pub expert_names: ExpertNames,
}

impl Model {
    /// Elements in all parameters (saturating).
    pub fn num_params(&self) -> u64 {
        self.params
            .iter()
            .fold(0, |acc, p| acc.saturating_add(p.numel()))
    }

    /// Bytes in all parameters, each in its dtype (saturating).
    pub fn weight_bytes(&self) -> u64 {
        self.params
            .iter()
            .fold(0, |acc, p| acc.saturating_add(p.bytes()))
    }

    /// Derives every parameter of a supported architecture from its config.
    ///
    /// ```
    /// use reshard_model::{Model, ModelConfig};
    /// let json = r#"{"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
    ///   "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    ///   "num_key_value_heads": 2}"#;
    /// let model = Model::from_config(&ModelConfig::from_json(json, "tiny").unwrap(), "tiny").unwrap();
    /// let k = model.params.iter().find(|p| p.name == "model.layers.1.self_attn.k_proj.weight").unwrap();
    /// assert_eq!(k.shape, [32, 64]); // 2 kv heads of 16
    /// assert_eq!(model.params.len(), 2 + 2 * 9 + 1); // embedding, lm_head, 9 per layer, norm
    /// ```
    pub fn from_config(config: &ModelConfig, name: &str) -> Result<Model, ModelError> {
        Model::from_config_with_dtype(config, name, None)
    }

    /// [`Model::from_config`], with `dtype` (a refit's training dtype) for a config that
    /// says none; a dtype the config says wins.
    pub fn from_config_with_dtype(
        config: &ModelConfig,
        name: &str,
        dtype: Option<DType>,
    ) -> Result<Model, ModelError> {
        let arch = config.architecture(name)?;
        let dtype = config.param_dtype_or(name, dtype)?;
        let c = Checked { config, path: name };
        let h = c.positive("hidden_size", config.hidden_size)?;
        let heads = c.positive("num_attention_heads", config.num_attention_heads)?;
        let kv = c.positive("num_key_value_heads", config.kv_heads())?;
        let layers = c.positive("num_hidden_layers", config.num_hidden_layers)?;
        if layers > MAX_LAYERS {
            // refused before the parameter list (about 20 tensors a layer) is built
            return Err(c.invalid(
                "num_hidden_layers",
                layers.to_string(),
                &format!("more than the {MAX_LAYERS} layers a model may have"),
            ));
        }
        let vocab = c.positive("vocab_size", config.vocab_size)?;
        let expert_names = if config.transformers_5() {
            ExpertNames::Transformers5
        } else {
            ExpertNames::Split
        };
        let mut out = Params {
            dtype,
            list: vec![],
        };
        out.push("model.embed_tokens.weight", &[vocab, h]);
        for i in 0..layers {
            let p = format!("model.layers.{i}");
            out.push(&format!("{p}.input_layernorm.weight"), &[h]);
            out.push(&format!("{p}.post_attention_layernorm.weight"), &[h]);
            match arch {
                Architecture::Llama | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                    let hd = match config.head_dim {
                        Some(d) => c.positive("head_dim", d)?,
                        None => c.head_dim_from_hidden(h, heads)?,
                    };
                    gqa_attention(&mut out, &p, h, heads, kv, hd, config, arch);
                }
                Architecture::DeepseekV3 => mla_attention(&mut out, &p, h, heads, &c)?,
            }
            match moe_experts(arch, config, i, &c)? {
                Some(experts) => {
                    let inter =
                        c.required("moe_intermediate_size", config.moe_intermediate_size)?;
                    out.push(&format!("{p}.mlp.gate.weight"), &[experts, h]);
                    if arch == Architecture::DeepseekV3 {
                        out.push(&format!("{p}.mlp.gate.e_score_correction_bias"), &[experts]);
                        let shared = config.n_shared_experts.unwrap_or(0);
                        if shared > 0 {
                            mlp(
                                &mut out,
                                &format!("{p}.mlp.shared_experts"),
                                h,
                                inter.saturating_mul(shared),
                            );
                        }
                    }
                    let e = format!("{p}.mlp.experts");
                    out.push(&format!("{e}.gate_proj.weight"), &[experts, inter, h]);
                    out.push(&format!("{e}.up_proj.weight"), &[experts, inter, h]);
                    let down = match expert_names {
                        ExpertNames::Split => format!("{e}.down_proj.weight"),
                        ExpertNames::Transformers5 => format!("{e}.down_proj"),
                    };
                    out.push(&down, &[experts, h, inter]);
                }
                None => {
                    let inter = c.positive("intermediate_size", config.intermediate_size)?;
                    mlp(&mut out, &format!("{p}.mlp"), h, inter);
                }
            }
        }
        out.push("model.norm.weight", &[h]);
        if !config.tie_word_embeddings {
            out.push("lm_head.weight", &[vocab, h]);
        }
        Ok(Model {
            name: name.to_string(),
            num_layers: layers,
            heads: Some(Heads {
                attention: heads,
                kv,
            }),
            params: out.list,
            quant: config
                .quantization_config
                .as_ref()
                .map(|q| super::quant::InferQuant::from_config(q, name))
                .transpose()?,
            expert_names,
        })
    }
}

struct Params {
    dtype: DType,
    list: Vec<Param>,
}

impl Params {
    fn push(&mut self, name: &str, shape: &[u64]) {
        self.list.push(Param::new(name, shape, self.dtype));
    }
}

/// Config reads that fail with the field's name.
struct Checked<'a> {
    config: &'a ModelConfig,
    path: &'a str,
}

impl Checked<'_> {
    fn invalid(&self, field: &'static str, value: String, reason: &str) -> ModelError {
        ModelError::InvalidConfig {
            path: self.path.to_string(),
            field,
            value,
            reason: reason.to_string(),
        }
    }

    fn positive(&self, field: &'static str, value: u64) -> Result<u64, ModelError> {
        if value == 0 {
            return Err(self.invalid(field, "0".into(), "must be positive"));
        }
        Ok(value)
    }

    fn required(&self, field: &'static str, value: Option<u64>) -> Result<u64, ModelError> {
        match value {
            Some(v) => self.positive(field, v),
            None => Err(self.invalid(
                field,
                "missing".into(),
                &format!("required for model_type `{}`", self.config.model_type),
            )),
        }
    }

    fn head_dim_from_hidden(&self, hidden: u64, heads: u64) -> Result<u64, ModelError> {
        if !hidden.is_multiple_of(heads) {
            return Err(self.invalid(
                "num_attention_heads",
                heads.to_string(),
                &format!("does not divide hidden_size {hidden} and head_dim is not given"),
            ));
        }
        Ok(hidden / heads)
    }
}

/// Grouped-query attention (Llama, Qwen3): q, k, v, o projections; Qwen3 adds per-head norms.
#[allow(clippy::too_many_arguments)]
fn gqa_attention(
    out: &mut Params,
    p: &str,
    h: u64,
    heads: u64,
    kv: u64,
    hd: u64,
    config: &ModelConfig,
    arch: Architecture,
) {
    let a = format!("{p}.self_attn");
    out.push(
        &format!("{a}.q_proj.weight"),
        &[heads.saturating_mul(hd), h],
    );
    out.push(&format!("{a}.k_proj.weight"), &[kv.saturating_mul(hd), h]);
    out.push(&format!("{a}.v_proj.weight"), &[kv.saturating_mul(hd), h]);
    out.push(
        &format!("{a}.o_proj.weight"),
        &[h, heads.saturating_mul(hd)],
    );
    if config.attention_bias {
        out.push(&format!("{a}.q_proj.bias"), &[heads.saturating_mul(hd)]);
        out.push(&format!("{a}.k_proj.bias"), &[kv.saturating_mul(hd)]);
        out.push(&format!("{a}.v_proj.bias"), &[kv.saturating_mul(hd)]);
        if arch == Architecture::Llama {
            out.push(&format!("{a}.o_proj.bias"), &[h]);
        }
    }
    if arch != Architecture::Llama {
        out.push(&format!("{a}.q_norm.weight"), &[hd]);
        out.push(&format!("{a}.k_norm.weight"), &[hd]);
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): low-rank query and key/value
/// projections with their norms, then per-head up-projections.
fn mla_attention(
    out: &mut Params,
    p: &str,
    h: u64,
    heads: u64,
    c: &Checked,
) -> Result<(), ModelError> {
    let config = c.config;
    let nope = c.required("qk_nope_head_dim", config.qk_nope_head_dim)?;
    let rope = c.required("qk_rope_head_dim", config.qk_rope_head_dim)?;
    let v = c.required("v_head_dim", config.v_head_dim)?;
    let kv_lora = c.required("kv_lora_rank", config.kv_lora_rank)?;
    let a = format!("{p}.self_attn");
    match config.q_lora_rank {
        Some(q_lora) => {
            let q_lora = c.positive("q_lora_rank", q_lora)?;
            out.push(&format!("{a}.q_a_proj.weight"), &[q_lora, h]);
            out.push(&format!("{a}.q_a_layernorm.weight"), &[q_lora]);
            out.push(
                &format!("{a}.q_b_proj.weight"),
                &[heads.saturating_mul(nope.saturating_add(rope)), q_lora],
            );
        }
        None => out.push(
            &format!("{a}.q_proj.weight"),
            &[heads.saturating_mul(nope.saturating_add(rope)), h],
        ),
    }
    out.push(
        &format!("{a}.kv_a_proj_with_mqa.weight"),
        &[kv_lora.saturating_add(rope), h],
    );
    out.push(&format!("{a}.kv_a_layernorm.weight"), &[kv_lora]);
    out.push(
        &format!("{a}.kv_b_proj.weight"),
        &[heads.saturating_mul(nope.saturating_add(v)), kv_lora],
    );
    out.push(&format!("{a}.o_proj.weight"), &[h, heads.saturating_mul(v)]);
    Ok(())
}

/// A SwiGLU MLP: gate, up and down projections.
fn mlp(out: &mut Params, p: &str, h: u64, inter: u64) {
    out.push(&format!("{p}.gate_proj.weight"), &[inter, h]);
    out.push(&format!("{p}.up_proj.weight"), &[inter, h]);
    out.push(&format!("{p}.down_proj.weight"), &[h, inter]);
}

/// The number of routed experts of layer `i`, or `None` for a dense layer.
fn moe_experts(
    arch: Architecture,
    config: &ModelConfig,
    i: u64,
    c: &Checked,
) -> Result<Option<u64>, ModelError> {
    match arch {
        Architecture::Llama | Architecture::Qwen3 => Ok(None),
        Architecture::Qwen3Moe => {
            let experts = expert_count(config.qwen3_experts(c.path)?, "num_experts", c.path)?;
            let step = c.positive(
                "decoder_sparse_step",
                config.decoder_sparse_step.unwrap_or(1),
            )?;
            let sparse =
                experts > 0 && !config.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(step);
            Ok(sparse.then_some(experts))
        }
        Architecture::DeepseekV3 => {
            let experts =
                expert_count(config.deepseek_experts(c.path)?, "n_routed_experts", c.path)?;
            let freq = c.positive("moe_layer_freq", config.moe_layer_freq.unwrap_or(1))?;
            let first_dense = config.first_k_dense_replace.unwrap_or(0);
            let sparse = experts > 0 && i >= first_dense && i.is_multiple_of(freq);
            Ok(sparse.then_some(experts))
        }
    }
}

/// A MoE config's count of routed experts: a missing one is refused, naming both keys,
/// since transformers would give the model its default experts, never a dense MLP.
fn expert_count(count: Option<u64>, field: &'static str, path: &str) -> Result<u64, ModelError> {
    count.ok_or_else(|| ModelError::InvalidConfig {
        path: path.to_string(),
        field,
        value: "missing".to_string(),
        reason: format!(
            "a MoE config needs its routed experts: add `\"{field}\": N` (or transformers 5's \
             `\"num_local_experts\": N`); 0 makes every layer dense"
        ),
    })
}

#[cfg(test)]
mod tests;
