//! The two-phase decision under `mpirun`: the same machine as over tcp, fed MPI's messages.
//! Built only with `--features mpi` (needs an MPI library and `mpirun`).
#![cfg(feature = "mpi")]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use reshard_core::agreement::Fingerprint;
use reshard_transport::Job;
use reshard_transport::control::Decision;
use reshard_transport::mpi::MpiJob;

/// Set for the ranks that `mpirun` starts: the rank that votes not prepared, or `none`.
const RANK_VAR: &str = "RESHARD_MPI_DECIDE";

/// One rank under `mpirun`; does nothing unless this process was started as one.
#[test]
fn mpi_decide_rank() {
    let Ok(refuses) = std::env::var(RANK_VAR) else {
        return;
    };
    let job = MpiJob::init().unwrap();
    job.agree(&Fingerprint::new("decide")).unwrap();
    let rank = job.rank();
    let vote = if refuses == rank.to_string() {
        Err(format!("rank {rank}: not staged"))
    } else {
        Ok(())
    };
    let said = match job.decide(vote).unwrap() {
        Decision::Commit => "commit".to_string(),
        Decision::Abort { ranks } => format!("abort {ranks:?}"),
    };
    println!("\nRANK {rank} DECISION {said}");
    job.finish(Ok(serde_json::json!(rank))).unwrap();
}

/// The decision every rank of a job of three printed, by rank.
fn decisions(refuses: &str) -> Vec<String> {
    let session = std::env::temp_dir().join(format!("mpi-decide-{}-{refuses}", std::process::id()));
    std::fs::create_dir_all(&session).unwrap();
    let mut child = Command::new("mpirun")
        .args(["-n", "3", "--oversubscribe"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "mpi_decide_rank",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(RANK_VAR, refuses)
        .env("TMPDIR", &session)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("mpirun did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut found: Vec<(usize, String)> = out
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("RANK ")?;
            let (rank, said) = rest.split_once(" DECISION ")?;
            Some((rank.parse().ok()?, said.to_string()))
        })
        .collect();
    found.sort();
    assert_eq!(found.len(), 3, "{out}");
    found.into_iter().map(|(_, said)| said).collect()
}

#[test]
fn every_rank_prepared_commits_under_mpirun() {
    if std::env::var(RANK_VAR).is_ok() {
        return;
    }
    assert_eq!(decisions("none"), vec!["commit"; 3]);
}

#[test]
fn one_rank_not_prepared_aborts_every_rank_under_mpirun() {
    if std::env::var(RANK_VAR).is_ok() {
        return;
    }
    let abort = format!("abort {:?}", vec![(2usize, "rank 2: not staged")]);
    assert_eq!(decisions("2"), vec![abort; 3]);
}
