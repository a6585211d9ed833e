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

/// `Qwen3MoeConfig(num_experts=4, ...).save_pretrained(d)` as transformers 5 writes it:
/// `num_local_experts`, no dtype, nulls.
pub(crate) const QWEN3_MOE_V5: &str = r#"{
    "architectures": null, "model_type": "qwen3_moe", "transformers_version": "5.0.0",
    "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": null, "num_local_experts": 4,
    "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": null,
    "tie_word_embeddings": null, "attention_bias": null, "rope_scaling": null,
    "quantization_config": null
}"#;

#[test]
fn configs_as_transformers_5_writes_them() {
    let config = ModelConfig::from_json(QWEN3_MOE_V5, "v5.json").unwrap();
    assert!(config.architectures.is_empty());
    assert_eq!(
        config.architecture("v5.json").unwrap(),
        Architecture::Qwen3Moe
    );
    assert_eq!(config.qwen3_experts("v5.json").unwrap(), Some(4));
    assert!(config.transformers_5());
    assert_eq!(
        config.param_dtype("v5.json").unwrap_err().to_string(),
        "v5.json: `dtype` is missing: a config written by transformers 5.0.0 without a dtype \
         holds f32 weights if fresh, bf16 if converted: add `\"dtype\": \"bfloat16\"` (or the \
         model's) to it, or give the training dtype (--train-dtype, Refit(..., train_dtype=...), Model::load_with_dtype)"
    );
    assert_eq!(
        config.param_dtype_or("v5.json", Some(DType::F32)).unwrap(),
        DType::F32
    );
    let with = QWEN3_MOE_V5.replace("\"head_dim\": null", "\"dtype\": \"float32\"");
    let config = ModelConfig::from_json(&with, "v5.json").unwrap();
    // the config's own dtype wins over a given one
    assert_eq!(
        config.param_dtype_or("v5.json", Some(DType::Bf16)).unwrap(),
        DType::F32
    );
    // a null dtype is no dtype
    let null = QWEN3_MOE_V5.replace("\"head_dim\": null", "\"dtype\": null");
    let config = ModelConfig::from_json(&null, "v5.json").unwrap();
    assert!(config.param_dtype("v5.json").is_err());
    // both names of one count must agree, as must both dtypes
    let twice = QWEN3_MOE_V5.replace("\"head_dim\": null", "\"num_experts\": 8");
    let config = ModelConfig::from_json(&twice, "v5.json").unwrap();
    assert_eq!(
        config.qwen3_experts("v5.json").unwrap_err().to_string(),
        "v5.json: `num_local_experts` is 4: differs from `num_experts` 8: give one"
    );
    let twice = QWEN3_MOE_V5.replace(
        "\"head_dim\": null",
        "\"dtype\": \"float32\", \"torch_dtype\": \"bfloat16\"",
    );
    let config = ModelConfig::from_json(&twice, "v5.json").unwrap();
    assert_eq!(
        config.param_dtype("v5.json").unwrap_err().to_string(),
        "v5.json: `dtype` is f32: differs from `torch_dtype` bf16: give one"
    );
    assert!(
        !ModelConfig::from_json(&QWEN3_MOE_V5.replace("5.0.0", "4.51.3"), "x")
            .unwrap()
            .transformers_5()
    );
}

#[test]
fn nulls_and_wrong_types_name_the_field() {
    let cases = [
        (
            "\"hidden_size\": 256",
            "\"hidden_size\": null",
            "v5.json: `hidden_size` is null: required: a positive integer",
        ),
        (
            "\"architectures\": null",
            "\"architectures\": \"Qwen3MoeForCausalLM\"",
            "v5.json: `architectures` is \"Qwen3MoeForCausalLM\": expected a sequence",
        ),
        (
            "\"num_local_experts\": 4",
            "\"num_local_experts\": -4",
            "v5.json: `num_local_experts` is -4: expected u64",
        ),
        (
            "\"mlp_only_layers\": null",
            "\"mlp_only_layers\": [0, \"one\"]",
            "v5.json: `mlp_only_layers` is [0,\"one\"]: expected u64",
        ),
    ];
    for (from, to, want) in cases {
        let json = QWEN3_MOE_V5.replace(from, to);
        let err = ModelConfig::from_json(&json, "v5.json").unwrap_err();
        assert_eq!(err.to_string(), want);
    }
    let err = ModelConfig::from_json("[1, 2]", "x.json").unwrap_err();
    assert_eq!(
        err.to_string(),
        "x.json: `config` is [1,2]: expected a JSON object of config keys"
    );
}

#[test]
fn every_field_is_checked_by_name() {
    // a key of ModelConfig missing from FIELDS would give serde's message without it
    let text = format!("{:?}", shipped("deepseek-v3").unwrap().1);
    let body = text.split_once('{').unwrap().1;
    let (mut depth, mut token, mut names) = (0, String::new(), vec![]);
    for ch in body.chars() {
        match ch {
            '{' | '[' | '(' => depth += 1,
            '}' | ']' | ')' => depth -= 1,
            ',' if depth == 0 => token.clear(),
            ':' if depth == 0 => names.push(std::mem::take(&mut token).trim().to_string()),
            _ if depth == 0 => token.push(ch),
            _ => {}
        }
    }
    assert!(names.len() > 25, "{names:?}");
    for name in names {
        assert!(
            FIELDS.iter().any(|f| f.0 == name),
            "{name} is not in FIELDS"
        );
    }
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
