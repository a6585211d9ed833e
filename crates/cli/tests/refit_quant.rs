//! A whole-model refit into an fp8 engine (`refit --infer-quant`, or a config's
//! `quantization_config`): what is quantized and the scale bytes against a count written
//! here from the model's shapes, and the refit run for real as one batch, in process and
//! over processes (tcp and shm), every fp8 value and scale, in fused buffers too, checked
//! against a naive quantizer.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use std::collections::BTreeMap;

use common::{EXE, text, wait_bounded};
use reshard::Side;
use reshard::batch::{Batch, BatchOptions, Fusion, Tensor, run_local_batch};
use reshard::convert::reference::quantize_tensor;
use reshard::exec::ExecOptions;
use reshard::fill::Fill;
use reshard::layout::LayoutSpec;
use reshard::model::{
    Fused, InferQuant, Inference, Model, Ranks, Refit, Rules, Training, scale_name,
};

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
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/deepseek-v3-fp8.config.json"),
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
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen3-0.6b.config.json"),
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

/// The whole refit as one batch, quantized tensors included ([`Tensor::quant`]), with both
/// sides' fused buffers.
fn refit_batch(refit: &Refit) -> Batch {
    let tensors = refit
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| Tensor {
            quant: refit.quant_plan(i).cloned(),
            ..Tensor::new(t.name.clone(), t.src.clone(), t.dst.clone())
        })
        .collect();
    let fusions = |fused: &[Fused], side| {
        fused
            .iter()
            .map(|f| Fusion {
                name: f.name.clone(),
                side,
                dim: f.dim,
                members: f.members.clone(),
            })
            .collect::<Vec<_>>()
    };
    let mut all = fusions(&refit.src_fused, Side::Src);
    all.extend(fusions(&refit.dst_fused, Side::Dst));
    Batch::new(tensors, all, BatchOptions::default()).unwrap()
}

/// A fused scale buffer on `rank` lies as `Refit.scale_fused` (Python) describes it: each
/// member's scale shard at its weight offset along the fused dim divided by the block, in a
/// row-major buffer whose extent along that dim is the members' scale extents added up.
fn check_fused_scales(refit: &Refit, f: &Fused, rank: usize, buffer: &reshard::batch::Buffer) {
    let layouts = refit.member_layouts(f, |t| &t.dst);
    let offsets = f.local_offsets(&layouts, rank).unwrap();
    let boxes: Vec<_> = f
        .members
        .iter()
        .map(|&m| {
            let plan = refit.quant_plan(m).unwrap();
            plan.dst_scale_box(&refit.tensors[m].dst, rank).unwrap()
        })
        .collect();
    let lead = refit.quant_plan(f.members[0]).unwrap();
    let (block, scale) = (lead.grid.block()[f.dim], lead.scale_bytes());
    let mut extent = boxes[0].extent.clone();
    extent[f.dim] = boxes.iter().map(|b| b.extent[f.dim]).sum();
    for p in &buffer.pieces {
        let m = f.members.iter().position(|&m| m == p.tensor).unwrap();
        let mut at = 0;
        for (d, &n) in extent.iter().enumerate() {
            let mut c = p.region.offset[d] - boxes[m].offset[d];
            if d == f.dim {
                c += offsets[m] / block;
            }
            at = at * n + c;
        }
        assert_eq!(
            p.bytes.start as u64,
            at * scale as u64,
            "{} on rank {rank}",
            buffer.name
        );
    }
}

