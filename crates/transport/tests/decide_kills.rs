//! Kill -9 trials of the two-phase decision across processes: jobs of three ranks over tcp
//! (this test binary, run again once per rank) agree, vote and finish, while one rank is
//! killed at a random moment. Whatever the moment, no rank commits while another aborts, and
//! every rank that lives says what it did: committed, aborted, in doubt, or failed before it
//! voted.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use reshard_core::agreement::Fingerprint;
use reshard_transport::Job;
use reshard_transport::control::Decision;
use reshard_transport::group::{Group, GroupEnv};

/// Set in a rank's environment: `RANK,WORLD,PORT,SEED`.
const RANK_VAR: &str = "RESHARD_DECIDE_TRIAL";

const WORLD: usize = 3;

const TRIALS: usize = 20;

/// The job's timeout: short, so that a rank killed before the rendezvous costs little.
const TIMEOUT: Duration = Duration::from_millis(500);

/// xorshift64: the trials' moments, reproducible from the seed a failure prints.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One rank of a trial; does nothing unless this process was started as one.
#[test]
fn trial_rank() {
    let Ok(spec) = std::env::var(RANK_VAR) else {
        return;
    };
    let fields: Vec<u64> = spec.split(',').map(|f| f.parse().unwrap()).collect();
    let (rank, world, port, seed) = (
        fields[0] as usize,
        fields[1] as usize,
        fields[2] as u16,
        fields[3],
    );
    let mut rng = Rng(seed | 1);
    let env = GroupEnv {
        rank,
        world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        token: "decide-trials".into(),
        host: "trials".into(),
    };
    let group = match Group::join(env, TIMEOUT)
        .and_then(|g| g.agree(&Fingerprint::new("trial")).map(|()| g))
    {
        Ok(g) => g,
        Err(e) => {
            println!("BEFORE {e}");
            return;
        }
    };
    // the data phase, of a random length
    std::thread::sleep(Duration::from_millis(rng.below(30)));
    let decision = group.decide(Ok(()));
    println!(
        "DECISION {}",
        match &decision {
            Ok(Decision::Commit) => "commit".to_string(),
            Ok(Decision::Abort { .. }) => "abort".to_string(),
            Err(reshard_core::error::Error::InDoubt { .. }) => "in-doubt".to_string(),
            Err(e) => format!("error {e}"),
        }
    );
    // applying it
    std::thread::sleep(Duration::from_millis(rng.below(10)));
    let finish = group.finish(Ok(serde_json::json!(rank)));
    println!("FINISH {}", if finish.is_ok() { "ok" } else { "failed" });
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for `child`, killing it (and failing) should it outlive every bounded wait of a
/// rank by far; its standard output.
fn output_of(mut child: Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait().unwrap() {
            Some(_) => break,
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("a rank did not end: a wait without a bound");
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    out
}

#[test]
fn kill_9_at_random_moments_leaves_the_living_ranks_agreed() {
    if std::env::var(RANK_VAR).is_ok() {
        return;
    }
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut rng = Rng(seed | 1);
    let exe = std::env::current_exe().unwrap();
    for trial in 0..TRIALS {
        let port = free_port();
        let mut children: Vec<Child> = (0..WORLD)
            .map(|r| {
                Command::new(&exe)
                    .args(["--exact", "trial_rank", "--nocapture", "--test-threads=1"])
                    .env(
                        RANK_VAR,
                        format!("{r},{WORLD},{port},{}", rng.below(u64::MAX)),
                    )
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let victim = rng.below(WORLD as u64) as usize;
        let moment = Duration::from_millis(rng.below(60));
        std::thread::sleep(moment);
        // SIGKILL, to this trial's own child, by its handle
        let _ = children[victim].kill();
        let outputs: Vec<String> = children.drain(..).map(output_of).collect();
        let what = format!(
            "seed {seed}, trial {trial}: rank {victim} killed after {moment:?}; ranks said {outputs:?}"
        );
        let decisions: Vec<Option<&str>> = outputs
            .iter()
            .map(|o| {
                // the harness starts the first line: "test trial_rank ... DECISION commit"
                o.lines()
                    .find_map(|l| l.split_once("DECISION ").map(|(_, d)| d.trim()))
            })
            .collect();
        for (r, out) in outputs.iter().enumerate().filter(|&(r, _)| r != victim) {
            assert!(
                decisions[r].is_some() || out.contains("BEFORE "),
                "rank {r} lives but said nothing of its decision; {what}"
            );
        }
        for d in decisions.iter().flatten() {
            assert!(
                ["commit", "abort", "in-doubt"].contains(d),
                "a decision that is neither: {d}; {what}"
            );
        }
        let commits = decisions.contains(&Some("commit"));
        let aborts = decisions.contains(&Some("abort"));
        assert!(
            !(commits && aborts),
            "some ranks committed, others aborted; {what}"
        );
        if decisions.contains(&Some("in-doubt")) {
            assert_eq!(victim, 0, "in doubt while rank 0 lived; {what}");
        }
        println!("trial {trial}: rank {victim} killed after {moment:?}: {decisions:?}");
    }
}
