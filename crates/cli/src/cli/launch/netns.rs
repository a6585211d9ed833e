//! Emulated hosts for `launch --hosts`: a network namespace and a host name (UTS namespace)
//! per host, joined through a bridge in a namespace of its own (the switch), each host's link
//! shaped with tc on both of its ends.
//!
//! Every namespace is held by a child of the launcher alone (the hidden `netns-holder`
//! command, which waits for its standard input to close): no name is mounted under
//! `/run/netns`, nothing is added to the machine's own namespace, and when the holders and the
//! ranks are gone (the job ended, failed, or the launcher was killed: every child dies with
//! it), the kernel removes the namespaces with their links, bridge and queues.
//!
//! The ranks of one host share its network namespace and everything else of the machine
//! (memory, `/dev/shm`, process ids), as the processes of one real host do; between hosts
//! there is only the emulated network.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use reshard::Error;
use reshard::error::Field;

use super::link::{self, Hosts};

/// The hidden command that holds a namespace: it reads its standard input until it closes.
pub const HOLDER_COMMAND: &str = "netns-holder";

/// What the error says is needed to emulate hosts.
const NEEDS: &str = "emulated hosts need root (CAP_SYS_ADMIN to create network and host-name \
                     namespaces, CAP_NET_ADMIN to build their links): run launch as root, or \
                     leave out --hosts";

/// A process that holds namespaces, and handles to them.
struct Holder {
    child: Child,
    net: File,
    uts: Option<File>,
}

/// The switch and the hosts of a job; dropping it ends the holders, and so the namespaces
/// once the ranks are gone too.
pub struct Network {
    switch: Holder,
    hosts: Vec<Holder>,
    plan: Hosts,
}

/// Asks the kernel to kill this child when the launcher dies, and ends it now if the
/// launcher (`parent`) is already gone. Runs between fork and exec: system calls only.
pub fn die_with_parent(parent: libc::pid_t) {
    // SAFETY: prctl, getppid and _exit are async-signal-safe system calls.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            libc::_exit(1);
        }
    }
}

pub fn launcher_pid() -> libc::pid_t {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}

