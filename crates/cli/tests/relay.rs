//! Plans across hosts, with relay, run over processes (tcp and shm, one process per rank):
//! the ranks are given a host map by hand (all run on this machine), and every destination
//! byte is verified against the fill and against the same run between threads.

use std::process::Command;
use std::time::Duration;

mod common;

use common::{EXE, Lcg, RandomRun, text, wait_bounded};

/// Random layouts over 2 or 3 hand-set hosts, relay on, checksummed: processes agree with
/// threads byte for byte, and both verify.
#[test]
fn relay_runs_over_processes_match_local_runs() {
    for (transport, seed) in [("tcp", 0x4e1a), ("shm", 0x4e1b)] {
        let mut rng = Lcg(seed);
        for case in 0..10 {
            let mut run = RandomRun::new(&mut rng, case, &format!("relay-{transport}"));
            let hosts = run.host_list(2 + case % 2);
            run.extra = ["--hosts", &hosts, "--relay", "on", "--checksum"]
                .map(String::from)
                .to_vec();
            run.check_against_local(transport, |args, world| {
                let mut c = Command::new(EXE);
                c.args(["launch", "--nproc", &world.to_string(), "--"])
                    .args(args);
                c
            });
        }
    }
}

fn launch(nproc: usize, args: &[&str]) -> String {
    let child = Command::new(EXE)
        .args(["launch", "--nproc", &nproc.to_string(), "--"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(120), "a relay run");
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

/// The example of relay, TP4 on host 0 -> DP2 x TP2 on host 1, and 2 hosts of 2 ranks, over
/// every process transport, with small slabs so that many rounds pipeline.
#[test]
fn relay_examples_verify_over_tcp_and_shm() {
    for transport in ["tcp", "shm", "auto"] {
        let out = launch(
            8,
            &[
                "run",
                "--shape",
                "256,192",
                "--src",
                "mesh=4 place=S(1)",
                "--dst",
                "mesh=2x2 place=R,S(1)",
                "--hosts",
                "2x4",
                "--relay",
                "on",
                "--verify",
                "--checksum",
                "--chunk-bytes",
                "1KiB",
                "--staging-bytes",
                "16KiB",
                "--transport",
                transport,
            ],
        );
        assert!(out.contains("every destination byte matches"), "{out}");
        let out = launch(
            4,
            &[
                "run",
                "--shape",
                "64,96",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=2 ranks=2,3 place=R",
                "--hosts",
                "2x2",
                "--relay",
                "on",
                "--verify",
                "--transport",
                transport,
            ],
        );
        assert!(out.contains("every destination byte matches"), "{out}");
    }
}

/// `bench` across hand-set hosts: both methods verified, and the link bytes reported.
#[test]
fn bench_reports_link_bytes_across_hosts() {
    let out = launch(
        8,
        &[
            "bench",
            "--shape",
            "128,128",
            "--src",
            "mesh=4 place=S(1)",
            "--dst",
            "mesh=2x2 place=R,S(1)",
            "--hosts",
            "2x4",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--json",
            "--transport",
            "shm",
        ],
    );
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["verified"], true, "{json}");
    let tensor = 128 * 128 * 2;
    assert_eq!(json["reshard"]["busiest_link_bytes"], tensor, "{json}");
    // the hierarchical baseline too sends the tensor into host 1 once
    assert_eq!(
        json["gather_broadcast"]["busiest_link_bytes"], tensor,
        "{json}"
    );
    assert_eq!(json["link_ratio"], 1.0, "{json}");
}

/// `plan --hosts`: relay halves the busiest link of TP4 -> DP2 x TP2, and the JSON shows the
/// hops and the links.
#[test]
fn plan_shows_relays_and_host_links() {
    let plan = |relay: &str| {
        let out = Command::new(EXE)
            .args([
                "plan",
                "--shape",
                "8192,8192",
                "--src",
                "mesh=4 place=S(1)",
                "--dst",
                "mesh=2x2 place=R,S(1)",
                "--hosts",
                "0,0,0,0,1,1,1,1",
                "--relay",
                relay,
                "--json",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (on, off) = (plan("on"), plan("off"));
    let tensor = 8192u64 * 8192 * 2;
    assert_eq!(on["totals"]["busiest_link_bytes"], tensor);
    assert_eq!(off["totals"]["busiest_link_bytes"], 2 * tensor);
    assert_eq!(on["totals"]["host_links"][1]["in"], tensor);
    let relayed = on["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t.get("via").is_some())
        .count();
    assert!(relayed > 0, "{on}");
    assert!(
        off["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.get("via").is_none())
    );
    // a bad map names the option and the value
    let out = Command::new(EXE)
        .args([
            "plan",
            "--shape",
            "8",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=2 place=R",
            "--hosts",
            "1x3",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--hosts: 1x3"),
        "{}",
        text(&out.stderr)
    );
}
