//! Where a process stands in a job, from its environment: the torchrun variables, the job's
//! token, and the name of its host.

use std::net::{SocketAddr, ToSocketAddrs};

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

/// Where a process stands in the job, from its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupEnv {
    /// This process's rank (`RANK`).
    pub rank: Rank,
    /// Processes in the job (`WORLD_SIZE`), from 1 to [`MAX_WORLD`].
    pub world: usize,
    /// Where rank 0 listens (`MASTER_ADDR`); `127.0.0.1` when unset.
    pub master_addr: String,
    /// The port rank 0 listens on (`MASTER_PORT`), from 1 to 65535.
    pub master_port: u16,
    /// The job's shared secret (`RESHARD_TOKEN`): a hello with another is turned away;
    /// [`DEFAULT_TOKEN`] when unset.
    pub token: String,
    /// The name of this process's host: ranks that give the same name share a host (and its
    /// memory). `RESHARD_HOST` when set (`launch --hosts` sets it), else the host name with
    /// a hash of the kernel's boot id and the process id namespace (two containers of one
    /// name on two machines do not look alike).
    pub host: String,
}

/// The token used when `RESHARD_TOKEN` is not set: it still keeps apart jobs of different
/// world sizes, but only a real token keeps out strangers.
pub const DEFAULT_TOKEN: &str = "reshard";

/// Largest `RESHARD_TOKEN`, so that a hello stays within [`super::super::screen::MAX_HELLO_BYTES`].
pub const MAX_TOKEN_BYTES: usize = 512;

/// Largest `WORLD_SIZE`: rank 0 holds a connection, so a file descriptor, to every other
/// rank, and 2^20 is Linux's default cap on a process's open files (`fs.nr_open`). Every rank
/// keeps a table of the job's ranks (an address and a process id each), some 40 bytes a rank.
pub const MAX_WORLD: usize = 1 << 20;

/// Longest host name a rank may give (`RESHARD_HOST`), as Linux's `HOST_NAME_MAX`; a longer
/// system host name is cut to it. With the largest token it still fits in a hello.
pub const MAX_HOST_BYTES: usize = 64;

/// The variables that place a process in a job; they must be valid UTF-8 when set.
const JOB_VARS: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RESHARD_TOKEN",
    "RESHARD_HOST",
];

impl GroupEnv {
    /// Reads the torchrun variables; `None` when `RANK` and `WORLD_SIZE` are both unset (a
    /// single process).
    pub fn from_env() -> Result<Option<GroupEnv>> {
        for name in JOB_VARS {
            if let Some(value) = std::env::var_os(name).filter(|v| v.to_str().is_none()) {
                // taken as unset, a garbled RESHARD_TOKEN would quietly mean no token at all
                return Err(Error::Env {
                    var: name,
                    value: value.to_string_lossy().into_owned(),
                    reason: "is not valid UTF-8".into(),
                });
            }
        }
        let var = |name: &'static str| std::env::var(name).ok();
        if var("RANK").is_none() && var("WORLD_SIZE").is_none() {
            // under mpirun, with MASTER_ADDR and MASTER_PORT passed along (-x), MPI's numbering
            // serves the tcp and shm transports too
            if let (Some(rank), Some(world), Some(_)) = (
                var("OMPI_COMM_WORLD_RANK"),
                var("OMPI_COMM_WORLD_SIZE"),
                var("MASTER_PORT"),
            ) {
                return Self::from_vars(|name| match name {
                    "RANK" => Some(rank.clone()),
                    "WORLD_SIZE" => Some(world.clone()),
                    other => std::env::var(other).ok(),
                });
            }
            return Ok(None);
        }
        Self::from_vars(var)
    }

