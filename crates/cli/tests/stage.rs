//! `reshard run --stage` and `refit --run --stage`: refits while every destination rank
//! serves, over threads, tcp and shm, random layouts; each version committed whole on every
//! rank, no pass of an engine seeing a mix of versions, every version verified; and the
//! flags' refusals.

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

/// What a staged stream's JSON must hold whatever the layouts: every version of every method
/// served (committed, or written in place), by every destination rank, none seeing a mix.
/// Each destination rank of a version's report with the commit group it is in.
fn commit_groups(version: &serde_json::Value) -> Vec<(u64, u64)> {
    version["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["rank"].as_u64().unwrap(), r["group"].as_u64().unwrap()))
        .collect()
}

fn check_stream(json: &serde_json::Value, methods: &[&str], steps: u64, what: &str) {
    let versions = json["versions"].as_array().unwrap();
    assert_eq!(
        versions.len() as u64,
        steps * methods.len() as u64,
        "{what}"
    );
    for v in versions {
        let method = v["method"].as_str().unwrap();
        assert!(methods.contains(&method), "{what}: {v}");
        let expected = match method.starts_with("staged") {
            true => "commit",
            false => "in place",
        };
        assert_eq!(v["outcome"], expected, "{what}: {v}");
        for r in v["ranks"].as_array().unwrap() {
            assert_eq!(r["mixed"], false, "{what}: {v}");
            assert_eq!(r["serving"], v["version"], "{what}: {v}");
            if expected == "in place" {
                // the engine could not serve while its shards were written
                assert_eq!(r["passes_during_refit"], 0, "{what}: {v}");
            }
        }
    }
    let summary = json["methods"].as_array().unwrap();
    assert_eq!(summary.len(), methods.len(), "{what}");
    for m in summary {
        assert_eq!(m["mixed"], false, "{what}");
        assert_eq!(m["served"], steps, "{what}");
    }
}

/// Random layouts (uneven, empty and replicated shards, overlapping ranks) as threads and as
/// processes over tcp and shm, dense and as deltas: every version verified.
#[test]
fn staged_streams_of_random_layouts_commit_every_version_whole() {
    let mut rng = Lcg(0x57a9e);
    for case in 0..6 {
        let run = RandomRun::new(&mut rng, case, "stage");
        let transport = ["local", "tcp", "shm"][case as usize % 3];
        let delta = case % 2 == 1;
        let mut args: Vec<String> = [
            "run", "--shape", &run.shape, "--dtype", run.dtype, "--src", &run.src, "--dst",
            &run.dst, "--stage", "--steps", "3", "--verify", "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let methods: &[&str] = match delta {
            true => &["in-place", "staged", "staged-delta"],
            false => &["in-place", "staged"],
        };
        if delta {
            args.push("--delta".into());
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
        let what = format!("case {case} over {transport}: {args:?}");
        assert!(out.status.success(), "{what}\n{}", text(&out.stderr));
        let json = json_of(&out);
        assert_eq!(json["verified"], true, "{what}");
        check_stream(&json, methods, 3, &what);
    }
}

/// A rolling commit: the destination ranks commit in groups, each group's ranks reported
/// with their group; the staged deltas carry patches, the dense staging none.
#[test]
fn a_rolling_commit_goes_group_by_group() {
    let out = Command::new(EXE)
        .args(["launch", "--nproc", "6", "--"])
        .args([
            "run",
            "--shape",
            "96x64",
            "--dtype",
            "bf16",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=2x2 place=R,S(1) ranks=2..6",
            "--stage",
            "--delta",
            "--stage-methods",
            "staged,staged-delta",
            "--rolling",
            "2",
            "--steps",
            "3",
            "--verify",
            "--json",
            "--transport",
            "tcp",
        ])
        .output()
        .unwrap();
    let json = json_of(&out);
    check_stream(&json, &["staged", "staged-delta"], 3, "rolling");
    for v in json["versions"].as_array().unwrap() {
        let groups = commit_groups(v);
        assert_eq!(groups, vec![(2, 0), (3, 0), (4, 1), (5, 1)], "{v}");
        let patches: u64 = v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["patch_bytes"].as_u64().unwrap())
            .sum();
        let staged_delta_later = v["method"] == "staged-delta" && v["version"].as_u64() > Some(1);
        assert_eq!(patches > 0, staged_delta_later, "{v}");
    }
}

/// `refit --run --stage`: a whole model, into bf16 and into an fp8 engine, staged dense and
/// as deltas beside the refit in place, every version of every method verified and alike.
#[test]
fn refits_of_a_whole_model_while_serving_verify() {
    let dir = common::temp_dir("stage-refit");
    let model = common::tiny_qwen3(dir.path());
    for (transport, quant) in [("tcp", "none"), ("shm", "fp8-block:8x8")] {
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
                "--stage",
                "--delta",
                "--steps",
                "3",
                "--json",
                "--transport",
                transport,
            ])
            .output()
            .unwrap();
        let json = json_of(&out);
        let run = &json["run"];
        assert_eq!(run["verified"], true, "{json}");
        check_stream(run, &["in-place", "staged", "staged-delta"], 3, transport);
        let staged = run["methods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["method"] == "staged")
            .unwrap();
        // a shadow of every destination byte of one rank (values and scales)
        assert!(staged["staging_bytes_per_rank"].as_u64().unwrap() > 0);
    }
}

