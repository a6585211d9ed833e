//! The `mpi` transport under `mpirun`: random layouts, checked against the in-process run.
//! Built only with `--features mpi` (needs an MPI library and `mpirun`).
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{EXE, Lcg, RandomRun, text, wait_bounded};

/// `mpirun -n N` of reshard, allowed as root and with more ranks than cores.
fn mpirun(n: u64) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["-n", &n.to_string(), "--oversubscribe", EXE])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
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

/// Under mpirun, `auto` picks MPI when no MASTER_PORT is set.
#[test]
fn auto_picks_mpi_under_mpirun() {
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
        ])
        .env_remove("MASTER_PORT")
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(120), "an mpirun");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("over mpi"),
        "{}",
        text(&out.stdout)
    );
}

/// `bench` and `refit --run` under mpirun: both methods over MPI, every byte verified, the
/// report from rank 0 alone.
#[test]
fn bench_and_refit_run_under_mpirun() {
    let child = mpirun(8)
        .args(["bench", "--suite", "refit", "--suite-bytes", "64KiB"])
        .args(["--iters", "1", "--transport", "mpi", "--json"])
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(180), "bench under mpirun");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["transport"], "mpi");
    let cases = j["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    assert!(cases.iter().all(|c| c["verified"] == true), "{j}");

    let dir = common::temp_dir("mpi-refit");
    std::fs::create_dir_all(&dir).unwrap();
    let config = common::tiny_moe_config(&dir);
    let child = mpirun(8)
        .args(["refit", "--model"])
        .arg(&config)
        .args(["--train", "tp=2,ep=2,pp=2", "--infer", "tp=4", "--run"])
        .args(["--iters", "1", "--transport", "mpi", "--json"])
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(180), "refit under mpirun");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["run"]["verified"], true, "{j}");
    assert_eq!(j["run"]["transport"], "mpi");
}
