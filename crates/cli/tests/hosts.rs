//! `launch --hosts`: ranks on emulated hosts (network and host-name namespaces joined by a
//! bridge, links shaped by tc). The tests that build hosts need root and iproute2's `ip` and
//! `tc`: they are ignored by default, and `.ci/run` (root, with iproute2 installed) runs them
//! with `--include-ignored`; run so without them, they fail saying what is missing.
//!
//! Every job here carries a marker in its environment, inherited by all its processes (the
//! launcher, the namespace holders, the ranks), so that the tests find exactly its processes
//! and namespaces in `/proc`, and can check that none is left behind.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod common;

use common::{EXE, text, wait_bounded};

/// The jobs of this file one at a time: each compares the machine's own interfaces before
/// and after.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A bound on every wait: a hang guard, not a measurement.
const LIMIT: Duration = Duration::from_secs(120);

const MARK_VAR: &str = "RESHARD_TEST_HOSTS_MARK";

/// Fails the test, saying what is missing, unless the emulated hosts can be built here: an
/// ignored test run without what it needs must not pass.
fn require_privileges(test: &str) {
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "{test}: emulated hosts need root (network namespaces)"
    );
    // iproute2 builds them; `.ci/run` installs it where it is missing
    let tools = ["ip", "tc"].iter().all(|tool| {
        Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(tools, "{test}: emulated hosts need iproute2's ip and tc");
}

/// A marker no other job carries.
fn new_mark(name: &str) -> String {
    format!("{name}-{}-{:?}", std::process::id(), Instant::now())
}

/// The processes whose environment carries `mark`: pid -> command line.
fn marked(mark: &str) -> BTreeMap<u32, String> {
    let needle = format!("{MARK_VAR}={mark}");
    let mut found = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmd = text(&cmd).replace('\0', " ");
            // a process that exited between the two reads has no command line: skip it
            if !cmd.is_empty() {
                found.insert(pid, cmd);
            }
        }
    }
    found
}

fn environ_var(pid: u32, var: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{var}=");
    env.split(|&b| b == 0)
        .map(text)
        .find_map(|v| v.strip_prefix(&prefix).map(str::to_string))
}

