//! One rank per process: the tcp transport under `reshard launch` and with hand-set
//! environments, checked against the in-process run, and killed at random moments.

use std::io::Write;
use std::net::TcpStream;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod common;

use common::{EXE, Lcg, RandomRun, free_port, text, wait_bounded};

/// One rank of a job started by hand, as on several hosts.
fn spawn_rank(rank: usize, world: usize, port: u16, token: &str, args: &[&str]) -> Child {
    Command::new(EXE)
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RESHARD_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The same random layouts over tcp and shm (one process per rank) and in one process: all
/// verify, and every destination buffer is identical.
#[test]
fn tcp_runs_match_local_runs() {
    runs_match_local_runs("tcp", 0x5eed);
}

#[test]
fn shm_runs_match_local_runs() {
    runs_match_local_runs("shm", 0xfeed);
}

/// The same through the shared-memory rings alone (senders kept out of receivers' shards).
#[test]
fn shm_ring_runs_match_local_runs() {
    runs_match_local_runs_with("shm", 0xbeef, &[("RESHARD_SHM_DIRECT", "0")]);
}

fn runs_match_local_runs(transport: &str, seed: u64) {
    runs_match_local_runs_with(transport, seed, &[]);
}

fn runs_match_local_runs_with(transport: &str, seed: u64, env: &[(&str, &str)]) {
    let mut rng = Lcg(seed);
    for case in 0..24 {
        let run = RandomRun::new(&mut rng, case, &format!("{transport}-{seed}"));
        run.check_against_local(transport, |args, world| {
            let mut c = Command::new(EXE);
            c.args(["launch", "--nproc", &world.to_string(), "--"])
                .args(args)
                .envs(env.iter().copied());
            c
        });
        let report = run.report.borrow();
        assert!(
            !report.contains("[rank"),
            "rank 0's output is unprefixed: {report}"
        );
    }
}

/// `--checksum` over processes: every sender's sums reach its receivers after the data, over
/// tcp frames, shm notices after direct writes, and shm notices after ring slots, and every
/// chunk checks.
#[test]
fn checksummed_runs_match_local_runs() {
    for (transport, seed, direct) in [
        ("tcp", 0xc0c0, "1"),
        ("shm", 0xc1c1, "1"),
        ("shm", 0xc2c2, "0"),
    ] {
        let mut rng = Lcg(seed);
        for case in 0..4 {
            let run = RandomRun::new(&mut rng, case, &format!("sums-{transport}-{seed}"));
            run.check_against_local(transport, |args, world| {
                let mut c = Command::new(EXE);
                c.args(["launch", "--nproc", &world.to_string(), "--"])
                    .args(args)
                    .arg("--checksum")
                    .env("RESHARD_SHM_DIRECT", direct);
                c
            });
            let report = run.report.borrow();
            assert!(
                report.contains("checksum every chunk landed as its sender summed it"),
                "{report}"
            );
        }
    }
}

/// kill -9 of a random rank at a random moment: every other rank exits non-zero, naming it,
/// within the timeout; nothing hangs and no process is left.
#[test]
fn killing_a_rank_fails_every_other_rank_over_tcp() {
    kill_trials("tcp", 42);
}

#[test]
fn killing_a_rank_fails_every_other_rank_over_shm() {
    kill_trials("shm", 43);
}

/// The job the failure tests disturb: 4 -> 2 ranks of 32 MiB over `transport`, in 256 KiB
/// chunks, waiting at most `timeout` seconds, `iters` times.
fn failure_job<'a>(transport: &'a str, timeout: &'a str, iters: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--shape",
        "2048,4096",
        "--dtype",
        "f32",
        "--src",
        "mesh=4 place=S(0)",
        "--dst",
        "mesh=2 place=S(1)",
        "--transport",
        transport,
        "--verify",
        "--timeout",
        timeout,
        "--chunk-bytes",
        "256KiB",
        "--iters",
        iters,
    ]
}