/// The text report reads the result: its table and its summary.
#[test]
fn the_text_report_has_every_version_and_method() {
    let out = Command::new(EXE)
        .args([
            "run",
            "--shape",
            "64x64",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=2 place=S(1)",
            "--stage",
            "--steps",
            "2",
            "--verify",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("verified: yes"), "{stdout}");
    for line in [
        "      1  staged",
        "      2  in-place",
        "pause / in-place refit",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    assert!(!stdout.contains("MIXED"), "{stdout}");
}

fn refused(args: &[&str], expected: &str) {
    let out = Command::new(EXE).args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?}");
    let stderr = text(&out.stderr);
    assert!(stderr.contains(expected), "{args:?}: {stderr}");
}

#[test]
fn bad_stage_flags_are_refused_naming_them() {
    let base = [
        "run",
        "--shape",
        "8x8",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=4 place=S(1)",
    ];
    let with =
        |more: &[&'static str]| -> Vec<&'static str> { base.iter().chain(more).copied().collect() };
    refused(
        &with(&["--steps", "3"]),
        "--steps: 3 is invalid: applies to a stream of refits: add --delta or --stage",
    );
    refused(
        &with(&["--stage", "--stage-methods", "staged-delta"]),
        "--stage-methods: staged-delta is invalid: moves deltas: add --delta",
    );
    refused(
        &with(&["--stage", "--stage-methods", "staged,twice"]),
        "--stage-methods: twice is invalid: expected a list of in-place, staged",
    );
    refused(
        &with(&["--stage", "--rolling", "3"]),
        "--rolling: 3 is invalid: must divide the 4 destination ranks (1 replica) into groups of equal size, each of whole replicas",
    );
    refused(&with(&["--rolling", "2"]), "--stage");
    refused(
        &with(&["--stage", "--quant", "block:2x2", "--dst-dtype", "fp8e4m3"]),
        "--stage",
    );
}

/// What a refused command must show: exit code 2 on every rank (bad input), the message in
/// its standard error, and no report (nothing ran).
fn refused_with_2(out: &std::process::Output, expected: &[&str], what: &str) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
    for e in expected {
        assert!(stderr.contains(e), "{what}: {e}: {stderr}");
    }
    assert!(
        !text(&out.stdout).contains("versions"),
        "{what}: {}",
        text(&out.stdout)
    );
}

/// A rolling commit whose groups would cut an inference replica (a TP replica committed
/// shard by shard, serving a mix of two versions meanwhile) is refused before any byte
/// moves, naming the flag, the value, the replica and the groups it falls into; groups of
/// whole replicas, even of ranks that are not contiguous, run.
#[test]
fn a_rolling_commit_that_cuts_a_replica_is_refused() {
    let dir = common::temp_dir("rolling-cut");
    let dump = dir.path().join("dump");
    let args = |dst: &str, rolling: &str| -> Vec<String> {
        [
            "run",
            "--shape",
            "16x16",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            dst,
            "--stage",
            "--steps",
            "2",
            "--rolling",
            rolling,
            "--verify",
            "--json",
            "--dump",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([dump.display().to_string()])
        .collect()
    };
    // two TP2 replicas on ranks 2..6 in four groups: each replica cut in two
    let cut = args("mesh=2x2 place=R,S(1)", "4");
    let expected = [
        "--rolling: 4 is invalid",
        "cuts the inference replica of ranks 2,3 across commit groups 0 and 1",
        "the 4 destination ranks form 2 replicas",
    ];
    let out = Command::new(EXE).args(&cut).output().unwrap();
    refused_with_2(&out, &expected, "threads");
    let out = Command::new(EXE)
        .args(["launch", "--nproc", "6", "--"])
        .args(&cut)
        .args(["--transport", "tcp"])
        .output()
        .unwrap();
    refused_with_2(&out, &expected, "tcp");
    // the dump folder may be made (checked writable first), but holds no shard
    let dumped = std::fs::read_dir(&dump).map_or(0, |d| d.count());
    assert_eq!(dumped, 0, "nothing written");
    // the replicas along the inner axis (ranks 2,4 and 3,5): two groups of whole replicas
    // run; one TP4 replica in two groups is refused
    let out = Command::new(EXE)
        .args(args("mesh=2x2 place=S(0),R", "2"))
        .output()
        .unwrap();
    let json = json_of(&out);
    check_stream(&json, &["in-place", "staged"], 2, "inner replicas");
    for v in json["versions"].as_array().unwrap() {
        let groups = commit_groups(v);
        if v["method"] == "staged" {
            assert_eq!(groups, vec![(2, 0), (3, 1), (4, 0), (5, 1)], "{v}");
        }
    }
    let out = Command::new(EXE)
        .args(args("mesh=4 place=S(1)", "2"))
        .output()
        .unwrap();
    refused_with_2(
        &out,
        &[
            "--rolling: 2 is invalid: it cuts the inference replica of ranks 2,3,4,5 across commit groups 0 and 1",
        ],
        "one replica",
    );
}

/// `refit --run --stage --rolling`: the groups are whole engines of the inference
/// parallelism (tp x pp ranks each); a count that cuts one is refused on every rank before
/// the job starts.
#[test]
fn a_rolling_refit_that_cuts_an_engine_is_refused() {
    let dir = common::temp_dir("rolling-refit");
    let model = common::tiny_qwen3(dir.path());
    let refit = |infer: &str, rolling: &str| {
        Command::new(EXE)
            .args(["launch", "--nproc", "6", "--", "refit", "--model"])
            .arg(&model)
            .args(["--train", "tp=2", "--infer", infer])
            .args(["--run", "--stage", "--steps", "2", "--json"])
            .args(["--rolling", rolling, "--transport", "tcp"])
            .output()
            .unwrap()
    };
    // one engine of tp=2 x pp=2 on ranks 2..6, committed in two halves
    let out = refit("tp=2,pp=2", "2");
    refused_with_2(
        &out,
        &[
            "--rolling: 2 is invalid",
            "cuts the inference replica of ranks 2,3,4,5 across commit groups 0 and 1",
            "form 1 replica,",
        ],
        "tp2 pp2",
    );
    // two engines of tp=2: a group each
    let out = refit("tp=2,dp=2", "2");
    let json = json_of(&out);
    let run = &json["run"];
    assert_eq!(run["verified"], true, "{json}");
    check_stream(run, &["in-place", "staged"], 2, "two engines");
    for v in run["versions"].as_array().unwrap() {
        if v["method"] == "staged" {
            let groups = commit_groups(v);
            assert_eq!(groups, vec![(2, 0), (3, 0), (4, 1), (5, 1)], "{v}");
        }
    }
}
