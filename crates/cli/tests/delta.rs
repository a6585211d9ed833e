//! `reshard run --delta`: streams of versions over threads, tcp and shm, checked against the
//! evolving fill every version, and the flags' refusals.

use std::process::Command;

mod common;

use common::{EXE, Lcg, RandomRun, text};

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)))
}

/// The reasons a refit of `method` at `version` sent something dense.
fn dense_reasons(json: &serde_json::Value, version: u64, method: &str) -> Vec<String> {
    let refit = json["refits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["version"] == version && r["method"] == method)
        .unwrap_or_else(|| panic!("no {method} refit of version {version}: {json}"));
    refit["dense_to"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d[1].as_str().unwrap().to_string())
        .collect()
}

fn wire(json: &serde_json::Value, version: u64, method: &str) -> u64 {
    json["refits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["version"] == version && r["method"] == method)
        .unwrap()["wire_bytes"]
        .as_u64()
        .unwrap()
}

/// Random layouts (uneven, replicated, overlapping ranks, up to 3-D, several dtypes) as
/// streams of deltas at every density, in one process and one process per rank over tcp and
/// shm, with and without checksums: every version of every method verifies, the first is
/// dense for want of a base, and later ones dense only where the encoding is no smaller.
#[test]
fn random_delta_streams_verify_over_every_transport() {
    let mut rng = Lcg(0xde17a);
    let densities = ["0", "0.0001", "0.01", "0.5", "1"];
    for case in 0..15 {
        let run = RandomRun::new(&mut rng, case, "delta");
        let transport = ["local", "tcp", "shm"][case as usize % 3];
        let density = densities[rng.below(5) as usize];
        let mut args: Vec<String> = [
            "run",
            "--shape",
            &run.shape,
            "--dtype",
            run.dtype,
            "--src",
            &run.src,
            "--dst",
            &run.dst,
            "--delta",
            "--steps",
            "4",
            "--delta-density",
            density,
            "--delta-methods",
            "delta,dense,gather-broadcast",
            "--verify",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if rng.below(2) == 1 {
            args.push("--checksum".into());
        }
        let out = match transport {
            "local" => Command::new(EXE).args(&args).output().unwrap(),
            t => Command::new(EXE)
                .args(["launch", "--nproc", &run.world.to_string(), "--"])
                .args(&args)
                .args(["--transport", t])
                .output()
                .unwrap(),
        };
        let json = json_of(&out);
        let what = format!("case {case} over {transport}: {args:?}");
        assert_eq!(json["verified"], true, "{what}");
        assert_eq!(json["refits"].as_array().unwrap().len(), 12, "{what}");
        assert!(
            dense_reasons(&json, 1, "delta")
                .iter()
                .all(|r| r == "no base"),
            "{what}"
        );
        for version in 2..=4 {
            for method in ["delta", "gather-broadcast"] {
                let reasons = dense_reasons(&json, version, method);
                assert!(
                    reasons.iter().all(|r| r == "not smaller"),
                    "{what}: {reasons:?}"
                );
            }
            // fences and headers aside, a delta never sends more than the values
            if density == "0" {
                assert!(wire(&json, version, "delta") <= wire(&json, version, "dense").max(4096));
            }
        }
    }
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(EXE).args(args).output().unwrap()
}

const TENSOR: [&str; 8] = [
    "run",
    "--shape",
    "256x256",
    "--dtype",
    "bf16",
    "--src",
    "mesh=2 place=S(0)",
    "--dst",
];

#[test]
fn sparse_versions_send_a_fraction_of_dense_and_anchors_send_everything() {
    let mut args = TENSOR.to_vec();
    args.extend([
        "mesh=4 place=S(1) ranks=2..6",
        "--delta",
        "--steps",
        "5",
        "--delta-density",
        "0.01",
        "--delta-anchor",
        "4",
        "--verify",
        "--json",
    ]);
    let json = json_of(&run(&args));
    assert_eq!(json["verified"], true);
    for v in [2, 3, 5] {
        assert!(
            wire(&json, v, "delta") * 10 < wire(&json, v, "dense"),
            "{json}"
        );
        assert!(dense_reasons(&json, v, "delta").is_empty());
    }
    assert_eq!(dense_reasons(&json, 4, "delta"), vec!["anchor"; 4]);
    assert!(wire(&json, 4, "delta") >= wire(&json, 4, "dense"));
}

/// f32 masters trained with a small learning rate, sent as bf16: what changes in bf16 is
/// sent, and every version verifies against the masters cast.
#[test]
fn training_like_updates_of_f32_masters_cast_to_bf16_verify() {
    let out = run(&[
        "run",
        "--shape",
        "128x256",
        "--dtype",
        "f32",
        "--dst-dtype",
        "bf16",
        "--fill",
        "normal:3",
        "--src",
        "mesh=2 place=S(1)",
        "--dst",
        "mesh=2 place=S(0) ranks=2..4",
        "--delta",
        "--steps",
        "3",
        "--delta-lr",
        "1e-5",
        "--verify",
        "--json",
    ]);
    let json = json_of(&out);
    assert_eq!(json["verified"], true);
    let changed = json["changed_fraction"].as_f64().unwrap();
    assert!(changed > 0.0 && changed < 0.5, "{json}");
    assert!(wire(&json, 2, "delta") < wire(&json, 2, "dense"));
}

#[test]
fn delta_flags_are_checked_before_any_byte_moves() {
    let dst = "mesh=2 place=S(1) ranks=2..4";
    let refused = |extra: &[&str], needle: &str| {
        let mut args = TENSOR.to_vec();
        args.push(dst);
        args.extend(extra);
        let out = run(&args);
        assert!(!out.status.success(), "{extra:?} ran");
        let err = text(&out.stderr);
        assert!(err.contains(needle), "{extra:?}: {err}");
    };
    refused(&["--steps", "3"], "--delta");
    refused(&["--delta", "--delta-anchor", "0"], "--delta-anchor: 0");
    refused(
        &["--delta", "--delta-methods", "delta,fast"],
        "--delta-methods: fast",
    );
    refused(&["--delta", "--delta-density", "2"], "--delta-density: 2");
    refused(&["--delta", "--delta-lr", "0.1"], "--fill");
    refused(&["--delta", "--steps", "0"], "--steps");
}

/// `refit --run --delta`: a whole model as a stream of versions, into bf16 and into an fp8
/// engine (values and scales diffed after quantizing), over tcp and shm: every version
/// verified, the first dense for want of a base, the later ones far smaller on the wire.
#[test]
fn refit_streams_of_a_whole_model_verify() {
    let dir = common::temp_dir("delta-refit");
    let model = common::tiny_qwen3(dir.path());
    for (transport, quant, update) in [
        ("tcp", "none", ["--delta-density", "0.01"]),
        ("shm", "fp8-block:8x8", ["--delta-lr", "1e-4"]),
    ] {
        let out = Command::new(EXE)
            .args(["launch", "--nproc", "4", "--", "refit", "--model"])
            .arg(&model)
            .args([
                "--train",
                "fsdp=2",
                "--infer",
                "tp=2",
                "--infer-quant",
                quant,
            ])
            .args([
                "--run",
                "--delta",
                "--steps",
                "3",
                "--json",
                "--transport",
                transport,
            ])
            .args(update)
            .output()
            .unwrap();
        let json = json_of(&out);
        let run = &json["run"];
        assert_eq!(run["verified"], true, "{json}");
        let versions = run["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 3);
        let reasons = |v: &serde_json::Value| -> Vec<String> {
            v["dense_to"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d[1].as_str().unwrap().to_string())
                .collect()
        };
        assert!(reasons(&versions[0]).iter().all(|r| r == "no base"));
        for v in &versions[1..] {
            assert!(reasons(v).iter().all(|r| r == "not smaller"), "{v}");
            let (delta, dense) = (
                v["delta_wire_bytes"].as_u64().unwrap(),
                v["dense_wire_bytes"].as_u64().unwrap(),
            );
            assert!(delta < dense, "{v}");
        }
        assert!(run["base_bytes_per_rank"].as_u64().unwrap() > 0);
    }
}

/// A destination that restarts (a new replica, its shard and state lost) is sent its regions
/// dense in the same refit, the report says which rank and why, and every version verifies,
/// in one process and one process per rank.
#[test]
fn restarted_ranks_are_sent_dense_and_verify_on_every_transport() {
    for transport in ["local", "tcp", "shm"] {
        let mut args = TENSOR.to_vec();
        args.extend([
            "mesh=2x2 place=R,S(1) ranks=2..6",
            "--delta",
            "--steps",
            "4",
            "--delta-restart",
            "3@3",
            "--delta-restart",
            "5@2",
            "--delta-methods",
            "delta,gather-broadcast",
            "--verify",
            "--json",
        ]);
        let out = match transport {
            "local" => run(&args),
            t => Command::new(EXE)
                .args(["launch", "--nproc", "6", "--"])
                .args(&args)
                .args(["--transport", t])
                .output()
                .unwrap(),
        };
        let json = json_of(&out);
        assert_eq!(json["verified"], true, "{transport}");
        let ranks = |version: u64| -> Vec<u64> {
            json["refits"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["version"] == version && r["method"] == "delta")
                .unwrap()["dense_to"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d[1] == "holds another version")
                .map(|d| d[0].as_u64().unwrap())
                .collect()
        };
        assert_eq!(ranks(2), vec![5], "{transport}: {json}");
        assert_eq!(ranks(3), vec![3], "{transport}: {json}");
        assert!(ranks(4).is_empty(), "{transport}");
    }
}

/// A relay plan (`--hosts`) as deltas, in one process and over tcp and shm: the relaying
/// ranks forward what their hops came as, and every version of every method verifies.
#[test]
fn relay_plans_refit_as_deltas() {
    for transport in ["local", "tcp", "shm"] {
        let mut args = TENSOR.to_vec();
        args.extend([
            "mesh=2x2 place=R,S(0) ranks=2..6",
            "--hosts",
            "0,0,1,1,1,1",
            "--delta",
            "--steps",
            "3",
            "--delta-methods",
            "delta,dense,gather-broadcast",
            "--verify",
            "--checksum",
            "--json",
        ]);
        let out = match transport {
            "local" => run(&args),
            t => Command::new(EXE)
                .args(["launch", "--nproc", "6", "--"])
                .args(&args)
                .args(["--transport", t])
                .output()
                .unwrap(),
        };
        let json = json_of(&out);
        assert_eq!(json["verified"], true, "{transport}");
        for v in 2..=3 {
            assert!(
                dense_reasons(&json, v, "delta").is_empty(),
                "{transport}: {json}"
            );
            assert!(
                wire(&json, v, "delta") * 4 < wire(&json, v, "dense"),
                "{transport}"
            );
        }
    }
}
