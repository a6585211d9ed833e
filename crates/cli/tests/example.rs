//! The example program `examples/multiprocess.rs` run as a job of processes over tcp and shm,
//! and alone (ranks as threads). The test binary holds the example's code and starts copies of
//! itself as the ranks, each running only [`example_rank`] with the torchrun variables set.

mod common;

#[path = "../../../examples/multiprocess.rs"]
#[allow(dead_code)]
mod example;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{free_port, text, wait_bounded};

/// Names the transport in a rank's environment; unset in the test run itself.
const TRANSPORT_VAR: &str = "RESHARD_EXAMPLE_TRANSPORT";

/// One rank of a job the tests below start: runs the example's part for this process. In
/// the ordinary test run (the variable unset) there is nothing to do.
#[test]
fn example_rank() {
    let Ok(transport) = std::env::var(TRANSPORT_VAR) else {
        return;
    };
    match example::run(&transport) {
        Ok(Some(line)) => println!("{line}"),
        Ok(None) => {}
        Err(e) => panic!("rank failed: {e}"),
    }
}

/// Runs the example as `world` processes over `transport`; returns rank 0's output.
fn job(transport: &str, world: usize) -> String {
    let exe = std::env::current_exe().unwrap();
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "example_rank", "--nocapture", "--test-threads=1"])
                .env(TRANSPORT_VAR, transport)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RESHARD_TOKEN", "example-test")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| wait_bounded(c, Duration::from_secs(120), "the example's job"))
        .collect();
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    text(&outputs[0].stdout)
}

#[test]
fn the_example_reshards_across_processes_over_tcp() {
    let out = job("tcp", 3);
    assert!(
        out.contains("over 3 ranks (one process each)")
            && out.contains("every destination shard verified"),
        "{out}"
    );
}

#[test]
fn the_example_reshards_across_processes_over_shm() {
    let out = job("shm", 4);
    assert!(
        out.contains("over 4 ranks (one process each)")
            && out.contains("every destination shard verified"),
        "{out}"
    );
}

/// Alone, with no job variables, the same program runs every rank as a thread.
#[test]
fn the_example_alone_runs_its_ranks_as_threads() {
    let line = example::run("auto").unwrap().unwrap();
    assert!(line.contains("(threads of one process)"), "{line}");
}

/// Under `mpirun` (a build with `--features mpi`), over MPI and, by `auto`, shared memory.
#[cfg(feature = "mpi")]
#[test]
fn the_example_reshards_under_mpirun() {
    let exe = std::env::current_exe().unwrap();
    for transport in ["mpi", "auto"] {
        let child = common::mpirun(3)
            .arg("-x")
            .arg(format!("{TRANSPORT_VAR}={transport}"))
            .arg(&exe)
            .args(["--exact", "example_rank", "--nocapture", "--test-threads=1"])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "the example under mpirun");
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
        assert!(
            stdout.contains("over 3 ranks (one process each)")
                && stdout.contains("every destination shard verified"),
            "{transport}: {stdout}"
        );
    }
}