fn kill_trials(transport: &str, seed: u64) {
    let world = 6;
    // several repetitions keep data moving for most of the kill window, in release builds too
    let args = failure_job(transport, "3", "10");
    let mut rng = Lcg(seed);
    let (mut hits, mut tries) = (0, 0);
    while hits < 20 {
        tries += 1;
        assert!(
            tries <= 60,
            "only {hits} of {tries} kills landed before the job ended"
        );
        let port = free_port();
        let mut ranks: Vec<Child> = (0..world)
            .map(|r| spawn_rank(r, world, port, "kill-test", &args))
            .collect();
        let victim = rng.below(world as u64) as usize;
        std::thread::sleep(Duration::from_millis(rng.below(400)));
        if ranks[victim].try_wait().unwrap().is_some() {
            // the job ended before the kill: not a trial
            for r in ranks {
                wait_bounded(r, Duration::from_secs(30), "a finished rank");
            }
            continue;
        }
        ranks[victim].kill().unwrap();
        let outcomes: Vec<(usize, bool, String)> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, child)| {
                let out = wait_bounded(child, Duration::from_secs(30), &format!("rank {rank}"));
                (rank, out.status.success(), text(&out.stderr))
            })
            .filter(|(rank, ..)| *rank != victim)
            .collect();
        if outcomes.iter().any(|(_, ok, _)| *ok) {
            // A rank succeeds only on rank 0's all-clear, which needs every rank's report of
            // success, the victim's included: the data had all moved before the kill (it hit
            // the final handshake). Not a trial.
            continue;
        }
        hits += 1;
        for (rank, _, err) in outcomes {
            assert!(
                err.contains(&format!("rank {victim}")),
                "rank {rank} does not name rank {victim}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

/// A rank that stops responding mid-transfer (SIGSTOP: its connections stay open, nothing
/// resets them) makes every other rank fail within a bounded time, naming it.
#[test]
fn a_stalled_rank_fails_every_other_rank_over_tcp() {
    stall_trial("tcp");
}

#[test]
fn a_stalled_rank_fails_every_other_rank_over_shm() {
    stall_trial("shm");
}

fn stall_trial(transport: &str) {
    let world = 6;
    let args = failure_job(transport, "2", "1000");
    let port = free_port();
    let mut ranks: Vec<Child> = (0..world)
        .map(|r| spawn_rank(r, world, port, "stall-test", &args))
        .collect();
    // a source rank, well into the repetitions
    let victim = 2;
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        ranks[victim].try_wait().unwrap().is_none(),
        "the job ended before the stall"
    );
    let pid = ranks[victim].id() as libc::pid_t;
    // SAFETY: signalling a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let started = std::time::Instant::now();
    for (rank, child) in ranks.iter_mut().enumerate().filter(|(r, _)| *r != victim) {
        while child.try_wait().unwrap().is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "rank {rank} still runs 30 s after rank {victim} stalled"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let elapsed = started.elapsed();
    // SAFETY: as above; the stopped rank is ended, then reaped.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut rest = Vec::new();
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = wait_bounded(child, Duration::from_secs(10), &format!("rank {rank}"));
        if rank != victim {
            rest.push((rank, out));
        }
    }
    for (rank, out) in rest {
        let err = text(&out.stderr);
        assert!(!out.status.success(), "rank {rank} succeeded: {err}");
        assert!(
            err.contains(&format!("rank {victim}")),
            "rank {rank} does not name rank {victim}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    // every wait is bounded by the 2 s timeout; allow a few of them in a row and a slow machine
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}

/// A process without the job's token, or from a job of another size, is refused.
#[test]
fn connections_without_the_token_are_refused() {
    let args = [
        "run",
        "--shape",
        "8,8",
        "--src",
        "mesh=1 place=R",
        "--dst",
        "mesh=1 ranks=1 place=R",
        "--transport",
        "tcp",
        "--timeout",
        "3",
    ];
    let port = free_port();
    let root = spawn_rank(0, 2, port, "right", &args);
    let intruder = spawn_rank(1, 2, port, "wrong", &args);
    let out = wait_bounded(intruder, Duration::from_secs(20), "the intruder");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("refused: wrong job token"),
        "{}",
        text(&out.stderr)
    );
    let stranger = spawn_rank(1, 3, port, "right", &args);
    let out = wait_bounded(stranger, Duration::from_secs(20), "the stranger");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("world size 3 does not match"),
        "{}",
        text(&out.stderr)
    );
    // garbage on the rendezvous port is dropped, and the job goes on
    let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _ = garbage.write_all(b"GET / HTTP/1.1\r\n\r\n\xff\xff\xff\xff");
    drop(garbage);
    let member = spawn_rank(1, 2, port, "right", &args);
    let out = wait_bounded(member, Duration::from_secs(20), "the member");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = wait_bounded(root, Duration::from_secs(20), "rank 0");
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Connects to `port`, retrying until the rank that listens there has started.
fn connect_when_listening(port: u16) -> TcpStream {
    let started = std::time::Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(e) if started.elapsed() < Duration::from_secs(60) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("nothing listens on port {port}: {e}"),
        }
    }
}