    pub(super) fn from_vars(
        var: impl Fn(&'static str) -> Option<String>,
    ) -> Result<Option<GroupEnv>> {
        let need = |name: &'static str| {
            var(name).ok_or(Error::Env {
                var: name,
                value: String::new(),
                reason: "must be set for a multi-process run (reshard launch sets it)".into(),
            })
        };
        let number = |name: &'static str| -> Result<usize> {
            let v = need(name)?;
            v.trim().parse().map_err(|_| Error::Env {
                var: name,
                value: v.clone(),
                reason: "expected a non-negative integer".into(),
            })
        };
        let rank = number("RANK")?;
        let world = number("WORLD_SIZE")?;
        if world == 0 || world > MAX_WORLD {
            return Err(Error::Env {
                var: "WORLD_SIZE",
                value: world.to_string(),
                reason: format!(
                    "must be from 1 to {MAX_WORLD} (2^20): rank 0 holds a connection to every rank"
                ),
            });
        }
        if rank >= world {
            return Err(Error::Env {
                var: "RANK",
                value: rank.to_string(),
                reason: format!("must be below WORLD_SIZE={world}"),
            });
        }
        let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = need("MASTER_PORT")?;
        let master_port = match port.trim().parse::<u16>() {
            Ok(p) if p > 0 => p,
            // port 0 would have rank 0 listen on a port of the system's choosing that no
            // other rank knows: every rank would wait out its timeout
            Ok(_) => {
                return Err(Error::Env {
                    var: "MASTER_PORT",
                    value: port.clone(),
                    reason: "must be a port from 1 to 65535 that every rank can reach".into(),
                });
            }
            Err(_) => {
                return Err(Error::Env {
                    var: "MASTER_PORT",
                    value: port.clone(),
                    reason: "expected a port number from 1 to 65535".into(),
                });
            }
        };
        let token = match var("RESHARD_TOKEN") {
            Some(t) => {
                check_token(&t)?;
                t
            }
            None => DEFAULT_TOKEN.into(),
        };
        let host = match var("RESHARD_HOST") {
            Some(h) => {
                check_host(&h)?;
                h
            }
            None => host_identity(),
        };
        Ok(Some(GroupEnv {
            rank,
            world,
            master_addr,
            master_port,
            token,
            host,
        }))
    }

    pub(super) fn master(&self) -> Result<SocketAddr> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Env {
                var: "MASTER_ADDR",
                value: self.master_addr.clone(),
                reason: "does not resolve to an address".into(),
            })
    }
}

/// Refuses a `RESHARD_TOKEN` that is set but cannot keep strangers out: empty or blank (most
/// likely an unset variable expanded into it, and no authentication at all), or too long for a
/// hello.
pub fn check_token(token: &str) -> Result<()> {
    let reason = if token.trim().is_empty() {
        "is set but empty; set a secret shared by the job's ranks, or unset it".to_string()
    } else if token.len() > MAX_TOKEN_BYTES {
        format!(
            "is {} bytes long; at most {MAX_TOKEN_BYTES} fit in a hello",
            token.len()
        )
    } else {
        return Ok(());
    };
    let shown = if token.len() > MAX_TOKEN_BYTES {
        "(not shown)".into()
    } else {
        token.to_string()
    };
    Err(Error::Env {
        var: "RESHARD_TOKEN",
        value: shown,
        reason,
    })
}

/// Refuses a `RESHARD_HOST` that is empty or blank (ranks would be placed by accident), or
/// longer than [`MAX_HOST_BYTES`].
fn check_host(host: &str) -> Result<()> {
    let reason = if host.trim().is_empty() {
        "is set but empty; name this rank's host, or unset it to use the host name"
    } else if host.len() > MAX_HOST_BYTES {
        "is longer than 64 bytes"
    } else {
        return Ok(());
    };
    Err(Error::Env {
        var: "RESHARD_HOST",
        value: host.chars().take(MAX_HOST_BYTES).collect(),
        reason: reason.into(),
    })
}

/// The default host identity: the host name, `@`, and a hash of the kernel's boot id and of
/// this process's process id namespace (in which a peer's `/proc/<pid>` means that peer).
pub fn host_identity() -> String {
    let mut kernel = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    kernel.truncate(kernel.trim_ascii_end().len());
    if let Ok(ns) = std::fs::metadata("/proc/self/ns/pid") {
        use std::os::unix::fs::MetadataExt;
        kernel.extend_from_slice(&ns.dev().to_le_bytes());
        kernel.extend_from_slice(&ns.ino().to_le_bytes());
    }
    let hash = kernel.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{}@{hash:016x}", host_name())
}

/// This machine's host name (of this process's UTS namespace), cut to [`MAX_HOST_BYTES`];
/// empty if the system will not tell.
pub fn host_name() -> String {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `name.len()` bytes into `name`.
    let named = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
    if !named {
        return String::new();
    }
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let mut text = String::from_utf8_lossy(&name[..len]).into_owned();
    while text.len() > MAX_HOST_BYTES {
        text.pop();
    }
    text
}
