//! `--model`: a shipped short name, a `config.json`, or a checkpoint folder.

use std::path::Path;

use reshard_core::dtype::DType;

use super::config::{ModelConfig, SHIPPED, shipped};
use super::params::{ExpertNames, Heads, Model};
use super::safetensors::{read_checkpoint, stack_experts};
use crate::error::ModelError;

impl Model {
    /// Loads a model from what a user passes to `--model`:
    /// - a folder: the tensors of its `*.safetensors` headers (experts stacked), with its
    ///   `config.json`, if any, for the layer count and attention heads (layers at or beyond
    ///   `num_hidden_layers`, such as multi-token-prediction layers, are left out); a folder
    ///   with only a `config.json` is derived from it;
    /// - a file: an HF `config.json`;
    /// - a shipped config's short name (`deepseek-v3`, `qwen3-0.6b`, ...).
    ///
    /// ```
    /// let model = reshard_model::Model::load("llama-3.1-8b").unwrap();
    /// assert_eq!(model.num_layers, 32);
    /// assert!(reshard_model::Model::load("no-such-model").is_err());
    /// ```
    pub fn load(arg: &str) -> Result<Model, ModelError> {
        Model::load_with_dtype(arg, None)
    }

    /// [`Model::load`], with `dtype` (a refit's training dtype) for a config that says none
    /// (transformers 5 leaves the dtype out of a fresh config); a checkpoint's tensors and a
    /// dtype the config says win.
    ///
    /// ```
    /// use reshard_core::DType;
    /// let model = reshard_model::Model::load_with_dtype("qwen3-0.6b", Some(DType::F32)).unwrap();
    /// assert_eq!(model.params[0].dtype, DType::Bf16); // the shipped config says bfloat16
    /// ```
    pub fn load_with_dtype(arg: &str, dtype: Option<DType>) -> Result<Model, ModelError> {
        let path = Path::new(arg);
        if path.is_dir() {
            return load_dir(path, dtype);
        }
        if path.is_file() {
            let config = ModelConfig::read(path)?;
            return Model::from_config_with_dtype(&config, &name_of(path), dtype);
        }
        match shipped(arg) {
            Some((name, config)) => Model::from_config_with_dtype(&config, name, dtype),
            None => Err(ModelError::UnknownModel {
                value: arg.to_string(),
                known: SHIPPED.iter().map(|(n, _)| n.to_string()).collect(),
            }),
        }
    }
}

/// `models/deepseek-v3.config.json` -> `deepseek-v3`; `ckpt/config.json` -> `ckpt`.
fn name_of(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    if file == "config.json"
        && let Some(dir) = path.parent().and_then(Path::file_name)
    {
        return dir.to_string_lossy().into_owned();
    }
    let file = file.strip_suffix(".json").unwrap_or(&file);
    file.strip_suffix(".config").unwrap_or(file).to_string()
}

fn load_dir(dir: &Path, dtype: Option<DType>) -> Result<Model, ModelError> {
    let config_path = dir.join("config.json");
    let config = if config_path.is_file() {
        Some(ModelConfig::read(&config_path))
    } else {
        None
    };
    let name = dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let tensors = read_checkpoint(dir)?;
    // beside its tensors, the config of an architecture no family knows only says nothing
    // (its layers are counted from the names); any other fault in it is refused
    let config = match config {
        Some(Err(ModelError::UnsupportedArchitecture { .. })) if tensors.is_some() => None,
        other => other.transpose()?,
    };
    let Some(tensors) = tensors else {
        return match config {
            Some(config) => Model::from_config_with_dtype(&config, &name, dtype),
            None => Err(ModelError::Checkpoint {
                path: dir.display().to_string(),
                reason: "holds neither config.json nor *.safetensors files".into(),
            }),
        };
    };
    let mut params = stack_experts(tensors, dir)?;
    let num_layers = match &config {
        Some(c) => {
            params.retain(|p| p.layer().is_none_or(|l| l < c.num_hidden_layers));
            c.num_hidden_layers
        }
        None => params
            .iter()
            .filter_map(|p| p.layer())
            .max()
            .map_or(1, |l| l + 1),
    };
    Ok(Model {
        name,
        num_layers,
        heads: config.as_ref().map(|c| Heads {
            attention: c.num_attention_heads,
            kv: c.kv_heads(),
        }),
        params,
        // the tensors of a checkpoint are what they are: an fp8 checkpoint's weights are
        // read as stored, not quantized again
        quant: None,
        // a checkpoint's tensors keep the names they are stored under
        expert_names: ExpertNames::Split,
    })
}

