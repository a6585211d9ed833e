//! kill -9 of one rank of `run --stage` (a stream of staged refits, one process per rank over
//! tcp) at a random moment: prepare, the decision or the commit. Every surviving destination
//! rank then serves one whole version, checked on its bytes: its live shard (`--dump`) equals
//! the shard of version v or v + 1 as a clean run of the same job writes it, never a mix.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod common;

use common::{EXE, Lcg, free_port, read_dumps, temp_dir, text, wait_bounded};

const STEPS: u64 = 6;
const WORLD: usize = 6;

/// The job: 2 -> 4 ranks (two replicas of two), six staged versions of a 4 MiB tensor.
fn job(dump: &Path, steps: u64) -> Vec<String> {
    [
        "run",
        "--shape",
        "1024,1024",
        "--dtype",
        "f32",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=2x2 place=R,S(1) ranks=2..6",
        "--stage",
        "--steps",
        &steps.to_string(),
        "--timeout",
        "2",
        "--dump",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dump.display().to_string()])
    .collect()
}

fn spawn_rank(rank: usize, port: u16, args: &[String]) -> Child {
    Command::new(EXE)
        .args(args)
        .args(["--transport", "tcp"])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", WORLD.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RESHARD_TOKEN", "stage-kill")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Every destination rank's shard of every version 0..=STEPS, as clean runs (threads of one
/// process) write them: `shards[v]` holds `(file name, bytes)` by rank.
fn reference() -> Vec<Vec<(String, Vec<u8>)>> {
    (0..=STEPS)
        .map(|v| {
            let dir = temp_dir(&format!("stage-kill-ref{v}"));
            if v == 0 {
                // before the first commit, a live shard holds zeros
                let clean = temp_dir("stage-kill-ref-shape");
                let out = Command::new(EXE)
                    .args(job(clean.path(), 1))
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{}", text(&out.stderr));
                return read_dumps(clean.path())
                    .into_iter()
                    .map(|(name, bytes)| (name, vec![0u8; bytes.len()]))
                    .collect();
            }
            let out = Command::new(EXE).args(job(dir.path(), v)).output().unwrap();
            assert!(out.status.success(), "{}", text(&out.stderr));
            read_dumps(dir.path())
        })
        .collect()
}

#[test]
fn kill_9_during_a_staged_stream_leaves_every_survivor_on_one_whole_version() {
    let shards = reference();
    let mut rng = Lcg(7);
    let (mut hits, mut tries) = (0, 0);
    while hits < 8 {
        tries += 1;
        assert!(
            tries <= 40,
            "only {hits} of {tries} kills landed before the job ended"
        );
        let dir = temp_dir("stage-kill");
        let args = job(dir.path(), STEPS);
        let port = free_port();
        let mut ranks: Vec<Child> = (0..WORLD).map(|r| spawn_rank(r, port, &args)).collect();
        let victim = rng.below(WORLD as u64) as usize;
        std::thread::sleep(Duration::from_millis(150 + rng.below(1200)));
        if ranks[victim].try_wait().unwrap().is_some() {
            for r in ranks {
                wait_bounded(r, Duration::from_secs(60), "a finished rank");
            }
            continue; // the stream ended before the kill: not a trial
        }
        ranks[victim].kill().unwrap();
        let mut failed = false;
        for (rank, child) in ranks.into_iter().enumerate() {
            // bounded: every wait of the job is a few of its 2 s timeouts
            let out = wait_bounded(child, Duration::from_secs(60), &format!("rank {rank}"));
            if rank != victim {
                let err = text(&out.stderr);
                assert!(!err.contains("panicked"), "{err}");
                failed |= !out.status.success();
            }
        }
        if !failed {
            continue; // every version had moved before the kill: not a trial
        }
        hits += 1;
        let dumps = read_dumps(dir.path());
        let mut served = Vec::new();
        for (name, bytes) in &dumps {
            let version = (0..=STEPS as usize)
                .find(|&v| shards[v].iter().any(|(n, b)| n == name && b == bytes));
            let Some(v) = version else {
                panic!("{name} (victim rank {victim}) holds no whole version: a mix");
            };
            served.push((name.clone(), v));
        }
        eprintln!("victim rank {victim}: survivors serve {served:?}");
        // the survivors serve version v or v + 1: one decision, whoever heard it
        let lo = served.iter().map(|s| s.1).min().unwrap_or(0);
        let hi = served.iter().map(|s| s.1).max().unwrap_or(0);
        assert!(hi - lo <= 1, "survivors serve versions {served:?}");
    }
}