/// Strangers on the rendezvous port: 100 that connect and say nothing, one that trickles a
/// hello a byte every half second, one that announces a gigabyte and sends 64 KiB of it. A
/// real job of two ranks still forms and completes within its timeout.
#[test]
fn strangers_on_the_rendezvous_port_do_not_stall_the_job() {
    let args = [
        "run",
        "--shape",
        "64,64",
        "--src",
        "mesh=1 place=R",
        "--dst",
        "mesh=1 ranks=1 place=R",
        "--transport",
        "tcp",
        "--verify",
        "--timeout",
        "20",
    ];
    let port = free_port();
    let root = spawn_rank(0, 2, port, "right", &args);
    let mut strangers: Vec<TcpStream> = (0..100).map(|_| connect_when_listening(port)).collect();
    let mut oversized = connect_when_listening(port);
    let mut header = b"RSHD\x01\0\0\0".to_vec();
    header.extend_from_slice(&(1u64 << 30).to_le_bytes());
    let _ = oversized.write_all(&header);
    let _ = oversized.write_all(&vec![b'x'; 64 << 10]);
    strangers.push(oversized);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickler = {
        let stop = stop.clone();
        let mut s = connect_when_listening(port);
        std::thread::spawn(move || {
            let mut hello = b"RSHD\x01\0\0\0\x40\0\0\0\0\0\0\0".to_vec();
            hello.extend_from_slice(&[b' '; 64]);
            for b in hello {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let member = spawn_rank(1, 2, port, "right", &args);
    let out = wait_bounded(member, Duration::from_secs(120), "rank 1");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = wait_bounded(root, Duration::from_secs(120), "rank 0");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("verif"), "{}", text(&out.stdout));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickler.join().unwrap();
    drop(strangers);
}

/// What a rank started with `vars` (over a base of a valid job environment) exits with, and
/// its standard error.
fn rank_with_env(vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = Command::new(EXE);
    command
        .args(["run", "--shape", "8", "--src", "mesh=1 place=R", "--dst"])
        .args([
            "mesh=1 ranks=1 place=R",
            "--transport",
            "tcp",
            "--timeout",
            "5",
        ])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", free_port().to_string())
        .env_remove("RESHARD_TOKEN");
    for &(k, v) in vars {
        command.env(k, v);
    }
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(60), "a rank");
    (out.status.code(), text(&out.stderr))
}

/// A job environment that cannot work is refused at once (exit code 2), naming the variable
/// and its value: no panic for a huge WORLD_SIZE, no wait for a port nobody knows, and no
/// silent fall-back to the default token for an empty one.
#[test]
fn unusable_job_environments_are_refused() {
    let (code, err) = rank_with_env(&[("WORLD_SIZE", "18446744073709551615")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("WORLD_SIZE=\"18446744073709551615\""), "{err}");
    let (code, err) = rank_with_env(&[("WORLD_SIZE", "100000000")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("WORLD_SIZE=\"100000000\""), "{err}");
    let (code, err) = rank_with_env(&[("MASTER_PORT", "0")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("MASTER_PORT=\"0\""), "{err}");
    for blank in ["", "  "] {
        let (code, err) = rank_with_env(&[("RESHARD_TOKEN", blank)]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("RESHARD_TOKEN="), "{err}");
    }
    let out = Command::new(EXE)
        .args(["launch", "--nproc", "2", "--", "run", "--shape", "8"])
        .args(["--src", "mesh=1 place=R", "--dst", "mesh=1 ranks=1 place=R"])
        .env("RESHARD_TOKEN", "")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("RESHARD_TOKEN=\"\""),
        "{}",
        text(&out.stderr)
    );
}

/// A rank that never comes: the others fail within the timeout, naming it.
#[test]
fn a_missing_rank_is_named() {
    let args = [
        "run",
        "--shape",
        "8,8",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=1 place=R",
        "--transport",
        "tcp",
        "--timeout",
        "2",
    ];
    let port = free_port();
    let ranks: Vec<Child> = [0, 1]
        .iter()
        .map(|&r| spawn_rank(r, 3, port, "t", &args))
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = wait_bounded(child, Duration::from_secs(20), "a rank");
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("rank 2 never joined"),
            "rank {rank}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn launch_fails_when_its_ranks_fail() {
    let out = Command::new(EXE)
        .args([
            "launch",
            "--nproc",
            "2",
            "--",
            "run",
            "--shape",
            "8",
            "--src",
            "mesh=4 place=S(0)",
            "--dst",
        ])
        .args(["mesh=1 place=R", "--transport", "tcp"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("[rank 1] error: WORLD_SIZE=\"2\" is invalid"),
        "{err}"
    );
    assert!(
        err.contains("[launch] rank ") && err.contains("the job failed"),
        "{err}"
    );
}

/// Ranks that outrun a short timeout (rank 0 fills a large shard while rank 1 waits): however
/// it turns out, the ranks agree: no rank reports success while another fails.
#[test]
fn ranks_agree_on_the_outcome() {
    let args = [
        "run",
        "--shape",
        "4096,4096",
        "--dtype",
        "f32",
        "--src",
        "mesh=1 ranks=0 place=R",
        "--dst",
        "mesh=1 ranks=0 place=R",
        "--transport",
        "tcp",
        "--timeout",
        "0.3",
    ];
    for _ in 0..3 {
        let port = free_port();
        let ranks: Vec<Child> = (0..2)
            .map(|r| spawn_rank(r, 2, port, "agree", &args))
            .collect();
        let codes: Vec<bool> = ranks
            .into_iter()
            .map(|c| {
                wait_bounded(c, Duration::from_secs(30), "a rank")
                    .status
                    .success()
            })
            .collect();
        assert!(
            codes.iter().all(|&ok| ok == codes[0]),
            "the ranks disagree: {codes:?}"
        );
    }
}

/// `bench` under `launch`: both methods on every transport, every case verified, the report
/// from rank 0 alone.
#[test]
fn bench_suite_runs_over_processes() {
    for transport in ["tcp", "shm"] {
        let child = Command::new(EXE)
            .args(["launch", "--nproc", "8", "--", "bench", "--suite", "refit"])
            .args(["--suite-bytes", "256KiB", "--iters", "2", "--json"])
            .args(["--transport", transport, "--timeout", "30"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "bench under launch");
        assert!(out.status.success(), "{transport}: {}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["transport"], transport);
        let cases = j["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 9);
        for c in cases {
            assert_eq!(c["verified"], true, "{c}");
            assert_eq!(c["iters"], 2);
        }
        let tp = cases
            .iter()
            .find(|c| c["name"] == "tp4-s0-to-tp4-s1")
            .unwrap();
        assert_eq!(tp["byte_ratio"], 7.0, "{tp}");
    }
}

/// A small Qwen3-shaped model (real structure, small sizes), refit for real over processes:
/// training TP2 x PP2 to inference TP4 and to TP2 x DP2 (fused qkv_proj and gate_up_proj),
/// every destination byte verified for both methods.
#[test]
fn refit_runs_over_processes() {
    let scratch = common::temp_dir("refit");
    let dir = scratch.path();
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000,
            "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    // and a small Qwen3-MoE: stacked experts, vLLM's w13 fused along dim 1 of [E, 2I, H]
    let moe = common::tiny_moe_config(dir);
    for (model, train, transport, infer, pack_below) in [
        (&config, "tp=2,pp=2", "tcp", "tp=4", "64KiB"),
        (&config, "tp=2,pp=2", "shm", "tp=2,dp=2", "0"),
        (&config, "tp=2,pp=2", "shm", "tp=4", "1MiB"),
        (&moe, "tp=2,ep=2,pp=2", "tcp", "tp=4", "1MiB"),
        (&moe, "tp=2,ep=2,pp=2", "shm", "tp=2,ep=2", "0"),
    ] {
        let child = Command::new(EXE)
            .args(["launch", "--nproc", "8", "--", "refit", "--model"])
            .arg(model)
            .args(["--train", train, "--infer", infer, "--run", "--json"])
            .args(["--transport", transport, "--iters", "1", "--timeout", "30"])
            .args(["--pack-below", pack_below])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "refit under launch");
        assert!(
            out.status.success(),
            "{transport} {infer}: {}",
            text(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let run = &j["run"];
        assert_eq!(run["verified"], true, "{run}");
        assert_eq!(run["transport"], transport);
        // every destination byte, once: what the plan moves (the sides share no rank)
        let planned = &j["reshard"];
        assert_eq!(
            run["dst_bytes"].as_u64().unwrap(),
            planned["bytes_remote"].as_u64().unwrap() + planned["bytes_local"].as_u64().unwrap()
        );
        if pack_below == "0" {
            assert_eq!(run["reshard"]["wire_bytes"], planned["bytes_remote"], "{j}");
        }
        assert_eq!(
            run["gather_broadcast"]["wire_bytes"], j["gather_broadcast"]["bytes"],
            "{j}"
        );
    }
}

/// Under `launch`: `verified` is what the ranks' checks found (true with `--verify`, false
/// without), and `--dump` at a regular file fails every rank by name before any byte moves.
#[test]
fn verified_and_dump_checks_over_processes() {
    let scratch = common::temp_dir("dump-check");
    let dir = scratch.path();
    let file = dir.join("not-a-dir");
    std::fs::write(&file, b"keep").unwrap();
    let job = [
        "run",
        "--shape",
        "8,8",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=4 place=S(1)",
        "--transport",
        "tcp",
        "--timeout",
        "30",
        "--json",
    ];
    let launch = |extra: &[&str]| {
        let child = Command::new(EXE)
            .args(["launch", "--nproc", "6", "--"])
            .args(job)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_bounded(child, Duration::from_secs(120), "run under launch")
    };
    for (extra, verified) in [(&["--verify"][..], true), (&[], false)] {
        let out = launch(extra);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["verified"], verified, "{j}");
    }
    let out = launch(&["--verify", "--dump", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&format!(
            "error: --dump: {} is invalid: it exists and is not a directory",
            file.display()
        )),
        "{}",
        text(&out.stderr)
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
}

/// `refit --run --checksum` over processes: the batched executor's transfers (pieces of many
/// tensors, small ones packed) carry their sums over tcp and shm, and the refit verifies.
#[test]
fn checksummed_refit_runs_over_processes() {
    let scratch = common::temp_dir("refit-sums");
    let moe = common::tiny_moe_config(scratch.path());
    for (transport, pack_below) in [("tcp", "64KiB"), ("shm", "0")] {
        let child = Command::new(EXE)
            .args(["launch", "--nproc", "8", "--", "refit", "--model"])
            .arg(&moe)
            .args([
                "--train",
                "tp=2,ep=2,pp=2",
                "--infer",
                "tp=4",
                "--run",
                "--json",
            ])
            .args(["--transport", transport, "--iters", "1", "--timeout", "30"])
            .args(["--pack-below", pack_below, "--checksum"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "refit under launch");
        assert!(out.status.success(), "{transport}: {}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["run"]["verified"], true, "{j}");
        assert_eq!(j["run"]["transport"], transport);
    }
}
