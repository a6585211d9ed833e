//! Resource limits (`ulimit -v`, `ulimit -u`): a command that runs out of memory or threads
//! ends with an error that says so, never with an abort, a panic or a hang.

use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_reshard");

/// Far more than any of these commands needs, even on a loaded machine: reaching it means the
/// command hung.
const BOUND: Duration = Duration::from_secs(300);

struct Ended {
    status: ExitStatus,
    stderr: String,
}

/// Runs `reshard ARGS` under the shell limits `limits` (e.g. `ulimit -v 200000`), through
/// `wrap` if not empty, with
/// backtraces on (the setting under which a panic could once hang); kills it and fails the
/// test if it has not ended within [`BOUND`]. Output goes to files, so that a full pipe cannot
/// stall the command.
fn reshard_limited(name: &str, wrap: &[&str], limits: &str, args: &[&str]) -> Ended {
    let dir = std::env::temp_dir().join(format!("reshard-limits-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let script = format!("{limits}; exec \"$0\" \"$@\"");
    // `wrap` (e.g. a change of user) runs the shell that sets the limits and becomes reshard
    let mut command = match wrap.split_first() {
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg("bash");
            c
        }
        None => Command::new("bash"),
    };
    let mut child = command
        .args(["-c", &script, EXE])
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = std::fs::read_to_string(&err).unwrap_or_default();
            let _ = std::fs::remove_dir_all(&dir);
            panic!(
                "`reshard {}` under `{limits}` hung; it said:\n{stderr}",
                args.join(" ")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = String::from_utf8_lossy(&std::fs::read(&err).unwrap()).into_owned();
    let _ = std::fs::remove_dir_all(&dir);
    Ended { status, stderr }
}

/// No panic, no abort: an exit code of 1 or 2 and an `error:` line.
fn assert_clean_error(ended: &Ended, mentions: &str) {
    let err = &ended.stderr;
    assert!(
        matches!(ended.status.code(), Some(1 | 2)),
        "{:?}: {err}",
        ended.status
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("error:") && err.contains(mentions), "{err}");
}

/// 512 MiB of bf16 on each side: more than the 300 MB of address space allowed below.
const LARGE: [&str; 6] = [
    "--shape",
    "16384,16384",
    "--src",
    "mesh=2 place=S(0)",
    "--dst",
    "mesh=4 place=S(1)",
];

#[test]
fn run_out_of_memory_is_an_error_naming_memory() {
    let ended = reshard_limited(
        "run",
        &[],
        "ulimit -v 300000",
        &[&["run"], &LARGE[..]].concat(),
    );
    assert_clean_error(&ended, "memory");
}

/// 512 MiB of bf16 from rank 0 to ranks 1 and 2.
const LARGE_3: [&str; 6] = [
    "--shape",
    "16384,16384",
    "--src",
    "mesh=1 place=R",
    "--dst",
    "mesh=2 place=S(1)",
];

fn launch_large() -> Vec<&'static str> {
    [
        &["launch", "--nproc", "3", "--", "run", "--transport", "tcp"][..],
        &["--timeout", "5"],
        &LARGE_3[..],
    ]
    .concat()
}

#[test]
fn launch_out_of_memory_ends_with_an_error() {
    let args = launch_large();
    let ended = reshard_limited("launch", &[], "ulimit -v 300000", &args);
    assert_clean_error(&ended, "memory");
    assert!(ended.stderr.contains("[launch]"), "{}", ended.stderr);
}

/// So little address space that the launcher itself may not get far: whatever fails (its
/// output threads, a small allocation, its ranks), the launcher ends, and nothing panics. It
/// once panicked on a thread it could not start, then hung for ever printing the backtrace.
/// The limits sweep the band where that happens for release and debug builds alike.
#[test]
fn launch_with_almost_no_memory_ends() {
    for limit in (16_000..=40_000).step_by(2_000) {
        let args = launch_large();
        let ended = reshard_limited("launch-low", &[], &format!("ulimit -v {limit}"), &args);
        assert!(!ended.status.success(), "{}", ended.stderr);
        assert!(!ended.stderr.contains("panicked"), "{}", ended.stderr);
    }
}

/// `ulimit -u` does not bind root, so the command runs as `nobody` (root can switch to it with
/// setpriv); elsewhere the test cannot check anything, so it is ignored by default and
/// `.ci/run` (root) runs it with `--include-ignored`; run so without root or setpriv, it fails
/// saying what is missing.
#[test]
#[ignore = "needs root and setpriv to run as a user that `ulimit -u` binds"]
fn out_of_threads_is_an_error_naming_the_thread() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "needs root to run the command as a user that `ulimit -u` binds"
    );
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| PathBuf::from(p).exists())
        .expect("needs setpriv (util-linux) to run the command as `nobody`");
    let wrap = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"];
    let args = [
        "run",
        "--shape",
        "64,64",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=4 place=S(1)",
    ];
    let ended = reshard_limited("threads", &wrap, "ulimit -u 2", &args);
    assert_eq!(ended.status.code(), Some(1), "{}", ended.stderr);
    assert!(!ended.stderr.contains("panicked"), "{}", ended.stderr);
    assert!(
        ended.stderr.contains("cannot start a thread for rank"),
        "{}",
        ended.stderr
    );
    // planning a model uses a pool of worker threads, which rayon would start with a panic
    let args = [
        "refit",
        "--model",
        "qwen3-0.6b",
        "--train",
        "dp=2",
        "--infer",
        "tp=2",
    ];
    let ended = reshard_limited("pool", &wrap, "ulimit -u 1", &args);
    assert_eq!(ended.status.code(), Some(1), "{}", ended.stderr);
    assert!(!ended.stderr.contains("panicked"), "{}", ended.stderr);
    assert!(
        ended
            .stderr
            .contains("cannot start a thread for the worker pool"),
        "{}",
        ended.stderr
    );
}

/// A process count no machine can hold is an error naming `--nproc`, not an abort of the
/// launcher.
#[test]
fn launch_of_more_processes_than_memory_can_list_is_an_error() {
    let args = ["launch", "--nproc", "100000000000000", "--", "plan"];
    let ended = reshard_limited("nproc", &[], "true", &args);
    assert_clean_error(&ended, "--nproc: 100000000000000 is invalid");
}