/// Starts a holder of new namespaces (`flags`), named `host_name` if it has a UTS namespace.
fn spawn_holder(exe: &Path, flags: libc::c_int, host_name: Option<&str>) -> std::io::Result<Child> {
    let parent = launcher_pid();
    // made before the fork: the child only makes system calls
    let name: Option<Vec<u8>> = host_name.map(|n| n.as_bytes().to_vec());
    let mut command = Command::new(exe);
    command
        .arg(HOLDER_COMMAND)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: the closure makes system calls only (no allocation, no locks).
    unsafe {
        command.pre_exec(move || {
            die_with_parent(parent);
            if libc::unshare(flags) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(name) = &name
                && libc::sethostname(name.as_ptr().cast(), name.len()) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn()
}

fn namespace(child: &Child, kind: &str) -> Result<File, Error> {
    let path = format!("/proc/{}/ns/{kind}", child.id());
    File::open(&path).map_err(|source| Error::Io { path, source })
}

impl Holder {
    fn start(exe: &Path, host_name: Option<&str>) -> Result<Holder, Error> {
        let flags = match host_name {
            Some(_) => libc::CLONE_NEWNET | libc::CLONE_NEWUTS,
            None => libc::CLONE_NEWNET,
        };
        let mut child =
            spawn_holder(exe, flags, host_name).map_err(|source| match source.kind() {
                ErrorKind::PermissionDenied => Error::InvalidOption {
                    field: Field::Flag("--hosts"),
                    value: "(namespaces)".into(),
                    reason: format!("{NEEDS} (creating a network namespace: {source})"),
                },
                _ => Error::Io {
                    path: format!("{} {HOLDER_COMMAND}", exe.display()),
                    source,
                },
            })?;
        let handles = namespace(&child, "net").and_then(|net| {
            let uts = host_name.map(|_| namespace(&child, "uts")).transpose()?;
            Ok((net, uts))
        });
        match handles {
            Ok((net, uts)) => Ok(Holder { child, net, uts }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `program -batch -` (iproute2's `ip` or `tc`) inside the network namespace `ns`,
/// feeding it `lines`; `what` names the namespace in errors.
fn run_batch(ns: &File, program: &str, lines: &[String], what: &str) -> Result<(), Error> {
    if lines.is_empty() {
        return Ok(());
    }
    let (fd, parent): (RawFd, _) = (ns.as_raw_fd(), launcher_pid());
    let mut command = Command::new(program);
    command
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: system calls only.
    unsafe {
        command.pre_exec(move || {
            die_with_parent(parent);
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|source| match source.kind() {
        ErrorKind::NotFound => Error::InvalidOption {
            field: Field::Flag("--hosts"),
            value: program.into(),
            reason: format!(
                "emulated hosts need iproute2's `ip` and `tc` on the PATH (Debian and Ubuntu: \
                 apt-get install iproute2); `{program}` was not found"
            ),
        },
        ErrorKind::PermissionDenied => Error::InvalidOption {
            field: Field::Flag("--hosts"),
            value: "(namespaces)".into(),
            reason: format!("{NEEDS} (entering a network namespace: {source})"),
        },
        _ => Error::Io {
            path: program.into(),
            source,
        },
    })?;
    let script = lines.join("\n") + "\n";
    if let Some(mut stdin) = child.stdin.take() {
        // a batch that fails early may close its input: its status says why
        let _ = stdin.write_all(script.as_bytes());
    }
    let output = child.wait_with_output().map_err(|source| Error::Io {
        path: program.into(),
        source,
    })?;
    if output.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&output.stderr).trim().to_string();
    // a batch names the line that failed: "Command failed -:N"
    let failed = said
        .rsplit_once("Command failed -:")
        .and_then(|(_, n)| n.trim().parse::<usize>().ok())
        .and_then(|n| lines.get(n.wrapping_sub(1)))
        .or(lines.first())
        .cloned()
        .unwrap_or_default();
    let unknown = said.contains("qdisc kind is unknown");
    let (field, reason) = if unknown && failed.contains("netem") {
        (
            "--link-latency",
            format!(
                "this kernel has no netem queueing discipline (CONFIG_NET_SCH_NETEM), which \
                 delays the links: leave out --link-latency, or run on a kernel with sch_netem \
                 (tc said: {said})"
            ),
        )
    } else if unknown {
        (
            "--link",
            format!(
                "this kernel has no tbf queueing discipline (CONFIG_NET_SCH_TBF), which shapes \
                 the links: leave out --link, or run on a kernel with sch_tbf (tc said: {said})"
            ),
        )
    } else if said.contains("Operation not permitted") {
        ("--hosts", format!("{NEEDS}; {program} said: {said}"))
    } else {
        (
            "--hosts",
            format!(
                "`{program} -batch` in {what} failed ({}) at `{failed}`: {said}",
                output.status
            ),
        )
    };
    Err(Error::InvalidOption {
        field: Field::Flag(field),
        value: failed,
        reason,
    })
}

impl Network {
    /// Builds the switch and the hosts of `plan`, their links up and shaped, before any rank
    /// starts. `exe` is this program (the holders run its hidden holder command).
    pub fn start(exe: &Path, plan: Hosts) -> Result<Network, Error> {
        let switch = Holder::start(exe, None)?;
        let mut network = Network {
            switch,
            hosts: Vec::with_capacity(plan.hosts),
            plan,
        };
        for h in 0..plan.hosts {
            network
                .hosts
                .push(Holder::start(exe, Some(&link::host_name(h)))?);
        }
        network.wire()?;
        Ok(network)
    }

    /// The bridge, a veth pair per host (one end on the bridge, the other the host's
    /// `eth0`), addresses, and the queues that shape both ends.
    fn wire(&self) -> Result<(), Error> {
        let bridge = link::BRIDGE;
        let mut switch = vec![
            format!("link add name {bridge} type bridge"),
            format!("link set dev {bridge} up"),
        ];
        for (h, host) in self.hosts.iter().enumerate() {
            let port = link::switch_port(h);
            switch.extend([
                format!(
                    "link add name {port} type veth peer name {} netns {}",
                    link::HOST_DEVICE,
                    host.child.id()
                ),
                format!("link set dev {port} master {bridge}"),
                format!("link set dev {port} up"),
            ]);
        }
        run_batch(&self.switch.net, "ip", &switch, "the switch's namespace")?;
        let shape = self.plan.shape;
        let shaping: Vec<String> = (0..self.hosts.len())
            .flat_map(|h| shape.tc_lines(&link::switch_port(h)))
            .collect();
        run_batch(&self.switch.net, "tc", &shaping, "the switch's namespace")?;
        for (h, host) in self.hosts.iter().enumerate() {
            let what = format!("host {h}'s namespace");
            let device = link::HOST_DEVICE;
            let setup = [
                "link set dev lo up".to_string(),
                format!(
                    "addr add {}/{} dev {device}",
                    link::address(h),
                    link::PREFIX_LEN
                ),
                format!("link set dev {device} up"),
            ];
            run_batch(&host.net, "ip", &setup, &what)?;
            run_batch(&host.net, "tc", &shape.tc_lines(device), &what)?;
        }
        Ok(())
    }

    /// Makes `command` (a rank) start inside host `host`: its network and its host name.
    pub fn enter(&self, host: usize, command: &mut Command) {
        let holder = &self.hosts[host];
        let net = holder.net.as_raw_fd();
        let uts = holder.uts.as_ref().map(AsRawFd::as_raw_fd);
        // SAFETY: system calls only; the descriptors stay open while `self` lives, and the
        // launcher starts its ranks while it holds the network.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(net, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(uts) = uts
                    && libc::setns(uts, libc::CLONE_NEWUTS) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            h.stop();
        }
        self.switch.stop();
    }
}

/// The hidden holder command: waits until the launcher closes its input (or dies).
pub fn hold() {
    let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
}
