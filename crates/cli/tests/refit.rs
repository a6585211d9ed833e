//! Whole-model refits: every plan of every shipped config, for a set of parallelism pairs,
//! tiles every destination shard exactly once from ranks that hold the data; the per-rank
//! planner agrees with the full plan; `reshard refit` prints the design notes' JSON and names
//! bad input.

use std::collections::BTreeMap;
use std::process::{Command, Output};

use reshard::model::{Inference, Model, Ranks, Refit, Rules, SHIPPED, Training};
use reshard::{Plan, PlanOptions, Rank, Transfer};
use serde_json::Value;

/// (training, inference, colocated): small enough for debug builds, covering TP, CP, DP, PP,
/// FSDP, EP with and without expert TP, vLLM's EP, kv-head replication and colocated ranks.
const PAIRS: [(&str, &str, bool); 5] = [
    ("tp=2,pp=2", "tp=4", false),
    ("tp=2,cp=2,dp=2,ep=4,pp=2", "tp=8,dp=2", false),
    ("tp=2,dp=4,ep=2,etp=2,fsdp=2", "tp=2,dp=2,pp=2,ep", false),
    ("ep=8,pp=4,dp=8", "tp=4,dp=4", false),
    ("tp=2,dp=2", "tp=2,dp=2", true),
];

/// The destination of every transfer is tiled exactly once, by boxes its sender holds.
fn check_tiles(name: &str, plan: &Plan) {
    let (src, dst) = (plan.src(), plan.dst());
    let mut by_dst: BTreeMap<Rank, Vec<&Transfer>> = BTreeMap::new();
    for t in plan.transfers() {
        assert!(!t.region.is_empty(), "{name}: empty transfer {t:?}");
        by_dst.entry(t.dst).or_default().push(t);
    }
    for &rank in dst.mesh().ranks() {
        let target = dst.local_region(rank).unwrap();
        let mine = by_dst.remove(&rank).unwrap_or_default();
        let mut covered = 0;
        for (i, t) in mine.iter().enumerate() {
            assert!(target.contains(&t.region), "{name}: {t:?} outside {target}");
            let held = src.local_region(t.src);
            assert!(
                held.is_some_and(|h| h.contains(&t.region)),
                "{name}: rank {} sends {t:?} it does not hold",
                t.src
            );
            for u in &mine[i + 1..] {
                assert!(
                    t.region.intersect(&u.region).is_none(),
                    "{name}: {t:?} overlaps {u:?}"
                );
            }
            covered += t.region.volume();
        }
        assert_eq!(covered, target.volume(), "{name}: rank {rank} is not tiled");
    }
    assert!(by_dst.is_empty(), "{name}: transfers to non-destinations");
}

fn refit(model: &Model, train: &str, infer: &str, colocated: bool) -> Refit {
    let ranks = if colocated {
        Ranks::Colocated
    } else {
        Ranks::Disjoint
    };
    Refit::new(
        model,
        &Training::parse(train).unwrap(),
        &Inference::parse(infer).unwrap(),
        &Rules::default(),
        ranks,
    )
    .unwrap_or_else(|e| panic!("{} {train} -> {infer}: {e}", model.name))
}

#[test]
fn every_shipped_model_tiles_every_destination() {
    let options = PlanOptions::default();
    for (name, _) in SHIPPED {
        let model = Model::load(name).unwrap();
        for (train, infer, colocated) in PAIRS {
            let refit = refit(&model, train, infer, colocated);
            let plans = refit.plans(&options).unwrap();
            assert_eq!(plans.len(), model.params.len());
            let mut remote = 0;
            for (t, plan) in refit.tensors.iter().zip(&plans) {
                check_tiles(&format!("{name} {train} -> {infer}: {}", t.name), plan);
                remote += plan.totals().bytes_remote;
            }
            // every inference rank ends up with its shards: what it receives or copies
            let totals = refit.totals_of(&plans, 0.0).unwrap();
            let dst_bytes: u64 = refit.tensors.iter().map(|t| t.dst.shard_bytes()).sum();
            assert_eq!(
                totals.bytes_remote + totals.bytes_local,
                dst_bytes,
                "{name}"
            );
            assert_eq!(totals.bytes_remote, remote, "{name}");
            assert_eq!(totals.weight_bytes, model.weight_bytes());
            assert_eq!(totals.params, model.num_params());
            assert!(
                totals.gather_broadcast_bytes >= totals.bytes_remote,
                "{name}"
            );
            if colocated {
                assert!(
                    totals.bytes_local > 0,
                    "{name}: colocated ranks copy locally"
                );
            } else {
                assert_eq!(totals.bytes_local, 0, "{name}");
            }
        }
    }
}

#[test]
fn one_rank_plans_agree_with_the_full_plan() {
    let model = Model::load("qwen3-30b-a3b").unwrap();
    let options = PlanOptions::default();
    let (train, infer, _) = PAIRS[2];
    let refit = refit(&model, train, infer, false);
    let plans = refit.plans(&options).unwrap();
    for rank in [0, 5, 7, 8, 11, 15] {
        let mine = refit.rank_plans(rank, &options).unwrap();
        for ((t, plan), part) in refit.tensors.iter().zip(&plans).zip(&mine) {
            assert_eq!(&plan.for_rank(rank), part, "rank {rank}, {}", t.name);
        }
    }
}