/// A whole refit into fp8 run as one batch between threads: every fp8 value of every
/// destination piece, in vLLM's fused buffers (`qkv_proj`, `gate_up_proj`, the experts' `w13`)
/// too, and every scale of every scale buffer (fused like the weights, under the engine's
/// names) equal to the whole tensor quantized by the naive reference, cut at the piece.
#[test]
fn quantized_refit_in_process_matches_the_reference() {
    let scratch = common::temp_dir("refit-quant-threads");
    let dir = scratch.path();
    let moe = common::tiny_moe_config(dir);
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
        (moe.clone(), "tp=2,ep=2", "tp=2", "fp8-block:8x8", 2 * 7),
    ] {
        let case = format!("{} {train} -> {infer}", config.display());
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
        assert_eq!(q.tensors(), quantized, "{case}");
        let batch = refit_batch(&refit);
        let fill_of = |i: usize| match refit.quant_plan(i) {
            Some(_) => Fill::Normal { seed: i as u64 },
            None => Fill::Hash { seed: i as u64 },
        };
        // the quantized weights, whole, quantized naively
        let want: Vec<_> = refit
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let qp = refit.quant_plan(i)?;
                let whole = LayoutSpec::parse("mesh=1 place=R")
                    .unwrap()
                    .resolve(t.src.shape(), t.src.dtype(), 0)
                    .unwrap();
                let tensor = fill_of(i).shard(&whole, 0).unwrap().unwrap();
                Some(quantize_tensor(qp.quant, &qp.grid, t.src.dtype(), &tensor).unwrap())
            })
            .collect();
        let (mut src, mut dst, mut scales) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        let mut amax = 0;
        for r in 0..batch.world() {
            let rb = batch.rank_batch(r).unwrap();
            amax += rb.amax.len();
            let mut bufs: Vec<Vec<u8>> = rb.src.iter().map(|b| vec![0u8; b.len]).collect();
            for (b, bytes) in rb.src.iter().zip(&mut bufs) {
                for p in &b.pieces {
                    let l = &batch.tensors()[p.tensor].src;
                    fill_of(p.tensor).fill_region(l, &p.region, &mut bytes[p.bytes.clone()]);
                }
            }
            src.insert(r, bufs);
            dst.insert(
                r,
                rb.dst.iter().map(|b| vec![0u8; b.len]).collect::<Vec<_>>(),
            );
            scales.insert(
                r,
                rb.scales
                    .iter()
                    .map(|b| vec![0u8; b.len])
                    .collect::<Vec<_>>(),
            );
        }
        run_local_batch(&batch, &src, &mut dst, &mut scales, &ExecOptions::default()).unwrap();
        let mut fused_scales = 0;
        for r in 0..batch.world() {
            let rb = batch.rank_batch(r).unwrap();
            for (b, bytes) in rb.dst.iter().zip(&dst[&r]) {
                for p in &b.pieces {
                    let got = &bytes[p.bytes.clone()];
                    match &want[p.tensor] {
                        Some(w) => assert!(w.values_of(&p.region) == got, "{case}: {}", b.name),
                        None => fill_of(p.tensor)
                            .verify_region(&batch.tensors()[p.tensor].dst, &p.region, got, (r, 0))
                            .unwrap(),
                    }
                }
            }
            for (b, bytes) in rb.scales.iter().zip(&scales[&r]) {
                for p in &b.pieces {
                    let w = want[p.tensor].as_ref().unwrap();
                    let got = &bytes[p.bytes.clone()];
                    assert!(w.scales_of(&p.region) == got, "{case}: rank {r} {}", b.name);
                }
                // a fused scale buffer is the engine's, named after its weights' buffer
                if b.pieces.iter().any(|p| p.tensor != b.pieces[0].tensor) {
                    let name = scale_name(&b.name);
                    assert!(q.fused.iter().any(|f| f.name == name), "{case}: {name}");
                    let f = refit.dst_fused.iter().find(|f| f.name == b.name).unwrap();
                    check_fused_scales(&refit, f, r, b);
                    fused_scales += 1;
                }
            }
        }
        assert!(fused_scales > 0, "{case}");
        // FSDP's flat shards of 64 rows over 3 ranks cut the 16-row blocks
        assert_eq!(amax > 0, train.contains("fsdp"), "{case}");
    }
}

/// `refit --run` into fp8 over processes, tcp and shm: every rank's fp8 values and scales,
/// in fused buffers too, verified against the naive quantizer, gather+broadcast's bf16
/// copies against the fill; the wire carries the planned fp8 values and scales, and each
/// inference rank's scale buffers add up to the planned scale bytes (and, colocated, the
/// scales a rank copies to itself besides).
#[test]
fn quantized_refit_runs_over_processes() {
    let scratch = common::temp_dir("refit-quant");
    let dir = scratch.path();
    let qwen = qwen_layer(dir);
    let tiny = tiny_qwen(dir);
    let moe = common::tiny_moe_config(dir);
    for (model, quant, train, infer, transport, colocated) in [
        (&qwen, "fp8-block", "tp=2", "tp=2", "shm", false),
        (
            &tiny,
            "fp8-block:16x16",
            "dp=3,fsdp=3",
            "tp=2",
            "tcp",
            false,
        ),
        (
            &tiny,
            "fp8-block:16x16",
            "tp=2,pp=2",
            "tp=2,dp=2",
            "shm",
            false,
        ),
        (
            &moe,
            "fp8-block:8x8",
            "tp=2,ep=2,pp=2",
            "tp=2",
            "tcp",
            false,
        ),
        (
            &moe,
            "fp8-block:8x8:e5m2",
            "tp=2,ep=2",
            "tp=2,ep=2",
            "shm",
            false,
        ),
        (&moe, "fp8-block:8x8", "tp=2,ep=2", "tp=2", "shm", true),
    ] {
        let ranks = match colocated {
            true => Ranks::Colocated,
            false => Ranks::Disjoint,
        };
        let world: u64 = Refit::new(
            &Model::load(model.to_str().unwrap()).unwrap(),
            &Training::parse(train).unwrap(),
            &Inference::parse(infer).unwrap(),
            &Rules::default(),
            ranks,
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
            .args(colocated.then_some("--colocated"))
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
        let u = |v: &serde_json::Value| v.as_u64().unwrap();
        match colocated {
            false => assert_eq!(run["scale_bytes"], planned["scale_bytes"], "{case}: {j}"),
            true => assert!(
                u(&run["scale_bytes"]) > u(&planned["scale_bytes"]),
                "{case}: {j}"
            ),
        }
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
