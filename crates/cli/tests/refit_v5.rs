//! `reshard refit --model <config.json>` with configs as transformers 5 writes them:
//! `num_local_experts`, no dtype, nulls; and `--train fsdp=N` alone.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

mod common;

/// `Qwen3MoeConfig(num_experts=4, ...).save_pretrained(d)` under transformers 5, by hand.
const QWEN3_MOE_V5: &str = r#"{
  "architectures": null, "model_type": "qwen3_moe", "transformers_version": "5.0.0",
  "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
  "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": null, "num_local_experts": 4,
  "num_experts_per_tok": 2, "mlp_only_layers": null, "tie_word_embeddings": null,
  "rope_scaling": null, "quantization_config": null
}"#;

fn write(dir: &std::path::Path, text: &str) -> PathBuf {
    let path = dir.join("config.json");
    std::fs::write(&path, text).unwrap();
    path
}

fn reshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_transformers_5_config_without_a_dtype_is_refused_naming_it() {
    let scratch = common::temp_dir("v5-no-dtype");
    let path = write(scratch.path(), QWEN3_MOE_V5);
    let out = reshard(&[
        "refit",
        "--model",
        path.to_str().unwrap(),
        "--train",
        "fsdp=2",
        "--infer",
        "tp=2",
    ]);
    assert!(!out.status.success());
    let err = common::text(&out.stderr);
    assert!(err.contains("`dtype` is missing"), "{err}");
    assert!(err.contains("add `\"dtype\": \"bfloat16\"`"), "{err}");
    assert!(err.contains("--train-dtype"), "{err}");
}

/// `--train-dtype` stands for the dtype such a config leaves out.
#[test]
fn a_train_dtype_gives_a_transformers_5_config_its_dtype() {
    let scratch = common::temp_dir("v5-train-dtype");
    let path = write(scratch.path(), QWEN3_MOE_V5);
    let out = reshard(&[
        "refit",
        "--model",
        path.to_str().unwrap(),
        "--train",
        "fsdp=2",
        "--infer",
        "tp=2",
        "--train-dtype",
        "f32",
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["train_dtype"], "f32", "{json}");
}

#[test]
fn a_transformers_5_moe_config_has_its_experts() {
    let scratch = common::temp_dir("v5-moe");
    let text = QWEN3_MOE_V5.replace("\"head_dim\": null", "\"dtype\": \"float32\"");
    let path = write(scratch.path(), &text);
    let out = reshard(&[
        "refit",
        "--model",
        path.to_str().unwrap(),
        "--train",
        "fsdp=2",
        "--infer",
        "tp=2,ep",
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["train_dtype"], "f32", "{json}");
    // the experts and their router, no dense MLP
    let layouts = reshard(&[
        "refit",
        "--model",
        path.to_str().unwrap(),
        "--train",
        "fsdp=2",
        "--infer",
        "tp=2,ep",
        "--layouts",
    ]);
    assert!(layouts.status.success());
    let listing = common::text(&layouts.stdout);
    assert!(
        listing.contains("model.layers.0.mlp.experts.gate_proj.weight"),
        "{listing}"
    );
    assert!(
        listing.contains("model.layers.1.mlp.gate.weight"),
        "{listing}"
    );
    assert!(
        !listing.contains("model.layers.0.mlp.gate_proj.weight"),
        "{listing}"
    );
    // transformers 5's names: down_proj without `.weight`, gate_up_proj on the training side
    assert!(
        listing.contains("model.layers.0.mlp.experts.down_proj  4x256x128 f32"),
        "{listing}"
    );
    assert!(listing.contains("fused (train) model.layers.1.mlp.experts.gate_up_proj = concat(dim 1: model.layers.1.mlp.experts.gate_proj.weight, model.layers.1.mlp.experts.up_proj.weight)"), "{listing}");
}

#[test]
fn nulls_name_the_field() {
    let scratch = common::temp_dir("v5-null");
    let text = QWEN3_MOE_V5.replace("\"hidden_size\": 256", "\"hidden_size\": null");
    let path = write(scratch.path(), &text);
    let out = reshard(&[
        "refit",
        "--model",
        path.to_str().unwrap(),
        "--train",
        "tp=1",
        "--infer",
        "tp=1",
    ]);
    assert!(!out.status.success());
    let err = common::text(&out.stderr);
    assert!(
        err.contains("`hidden_size` is null: required: a positive integer"),
        "{err}"
    );
}

#[test]
fn fsdp_alone_and_what_to_write_instead() {
    let out = reshard(&[
        "refit",
        "--model",
        "qwen3-0.6b",
        "--train",
        "fsdp=4",
        "--infer",
        "tp=2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let out = reshard(&[
        "refit",
        "--model",
        "qwen3-30b-a3b",
        "--train",
        "ep=4,fsdp=4",
        "--infer",
        "tp=4",
    ]);
    assert!(!out.status.success());
    let err = common::text(&out.stderr);
    assert!(
        err.contains("(write ep=4,dp=16,fsdp=4, or fsdp=1)"),
        "{err}"
    );
}

#[test]
fn a_tp_the_heads_refuse_names_the_sizes_to_write() {
    let out = reshard(&[
        "refit",
        "--model",
        "qwen3-0.6b",
        "--train",
        "tp=2",
        "--infer",
        "tp=6",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = common::text(&out.stderr);
    assert!(
        err.starts_with(
            "error: --infer: `tp=6`: does not divide the model's 16 attention heads (write tp=4 or tp=8)"
        ),
        "{err}"
    );
    let out = reshard(&[
        "refit",
        "--model",
        "qwen3-0.6b",
        "--train",
        "tp=32",
        "--infer",
        "tp=2",
    ]);
    let err = common::text(&out.stderr);
    assert!(err.contains("(write tp=16)"), "{err}");
}
