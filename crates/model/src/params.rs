//! A model as the refit sees it: named parameters with shapes and dtypes, derived from an HF
//! config with the names HF checkpoints use.
//!
//! One deliberate difference from the checkpoints: the routed experts of a MoE layer are
//! stacked into one tensor per projection, `[E, out, in]`
//! (`model.layers.3.mlp.experts.gate_proj.weight`), as training frameworks hold them for
//! grouped GEMMs and inference engines for fused MoE kernels. Multi-token-prediction layers
//! are left out: inference does not load them.

use reshard_core::dtype::DType;
use reshard_core::limits::MAX_LAYERS;

use super::config::{Architecture, ModelConfig};
use crate::error::ModelError;

/// One named parameter tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: DType,
}

impl Param {
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
    pub name: String,
    pub num_layers: u64,
    /// Unknown for a checkpoint read without its config.
    pub heads: Option<Heads>,
    pub params: Vec<Param>,
    /// The config's `quantization_config`: how the inference engine holds the weights
    /// (what `refit` quantizes unless `--infer-quant` says otherwise).
    pub quant: Option<super::quant::InferQuant>,
    /// How the stacked experts are named (the training side's fused buffers follow).
    pub expert_names: ExpertNames,
}

impl Model {
    pub fn num_params(&self) -> u64 {
        self.params
            .iter()
            .fold(0, |acc, p| acc.saturating_add(p.numel()))
    }

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
            let experts = config.qwen3_experts(c.path)?.unwrap_or(0);
            let step = c.positive(
                "decoder_sparse_step",
                config.decoder_sparse_step.unwrap_or(1),
            )?;
            let sparse =
                experts > 0 && !config.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(step);
            Ok(sparse.then_some(experts))
        }
        Architecture::DeepseekV3 => {
            let experts = config.deepseek_experts(c.path)?.unwrap_or(0);
            let freq = c.positive("moe_layer_freq", config.moe_layer_freq.unwrap_or(1))?;
            let first_dense = config.first_k_dense_replace.unwrap_or(0);
            let sparse = experts > 0 && i >= first_dense && i.is_multiple_of(freq);
            Ok(sparse.then_some(experts))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::{SHIPPED, shipped};
    use super::*;

    fn model(name: &str) -> Model {
        let (name, config) = shipped(name).unwrap();
        Model::from_config(&config, name).unwrap()
    }

    fn find<'a>(m: &'a Model, name: &str) -> &'a Param {
        m.params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("{name} missing from {}", m.name))
    }

    /// The totals of the design notes (section 6), in billions to one decimal (0.01 for 0.6B).
    #[test]
    fn totals_match_the_design_notes() {
        let expected = [
            ("deepseek-v3", 671.0),
            ("deepseek-v3-fp8", 671.0),
            ("kimi-k2", 1026.4),
            ("qwen3-235b-a22b", 235.1),
            ("qwen3-30b-a3b", 30.5),
            ("qwen3-32b", 32.8),
            ("llama-3.1-8b", 8.03),
            ("qwen3-0.6b", 0.60),
        ];
        assert_eq!(expected.len(), SHIPPED.len());
        for (name, billions) in expected {
            let m = model(name);
            let got = m.num_params() as f64 / 1e9;
            let digits = if billions < 10.0 { 100.0 } else { 10.0 };
            assert_eq!(
                (got * digits).round() / digits,
                billions,
                "{name}: {got} billion parameters"
            );
            assert_eq!(m.weight_bytes(), 2 * m.num_params(), "{name} is bf16");
            // every name is unique
            let mut names: Vec<&str> = m.params.iter().map(|p| p.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), m.params.len(), "{name}");
        }
    }

    /// A hundred million layers are refused before their billions of tensors are listed.
    #[test]
    fn absurd_layer_counts_are_refused() {
        let json = r#"{"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 256, "num_hidden_layers": 100000000, "num_attention_heads": 4}"#;
        let config = ModelConfig::from_json(json, "deep.json").unwrap();
        let err = Model::from_config(&config, "deep.json").unwrap_err();
        assert_eq!(
            err.to_string(),
            "deep.json: `num_hidden_layers` is 100000000: more than the 16384 layers a model may have"
        );
        let json = json.replace("100000000", "16384");
        let config = ModelConfig::from_json(&json, "deep.json").unwrap();
        assert!(Model::from_config(&config, "deep.json").is_ok());
    }

    #[test]
    fn deepseek_v3_layers() {
        let m = model("deepseek-v3");
        assert_eq!(m.num_layers, 61);
        // the first three layers are dense, the rest MoE with a shared expert
        assert_eq!(
            find(&m, "model.layers.2.mlp.gate_proj.weight").shape,
            [18432, 7168]
        );
        assert!(
            !m.params
                .iter()
                .any(|p| p.name.starts_with("model.layers.3.mlp.gate_proj"))
        );
        assert_eq!(
            find(&m, "model.layers.3.mlp.experts.gate_proj.weight").shape,
            [256, 2048, 7168]
        );
        assert_eq!(
            find(&m, "model.layers.60.mlp.experts.down_proj.weight").shape,
            [256, 7168, 2048]
        );
        assert_eq!(
            find(&m, "model.layers.3.mlp.shared_experts.down_proj.weight").shape,
            [7168, 2048]
        );
        assert_eq!(
            find(&m, "model.layers.3.mlp.gate.e_score_correction_bias").shape,
            [256]
        );
        // MLA: 128 heads of 128 + 64 query dims, latent ranks 1536 and 512
        assert_eq!(
            find(&m, "model.layers.0.self_attn.q_b_proj.weight").shape,
            [24576, 1536]
        );
        assert_eq!(
            find(&m, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight").shape,
            [576, 7168]
        );
        assert_eq!(
            find(&m, "model.layers.0.self_attn.kv_b_proj.weight").shape,
            [32768, 512]
        );
        assert_eq!(
            find(&m, "model.layers.0.self_attn.o_proj.weight").shape,
            [7168, 16384]
        );
        assert_eq!(
            find(&m, "model.layers.0.self_attn.kv_a_layernorm.weight").shape,
            [512]
        );
        // no multi-token-prediction layer 61
        assert!(!m.params.iter().any(|p| p.layer() == Some(61)));
        let kimi = model("kimi-k2");
        assert!(
            kimi.params
                .iter()
                .any(|p| p.name == "model.layers.1.mlp.experts.up_proj.weight")
        );
        assert_eq!(
            find(&kimi, "model.layers.1.mlp.gate.weight").shape,
            [384, 7168]
        );
    }

    #[test]
    fn qwen3_and_llama() {
        let small = model("qwen3-0.6b");
        // tied: no lm_head; head_dim 128 although hidden / heads is 64
        assert!(!small.params.iter().any(|p| p.name == "lm_head.weight"));
        assert_eq!(
            find(&small, "model.layers.0.self_attn.q_proj.weight").shape,
            [2048, 1024]
        );
        assert_eq!(
            find(&small, "model.layers.0.self_attn.k_norm.weight").shape,
            [128]
        );
        let moe = model("qwen3-30b-a3b");
        assert_eq!(
            find(&moe, "model.layers.47.mlp.experts.up_proj.weight").shape,
            [128, 768, 2048]
        );
        assert_eq!(
            find(&moe, "model.layers.0.mlp.gate.weight").shape,
            [128, 2048]
        );
        assert!(!moe.params.iter().any(|p| p.name.contains("shared_experts")));
        let llama = model("llama-3.1-8b");
        assert_eq!(
            find(&llama, "model.layers.0.self_attn.v_proj.weight").shape,
            [1024, 4096]
        );
        assert!(!llama.params.iter().any(|p| p.name.contains("q_norm")));
        assert_eq!(
            llama.heads,
            Some(Heads {
                attention: 32,
                kv: 8
            })
        );
    }

    #[test]
    fn qwen3_moe_dense_layers_follow_the_config() {
        let (_, mut config) = shipped("qwen3-30b-a3b").unwrap();
        config.mlp_only_layers = vec![0];
        config.decoder_sparse_step = Some(2);
        let m = Model::from_config(&config, "x").unwrap();
        assert!(
            m.params
                .iter()
                .any(|p| p.name == "model.layers.0.mlp.gate_proj.weight")
        );
        assert!(
            m.params
                .iter()
                .any(|p| p.name == "model.layers.1.mlp.gate.weight")
        );
        assert!(
            m.params
                .iter()
                .any(|p| p.name == "model.layers.2.mlp.down_proj.weight")
        );
    }

    /// The issue's config: transformers 5 writes `num_local_experts`, which is not a dense MLP.
    #[test]
    fn a_transformers_5_moe_config_has_its_experts() {
        let text = super::super::config::tests::QWEN3_MOE_V5;
        let config = ModelConfig::from_json(text, "v5").unwrap();
        let err = Model::from_config(&config, "v5").unwrap_err().to_string();
        assert!(err.starts_with("v5: `dtype` is missing"), "{err}");
        let m = Model::from_config_with_dtype(&config, "v5", Some(DType::F32)).unwrap();
        assert_eq!(
            find(&m, "model.layers.0.mlp.experts.gate_proj.weight").shape,
            [4, 128, 256]
        );
        assert_eq!(find(&m, "model.layers.1.mlp.gate.weight").shape, [4, 256]);
        assert!(
            !m.params
                .iter()
                .any(|p| p.name == "model.layers.0.mlp.gate_proj.weight")
        );
        assert!(m.params.iter().all(|p| p.dtype == DType::F32));
        // tie_word_embeddings: null is transformers' default, untied
        assert!(m.params.iter().any(|p| p.name == "lm_head.weight"));
        // transformers 5 names: down_proj without `.weight`; gate_up_proj is the training
        // side's fused buffer of the gate and up members
        assert_eq!(m.expert_names, ExpertNames::Transformers5);
        assert_eq!(
            find(&m, "model.layers.0.mlp.experts.down_proj").shape,
            [4, 256, 128]
        );
        let refit = crate::Refit::new(
            &m,
            &crate::Training::parse("fsdp=2").unwrap(),
            &crate::Inference::parse("tp=2").unwrap(),
            &crate::Rules::default(),
            crate::Ranks::Disjoint,
        )
        .unwrap();
        let fused = refit
            .src_fused
            .iter()
            .find(|f| f.name == "model.layers.0.mlp.experts.gate_up_proj")
            .unwrap();
        assert_eq!(fused.dim, 1);
        let down = refit
            .tensors
            .iter()
            .find(|t| t.name == "model.layers.1.mlp.experts.down_proj")
            .unwrap();
        // expert-row: vLLM's TP splits dim 2 of every expert
        assert_eq!(down.dst.local_region(2).unwrap().extent, [4, 256, 64]);
        // an earlier transformers keeps the split names
        let v4 = text.replace("5.0.0", "4.57.1");
        let config = ModelConfig::from_json(&v4, "v4").unwrap();
        let m = Model::from_config_with_dtype(&config, "v4", Some(DType::F32)).unwrap();
        assert_eq!(m.expert_names, ExpertNames::Split);
        find(&m, "model.layers.0.mlp.experts.down_proj.weight");
    }

    #[test]
    fn bad_configs_name_the_field() {
        let (_, mut config) = shipped("deepseek-v3").unwrap();
        config.kv_lora_rank = None;
        let err = Model::from_config(&config, "ds.json")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ds.json: `kv_lora_rank` is missing: required for model_type `deepseek_v3`"
        );
        let (_, mut config) = shipped("llama-3.1-8b").unwrap();
        config.num_attention_heads = 0;
        let err = Model::from_config(&config, "l.json")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "l.json: `num_attention_heads` is 0: must be positive");
    }
}
