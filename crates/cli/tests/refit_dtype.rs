//! A refit with a precision change on the command line (`refit --train-dtype`,
//! `--infer-dtype`): fp32 master weights into a bf16 engine, planned (wire bytes in the
//! inference dtype, gather+broadcast in the training dtype), priced, refused for dtypes that
//! do not convert, and run over processes with every byte checked against the fill cast as
//! torch's `.to()` casts it, fp8 weights quantized from f32 included.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{EXE, text, wait_bounded};
use serde_json::Value;

fn reshard(args: &[&str]) -> Output {
    Command::new(EXE)
        .args(args)
        .output()
        .expect("the reshard binary runs")
}

fn json_of(args: &[&str]) -> Value {
    let out = reshard(args);
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

const QWEN: [&str; 7] = [
    "refit",
    "--model",
    "qwen3-0.6b",
    "--train",
    "tp=2",
    "--infer",
    "tp=2",
];

fn qwen(more: &[&'static str]) -> Vec<&'static str> {
    QWEN.iter().chain(more).copied().collect()
}

/// Qwen3-0.6B (596,049,920 parameters) from f32 TP2 into bf16 TP2 on two other ranks: the
/// wire carries every inference shard once in bf16 (the norms twice, replicated), exactly
/// what the bf16 refit moves; the weights and gather+broadcast are counted in f32.
#[test]
fn f32_into_bf16_plans_wire_bytes() {
    let bf16 = json_of(&qwen(&["--json"]));
    let cast = json_of(&qwen(&["--train-dtype", "f32", "--json"]));
    assert_eq!(
        (&cast["train_dtype"], &cast["infer_dtype"]),
        (&"f32".into(), &"bf16".into())
    );
    assert_eq!(
        (&bf16["train_dtype"], &bf16["infer_dtype"]),
        (&"bf16".into(), &"bf16".into())
    );
    assert_eq!(cast["params"], 596_049_920u64);
    assert_eq!(cast["weight_bytes"], 4 * 596_049_920u64);
    assert_eq!(
        cast["gather_broadcast"]["logical_payload_bytes"],
        8 * 596_049_920u64
    );
    let r = &cast["reshard"];
    assert_eq!(r["bytes_remote"], 1_192_230_912u64);
    assert_eq!(r["bytes_local"], 0);
    assert_eq!(r["messages"], 620);
    assert_eq!(r["max_rank_send_bytes"], 596_115_456u64);
    assert_eq!(r["max_rank_recv_bytes"], 596_115_456u64);
    assert_eq!(r, &bf16["reshard"]);
    // the baseline moves f32: twice the bf16 refit's baseline
    assert_eq!(cast["gather_broadcast"]["bytes"], 7_152_336_896u64);
    assert_eq!(
        cast["gather_broadcast"]["bytes"].as_u64().unwrap(),
        2 * bf16["gather_broadcast"]["bytes"].as_u64().unwrap()
    );
    // an f32 engine receives twice as much
    let f32 = json_of(&qwen(&[
        "--train-dtype",
        "f32",
        "--infer-dtype",
        "f32",
        "--json",
    ]));
    assert_eq!(f32["reshard"]["bytes_remote"], 2 * 1_192_230_912u64);
    assert_eq!(
        f32["gather_broadcast"]["bytes"],
        cast["gather_broadcast"]["bytes"]
    );
    // the text report says both
    let out = reshard(&qwen(&["--train-dtype", "float32"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    assert!(
        report.contains("f32 in training -> bf16 in inference"),
        "{report}"
    );
}

/// `--simulate` prices reshard's wire bytes (bf16: as fast as the bf16 refit) and
/// gather+broadcast's f32.
#[test]
fn simulate_prices_wire_bytes() {
    let bf16 = json_of(&qwen(&["--simulate", "h100", "--json"]));
    let cast = json_of(&qwen(&[
        "--train-dtype",
        "f32",
        "--simulate",
        "h100",
        "--json",
    ]));
    let s = |j: &Value, key: &str| j["simulation"][key].as_f64().unwrap();
    assert_eq!(s(&cast, "reshard_s"), s(&bf16, "reshard_s"));
    assert!(
        s(&cast, "gather_broadcast_s") > s(&bf16, "gather_broadcast_s"),
        "{cast} {bf16}"
    );
}

/// Dtypes a refit does not convert between are refused with exit 2, naming the flag and the
/// value, before anything is planned or moved (also with `--run`).
#[test]
fn non_float_dtypes_are_refused() {
    for (flag, value, says) in [
        ("--train-dtype", "i32", "float dtypes only"),
        ("--infer-dtype", "fp8e4m3", "--infer-quant"),
        ("--infer-dtype", "bool", "float dtypes only"),
        ("--train-dtype", "f31", "not a dtype"),
    ] {
        for run in [false, true] {
            let mut args = qwen(&[flag, value]);
            if run {
                args.extend(["--run", "--transport", "tcp"]);
            }
            let out = reshard(&args);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
            assert!(err.contains(&format!("{flag}: `{value}`: ")), "{err}");
            assert!(err.contains(says), "{err}");
            assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
        }
    }
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

/// Launches `refit --run --json` on `world` processes and returns its JSON.
fn run(model: &Path, world: usize, args: &[&str], case: &str) -> Value {
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
        .args(args)
        .args([
            "--run",
            "--json",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--timeout",
            "60",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(300), case);
    assert!(out.status.success(), "{case}: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The refit run for real over processes: the senders cast while they pack (the wire carries
/// the planned bytes of the inference dtype), gather+broadcast moves the training dtype and
/// its receivers cast; both verified byte for byte against the fill cast as torch casts it,
/// fused buffers, colocated ranks and packed broadcasts included.
#[test]
fn cast_refits_run_over_processes() {
    let scratch = common::temp_dir("refit-dtype");
    let tiny = tiny_qwen(scratch.path());
    for (world, args) in [
        (
            4,
            &[
                "--train",
                "tp=2",
                "--infer",
                "tp=2",
                "--train-dtype",
                "f32",
                "--transport",
                "shm",
            ][..],
        ),
        (
            4,
            &[
                "--train",
                "tp=2,pp=2",
                "--infer",
                "dp=2",
                "--infer-dtype",
                "f32",
                "--colocated",
                "--transport",
                "shm",
            ],
        ),
        (
            5,
            &[
                "--train",
                "dp=3,fsdp=3",
                "--infer",
                "tp=2",
                "--train-dtype",
                "f64",
                "--infer-dtype",
                "f16",
                "--transport",
                "tcp",
                "--pack-below",
                "0",
            ],
        ),
    ] {
        let case = args.join(" ");
        let j = run(&tiny, world, args, &case);
        let (run, planned) = (&j["run"], &j["reshard"]);
        assert_eq!(run["verified"], true, "{case}: {run}");
        assert_ne!(j["train_dtype"], j["infer_dtype"], "{case}");
        let u = |v: &Value| v.as_u64().unwrap();
        assert_eq!(
            u(&run["reshard"]["wire_bytes"]),
            u(&planned["bytes_remote"]),
            "{case}: {j}"
        );
        assert_eq!(
            u(&run["dst_bytes"]),
            u(&planned["bytes_remote"]) + u(&planned["bytes_local"]),
            "{case}"
        );
        if !case.contains("colocated") {
            assert_eq!(
                u(&run["gather_broadcast"]["wire_bytes"]),
                u(&j["gather_broadcast"]["bytes"]),
                "{case}: {j}"
            );
        }
    }
}

/// fp8 weights quantized straight from f32 master weights, the engine's other tensors
/// (norms, embeddings, lm_head) cast into f16: every fp8 value and scale checked against the
/// naive quantizer of the f32 fill, every other byte against the fill cast to f16.
#[test]
fn f32_into_fp8_runs_over_processes() {
    let scratch = common::temp_dir("refit-dtype-fp8");
    let tiny = tiny_qwen(scratch.path());
    for transport in ["tcp", "shm"] {
        let args = [
            "--train",
            "tp=2",
            "--infer",
            "tp=2",
            "--train-dtype",
            "f32",
            "--infer-dtype",
            "f16",
            "--infer-quant",
            "fp8-block:16x16",
            "--transport",
            transport,
        ];
        let j = run(&tiny, 4, &args, transport);
        let (run, planned) = (&j["run"], &j["reshard"]);
        assert_eq!(run["verified"], true, "{transport}: {run}");
        assert_eq!(
            (&j["train_dtype"], &j["infer_dtype"]),
            (&"f32".into(), &"f16".into())
        );
        assert_eq!(j["quant"]["dtype"], "fp8e4m3");
        let u = |v: &Value| v.as_u64().unwrap();
        assert_eq!(run["scale_bytes"], planned["scale_bytes"], "{j}");
        assert_eq!(
            u(&run["reshard"]["wire_bytes"]),
            u(&planned["bytes_remote"]) + u(&planned["scale_bytes"]),
            "{j}"
        );
        // the same refit from bf16 moves the same bytes: the wire carries fp8 and f16
        let bf16 = json_of(&[
            "refit",
            "--model",
            tiny.to_str().unwrap(),
            "--train",
            "tp=2",
            "--infer",
            "tp=2",
            "--infer-dtype",
            "f16",
            "--infer-quant",
            "fp8-block:16x16",
            "--json",
        ]);
        assert_eq!(bf16["reshard"]["bytes_remote"], planned["bytes_remote"]);
    }
}

/// Ranks of one `refit --run` job that disagree on a side's dtype are refused at
/// rendezvous, every one of them with exit 2 naming the rank and the flag, before any byte
/// moves.
#[test]
fn ranks_that_disagree_on_a_dtype_are_refused() {
    let scratch = common::temp_dir("refit-dtype-agree");
    let tiny = tiny_qwen(scratch.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let children: Vec<_> = (0..4)
        .map(|rank| {
            let dtype = if rank == 1 { "f32" } else { "bf16" };
            Command::new(EXE)
                .args(["refit", "--model"])
                .arg(&tiny)
                .args(["--train", "tp=2", "--infer", "tp=2", "--train-dtype", dtype])
                .args([
                    "--run",
                    "--transport",
                    "tcp",
                    "--iters",
                    "1",
                    "--timeout",
                    "120",
                ])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RESHARD_TOKEN", "refit-dtype-test")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let out = wait_bounded(child, Duration::from_secs(60), "ranks that disagree");
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {rank}: {err}");
        assert!(
            err.contains("rank 1 runs --train-dtype"),
            "rank {rank}: {err}"
        );
        assert!(err.contains("nothing was moved"), "rank {rank}: {err}");
    }
}
