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
