//! A whole-model refit into an fp8 engine (`refit --infer-quant`, or a config's
//! `quantization_config`): what is quantized and the scale bytes against a count written
//! here from the model's shapes, and the refit run for real, in process and over processes
//! (tcp and shm), every fp8 value and scale checked against a naive quantizer.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{EXE, text, wait_bounded};
use reshard::convert::reference::quantize_tensor;
use reshard::exec::{ExecOptions, run_local_quantized};
use reshard::fill::Fill;
use reshard::layout::LayoutSpec;
use reshard::model::{InferQuant, Inference, Model, Ranks, Refit, Rules, Training};
use reshard::{Plan, PlanOptions};

fn refit_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(EXE)
        .arg("refit")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Blocks of 128x128 over `[rows, cols]` cut into `tp` shards along `split` (0: rows, 1: cols,
/// None: replicated), summed over the shards: the scales a TP group holds.
fn tp_blocks(rows: u64, cols: u64, split: Option<usize>, tp: u64) -> u64 {
    let b = |n: u64| n.div_ceil(128);
    match split {
        None => tp * b(rows) * b(cols),
        Some(0) => tp * b(rows / tp) * b(cols),
        Some(_) => tp * b(rows) * b(cols / tp),
    }
}

/// DeepSeek-V3 with its real `quantization_config` (e4m3, 128x128 blocks), into vLLM TP8 x
/// DP2: the fp8 weights (8 in each dense layer, 11 in each MoE layer), and the f32 scales
/// every inference rank receives once, counted here from the config's shapes and vLLM's
/// splits.
#[test]
fn deepseek_v3_fp8_counts_its_scales() {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/deepseek-v3-fp8.config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let n = |k: &str| config[k].as_u64().unwrap();
    let (h, inter, moe) = (
        n("hidden_size"),
        n("intermediate_size"),
        n("moe_intermediate_size"),
    );
    let (heads, experts, dense) = (
        n("num_attention_heads"),
        n("n_routed_experts"),
        n("first_k_dense_replace"),
    );
    let (q_lora, kv_lora, nope, rope, v) = (
        n("q_lora_rank"),
        n("kv_lora_rank"),
        n("qk_nope_head_dim"),
        n("qk_rope_head_dim"),
        n("v_head_dim"),
    );
    let layers = n("num_hidden_layers");
    let (tp, dp) = (8, 2);
    let attention = tp_blocks(q_lora, h, None, tp)
        + tp_blocks(heads * (nope + rope), q_lora, Some(0), tp)
        + tp_blocks(kv_lora + rope, h, None, tp)
        + tp_blocks(heads * (nope + v), kv_lora, Some(0), tp)
        + tp_blocks(h, heads * v, Some(1), tp);
    let mlp = |i: u64, tp: u64| 2 * tp_blocks(i, h, Some(0), tp) + tp_blocks(h, i, Some(1), tp);
    // every DP replica holds the attention and dense MLPs; the routed experts are split over
    // all tp x dp ranks once (vLLM's MoE tensor parallelism spans the data-parallel ranks)
    let blocks = dp
        * (dense * (attention + mlp(inter, tp)) + (layers - dense) * (attention + mlp(moe, tp)))
        + (layers - dense) * experts * mlp(moe, tp * dp);
    let j = refit_json(&[
        "--model",
        "deepseek-v3-fp8",
        "--train",
        "ep=8,pp=8,dp=8",
        "--infer",
        "tp=8,dp=2",
    ]);
    assert_eq!(
        j["quant"]["tensors"],
        dense * 8 + (layers - dense) * 11,
        "{j}"
    );
    assert_eq!(j["quant"]["scheme"], "block:128x128");
    assert_eq!(j["quant"]["dtype"], "fp8e4m3");
    assert_eq!(j["reshard"]["scale_bytes"], blocks * 4, "{j}");
    // EP shards whole experts and PP whole layers: no block straddles two source shards
    assert_eq!(j["reshard"]["amax_bytes"], 0);
    // fp8 values are one byte: the quantized refit moves less than the same refit in bf16
    let plain = refit_json(&[
        "--model",
        "deepseek-v3-fp8",
        "--train",
        "ep=8,pp=8,dp=8",
        "--infer",
        "tp=8,dp=2",
        "--infer-quant",
        "none",
    ]);
    assert!(plain.get("quant").is_none() && plain["reshard"].get("scale_bytes").is_none());
    let (q, b) = (
        &j["reshard"]["bytes_remote"],
        &plain["reshard"]["bytes_remote"],
    );
    assert!(q.as_u64().unwrap() < b.as_u64().unwrap(), "{q} {b}");
}

/// TP16 splits the dense MLP's 18432 rows into shards of 1152, which cut the 128-row
/// blocks: refused before anything is planned, naming the tensor, the dim and the boundary.
#[test]
fn inference_shards_that_cut_a_block_are_refused() {
    let out = Command::new(EXE)
        .args([
            "refit",
            "--model",
            "qwen3-0.6b",
            "--train",
            "tp=2",
            "--infer",
            "tp=16",
        ])
        .args(["--infer-quant", "fp8-block"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("tensor model.layers.0.mlp.gate_proj.weight: --infer layout: a shard boundary at 192 along dim 0 cuts an fp8 block of 128x128"),
        "{err}"
    );
    let out = Command::new(EXE)
        .args([
            "refit",
            "--model",
            "qwen3-0.6b",
            "--train",
            "tp=2",
            "--infer",
            "tp=2",
        ])
        .args(["--infer-quant", "fp8-blocks"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--infer-quant: `fp8-blocks`"));
}

/// Qwen3-0.6B's layer shapes (hidden 1024, 16 query and 8 key-value heads of 128,
/// intermediate 3072) with one layer and a small vocabulary, so that it runs in a debug
/// build.
fn qwen_layer(dir: &Path) -> PathBuf {
    let path = dir.join("qwen3-layer.json");
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen3-0.6b.config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    config["num_hidden_layers"] = 1.into();
    config["vocab_size"] = 1024.into();
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

fn tiny_qwen(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.json");
    std::fs::write(
        &path,
        r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000,
            "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    path
}

/// Every quantized tensor of a refit run between threads, each destination's fp8 values and
/// scales compared with its box of the whole tensor quantized by the naive reference.
#[test]
fn quantized_refit_in_process_matches_the_reference() {
    let scratch = common::temp_dir("refit-quant-threads");
    let dir = scratch.path();
    for (config, train, infer, quant, quantized) in [
        (qwen_layer(dir), "tp=2", "tp=2", "fp8-block", 7),
        (
            tiny_qwen(dir),
            "dp=3,fsdp=3",
            "tp=2,dp=2",
            "fp8-block:16x16",
            21,
        ),
        (
            tiny_qwen(dir),
            "tp=2,pp=3",
            "tp=4",
            "fp8-block:16x8:e5m2",
            21,
        ),
    ] {
        let model = Model::load(config.to_str().unwrap()).unwrap();
        let refit = Refit::new(
            &model,
            &Training::parse(train).unwrap(),
            &Inference::parse(infer).unwrap(),
            &Rules::default(),
            Ranks::Disjoint,
        )
        .unwrap()
        .quantized(&InferQuant::parse(quant).unwrap().unwrap())
        .unwrap();
        let q = refit.quant.as_ref().unwrap();
        assert_eq!(q.tensors(), quantized, "{train} -> {infer}");
        let mut amax = 0;
        for s in &q.scales {
            let t = &refit.tensors[s.tensor];
            let qp = refit.quant_plan(s.tensor).unwrap().clone();
            let plan =
                Plan::quantized(t.src.clone(), t.dst.clone(), PlanOptions::default(), qp).unwrap();
            amax += plan.quant().unwrap().amax_messages(plan.src()).len();
            let fill = Fill::Normal {
                seed: s.tensor as u64,
            };
            let sources = fill.shards(plan.src()).unwrap();
            let mut shards = reshard::exec::zeroed_shards(plan.dst()).unwrap();
            let mut scales = reshard::exec::zeroed_scale_shards(&plan).unwrap();
            run_local_quantized(
                &plan,
                &sources,
                &mut shards,
                &mut scales,
                &ExecOptions::default(),
            )
            .unwrap();
            let whole = LayoutSpec::parse("mesh=1 place=R")
                .unwrap()
                .resolve(t.src.shape(), t.src.dtype(), 0)
                .unwrap();
            let tensor = fill.shard(&whole, 0).unwrap().unwrap();
            let qp = plan.quant().unwrap();
            let want = quantize_tensor(qp.quant, &qp.grid, t.src.dtype(), &tensor).unwrap();
            assert_eq!(want.grid_shape, s.shape, "{}", s.name);
            for (&r, values) in &shards {
                let shard = t.dst.local_region(r).unwrap();
                assert!(want.values_of(&shard) == *values, "{} rank {r}", t.name);
                let blocks = q
                    .scale_region(
                        &refit,
                        q.scales.iter().position(|x| x.name == s.name).unwrap(),
                        r,
                    )
                    .unwrap();
                assert!(
                    want.scales_of(&blocks) == scales[&r],
                    "{} rank {r} scales",
                    s.name
                );
            }
        }
        // FSDP's flat shards of 64 rows over 3 ranks cut the 16-row blocks
        assert_eq!(amax > 0, train.contains("fsdp"), "{train}");
    }
}

/// `refit --run` into fp8 over processes, tcp and shm: every rank's fp8 values and scales
/// verified against the naive quantizer, gather+broadcast's bf16 copies against the fill;
/// the wire carries the planned fp8 values and scales, and each inference rank's scale
/// shards add up to the planned scale bytes.
#[test]
fn quantized_refit_runs_over_processes() {
    let scratch = common::temp_dir("refit-quant");
    let dir = scratch.path();
    let qwen = qwen_layer(dir);
    let tiny = tiny_qwen(dir);
    let moe = common::tiny_moe_config(dir);
    for (model, quant, train, infer, transport) in [
        (&qwen, "fp8-block", "tp=2", "tp=2", "shm"),
        (&tiny, "fp8-block:16x16", "dp=3,fsdp=3", "tp=2", "tcp"),
        (&tiny, "fp8-block:16x16", "tp=2,pp=2", "tp=2,dp=2", "shm"),
        (&moe, "fp8-block:8x8", "tp=2,ep=2,pp=2", "tp=2", "tcp"),
        (&moe, "fp8-block:8x8:e5m2", "tp=2,ep=2", "tp=2,ep=2", "shm"),
    ] {
        let world: u64 = Refit::new(
            &Model::load(model.to_str().unwrap()).unwrap(),
            &Training::parse(train).unwrap(),
            &Inference::parse(infer).unwrap(),
            &Rules::default(),
            Ranks::Disjoint,
        )
        .unwrap()
        .world() as u64;
        let child = Command::new(EXE)
            .args([
                "launch",
                "--nproc",
                &world.to_string(),
                "--",
                "refit",
                "--model",
            ])
            .arg(model)
            .args(["--train", train, "--infer", infer, "--infer-quant", quant])
            .args(["--run", "--json", "--transport", transport, "--iters", "1"])
            .args(["--warmup", "0", "--timeout", "60", "--pack-below", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(300), "quantized refit");
        let case = format!("{} {train} -> {infer} over {transport}", model.display());
        assert!(out.status.success(), "{case}: {}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let (run, planned) = (&j["run"], &j["reshard"]);
        assert_eq!(run["verified"], true, "{case}: {run}");
        assert_eq!(run["transport"], transport);
        assert_eq!(run["scale_bytes"], planned["scale_bytes"], "{case}: {j}");
        let u = |v: &serde_json::Value| v.as_u64().unwrap();
        assert_eq!(
            u(&run["dst_bytes"]),
            u(&planned["bytes_remote"]) + u(&planned["bytes_local"]),
            "{case}"
        );
        assert_eq!(
            u(&run["reshard"]["wire_bytes"]),
            u(&planned["bytes_remote"]) + u(&planned["scale_bytes"]),
            "{case}: {j}"
        );
    }
}
