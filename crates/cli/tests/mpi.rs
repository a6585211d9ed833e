//! The `mpi` transport under `mpirun`, and `shm` riding on MPI: random layouts, checked
//! against the in-process run.
//! Built only with `--features mpi` (needs an MPI library and `mpirun`).
#![cfg(feature = "mpi")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{EXE, Lcg, RandomRun, text, wait_bounded};

/// `mpirun -n N` of reshard, allowed as root and with more ranks than cores.
fn mpirun(n: u64) -> Command {
    mpirun_with(n, &[])
}

/// The same, with `mpirun` options (such as `-x VAR=value`) before the program.
fn mpirun_with(n: u64, options: &[&str]) -> Command {
    let mut c = common::mpirun(n);
    c.args(options).arg(EXE);
    c
}

#[test]
fn mpi_runs_match_local_runs() {
    let mut rng = Lcg(0xa11);
    for case in 0..16 {
        let run = RandomRun::new(&mut rng, case, "mpi");
        run.check_against_local("mpi", |args, world| {
            let mut c = mpirun(world);
            c.args(args);
            c
        });
    }
}

/// `shm` under mpirun: notices over MPI, bytes through shared memory, written straight into
/// the destination shards or (with `RESHARD_SHM_DIRECT=0`) through rings.
#[test]
fn shm_over_mpi_runs_match_local_runs() {
    let mut rng = Lcg(0x5a1);
    for case in 0..12 {
        let run = RandomRun::new(&mut rng, case, "shm-mpi");
        let direct = if case % 2 == 0 { "1" } else { "0" };
        run.check_against_local("shm", |args, world| {
            let mut c = mpirun_with(world, &["-x", &format!("RESHARD_SHM_DIRECT={direct}")]);
            c.args(args).env_remove("MASTER_PORT");
            c
        });
    }
}

/// Under mpirun (no MASTER_PORT set), `auto` puts peers on this host in shared memory and
/// would reach the others through MPI; `mpi` keeps MPI for all.
#[test]
fn auto_under_mpirun_uses_shared_memory_on_one_host() {
    for (kind, over) in [("auto", "over shm"), ("mpi", "over mpi")] {
        let child = mpirun(3)
            .args([
                "run",
                "--shape",
                "9,4",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=1 place=R",
                "--verify",
                "--transport",
                kind,
            ])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "an mpirun");
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains(over), "{}", text(&out.stdout));
    }
}

/// `bench` and `refit --run` under mpirun, over MPI and over shared memory with MPI
/// carrying the notices: both methods, every byte verified, the report from rank 0 alone.
#[test]
fn bench_and_refit_run_under_mpirun() {
    let scratch = common::temp_dir("mpi-refit");
    let dir = scratch.path();
    let config = common::tiny_moe_config(dir);
    for (kind, name) in [("mpi", "mpi"), ("auto", "shm")] {
        let child = mpirun(8)
            .args(["bench", "--suite", "refit", "--suite-bytes", "64KiB"])
            .args(["--iters", "1", "--transport", kind, "--json"])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(180), "bench under mpirun");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["transport"], name);
        let cases = j["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 9);
        assert!(cases.iter().all(|c| c["verified"] == true), "{j}");

        let child = mpirun(8)
            .args(["refit", "--model"])
            .arg(&config)
            .args(["--train", "tp=2,ep=2,pp=2", "--infer", "tp=4", "--run"])
            .args(["--iters", "1", "--transport", kind, "--json"])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(180), "refit under mpirun");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["run"]["verified"], true, "{j}");
        assert_eq!(j["run"]["transport"], name);

        // into fp8: the weights quantized in the batch, every value and scale verified
        let child = mpirun(8)
            .args(["refit", "--model"])
            .arg(&config)
            .args(["--train", "tp=2,ep=2,pp=2", "--infer", "tp=4", "--run"])
            .args(["--infer-quant", "fp8-block:4x4"])
            .args(["--iters", "1", "--transport", kind, "--json"])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(180), "fp8 refit under mpirun");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["run"]["verified"], true, "{j}");
        assert_eq!(j["run"]["scale_bytes"], j["reshard"]["scale_bytes"], "{j}");
    }
}

/// Ranks of one MPI job given different jobs (MPMD: `mpirun -n 3 A : -n 1 B`) are refused
/// on every rank (exit 2), naming the rank and the field, before any byte moves.
#[test]
fn ranks_that_disagree_are_refused_under_mpirun() {
    for transport in ["mpi", "auto"] {
        let job = |dtype: &'static str| {
            [
                "run",
                "--shape",
                "8,8",
                "--dtype",
                dtype,
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=2 place=S(1)",
                "--transport",
                transport,
            ]
        };
        let mut c = mpirun(3);
        c.args(job("f32"))
            .args([":", "-n", "1", EXE])
            .args(job("i32"));
        let out = wait_bounded(c.spawn().unwrap(), Duration::from_secs(120), "mpirun");
        let err = text(&out.stderr);
        // mpirun ends the job once one rank exits non-zero: not every rank may get to print
        assert_eq!(out.status.code(), Some(2), "{transport}: {err}");
        assert!(
            err.contains("rank 3 runs --dtype i32; rank 0 runs --dtype f32"),
            "{transport}: {err}"
        );
    }
}

