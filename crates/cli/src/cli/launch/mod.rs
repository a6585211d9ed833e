//! `reshard launch`: start N local processes with torchrun's rendezvous environment, on this
//! host or (`--hosts H`) on H emulated hosts with shaped links between them.

mod link;
mod netns;

pub use netns::{HOLDER_COMMAND, hold};

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use reshard::Error;
use reshard::error::Field;
use reshard::limits::MAX_LOCAL_PROCESSES;
use reshard::transport::group::check_token;

use super::Failure;

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Number of processes (ranks 0..N).
    #[arg(long)]
    nproc: usize,
    /// Run the ranks on H emulated hosts (consecutive ranks per host; N must be a multiple of
    /// H): each host its own network namespace and host name, joined through an emulated
    /// switch. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2.
    #[arg(long, value_name = "H")]
    hosts: Option<usize>,
    /// With --hosts: shape each host's link to RATE each way, as tc writes rates (e.g.
    /// 2gbit, 100mbit).
    #[arg(long, value_name = "RATE", requires = "hosts")]
    link: Option<String>,
    /// With --hosts: delay each host's link by MS milliseconds each way (needs the kernel's
    /// netem queueing discipline).
    #[arg(long, value_name = "MS", requires = "hosts")]
    link_latency: Option<String>,
    /// Rendezvous port on 127.0.0.1 (default: a free one).
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds the other ranks get to report their own error after one fails, before they are
    /// killed.
    #[arg(long, default_value_t = 10.0)]
    grace: f64,
    /// Run the program that ARGS name (its path, then its arguments) on every rank instead of
    /// a reshard command: a torch.distributed job reads the same environment (a Python RL
    /// loop across emulated hosts, say).
    #[arg(long)]
    exec: bool,
    /// The reshard command every rank runs, e.g. `run --transport tcp ...` (with --exec, the
    /// program and its arguments).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required = true,
        value_name = "ARGS"
    )]
    command: Vec<String>,
}

/// 32 hex digits from the kernel's random source: the job's token.
fn random_token() -> Result<String, Error> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| Error::Io {
            path: "/dev/urandom".into(),
            source,
        })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Copies a child's output: rank 0's stdout unchanged, every other stream line by line with
/// a `[rank R]` prefix. A thread the system will not start is an error, not a panic: the
/// launcher must end cleanly, with its children, when it runs out of threads or memory.
fn forward(
    rank: usize,
    stream: impl Read + Send + 'static,
    to_stdout: bool,
) -> Result<std::thread::JoinHandle<()>, Error> {
    let which = if to_stdout { "stdout" } else { "stderr" };
    // a small stack: it copies through a buffer on the heap, and a launcher held to little
    // memory (ulimit -v) must still start one per stream of every rank
    let spawned = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            if rank == 0 && to_stdout {
                // unchanged bytes, the lock taken per piece so that other ranks' lines get through
                let mut stream = stream;
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n @ 1..) = stream.read(&mut buf) {
                    let mut out = std::io::stdout().lock();
                    if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                        return;
                    }
                }
                return;
            }
            for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
                let text = format!("[rank {rank}] {}\n", String::from_utf8_lossy(&line));
                let _ = if to_stdout {
                    std::io::stdout().lock().write_all(text.as_bytes())
                } else {
                    std::io::stderr().lock().write_all(text.as_bytes())
                };
            }
        });
    spawned.map_err(|source| Error::ThreadStart {
        what: format!("forwarding rank {rank}'s {which}"),
        source,
    })
}