fn namespace(pid: u32, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Every process's network namespace now.
fn namespaces_in_use() -> BTreeSet<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read_link(e.path().join("ns/net")).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

/// The interfaces of the machine's own network namespace (this test's).
fn root_links() -> BTreeSet<String> {
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    text(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_string())
        .collect()
}

/// Runs `command` inside the network (and host-name) namespace of `pid`.
fn inside(pid: u32, command: &[&str]) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .arg(format!("--uts=/proc/{pid}/ns/uts"))
        .args(command)
        .output()
        .unwrap();
    assert!(out.status.success(), "{command:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

fn launch(mark: &str, launch_args: &[&str], command: &[&str]) -> Command {
    let mut c = Command::new(EXE);
    c.arg("launch")
        .args(launch_args)
        .arg("--")
        .args(command)
        .env(MARK_VAR, mark)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits (bounded) until no process of the job is left, then checks that none of its
/// network namespaces is in use and that the machine's own interfaces are as before.
fn assert_nothing_left(
    mark: &str,
    job_namespaces: &BTreeSet<String>,
    links_before: &BTreeSet<String>,
) {
    let started = Instant::now();
    while !marked(mark).is_empty() {
        assert!(
            started.elapsed() < LIMIT,
            "processes of the job are left: {:?}",
            marked(mark)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // a process the kernel is still tearing down may hold its namespace a moment longer
    let left = loop {
        let in_use = namespaces_in_use();
        let left: Vec<String> = job_namespaces.intersection(&in_use).cloned().collect();
        if left.is_empty() || started.elapsed() >= LIMIT {
            break left;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        left.is_empty(),
        "namespaces of the job still in use: {left:?}"
    );
    let links = root_links();
    assert!(
        links.iter().all(|l| !l.starts_with("rsh-")),
        "the job's links leaked into the machine's namespace: {links:?}"
    );
    assert_eq!(&links, links_before, "the machine's interfaces changed");
    assert!(!std::path::Path::new("/run/netns/host0").exists());
}

const SRC: &str = "mesh=2 ranks=0,2 place=S(0)";
const DST: &str = "mesh=4 ranks=0..4 place=S(1)";

/// 2 hosts x 2 ranks over `auto`, links at 1 Gbit/s (and 1 ms where the kernel can delay):
/// every destination byte verified, ranks of one host on shared memory (shm alone is refused
/// for peers on the other host, so the ranks know the host map), and nothing left after.
#[test]
#[ignore = "needs root and iproute2's ip and tc to build emulated hosts"]
fn two_hosts_of_two_ranks_verify_over_auto_and_leave_nothing() {
    require_privileges("two_hosts_of_two_ranks_verify_over_auto_and_leave_nothing");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let before = root_links();
    let run = |transport: &str| {
        [
            "run",
            "--shape",
            "96,80",
            "--dtype",
            "bf16",
            "--src",
            SRC,
            "--dst",
            DST,
            "--verify",
            "--transport",
        ]
        .into_iter()
        .chain([transport])
        .map(str::to_string)
        .collect::<Vec<_>>()
    };
    let mut shape = vec!["--hosts", "2", "--nproc", "4", "--link", "1gbit"];
    if common::netem_available() {
        shape.extend(["--link-latency", "1"]);
    } else {
        // the clear refusal, then the same job without the delay
        let mark = new_mark("no-netem");
        let args = [
            "--hosts",
            "2",
            "--nproc",
            "4",
            "--link",
            "1gbit",
            "--link-latency",
            "1",
        ];
        let out = wait_bounded(
            launch(
                &mark,
                &args,
                &run("auto").iter().map(String::as_str).collect::<Vec<_>>(),
            )
            .spawn()
            .unwrap(),
            LIMIT,
            "launch without netem",
        );
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("--link-latency") && err.contains("netem"),
            "{err}"
        );
        assert_nothing_left(&mark, &BTreeSet::new(), &before);
        eprintln!("this kernel has no netem: the links are shaped without a delay");
    }
    let mark = new_mark("auto");
    let args = run("auto");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = wait_bounded(
        launch(&mark, &shape, &args).spawn().unwrap(),
        LIMIT,
        "launch --hosts",
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("verify  every destination byte matches"),
        "{stdout}"
    );
    assert_nothing_left(&mark, &BTreeSet::new(), &before);

    let mark = new_mark("shm");
    let args = run("shm");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = wait_bounded(
        launch(&mark, &shape, &args).spawn().unwrap(),
        LIMIT,
        "launch --hosts shm",
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("runs on another host"), "{stderr}");
    assert_nothing_left(&mark, &BTreeSet::new(), &before);
}

/// While a slow job runs: each host is its own network and host name, its ranks share it,
/// both ends of every link carry the queues asked for (read back with tc), and the switch is
/// a bridge of its own namespace. Then `kill -9` of the launcher: every process and
/// namespace of the job goes with it.
#[test]
#[ignore = "needs root and iproute2's ip and tc to build emulated hosts"]
fn the_links_are_shaped_as_asked_and_kill_9_leaves_nothing() {
    require_privileges("the_links_are_shaped_as_asked_and_kill_9_leaves_nothing");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let before = root_links();
    let root_ns = namespace(std::process::id(), "net");
    let netem = common::netem_available();
    let mut args = vec!["--hosts", "2", "--nproc", "4", "--link", "3mbit"];
    if netem {
        args.extend(["--link-latency", "7"]);
    }
    // some 100 s of traffic at 3 Mbit/s: alive until killed
    let job = [
        "bench",
        "--shape",
        "1024,1024",
        "--dtype",
        "bf16",
        "--src",
        SRC,
        "--dst",
        DST,
        "--iters",
        "20",
        "--transport",
        "auto",
    ];
    let mark = new_mark("kill");
    let mut launcher = launch(&mark, &args, &job).spawn().unwrap();
    // the launcher, 3 holders (switch, 2 hosts) and 4 ranks
    let started = Instant::now();
    let procs = loop {
        let procs = marked(&mark);
        if procs.len() == 8 {
            break procs;
        }
        if let Some(status) = launcher.try_wait().unwrap() {
            let out = launcher.wait_with_output().unwrap();
            panic!("the job ended early ({status}): {}", text(&out.stderr));
        }
        assert!(
            started.elapsed() < LIMIT,
            "the job never started: {procs:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let ranks: BTreeMap<usize, u32> = procs
        .iter()
        .filter(|(_, cmd)| cmd.split(' ').nth(1) == Some("bench"))
        .map(|(&pid, _)| (environ_var(pid, "RANK").unwrap().parse().unwrap(), pid))
        .collect();
    assert_eq!(
        ranks.keys().copied().collect::<Vec<_>>(),
        [0, 1, 2, 3],
        "{procs:?}"
    );
    let holders: Vec<u32> = procs
        .iter()
        .filter(|(_, cmd)| cmd.split(' ').nth(1) == Some("netns-holder"))
        .map(|(&pid, _)| pid)
        .collect();
    assert_eq!(holders.len(), 3, "{procs:?}");
    let net = |rank: usize| namespace(ranks[&rank], "net");
    assert_eq!(net(0), net(1));
    assert_eq!(net(2), net(3));
    assert!(net(0) != net(2) && net(0) != root_ns && net(2) != root_ns);
    assert_ne!(namespace(ranks[&0], "uts"), namespace(ranks[&2], "uts"));
    // the job's own namespaces: the switch's and the hosts' (the launcher stays in this one)
    let job_namespaces: BTreeSet<String> = procs
        .keys()
        .map(|&p| namespace(p, "net"))
        .filter(|ns| *ns != root_ns)
        .collect();
    assert_eq!(job_namespaces.len(), 3, "{job_namespaces:?}");

    let rate = "rate 3Mbit";
    for (host, rank) in [(0, 0), (1, 2)] {
        let pid = ranks[&rank];
        assert_eq!(inside(pid, &["hostname"]).trim(), format!("host{host}"));
        assert_eq!(
            environ_var(pid, "RESHARD_HOST").unwrap(),
            format!("host{host}")
        );
        let addr = inside(pid, &["ip", "-o", "-4", "addr", "show", "dev", "eth0"]);
        assert!(
            addr.contains(&format!("inet 10.87.0.{}/24", host + 1)),
            "{addr}"
        );
        let qdiscs = inside(pid, &["tc", "qdisc", "show", "dev", "eth0"]);
        assert!(
            qdiscs.contains("qdisc tbf 1: root") && qdiscs.contains(rate),
            "{qdiscs}"
        );
        if netem {
            assert!(
                qdiscs.contains("netem") && qdiscs.contains("delay 7ms"),
                "{qdiscs}"
            );
        }
        // only loopback and the link: the machine's own interfaces are not there
        let links = inside(pid, &["ip", "-o", "link", "show"]);
        assert_eq!(links.lines().count(), 2, "{links}");
    }
    // the switch: the holder whose namespace no rank has
    let rank_nets: BTreeSet<String> = (0..4).map(net).collect();
    let switch = holders
        .iter()
        .copied()
        .find(|&h| !rank_nets.contains(&namespace(h, "net")))
        .expect("a switch namespace");
    let bridge = inside(switch, &["ip", "-o", "link", "show", "type", "bridge"]);
    assert!(bridge.contains("rsh-switch"), "{bridge}");
    for port in ["rsh-h0", "rsh-h1"] {
        let link = inside(switch, &["ip", "-o", "link", "show", "dev", port]);
        assert!(link.contains("master rsh-switch"), "{link}");
        let qdiscs = inside(switch, &["tc", "qdisc", "show", "dev", port]);
        assert!(qdiscs.contains(rate), "{port}: {qdiscs}");
        if netem {
            assert!(qdiscs.contains("delay 7ms"), "{port}: {qdiscs}");
        }
    }

    // SAFETY: kill(2) on the launcher this test started.
    assert_eq!(
        unsafe { libc::kill(launcher.id() as i32, libc::SIGKILL) },
        0
    );
    let status = launcher.wait().unwrap();
    assert!(!status.success());
    assert_nothing_left(&mark, &job_namespaces, &before);
}

/// Without the capabilities to make namespaces, launch says what it needs (exit code 2),
/// and leaves nothing behind; bad shapes of the job are refused before anything starts.
#[test]
fn without_privileges_the_error_says_what_is_needed() {
    let job = ["run", "--shape", "8,8", "--src", SRC, "--dst", DST];
    let refused = |out: Output, needles: &[&str]| {
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        for n in needles {
            assert!(err.contains(n), "{n}: {err}");
        }
    };
    let mark = new_mark("input");
    let out = launch(&mark, &["--hosts", "3", "--nproc", "4"], &job)
        .output()
        .unwrap();
    refused(out, &["--nproc: 4", "multiple of 3"]);
    let out = launch(&mark, &["--nproc", "4", "--link", "1gbit"], &job)
        .output()
        .unwrap();
    refused(out, &["--hosts"]);
    let out = launch(
        &mark,
        &["--hosts", "2", "--nproc", "4", "--link", "2gbps"],
        &job,
    )
    .output()
    .unwrap();
    refused(out, &["--link: 2gbps", "in bits"]);
}

/// Root without the two capabilities the emulated hosts need is refused, naming them.
#[test]
#[ignore = "needs root, setpriv and iproute2's ip and tc to drop the capabilities emulated hosts need"]
fn without_the_capabilities_the_error_says_what_is_needed() {
    let job = ["run", "--shape", "8,8", "--src", SRC, "--dst", DST];
    let refused = |out: Output, needles: &[&str]| {
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        for n in needles {
            assert!(err.contains(n), "{n}: {err}");
        }
    };
    let mark = new_mark("input");
    require_privileges("without_the_capabilities_the_error_says_what_is_needed");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let before = root_links();
    // root with the two capabilities dropped from its bounding set, so from the launcher
    let c = launch(&mark, &["--hosts", "2", "--nproc", "4"], &job);
    let args: Vec<String> = std::iter::once(c.get_program())
        .chain(c.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut dropped = Command::new("setpriv");
    dropped
        .args([
            "--bounding-set=-sys_admin,-net_admin",
            "--inh-caps=-sys_admin,-net_admin",
        ])
        .args(&args)
        .env(MARK_VAR, &mark);
    let out = dropped
        .output()
        .unwrap_or_else(|e| panic!("setpriv (util-linux) drops the capabilities: {e}"));
    refused(out, &["--hosts", "CAP_SYS_ADMIN", "CAP_NET_ADMIN", "root"]);
    assert_nothing_left(&mark, &BTreeSet::new(), &before);
}

/// 2 hosts x 2 ranks: the ranks plan on the host map they learned at rendezvous without being
/// given `--hosts`, and relay: the two ranks of host 1 that need the same column half get it
/// across the link once, one of them forwarding it over shared memory; every byte verified,
/// with checksums on every hop, and the busiest link carries half of what it does without relay.
#[test]
#[ignore = "needs root and iproute2's ip and tc to build emulated hosts"]
fn ranks_on_emulated_hosts_relay_what_they_share_and_verify() {
    require_privileges("ranks_on_emulated_hosts_relay_what_they_share_and_verify");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let before = root_links();
    let busiest = |relay: &str| {
        let mark = new_mark("relay");
        let args = [
            "run",
            "--shape",
            "256,192",
            "--dtype",
            "bf16",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=2 ranks=2..4 place=R",
            "--transport",
            "auto",
            "--verify",
            "--checksum",
            "--json",
            "--relay",
            relay,
        ];
        let out = launch(
            &mark,
            &["--hosts", "2", "--nproc", "4", "--link", "1gbit"],
            &args,
        )
        .output()
        .unwrap();
        assert!(out.status.success(), "relay {relay}: {}", text(&out.stderr));
        assert_nothing_left(&mark, &BTreeSet::new(), &before);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["verified"], true, "{json}");
        assert_eq!(json["hosts"], "2x2", "{json}");
        assert_eq!(json["relay"], relay == "on", "{json}");
        json["busiest_link_bytes"].as_u64().unwrap()
    };
    let tensor = 256 * 192 * 2;
    assert_eq!(busiest("on"), tensor);
    assert_eq!(busiest("off"), 2 * tensor);
}

#[test]
#[ignore = "needs root and iproute2's ip and tc to build emulated hosts"]
fn exec_runs_any_program_on_the_emulated_hosts() {
    require_privileges("exec_runs_any_program_on_the_emulated_hosts");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mark = new_mark("exec");
    // each rank says where it runs: its host name (its own UTS namespace), its rendezvous
    // address (host 0's private one) and its rank
    let script = "echo \"at $(uname -n) rank $RANK local $LOCAL_RANK of $WORLD_SIZE master $MASTER_ADDR if $GLOO_SOCKET_IFNAME\"";
    let out = launch(
        &mark,
        &["--hosts", "2", "--nproc", "4", "--exec"],
        &["sh", "-c", script],
    )
    .output()
    .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains(" master ")).collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    let hosts: std::collections::BTreeSet<&str> = lines
        .iter()
        .map(|l| l.split("at ").nth(1).unwrap().split(' ').next().unwrap())
        .collect();
    assert_eq!(hosts.len(), 2, "{stdout}");
    assert!(
        lines.iter().all(|l| !l.contains("master 127.0.0.1")),
        "{stdout}"
    );
    assert!(marked(&mark).is_empty(), "ranks outlived the launcher");
}