#[test]
fn summary_matches_the_plans() {
    let model = Model::load("qwen3-0.6b").unwrap();
    let options = PlanOptions::default();
    let refit = refit(&model, "tp=2,pp=2", "tp=2,dp=2", false);
    let plans = refit.plans(&options).unwrap();
    let mut a = refit.summary(&options).unwrap();
    let b = refit.totals_of(&plans, a.plan_seconds).unwrap();
    a.plan_seconds = b.plan_seconds;
    assert_eq!(a, b);
    // per-rank maxima are sums over tensors: at least the largest single tensor's
    let largest = plans
        .iter()
        .map(|p| p.totals().max_rank_recv_bytes)
        .max()
        .unwrap();
    assert!(a.max_rank_recv_bytes > largest);
    // TP2 x DP2 inference on separate ranks: every inference shard arrives once, that is the
    // whole model twice, plus the copies of what TP replicates (norms)
    let dst_bytes: u64 = refit.tensors.iter().map(|t| t.dst.shard_bytes()).sum();
    assert_eq!(a.bytes_remote, dst_bytes);
    let norms: u64 = model
        .params
        .iter()
        .filter(|p| p.name.ends_with("norm.weight"))
        .map(|p| p.bytes())
        .sum();
    assert_eq!(dst_bytes, 2 * model.weight_bytes() + 2 * norms);
}

fn reshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(args)
        .output()
        .expect("the reshard binary runs")
}

