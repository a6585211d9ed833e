//! A refit into an fp8 inference engine: which parameters the engine keeps in fp8, their
//! block scales under the engine's names, and the checks that the inference layout keeps
//! every block whole.
//!
//! The engine's rule (vLLM's `Fp8LinearMethod` and `Fp8MoEMethod` with `weight_block_size`):
//! the weights of linear layers are fp8 with one f32 scale per `R x C` block
//! (`X.weight_scale_inv`, shape `[ceil(rows/R), ceil(cols/C)]`, a grid per expert for the
//! stacked `[E, rows, cols]` experts): attention projections, dense MLPs, routed and shared
//! experts. Norms, embeddings, the router (`mlp.gate`), `lm_head` and any module named by
//! the config's `modules_to_not_convert` stay in the checkpoint's dtype. Fused buffers fuse
//! their scales like their weights (`qkv_proj.weight_scale_inv`,
//! `gate_up_proj.weight_scale_inv`, `w13_weight_scale_inv`); the stacked `down_proj` experts
//! are vLLM's `w2_weight` and their scales `w2_weight_scale_inv`.
//!
//! ```
//! use reshard_model::{InferQuant, Inference, Model, Ranks, Refit, Rules, Training};
//! let model = Model::load("qwen3-0.6b").unwrap();
//! let refit = Refit::new(&model, &Training::parse("tp=2").unwrap(),
//!     &Inference::parse("tp=2").unwrap(), &Rules::default(), Ranks::Disjoint).unwrap();
//! let fp8 = InferQuant::parse("fp8-block").unwrap().unwrap();
//! let refit = refit.quantized(&fp8).unwrap();
//! let q = refit.quant.as_ref().unwrap();
//! // 7 linear weights in each of 28 layers
//! assert_eq!(q.scales.len(), 7 * 28);
//! let down = q.scales.iter().find(|s| s.name == "model.layers.0.mlp.down_proj.weight_scale_inv").unwrap();
//! assert_eq!(down.shape, [8, 24]); // [1024, 3072] in blocks of 128x128
//! assert!(q.fused.iter().any(|f| f.name == "model.layers.0.self_attn.qkv_proj.weight_scale_inv"));
//! ```

use std::fmt;

use globset::{Glob, GlobMatcher};

use reshard_core::convert::QuantScheme;
use reshard_core::dtype::DType;
use reshard_core::plan::QuantRequest;

use crate::error::ModelError;

/// The block of `fp8-block` without a size: DeepSeek-V3's and vLLM's default.
pub const DEFAULT_BLOCK: [u64; 2] = [128, 128];

/// How the inference side holds its fp8 weights: the fp8 format, the block, and the
/// modules left unconverted.
#[derive(Clone, Debug)]
pub struct InferQuant {
    /// [`DType::Fp8E4M3`] or [`DType::Fp8E5M2`].
    pub fp8: DType,
    /// Rows x cols of one block of the last two dims.
    pub block: [u64; 2],
    /// `modules_to_not_convert`: name fragments (a module whose name contains one stays
    /// unconverted) or globs (`*` and `?`, matched against the whole module name).
    pub not_convert: Vec<String>,
    globs: Vec<Option<GlobMatcher>>,
}

impl PartialEq for InferQuant {
    fn eq(&self, other: &InferQuant) -> bool {
        (self.fp8, self.block, &self.not_convert) == (other.fp8, other.block, &other.not_convert)
    }
}

impl fmt::Display for InferQuant {
    /// `fp8-block:128x128` (with `:e5m2` for e5m2 values).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fp8-block:{}x{}", self.block[0], self.block[1])?;
        if self.fp8 == DType::Fp8E5M2 {
            f.write_str(":e5m2")?;
        }
        Ok(())
    }
}

impl InferQuant {
    /// A block quantization with nothing left unconverted beyond the engine's rule.
    pub fn new(fp8: DType, block: [u64; 2]) -> InferQuant {
        InferQuant {
            fp8,
            block,
            not_convert: Vec::new(),
            globs: Vec::new(),
        }
    }

