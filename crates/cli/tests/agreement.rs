//! Ranks given different jobs are refused at rendezvous, before any byte moves: every rank
//! exits 2 naming the first rank that differs, the field and both values, at once rather
//! than at the timeout.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{EXE, free_port, text, wait_bounded};

/// Starts one process per entry of `jobs` (rank = index) and waits for all of them. The
/// timeout the ranks get is far longer than the bound here: a refusal that waited for it
/// fails the test as a hang.
fn job(jobs: &[Vec<&str>]) -> Vec<Output> {
    let port = free_port().to_string();
    let world = jobs.len().to_string();
    let children: Vec<_> = jobs
        .iter()
        .enumerate()
        .map(|(rank, args)| {
            Command::new(EXE)
                .args(args)
                .args(["--timeout", "120"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", &world)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RESHARD_TOKEN", "agreement-test")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| wait_bounded(c, Duration::from_secs(60), "a job of ranks that disagree"))
        .collect()
}

fn run_args<'a>(dtype: &'a str, src: &'a str, dst: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--shape",
        "8,8",
        "--dtype",
        dtype,
        "--src",
        src,
        "--dst",
        dst,
        "--transport",
        "tcp",
    ]
}

/// Every rank exited 2 and said the same thing, which contains every one of `needles`.
fn every_rank_refused(outputs: &[Output], needles: &[&str]) {
    let first = text(&outputs[0].stderr);
    for (rank, out) in outputs.iter().enumerate() {
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {rank}: {err}");
        assert!(err.contains("nothing was moved"), "rank {rank}: {err}");
        for needle in needles {
            assert!(err.contains(needle), "rank {rank} lacks {needle:?}: {err}");
        }
        assert_eq!(err, first, "every rank names the same difference");
    }
}

#[test]
fn a_reordered_rank_list_is_refused_on_every_rank() {
    let dst = "mesh=3 ranks=2..5 place=S(1)";
    let mut jobs = vec![run_args("f32", "mesh=2 place=S(0)", dst); 5];
    jobs[3] = run_args("f32", "mesh=2 place=S(0)", "mesh=3 ranks=2,4,3 place=S(1)");
    every_rank_refused(
        &job(&jobs),
        &[
            "rank 3 runs --dst ranks 2,4,3",
            "rank 0 runs --dst ranks 2..5",
        ],
    );
}

#[test]
fn a_different_dtype_is_refused() {
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let mut jobs = vec![run_args("f32", src, dst); 4];
    jobs[1] = run_args("i32", src, dst);
    every_rank_refused(&job(&jobs), &["rank 1", "--dtype", "i32", "f32"]);
}

/// `--dst-dtype` is part of the job: a rank converting to another dtype is refused.
#[test]
fn a_different_destination_dtype_is_refused() {
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let with = |dst_dtype| {
        let mut args = run_args("f32", src, dst);
        args.extend(["--dst-dtype", dst_dtype]);
        args
    };
    let mut jobs = vec![with("bf16"); 4];
    jobs[2] = with("f16");
    every_rank_refused(&job(&jobs), &["rank 2", "--dst-dtype", "bf16", "f16"]);
}

#[test]
fn a_different_source_layout_is_refused_at_once() {
    // the two would exchange with different peers: without the agreement, a wait for a
    // link that never comes
    let dst = "mesh=2 place=S(1)";
    let mut jobs = vec![run_args("f32", "mesh=2 place=S(0)", dst); 4];
    jobs[2] = run_args("f32", "mesh=2 place=S(1)", dst);
    every_rank_refused(&job(&jobs), &["rank 2", "--src place", "S(1)", "S(0)"]);
}

#[test]
fn run_and_bench_together_are_refused() {
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let mut jobs = vec![run_args("bf16", src, dst); 4];
    let mut bench = run_args("bf16", src, dst);
    bench[0] = "bench";
    jobs[1] = bench;
    every_rank_refused(&job(&jobs), &["rank 1 runs command bench", "command run"]);
}

#[test]
fn different_transports_are_refused() {
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let mut jobs = vec![run_args("bf16", src, dst); 4];
    let last = jobs[3].len() - 1;
    jobs[3][last] = "shm";
    every_rank_refused(
        &job(&jobs),
        &["rank 3", "--transport shm", "--transport tcp"],
    );
}

#[test]
fn refits_of_different_parallelism_are_refused() {
    let refit = |infer: &'static str| {
        vec![
            "refit",
            "--model",
            "qwen3-0.6b",
            "--train",
            "tp=2",
            "--infer",
            infer,
            "--run",
            "--transport",
            "tcp",
            "--iters",
            "1",
            "--warmup",
            "0",
        ]
    };
    let mut jobs = vec![refit("tp=2"); 4];
    jobs[2] = refit("tp=1,dp=2");
    every_rank_refused(&job(&jobs), &["rank 2 runs --infer"]);
}

#[test]
fn options_that_do_not_change_the_job_may_differ() {
    // the report's format and where a rank dumps its shard are each rank's own business
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let mut jobs = vec![run_args("u8", src, dst); 4];
    jobs[0].push("--json");
    let outputs = job(&jobs);
    for (rank, out) in outputs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}: {}", text(&out.stderr));
    }
    assert!(text(&outputs[0].stdout).contains("\"transport\""));
}

#[test]
fn a_rank_that_cannot_run_its_part_is_named_at_once() {
    // rank 1's layouts need six processes where the job has four: it refuses at rendezvous,
    // and every rank hears why, instead of waiting for it until the timeout
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let mut jobs = vec![run_args("f32", src, dst); 4];
    jobs[1] = run_args("f32", src, "mesh=4 place=S(1)");
    let outputs = job(&jobs);
    for (rank, out) in outputs.iter().enumerate() {
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {rank}: {err}");
        assert!(
            err.contains("WORLD_SIZE=\"4\" is invalid"),
            "rank {rank}: {err}"
        );
        // the rank that refused says its own error; the others name it
        let named = err.contains("rank 1 cannot run its part of the job, so nothing was moved");
        assert_eq!(named, rank != 1, "rank {rank}: {err}");
    }
}

/// `run --delta` agrees on what `run` agrees on, and on its stream: a rank with other layouts
/// or another density is refused on every rank before any byte moves.
#[test]
fn delta_streams_that_differ_are_refused_on_every_rank() {
    let (src, dst) = ("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let delta = |mut args: Vec<&'static str>, density: &'static str| {
        args.extend(["--delta", "--steps", "2", "--delta-density", density]);
        args
    };
    let mut jobs = vec![delta(run_args("f32", src, dst), "0.01"); 4];
    jobs[2] = delta(run_args("f32", src, "mesh=2 place=S(0)"), "0.01");
    every_rank_refused(&job(&jobs), &["rank 2", "--dst", "S(0)"]);
    let mut jobs = vec![delta(run_args("f32", src, dst), "0.01"); 4];
    jobs[3] = delta(run_args("f32", src, dst), "0.5");
    every_rank_refused(&job(&jobs), &["rank 3", "--delta-update", "0.5"]);
}
