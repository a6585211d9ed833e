//! The parameter lists derived from the shipped configs and from configs as transformers
//! writes them.

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

/// A MoE config without its expert count is refused, never read as a dense model.
#[test]
fn a_moe_config_without_experts_is_refused() {
    let (_, mut config) = shipped("qwen3-30b-a3b").unwrap();
    config.num_experts = None;
    config.num_local_experts = None;
    let err = Model::from_config(&config, "q.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("q.json: `num_experts` is missing: a MoE config needs its routed experts: add `\"num_experts\": N` (or transformers 5's `\"num_local_experts\": N`)"),
        "{err}"
    );
    let (_, mut config) = shipped("deepseek-v3").unwrap();
    config.n_routed_experts = None;
    config.num_local_experts = None;
    let err = Model::from_config(&config, "d.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("d.json: `n_routed_experts` is missing"),
        "{err}"
    );
    // an explicit 0 is a dense model, as transformers builds it
    let (_, mut config) = shipped("qwen3-30b-a3b").unwrap();
    config.num_experts = Some(0);
    let m = Model::from_config(&config, "q.json").unwrap();
    find(&m, "model.layers.0.mlp.gate_proj.weight");
}