#[cfg(test)]
mod tests {
    use super::super::safetensors::tests::{temp_dir, write};
    use super::*;

    #[test]
    fn a_checkpoint_folder_with_its_config() {
        let scratch_dir = temp_dir("ckpt");
        let dir = scratch_dir.path();
        write(
            &dir.join("model.safetensors"),
            &[
                ("model.embed_tokens.weight", "BF16", &[32, 8]),
                (
                    "model.layers.0.mlp.experts.0.down_proj.weight",
                    "BF16",
                    &[8, 4],
                ),
                (
                    "model.layers.0.mlp.experts.1.down_proj.weight",
                    "BF16",
                    &[8, 4],
                ),
                ("model.layers.1.input_layernorm.weight", "BF16", &[8]),
            ],
        );
        let m = Model::load(dir.to_str().unwrap()).unwrap();
        assert_eq!(m.num_layers, 2);
        assert_eq!(m.heads, None);
        let stacked = m
            .params
            .iter()
            .find(|p| p.name == "model.layers.0.mlp.experts.down_proj.weight");
        assert_eq!(stacked.unwrap().shape, [2, 8, 4]);
        // with a config saying 1 layer, layer 1 (say, a prediction layer) is left out
        let config = r#"{"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_experts": 2, "moe_intermediate_size": 4}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        let m = Model::load(dir.to_str().unwrap()).unwrap();
        assert_eq!(m.num_layers, 1);
        assert_eq!(m.params.len(), 2);
        assert_eq!(
            m.heads,
            Some(Heads {
                attention: 2,
                kv: 2
            })
        );
        // a config file by path is named after the file
        let file = dir.join("tiny.config.json");
        std::fs::write(&file, config).unwrap();
        assert_eq!(Model::load(file.to_str().unwrap()).unwrap().name, "tiny");
    }

    #[test]
    fn an_architecture_no_family_knows_is_named_and_its_checkpoint_loads() {
        let scratch_dir = temp_dir("gpt2");
        let dir = scratch_dir.path();
        let config = r#"{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "n_embd": 8, "n_layer": 2, "n_head": 2, "vocab_size": 32}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        // the config alone: refused naming the architecture, not a field GPT-2 calls otherwise
        let err = Model::load(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(
            err.contains(
                "unsupported architecture (model_type `gpt2`, architectures [GPT2LMHeadModel])"
            ),
            "{err}"
        );
        assert!(err.contains("give the checkpoint folder"), "{err}");
        // with its tensors (Conv1D weights stored [in, out]): the headers are the model
        write(
            &dir.join("model.safetensors"),
            &[
                ("transformer.wte.weight", "F32", &[32, 8]),
                ("transformer.h.0.attn.c_attn.weight", "F32", &[8, 24]),
                ("transformer.h.1.mlp.c_fc.weight", "F32", &[8, 32]),
            ],
        );
        let m = Model::load(dir.to_str().unwrap()).unwrap();
        assert_eq!(m.params.len(), 3);
        assert_eq!(m.heads, None);
        let attn = m.params.iter().find(|p| p.name.ends_with("c_attn.weight"));
        assert_eq!(attn.unwrap().shape, [8, 24]);
        // a config that is broken otherwise is still refused beside tensors
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type": "gpt2", "vocab_size": null}"#,
        )
        .unwrap();
        assert!(Model::load(dir.to_str().unwrap()).is_err());
    }

    #[test]
    fn unknown_models_list_the_shipped_ones() {
        let err = Model::load("gpt-9").unwrap_err().to_string();
        assert!(err.starts_with("model: `gpt-9` is neither a file, a folder nor a shipped model (known: deepseek-v3, deepseek-v3-fp8, kimi-k2,"), "{err}");
        let scratch_empty = temp_dir("nothing");
        let empty = scratch_empty.path();
        let err = Model::load(empty.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("holds neither config.json nor *.safetensors files"),
            "{err}"
        );
    }
}
