//! The testbed cost model from the command line: `bench --simulate FILE` adds each method's
//! `predicted_s`, `plan --simulate FILE` prices relay plans on a testbed, and bad files are
//! refused before any byte moves.

use std::process::{Command, Output};

use serde_json::Value;

mod common;

use common::{EXE, temp_dir, text};

fn reshard(args: &[&str]) -> Output {
    Command::new(EXE).args(args).output().unwrap()
}

const TESTBED: &str = r#"{"kind": "hosts", "name": "bed", "hosts": 2, "ranks_per_host": 4,
    "link_gbit": 2, "memory_gb_s": 2, "tcp_gb_s": 1, "cores": 2, "shared_cpu": true}"#;

const PAIR: [&str; 8] = [
    "--shape",
    "256,256",
    "--src",
    "mesh=4 place=S(0)",
    "--dst",
    "mesh=2x2 ranks=4..8 place=R,S(1)",
    "--hosts",
    "2x4",
];

#[test]
fn bench_reports_predicted_seconds_beside_measured_ones() {
    let dir = temp_dir("costmodel-bench");
    let file = dir.path().join("bed.json");
    std::fs::write(&file, TESTBED).unwrap();
    let file = file.to_str().unwrap();
    let out = reshard(
        &[
            &["bench"][..],
            &PAIR,
            &[
                "--iters",
                "1",
                "--warmup",
                "0",
                "--json",
                "--simulate",
                file,
            ],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: Value = serde_json::from_str(&text(&out.stdout)).unwrap();
    for method in ["reshard", "gather_broadcast"] {
        let p = json[method]["predicted_s"].as_f64().unwrap();
        assert!(p > 0.0 && p.is_finite(), "{method}: {json}");
    }
    let text_out = reshard(
        &[
            &["bench"][..],
            &PAIR,
            &["--iters", "1", "--warmup", "0", "--simulate", file],
        ]
        .concat(),
    );
    assert!(text_out.status.success(), "{}", text(&text_out.stderr));
    assert!(text(&text_out.stdout).contains("predicted"));
    // without it, no prediction
    let plain = reshard(&[&["bench"][..], &PAIR, &["--iters", "1", "--json"]].concat());
    let plain: Value = serde_json::from_str(&text(&plain.stdout)).unwrap();
    assert!(plain["reshard"].get("predicted_s").is_none());
}

#[test]
fn plan_prices_relay_on_a_testbed_lighter_than_without() {
    let dir = temp_dir("costmodel-plan");
    let file = dir.path().join("bed.json");
    std::fs::write(
        &file,
        TESTBED.replace("\"link_gbit\": 2", "\"link_gbit\": 0.01"),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let priced = |relay: &str| {
        let out = reshard(
            &[
                &["plan"][..],
                &PAIR,
                &["--relay", relay, "--json", "--simulate", file],
            ]
            .concat(),
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: Value = serde_json::from_str(&text(&out.stdout)).unwrap();
        assert_eq!(json["simulation"]["cluster"], "bed");
        json["simulation"]["reshard_s"].as_f64().unwrap()
    };
    // on a slow link the DP2 x TP2 destination's shared bytes cross once with relay
    let (on, off) = (priced("on"), priced("off"));
    assert!(on < off, "relay on {on} s, off {off} s");
}

#[test]
fn bad_testbeds_are_refused_naming_the_field() {
    let dir = temp_dir("costmodel-bad");
    let file = dir.path().join("bad.json");
    for (bad, field) in [
        (TESTBED.replace("\"cores\": 2", "\"cores\": 0"), "cores"),
        (
            TESTBED.replace("\"hosts\": 2", "\"hosts\": 1"),
            "is on no host",
        ),
    ] {
        std::fs::write(&file, &bad).unwrap();
        let out = reshard(
            &[
                &["bench"][..],
                &PAIR,
                &["--iters", "1", "--simulate", file.to_str().unwrap()],
            ]
            .concat(),
        );
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(err.contains("--simulate") && err.contains(field), "{err}");
    }
}
