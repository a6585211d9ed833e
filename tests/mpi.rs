//! The `mpi` transport under `mpirun`: random layouts, checked against the in-process run.
//! Built only with `--features mpi` (needs an MPI library and `mpirun`).
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{EXE, Lcg, random_spec, read_dumps, temp_dir, text, wait_bounded};

/// `mpirun -n N` of reshard, allowed as root and with more ranks than cores.
fn mpirun(n: u64) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["-n", &n.to_string(), "--oversubscribe", EXE])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn mpi_runs_match_local_runs() {
    let mut rng = Lcg(0xa11);
    for case in 0..16 {
        let ndim = 1 + rng.below(3) as usize;
        let shape: Vec<String> = (0..ndim).map(|_| rng.below(10).to_string()).collect();
        let world = 2 + rng.below(4);
        let src = random_spec(&mut rng, ndim, world);
        let dst = random_spec(&mut rng, ndim, world);
        let dtype = ["u8", "bf16", "f32", "f64"][rng.below(4) as usize];
        let chunk = ["3", "64", "4MiB"][rng.below(3) as usize];
        let shape = shape.join(",");
        let fill = format!("hash:{case}");
        let common = [
            "run",
            "--shape",
            &shape,
            "--dtype",
            dtype,
            "--src",
            &src,
            "--dst",
            &dst,
            "--fill",
            &fill,
            "--verify",
            "--chunk-bytes",
            chunk,
            "--staging-bytes",
            "8MiB",
        ];
        let (local_dir, mpi_dir) = (
            temp_dir(&format!("mpi-local{case}")),
            temp_dir(&format!("mpi{case}")),
        );
        let local = Command::new(EXE)
            .args(common)
            .args([
                "--transport",
                "local",
                "--dump",
                local_dir.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(
            local.status.success(),
            "case {case} local: {}",
            text(&local.stderr)
        );
        let child = mpirun(world)
            .args(common)
            .args(["--transport", "mpi", "--dump", mpi_dir.to_str().unwrap()])
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "an mpirun");
        assert!(
            out.status.success(),
            "case {case} ({shape} {dtype} {src} -> {dst}): {}",
            text(&out.stderr)
        );
        let report = text(&out.stdout);
        assert!(
            report.contains("over mpi") && report.contains("verify"),
            "{report}"
        );
        assert_eq!(read_dumps(&mpi_dir), read_dumps(&local_dir), "case {case}");
        let _ = std::fs::remove_dir_all(&local_dir);
        let _ = std::fs::remove_dir_all(&mpi_dir);
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