/// `--dst-dtype` over mpi: derived datatypes cannot convert, so converted transfers go as
/// packed chunks (whole transfers and, with small chunks, pieces of them); over shm riding on
/// MPI too. Every destination byte equals the in-process run's, which the precision tests
/// check against the reference cast.
#[test]
fn conversions_under_mpirun_match_local_runs() {
    let scratch = common::temp_dir("mpi-cast");
    for (i, (transport, from, to, chunk)) in [
        ("mpi", "f32", "bf16", "4MiB"),
        ("mpi", "bf16", "f64", "20"),
        ("shm", "f64", "f16", "4MiB"),
    ]
    .into_iter()
    .enumerate()
    {
        let job = |dir: &std::path::Path| {
            vec![
                "run".to_string(),
                "--shape".into(),
                "13,11".into(),
                "--dtype".into(),
                from.into(),
                "--dst-dtype".into(),
                to.into(),
                "--src".into(),
                "mesh=2x2 place=S(0),R".into(),
                "--dst".into(),
                "mesh=3 ranks=2..5 place=S(1)".into(),
                "--chunk-bytes".into(),
                chunk.into(),
                "--verify".into(),
                "--dump".into(),
                dir.to_str().unwrap().into(),
            ]
        };
        let (local, remote) = (
            scratch.path().join(format!("local{i}")),
            scratch.path().join(format!("mpi{i}")),
        );
        let out = Command::new(EXE)
            .args(job(&local))
            .args(["--transport", "local"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let child = mpirun(5)
            .args(job(&remote))
            .args(["--transport", transport, "--timeout", "60"])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(180), "an mpirun");
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(
            common::read_dumps(&local),
            common::read_dumps(&remote),
            "{from} -> {to} over {transport}"
        );
    }
}

/// A relay plan under mpirun, over MPI and over shared memory riding on MPI: 2 hand-set
/// hosts of 2 ranks, every byte verified and checksummed.
#[test]
fn relay_runs_under_mpirun() {
    for transport in ["mpi", "auto"] {
        let child = mpirun(4)
            .args([
                "run",
                "--shape",
                "96,64",
                "--src",
                "mesh=2 place=S(1)",
                "--dst",
                "mesh=2 ranks=2,3 place=R",
                "--hosts",
                "2x2",
                "--relay",
                "on",
                "--verify",
                "--checksum",
                "--chunk-bytes",
                "512",
                "--staging-bytes",
                "4KiB",
                "--transport",
                transport,
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "an mpirun");
        assert!(out.status.success(), "{transport}: {}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains("every destination byte matches"),
            "{}",
            text(&out.stdout)
        );
    }
}

/// `run --delta` under mpirun: a stream of versions over the mpi transport (and shm riding
/// on it), every version of every method verified.
#[test]
fn delta_streams_under_mpirun() {
    for transport in ["mpi", "shm"] {
        let out = mpirun(6)
            .args([
                "run",
                "--shape",
                "96x80",
                "--dtype",
                "bf16",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=2x2 place=R,S(1) ranks=2..6",
                "--delta",
                "--steps",
                "3",
                "--delta-methods",
                "delta,dense,gather-broadcast",
                "--verify",
                "--checksum",
                "--json",
                "--transport",
                transport,
            ])
            .env_remove("MASTER_PORT")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["verified"], true, "{json}");
        assert_eq!(json["refits"].as_array().unwrap().len(), 9);
    }
}

/// `run --stage` under mpirun: each version staged beside the served one and committed on
/// every rank (the job's two-phase decision over MPI's control links, once per version),
/// rolling by replica, every version verified and no pass of an engine seeing a mix.
#[test]
fn staged_streams_under_mpirun() {
    for transport in ["mpi", "shm"] {
        let out = mpirun(6)
            .args([
                "run",
                "--shape",
                "96x80",
                "--dtype",
                "bf16",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=2x2 place=R,S(1) ranks=2..6",
                "--stage",
                "--delta",
                "--rolling",
                "2",
                "--steps",
                "3",
                "--verify",
                "--checksum",
                "--json",
                "--transport",
                transport,
            ])
            .env_remove("MASTER_PORT")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["verified"], true, "{json}");
        let versions = json["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 9);
        for v in versions {
            let expected = match v["method"].as_str().unwrap().starts_with("staged") {
                true => "commit",
                false => "in place",
            };
            assert_eq!(v["outcome"], expected, "{v}");
            assert!(
                v["ranks"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|r| r["mixed"] == false && r["serving"] == v["version"]),
                "{v}"
            );
        }
    }
}