    /// Leaves the modules matching `patterns` unconverted (see [`InferQuant::not_convert`]).
    pub fn with_not_convert(mut self, patterns: Vec<String>) -> Result<InferQuant, String> {
        self.globs = patterns
            .iter()
            .map(|p| {
                if p.contains(['*', '?']) {
                    Glob::new(p)
                        .map(|g| Some(g.compile_matcher()))
                        .map_err(|e| format!("`{p}` is not a valid glob: {e}"))
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<_, _>>()?;
        self.not_convert = patterns;
        Ok(self)
    }

    /// `--infer-quant`: `fp8-block` (128x128, e4m3), `fp8-block:RxC`, either with `:e5m2`
    /// (or `:e4m3`), or `none` (`Ok(None)`: the inference side keeps the checkpoint's
    /// dtype, whatever the config says).
    ///
    /// ```
    /// use reshard_model::InferQuant;
    /// assert_eq!(InferQuant::parse("fp8-block:64x32").unwrap().unwrap().block, [64, 32]);
    /// assert!(InferQuant::parse("none").unwrap().is_none());
    /// assert!(InferQuant::parse("fp8-block:0x128").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Option<InferQuant>, ModelError> {
        let bad = |reason: &str| ModelError::InferQuant {
            value: text.to_string(),
            reason: reason.to_string(),
        };
        let t = text.trim();
        if t == "none" {
            return Ok(None);
        }
        let mut parts = t.split(':');
        if parts.next() != Some("fp8-block") {
            return Err(bad(
                "expected `fp8-block`, `fp8-block:RxC` (e.g. `fp8-block:128x128`), optionally followed by `:e4m3` or `:e5m2`, or `none`",
            ));
        }
        let mut q = InferQuant::new(DType::Fp8E4M3, DEFAULT_BLOCK);
        for part in parts {
            match part {
                "e4m3" => q.fp8 = DType::Fp8E4M3,
                "e5m2" => q.fp8 = DType::Fp8E5M2,
                size => {
                    let dims: Vec<Option<u64>> =
                        size.split('x').map(|n| n.parse::<u64>().ok()).collect();
                    match dims[..] {
                        [Some(r), Some(c)] if r > 0 && c > 0 => q.block = [r, c],
                        _ => {
                            return Err(bad(&format!(
                                "`{size}` is not a block size of positive rows x cols (e.g. 128x128) nor e4m3/e5m2"
                            )));
                        }
                    }
                }
            }
        }
        Ok(Some(q))
    }

    /// An HF config's `quantization_config` (`path` names the config in errors):
    /// `quant_method: fp8` with `weight_block_size: [R, C]`, `fmt` `e4m3` (the default) or
    /// `e5m2`, and `modules_to_not_convert`; `activation_scheme` concerns activations and is
    /// not read.
    pub fn from_config(value: &serde_json::Value, path: &str) -> Result<InferQuant, ModelError> {
        let invalid =
            |field: &'static str, value: String, reason: &str| ModelError::InvalidConfig {
                path: path.to_string(),
                field,
                value,
                reason: reason.to_string(),
            };
        let method = value.get("quant_method").and_then(|m| m.as_str());
        if method != Some("fp8") {
            return Err(invalid(
                "quantization_config.quant_method",
                value
                    .get("quant_method")
                    .map_or("missing".into(), |m| m.to_string()),
                "only `fp8` (block-wise, with weight_block_size) is supported",
            ));
        }
        // a null `fmt` is transformers' unset key: the default, e4m3
        let fmt = value.get("fmt").filter(|f| !f.is_null());
        let fp8 = match fmt.map(|f| f.as_str()) {
            None | Some(Some("e4m3")) => DType::Fp8E4M3,
            Some(Some("e5m2")) => DType::Fp8E5M2,
            Some(_) => {
                return Err(invalid(
                    "quantization_config.fmt",
                    value["fmt"].to_string(),
                    "expected \"e4m3\" or \"e5m2\"",
                ));
            }
        };
        let block = value.get("weight_block_size");
        let dims: Option<Vec<u64>> = block
            .and_then(|b| b.as_array())
            .map(|a| a.iter().filter_map(|n| n.as_u64()).collect());
        let block = match (block, dims.as_deref()) {
            (Some(_), Some(&[r, c])) if r > 0 && c > 0 => [r, c],
            (None, _) | (Some(serde_json::Value::Null), _) => {
                return Err(invalid(
                    "quantization_config.weight_block_size",
                    "missing".into(),
                    "only block-wise fp8 is supported (per-tensor fp8 has no weight_block_size)",
                ));
            }
            (Some(b), _) => {
                return Err(invalid(
                    "quantization_config.weight_block_size",
                    b.to_string(),
                    "expected [rows, cols], both positive",
                ));
            }
        };
        let skip = match value.get("modules_to_not_convert") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .map(|m| {
                    m.as_str().map(str::to_string).ok_or_else(|| {
                        invalid(
                            "quantization_config.modules_to_not_convert",
                            m.to_string(),
                            "expected module names (strings)",
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(invalid(
                    "quantization_config.modules_to_not_convert",
                    other.to_string(),
                    "expected a list of module names",
                ));
            }
        };
        InferQuant::new(fp8, block)
            .with_not_convert(skip)
            .map_err(|reason| {
                invalid(
                    "quantization_config.modules_to_not_convert",
                    value["modules_to_not_convert"].to_string(),
                    &reason,
                )
            })
    }

    /// The reshard's quantization scheme: `block:RxC`, f32 scales.
    pub fn scheme(&self) -> QuantScheme {
        QuantScheme::Block {
            rows: self.block[0],
            cols: self.block[1],
            ue8m0: false,
        }
    }

    /// What the core's quantizing plan is asked for: [`InferQuant::scheme`], with the
    /// scheme's default scale dtype.
    pub fn request(&self) -> QuantRequest {
        QuantRequest {
            scheme: self.scheme(),
            scale_dtype: None,
        }
    }

    /// Whether the engine keeps parameter `name` (of `ndim` dims) in fp8: a linear layer's
    /// weight (attention, MLP, experts), not a norm, embedding, router or `lm_head`, and not
    /// a module of `modules_to_not_convert`.
    pub fn quantizes(&self, name: &str, ndim: usize) -> bool {
        // transformers 5's stacked experts are parameters of their own, without `.weight`
        let module = match name.strip_suffix(".weight") {
            Some(module) => module,
            None if name.ends_with(".mlp.experts.down_proj") => name,
            None => return false,
        };
        let linear = ndim >= 2
            && (module.contains(".self_attn.") || module.contains(".mlp."))
            && !module.ends_with(".mlp.gate")
            && !module
                .rsplit('.')
                .next()
                .is_some_and(|m| m.contains("norm"));
        let skipped = self
            .not_convert
            .iter()
            .zip(self.globs.iter().chain(std::iter::repeat(&None)))
            .any(|(p, g)| match g {
                Some(g) => g.is_match(module),
                None => module.contains(p.as_str()),
            });
        linear && !skipped && !module.contains("embed_tokens") && !module.contains("lm_head")
    }
}

/// The engine's name of the scales of weight (or fused buffer) `weight`: `X.weight` ->
/// `X.weight_scale_inv`, `w13_weight` -> `w13_weight_scale_inv`, and the stacked
/// `mlp.experts.down_proj.weight` (transformers 5: `mlp.experts.down_proj`) ->
/// `mlp.experts.w2_weight_scale_inv`.
pub fn scale_name(weight: &str) -> String {
    if let Some(p) = weight
        .strip_suffix(".mlp.experts.down_proj.weight")
        .or_else(|| weight.strip_suffix(".mlp.experts.down_proj"))
    {
        return format!("{p}.mlp.experts.w2_weight_scale_inv");
    }
    format!("{weight}_scale_inv")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys transformers leaves unset are written null: read as absent.
    #[test]
    fn null_keys_of_a_quantization_config_are_absent() {
        let config = serde_json::json!({"quant_method": "fp8", "fmt": null,
            "weight_block_size": [128, 128], "modules_to_not_convert": null});
        let q = InferQuant::from_config(&config, "c.json").unwrap();
        assert_eq!((q.fp8, q.not_convert.len()), (DType::Fp8E4M3, 0));
    }

    /// transformers 5's `mlp.experts.down_proj` (no `.weight`) is the engine's `w2_weight`.
    #[test]
    fn transformers_5_expert_names_quantize() {
        let q = InferQuant::parse("fp8-block").unwrap().unwrap();
        assert!(q.quantizes("model.layers.3.mlp.experts.down_proj", 3));
        assert!(!q.quantizes("model.layers.3.mlp.experts.down_bias", 2));
        assert_eq!(
            scale_name("model.layers.3.mlp.experts.down_proj"),
            "model.layers.3.mlp.experts.w2_weight_scale_inv"
        );
    }

    #[test]
    fn the_engine_keeps_linear_weights_in_fp8() {
        let q = InferQuant::parse("fp8-block").unwrap().unwrap();
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.3.mlp.experts.gate_proj.weight",
            "model.layers.3.mlp.shared_experts.up_proj.weight",
        ] {
            assert!(q.quantizes(name, 2), "{name}");
        }
        for (name, ndim) in [
            ("model.embed_tokens.weight", 2),
            ("lm_head.weight", 2),
            ("model.layers.3.mlp.gate.weight", 2),
            ("model.layers.3.mlp.gate.e_score_correction_bias", 1),
            ("model.layers.0.input_layernorm.weight", 1),
            ("model.layers.0.self_attn.q_a_layernorm.weight", 1),
            ("model.layers.0.self_attn.q_norm.weight", 1),
            ("model.layers.0.self_attn.q_proj.bias", 1),
            ("model.norm.weight", 1),
        ] {
            assert!(!q.quantizes(name, ndim), "{name}");
        }
        let skip = q
            .with_not_convert(vec![
                "self_attn.kv_b".into(),
                "model.layers.1?.mlp.*".into(),
            ])
            .unwrap();
        assert!(!skip.quantizes("model.layers.0.self_attn.kv_b_proj.weight", 2));
        assert!(!skip.quantizes("model.layers.12.mlp.down_proj.weight", 2));
        assert!(skip.quantizes("model.layers.2.mlp.down_proj.weight", 2));
    }

    #[test]
    fn configs_and_flags_parse() {
        let config = serde_json::json!({"quant_method": "fp8", "fmt": "e5m2",
            "weight_block_size": [64, 32], "activation_scheme": "dynamic"});
        let q = InferQuant::from_config(&config, "c.json").unwrap();
        assert_eq!((q.fp8, q.block), (DType::Fp8E5M2, [64, 32]));
        assert_eq!(q.to_string(), "fp8-block:64x32:e5m2");
        assert_eq!(InferQuant::parse(&q.to_string()).unwrap().unwrap(), q);
        let err = InferQuant::from_config(&serde_json::json!({"quant_method": "awq"}), "c.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("quantization_config.quant_method"), "{err}");
        let err = InferQuant::from_config(&serde_json::json!({"quant_method": "fp8"}), "c.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("weight_block_size"), "{err}");
        let err = InferQuant::parse("int4").unwrap_err().to_string();
        assert!(err.starts_with("infer_quant: `int4`"), "{err}");
        assert_eq!(
            scale_name("model.layers.3.mlp.experts.down_proj.weight"),
            "model.layers.3.mlp.experts.w2_weight_scale_inv"
        );
        assert_eq!(
            scale_name("model.layers.3.mlp.experts.w13_weight"),
            "model.layers.3.mlp.experts.w13_weight_scale_inv"
        );
    }
}