/// Kills and reaps every child started so far: the job cannot go on without the launcher.
fn stop_all(children: &mut [Child]) {
    for c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn code(status: ExitStatus) -> u8 {
    status
        .code()
        .map_or(1, |c| u8::try_from(c).unwrap_or(1).max(1))
}

pub fn main(args: &LaunchArgs) -> Result<std::process::ExitCode, Failure> {
    if args.nproc == 0 {
        return Err(Failure::Input(Error::InvalidOption {
            field: Field::Flag("--nproc"),
            value: "0".into(),
            reason: "at least one process is needed".into(),
        }));
    }
    if args.nproc > MAX_LOCAL_PROCESSES {
        return Err(Failure::Input(Error::InvalidOption {
            field: Field::Flag("--nproc"),
            value: args.nproc.to_string(),
            reason: format!(
                "more than the {MAX_LOCAL_PROCESSES} processes launch starts on one host (for larger jobs, start the ranks with mpirun or a cluster launcher)"
            ),
        }));
    }
    if args.master_port == Some(0) {
        // port 0 would make the rendezvous listen on a random port that no rank knows
        return Err(Failure::Input(Error::InvalidOption {
            field: Field::Flag("--master-port"),
            value: "0".into(),
            reason: "the ranks need a fixed port to meet at; give one from 1 to 65535, or leave --master-port out to get a free one".into(),
        }));
    }
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        return Err(Failure::Input(Error::InvalidOption {
            field: Field::Flag("--grace"),
            value: args.grace.to_string(),
            reason: "expected a non-negative number of seconds".into(),
        }));
    }
    let hosts = args
        .hosts
        .map(|h| {
            link::Hosts::new(
                h,
                args.nproc,
                args.link.as_deref(),
                args.link_latency.as_deref(),
            )
        })
        .transpose()?;
    let port = match args.master_port {
        Some(p) => p,
        None => TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|source| Error::Io {
                path: "127.0.0.1:0".into(),
                source,
            })?,
    };
    // a token set for the job is checked as every rank would check it: an empty one is a
    // mistake to report, not a reason to make up another
    let token = match std::env::var("RESHARD_TOKEN") {
        Ok(t) => {
            check_token(&t)?;
            t
        }
        Err(std::env::VarError::NotPresent) => random_token()?,
        Err(std::env::VarError::NotUnicode(value)) => {
            return Err(Failure::Input(Error::Env {
                var: "RESHARD_TOKEN",
                value: value.to_string_lossy().into_owned(),
                reason: "is not valid UTF-8".into(),
            }));
        }
    };
    let exe = std::env::current_exe().map_err(|source| Error::Io {
        path: "the reshard executable".into(),
        source,
    })?;
    // the emulated hosts, when asked for: built before any rank starts, and gone with the
    // launcher (dropped at the end, or killed with it)
    let network = match hosts {
        Some(plan) => Some(netns::Network::start(&exe, plan).map_err(|e| match e {
            e @ Error::InvalidOption { .. } => Failure::Input(e),
            e => Failure::Run(e),
        })?),
        None => None,
    };
    let parent = netns::launcher_pid();
    let mut children: Vec<Child> = Vec::new();
    children
        .try_reserve_exact(args.nproc)
        .map_err(|_| Error::OutOfMemory {
            what: format!("the table of {} processes", args.nproc),
            bytes: (args.nproc as u64).saturating_mul(std::mem::size_of::<Child>() as u64),
        })?;
    let mut forwarders = Vec::new();
    let (program, program_args) = match (args.exec, args.command.split_first()) {
        (true, Some((program, rest))) => (std::path::PathBuf::from(program), rest),
        _ => (exe.clone(), &args.command[..]),
    };
    for rank in 0..args.nproc {
        let mut command = Command::new(&program);
        // SAFETY: system calls only; the kernel kills this child when the launcher dies, so
        // that no rank outlives it.
        unsafe {
            command.pre_exec(move || {
                netns::die_with_parent(parent);
                Ok(())
            });
        }
        let (local_rank, local_world, master) = match (&network, hosts) {
            (Some(network), Some(plan)) => {
                let host = plan.host_of(rank);
                network.enter(host, &mut command);
                // torch.distributed's gloo and NCCL bind the interface these name, not the
                // loopback that the host name resolves to
                command
                    .env("RESHARD_HOST", link::host_name(host))
                    .env("GROUP_RANK", host.to_string())
                    .env("GLOO_SOCKET_IFNAME", link::HOST_DEVICE)
                    .env("NCCL_SOCKET_IFNAME", link::HOST_DEVICE);
                (
                    rank % plan.per_host,
                    plan.per_host,
                    link::address(0).to_string(),
                )
            }
            _ => (rank, args.nproc, "127.0.0.1".to_string()),
        };
        let spawned = command
            .args(program_args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", args.nproc.to_string())
            .env("LOCAL_WORLD_SIZE", local_world.to_string())
            .env("MASTER_ADDR", master)
            .env("MASTER_PORT", port.to_string())
            .env("RESHARD_TOKEN", &token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(source) => {
                stop_all(&mut children);
                return Err(Failure::Run(Error::Io {
                    path: program.display().to_string(),
                    source,
                }));
            }
        };
        let (out, err) = (child.stdout.take(), child.stderr.take());
        children.push(child);
        let started = out
            .map(|out| forward(rank, out, true))
            .into_iter()
            .chain(err.map(|err| forward(rank, err, false)))
            .collect::<Result<Vec<_>, Error>>();
        match started {
            Ok(started) => forwarders.extend(started),
            Err(e) => {
                // the children die; their pipes close, so the forwarders started so far end
                stop_all(&mut children);
                for f in forwarders {
                    let _ = f.join();
                }
                return Err(Failure::Run(e));
            }
        }
    }

    // Wait for all; after the first failure, give the others `grace` to fail on their own
    // (reporting what they saw), then kill what is left.
    let mut status: Vec<Option<ExitStatus>> = vec![None; args.nproc];
    let mut first_failure: Option<(usize, Instant)> = None;
    let grace = Duration::from_secs_f64(args.grace);
    while status.iter().any(Option::is_none) {
        for (rank, child) in children.iter_mut().enumerate() {
            if status[rank].is_some() {
                continue;
            }
            if let Ok(Some(s)) = child.try_wait() {
                status[rank] = Some(s);
                if !s.success() && first_failure.is_none() {
                    first_failure = Some((rank, Instant::now()));
                }
            }
        }
        if first_failure.is_some_and(|(_, at)| at.elapsed() >= grace) {
            for (rank, child) in children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    let _ = child.kill();
                    status[rank] = child.wait().ok();
                    eprintln!("[launch] killed rank {rank}: another rank had failed");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for f in forwarders {
        let _ = f.join();
    }
    drop(network);
    match first_failure {
        None => Ok(std::process::ExitCode::SUCCESS),
        Some((rank, _)) => {
            let s = status[rank].expect("a failed rank has a status");
            eprintln!("[launch] rank {rank} failed ({s}); the job failed");
            Ok(std::process::ExitCode::from(code(s)))
        }
    }
}