#[test]
fn cli_json_on_every_shipped_model() {
    for (name, _) in SHIPPED {
        let out = reshard(&[
            "refit",
            "--model",
            name,
            "--train",
            "ep=8,pp=4,dp=8",
            "--infer",
            "tp=8,dp=2",
            "--json",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        let model = Model::load(name).unwrap();
        assert_eq!(json["model"], name);
        assert_eq!(json["tensors"], model.params.len());
        assert_eq!(json["params"], model.num_params());
        assert_eq!(json["weight_bytes"], model.weight_bytes());
        assert_eq!(json["train_ranks"], 32);
        assert_eq!(json["infer_ranks"], 16);
        assert!(json["plan_seconds"].as_f64().unwrap() >= 0.0);
        // every inference shard arrives once: dense weights twice (two replicas), experts
        // once (vLLM's expert layers span both replicas)
        // deepseek-v3-fp8's config quantizes its linear weights: fp8 on the wire
        let mut lib = refit(&model, "ep=8,pp=4,dp=8", "tp=8,dp=2", false);
        if let Some(q) = &model.quant {
            lib = lib.quantized(q).unwrap();
        }
        let dst_bytes: u64 = lib.tensors.iter().map(|t| t.dst.shard_bytes()).sum();
        assert_eq!(json["reshard"]["bytes_remote"], dst_bytes);
        let experts: u64 = model
            .params
            .iter()
            .filter(|p| p.name.contains(".experts."))
            .map(|p| p.bytes())
            .sum();
        if model.quant.is_none() {
            assert!(dst_bytes > 2 * model.weight_bytes() - experts, "{name}");
        }
        assert_eq!(json["reshard"]["bytes_local"], 0);
        for key in ["messages", "max_rank_send_bytes", "max_rank_recv_bytes"] {
            assert!(json["reshard"][key].as_u64().unwrap() > 0, "{name}: {key}");
        }
        assert_eq!(
            json["gather_broadcast"]["logical_payload_bytes"],
            2 * model.weight_bytes()
        );
        assert!(json["gather_broadcast"]["bytes"].as_u64().unwrap() > 2 * model.weight_bytes());
        assert!(json.get("simulation").is_none());
    }
}

#[test]
fn cli_text_report() {
    let out = reshard(&[
        "refit",
        "--model",
        "qwen3-0.6b",
        "--train",
        "tp=2,pp=2",
        "--infer",
        "tp=4",
        "--override",
        "infer:*.o_proj.weight=replicate",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "model              qwen3-0.6b: 310 tensors, 0.60B parameters",
        "training           tp=2,pp=2 -> 4 ranks (0..4)",
        "inference          tp=4 -> 4 ranks (4..8)",
        "gather+broadcast",
        "logical payload",
        "busiest rank       sends",
    ] {
        assert!(text.contains(line), "missing `{line}` in\n{text}");
    }
}

#[test]
fn cli_lists_layouts_and_rules() {
    let out = reshard(&[
        "refit",
        "--model",
        "qwen3-235b-a22b",
        "--train",
        "tp=2,ep=4,dp=2",
        "--infer",
        "tp=8",
        "--layouts",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "model.layers.0.self_attn.k_proj.weight  512x4096 bf16\n  train  kv-column     mesh=2x2 ranks=0..4 place=R,S(0)  (rule `*.self_attn.k_proj.*`)\n  infer  kv-column     mesh=4x2 ranks=4..12 place=S(0),R  (rule `*.self_attn.k_proj.*`)",
        "model.layers.93.mlp.experts.down_proj.weight  128x4096x1536 bf16\n  train  expert-row    mesh=4 ranks=0..4 place=S(0)",
        "fused (infer) model.layers.0.self_attn.qkv_proj.weight = concat(dim 0: model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight)",
        "fused (infer) model.layers.5.mlp.experts.w13_weight = concat(dim 1: ",
    ] {
        assert!(text.contains(line), "missing `{line}`");
    }
}

#[test]
fn cli_errors_name_the_field_and_value() {
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "--model",
                "qwen3-0.6b",
                "--train",
                "tp=2,zp=2",
                "--infer",
                "tp=4",
            ],
            "error: --train: `zp=2`: unknown key (expected tp, cp, ep, etp, dp, pp, fsdp, world)",
        ),
        (
            &[
                "--model",
                "qwen3-0.6b",
                "--train",
                "tp=2",
                "--infer",
                "tp=0",
            ],
            "error: --infer: `tp=0`: must be at least 1",
        ),
        (
            &[
                "--model",
                "qwen3-0.6b",
                "--train",
                "tp=2",
                "--infer",
                "tp=3",
            ],
            "error: --infer: `tp=3`: does not divide the model's 16 attention heads",
        ),
        (
            &[
                "--model",
                "qwen3-0.6b",
                "--train",
                "pp=29",
                "--infer",
                "tp=2",
            ],
            "error: --train: `pp=29`: more stages than the model's 28 layers",
        ),
        (
            &["--model", "gpt-9", "--train", "tp=2", "--infer", "tp=2"],
            "error: --model: `gpt-9` is neither a file, a folder nor a shipped model",
        ),
        (
            &[
                "--model",
                "qwen3-0.6b",
                "--train",
                "tp=2",
                "--infer",
                "tp=2",
                "--override",
                "*norm*=diagonal",
            ],
            "error: --override: `*norm*=diagonal`: unknown kind `diagonal`",
        ),
    ];
    for (args, message) in cases {
        let out = reshard(&[&["refit"], args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with(message), "{args:?}: {err}");
    }
}

/// Writes a safetensors file (zero data) holding `tensors`.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, Vec<u64>)]) {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, shape) in tensors {
        let bytes = 2 * shape.iter().product::<u64>();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.resize(out.len() + at as usize, 0);
    std::fs::write(path, out).unwrap();
}

/// A checkpoint folder (per-expert tensors over two files, an index, a config) gives the same
/// tensors as the config alone, and the same refit.
#[test]
fn cli_reads_a_checkpoint_folder() {
    // removed when the test ends, passing or failing
    let scratch = tempfile::Builder::new()
        .prefix("reshard-refit-ckpt-")
        .tempdir()
        .unwrap();
    let dir = scratch.path();
    let config = r#"{"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
        "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 4, "num_experts": 4, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16"}"#;
    std::fs::write(dir.join("config.json"), config).unwrap();
    let from_config = Model::load(dir.join("config.json").to_str().unwrap()).unwrap();
    // the checkpoint's own naming: one tensor per expert
    let mut tensors: Vec<(String, Vec<u64>)> = Vec::new();
    for p in &from_config.params {
        match p.name.split_once(".experts.") {
            Some((head, tail)) => {
                for e in 0..p.shape[0] {
                    tensors.push((format!("{head}.experts.{e}.{tail}"), p.shape[1..].to_vec()));
                }
            }
            None => tensors.push((p.name.clone(), p.shape.clone())),
        }
    }
    let (a, b) = tensors.split_at(tensors.len() / 2);
    write_safetensors(&dir.join("model-00001-of-00002.safetensors"), a);
    write_safetensors(&dir.join("model-00002-of-00002.safetensors"), b);
    let weight_map: serde_json::Map<String, Value> = a
        .iter()
        .map(|(n, _)| (n.clone(), Value::from("model-00001-of-00002.safetensors")))
        .chain(
            b.iter()
                .map(|(n, _)| (n.clone(), Value::from("model-00002-of-00002.safetensors"))),
        )
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let from_checkpoint = Model::load(dir.to_str().unwrap()).unwrap();
    let mut x: Vec<_> = from_checkpoint.params.clone();
    let mut y: Vec<_> = from_config.params.clone();
    x.sort_by(|p, q| p.name.cmp(&q.name));
    y.sort_by(|p, q| p.name.cmp(&q.name));
    assert_eq!(x, y);
    assert_eq!(from_checkpoint.heads, from_config.heads);

    let json = |model: &str| -> Value {
        let out = reshard(&[
            "refit",
            "--model",
            model,
            "--train",
            "tp=2,ep=2,pp=2",
            "--infer",
            "tp=2,dp=2",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["plan_seconds"] = Value::Null;
        v["model"] = Value::Null;
        v
    };
    assert_eq!(
        json(dir.to_str().unwrap()),
        json(dir.join("config.json").to_str().unwrap())
    );
}
