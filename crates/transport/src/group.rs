//! A job of processes: torchrun-style rendezvous, authenticated connections between the peers
//! that exchange data, and a control channel through rank 0 (plan agreement, barrier,
//! two-phase decision, final verdict). The control protocol itself is [`super::control`];
//! this module opens its links and hands them to its driver.
//!
//! Every process reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `RESHARD_TOKEN`.
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects to it, says who it
//! is and names its host (`RESHARD_HOST`, or the host name), and learns every rank's address
//! and the host map: which ranks share a host, and so may share memory. A connection whose
//! token, world size or rank does not fit the job is refused and the job goes on. Every wait
//! is bounded by the job's timeout.
//!
//! The ports that accept connections (rank 0's rendezvous port, every rank's data-link port)
//! screen all newcomers at once ([`super::screen`]): strangers that stay silent, trickle,
//! send too much or come by the hundred are dropped without delaying the ranks.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use reshard_core::agreement::Fingerprint;
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::topology::HostMap;

use super::control::driver::ControlLinks;
use super::control::{Call, Decision};
use super::frame;
use super::screen::Screen;

mod env;
pub use env::{
    DEFAULT_TOKEN, GroupEnv, MAX_HOST_BYTES, MAX_TOKEN_BYTES, MAX_WORLD, check_token, host_identity,
};

/// What a connecting process says first.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Hello {
    token: String,
    world: usize,
    rank: Rank,
    /// `control` (to rank 0, at rendezvous) or `peer` (a data link).
    purpose: String,
    /// The port this rank accepts peer links on.
    port: u16,
    /// The process id, for same-host transports to watch the peer.
    #[serde(default)]
    pid: u32,
    /// The name of the rank's host (see [`GroupEnv::host`]).
    #[serde(default)]
    host: String,
}

/// The answer to a hello.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Reply {
    Welcome {
        addrs: Vec<SocketAddr>,
        pids: Vec<u32>,
        /// The host of every rank, numbered by first rank.
        hosts: Vec<usize>,
    },
    Accepted,
    Refused {
        reason: String,
    },
}

/// One process's membership in a job.
#[derive(Debug)]
pub struct Group {
    env: GroupEnv,
    timeout: Duration,
    listener: TcpListener,
    addrs: Vec<SocketAddr>,
    /// Every rank's process id (meaningful between ranks of one host).
    pids: Vec<u32>,
    /// Which host every rank runs on, from the names the ranks gave at rendezvous.
    hosts: HostMap,
    /// The control protocol's thread, over rank 0's link to every other rank or a member's
    /// link to rank 0.
    control: ControlLinks,
}

/// Connects, retrying while the other side is not listening yet, until `deadline`.
fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline && e.kind() != ErrorKind::PermissionDenied => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

/// How often a rank waiting for its peers' connections looks whether the control plane
/// knows of a lost rank.
const LOST_POLL: Duration = Duration::from_millis(50);

/// How long a refusal may take to write before the connection is dropped without it.
const REFUSAL_WAIT: Duration = Duration::from_secs(1);

/// `rank 4` or `ranks 4, 5`: names that a reader (and a search for "rank 4") finds.
fn name_ranks(ranks: &[Rank]) -> String {
    let list: Vec<String> = ranks.iter().map(Rank::to_string).collect();
    match list.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// Byte-wise comparison whose time does not depend on where the inputs differ.
fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

impl Group {
    /// Joins the job: rendezvous through rank 0, within `timeout`.
    pub fn join(env: GroupEnv, timeout: Duration) -> Result<Group> {
        Group::join_on(env, timeout, None)
    }

    /// Rank 0's rendezvous port, bound before the job is joined: a port the system picked
    /// (`MASTER_PORT` 0) is known, and can be told to the other ranks by another channel (a
    /// torch process group's store), before [`Group::join_on`] waits for them.
    pub fn bind(env: &GroupEnv) -> Result<TcpListener> {
        let master = env.master()?;
        TcpListener::bind(master).map_err(|e| Error::Io {
            path: format!("MASTER_ADDR:MASTER_PORT {master}"),
            source: e,
        })
    }

    /// [`Group::join`], rank 0 on `listener` (from [`Group::bind`]) when given.
    pub fn join_on(
        env: GroupEnv,
        timeout: Duration,
        listener: Option<TcpListener>,
    ) -> Result<Group> {
        let deadline = Instant::now() + timeout;
        let master = env.master()?;
        let rank = env.rank;
        if rank == 0 {
            let listener = match listener {
                Some(l) => l,
                None => Group::bind(&env)?,
            };
            let master = listener.local_addr().unwrap_or(master);
            let mut addrs = vec![master; env.world];
            let mut pids = vec![std::process::id(); env.world];
            let mut names = vec![env.host.clone(); env.world];
            let (streams, hosts) = Group::gather_members(
                &env, &listener, timeout, deadline, &mut addrs, &mut pids, &mut names,
            )?;
            let control = ControlLinks::start(0, env.world, timeout, streams)?;
            Ok(Group {
                env,
                timeout,
                listener,
                addrs,
                pids,
                hosts,
                control,
            })
        } else {
            let mut stream = connect_until(master, deadline).map_err(|e| Error::PeerGone {
                rank,
                peer: 0,
                detail: format!("cannot reach the rendezvous at {master}: {e}"),
            })?;
            let _ = stream.set_nodelay(true);
            // control messages are small: a peer that stops reading must not block us forever
            let _ = stream.set_write_timeout(Some(timeout));
            let local_ip: IpAddr = stream.local_addr().map(|a| a.ip()).unwrap_or(master.ip());
            let listener = TcpListener::bind((local_ip, 0)).map_err(|e| Error::Io {
                path: format!("{local_ip}:0"),
                source: e,
            })?;
            let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
            let hello = Hello {
                token: env.token.clone(),
                world: env.world,
                rank,
                purpose: "control".into(),
                port,
                pid: std::process::id(),
                host: env.host.clone(),
            };
            // rank 0 was listening, so it waits for the last rank until at most one timeout
            // from now, then answers: the reply may take that long, and a little more
            let wait = timeout.saturating_mul(2);
            let _ = stream.set_read_timeout(Some(wait));
            frame::write_control(&mut stream, &hello)
                .map_err(|e| e.into_error(rank, 0, "rendezvous", timeout))?;
            let reply: Reply = frame::read_control(&mut stream)
                .map_err(|e| e.into_error(rank, 0, "rendezvous", wait))?;
            let (addrs, pids, hosts) = match reply {
                Reply::Welcome { addrs, pids, hosts }
                    if addrs.len() == env.world
                        && pids.len() == env.world
                        && hosts.len() == env.world =>
                {
                    let hosts = HostMap::from_indices(&hosts).map_err(|e| Error::Protocol {
                        rank,
                        peer: 0,
                        detail: format!("the host map of the rendezvous: {e}"),
                    })?;
                    (addrs, pids, hosts)
                }
                Reply::Refused { reason } => {
                    return Err(Error::Refused {
                        rank,
                        what: "to rank 0".into(),
                        reason,
                    });
                }
                other => {
                    return Err(Error::Protocol {
                        rank,
                        peer: 0,
                        detail: format!("unexpected rendezvous reply {other:?}"),
                    });
                }
            };
            let mut streams: Vec<Option<TcpStream>> = (0..env.world).map(|_| None).collect();
            streams[0] = Some(stream);
            let control = ControlLinks::start(rank, env.world, timeout, streams)?;
            Ok(Group {
                env,
                timeout,
                listener,
                addrs,
                pids,
                hosts,
                control,
            })
        }
    }

    /// Checks a hello against this job; the reason for refusal otherwise.
    fn check_hello(
        env: &GroupEnv,
        hello: &Hello,
        purpose: &str,
        expected: impl Fn(Rank) -> bool,
    ) -> Result<(), String> {
        if !same_token(&hello.token, &env.token) {
            return Err("wrong job token (RESHARD_TOKEN)".into());
        }
        if hello.world != env.world {
            return Err(format!(
                "world size {} does not match this job's {}",
                hello.world, env.world
            ));
        }
        if hello.purpose != purpose {
            return Err(format!("unexpected {} connection", hello.purpose));
        }
        if !expected(hello.rank) {
            return Err(format!("rank {} is not expected here", hello.rank));
        }
        Ok(())
    }

    /// The next connection before `deadline` whose hello fits the job, `purpose` and
    /// `expected`; others are refused (told why) or dropped (strangers that do not speak the
    /// protocol), all screened at once by `screen`.
    fn admit(
        env: &GroupEnv,
        screen: &mut Screen<'_>,
        purpose: &str,
        expected: impl Fn(Rank) -> bool,
        deadline: Instant,
    ) -> Option<(Hello, TcpStream, SocketAddr)> {
        loop {
            let (hello, mut stream, from) = screen.next::<Hello>(deadline)?;
            match Group::check_hello(env, &hello, purpose, &expected) {
                Ok(()) => return Some((hello, stream, from)),
                Err(reason) => {
                    tracing::warn!(rank = env.rank, from = hello.rank, %reason, "refused a connection");
                    // a fresh connection's send buffer is empty: a short answer never blocks
                    // for long, and a peer that does not read it cannot hold us
                    let _ = stream.set_write_timeout(Some(REFUSAL_WAIT));
                    let _ = frame::write_control(&mut stream, &Reply::Refused { reason });
                }
            }
        }
    }

    /// Rank 0: waits for every other rank's hello, then sends everyone the address table
    /// and the host map (hosts numbered in the order of their first rank).
    fn gather_members(
        env: &GroupEnv,
        listener: &TcpListener,
        timeout: Duration,
        deadline: Instant,
        addrs: &mut [SocketAddr],
        pids: &mut [u32],
        names: &mut [String],
    ) -> Result<(Vec<Option<TcpStream>>, HostMap)> {
        let mut control: Vec<Option<TcpStream>> = (0..env.world).map(|_| None).collect();
        // one flag per rank rather than a set: the memory a rank needs stays small and linear
        // in the world size
        let mut joined = vec![false; env.world];
        joined[0] = true;
        let mut to_join = env.world - 1;
        let mut screen = Screen::new(listener, 0);
        while to_join > 0 {
            let admitted = Group::admit(
                env,
                &mut screen,
                "control",
                |r| joined.get(r) == Some(&false),
                deadline,
            );
            let Some((hello, stream, from)) = admitted else {
                let missing: Vec<Rank> = (0..env.world).filter(|&r| !joined[r]).collect();
                let detail = format!("rendezvous: {} never joined", name_ranks(&missing));
                // tell the ranks that did join who is missing, so that they need not guess
                let refusal = Reply::Refused {
                    reason: detail.clone(),
                };
                for s in control.iter_mut().flatten() {
                    let _ = frame::write_control(s, &refusal);
                }
                return Err(Error::Timeout {
                    rank: 0,
                    peer: missing[0],
                    waited: timeout,
                    detail,
                });
            };
            let _ = stream.set_nodelay(true);
            let _ = stream.set_write_timeout(Some(timeout));
            addrs[hello.rank] = SocketAddr::new(from.ip(), hello.port);
            pids[hello.rank] = hello.pid;
            names[hello.rank] = hello.host;
            joined[hello.rank] = true;
            to_join -= 1;
            control[hello.rank] = Some(stream);
        }
        drop(screen);
        let hosts = HostMap::from_names(names)?;
        let welcome = frame::encode_control(&Reply::Welcome {
            addrs: addrs.to_vec(),
            pids: pids.to_vec(),
            hosts: hosts.hosts().collect(),
        })
        .map_err(|e| e.into_error(0, 0, "the rendezvous", timeout))?;
        // a rank that died since its hello shows up at the barrier, where all ranks hear of it
        for s in control.iter_mut().flatten() {
            let _ = frame::write_encoded(s, &welcome);
        }
        Ok((control, hosts))
    }

    /// The first rank this process knows to be lost (its control link closed before it
    /// reported), and how; rank 0 tells every member as soon as it sees one.
    pub fn lost(&self) -> Option<(Rank, String)> {
        self.control.lost()
    }

    /// The job's timeout: how long any one wait may last.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `peer`'s process id (meaningful when it runs on this host).
    pub fn pid(&self, peer: Rank) -> u32 {
        self.pids[peer]
    }

    /// Which host every rank runs on, as the ranks named their hosts at rendezvous.
    pub fn hosts(&self) -> &HostMap {
        &self.hosts
    }

    /// Whether `peer` runs on this host (the host map puts it there), so that its memory can
    /// be read directly.
    pub fn same_host(&self, peer: Rank) -> bool {
        self.hosts.same_host(self.env.rank, peer)
    }

    /// Opens an authenticated link to every rank in `peers` (both sides must name each other):
    /// the higher rank connects, the lower accepts.
    pub fn connect_peers(&self, peers: &BTreeSet<Rank>) -> Result<BTreeMap<Rank, TcpStream>> {
        let rank = self.env.rank;
        let deadline = Instant::now() + self.timeout;
        let mut links = BTreeMap::new();
        for &peer in peers.range(..rank) {
            // every rank listens before it says hello, so a refused connection is a dead peer
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let mut s = TcpStream::connect_timeout(&self.addrs[peer], left).map_err(|e| {
                Error::PeerGone {
                    rank,
                    peer,
                    detail: format!("cannot connect to {}: {e}", self.addrs[peer]),
                }
            })?;
            let hello = Hello {
                token: self.env.token.clone(),
                world: self.env.world,
                rank,
                purpose: "peer".into(),
                port: 0,
                pid: std::process::id(),
                host: self.env.host.clone(),
            };
            let _ = s.set_read_timeout(Some(self.timeout));
            frame::write_control(&mut s, &hello)
                .map_err(|e| e.into_error(rank, peer, "connecting", self.timeout))?;
            match frame::read_control::<Reply>(&mut s)
                .map_err(|e| e.into_error(rank, peer, "connecting", self.timeout))?
            {
                Reply::Accepted => {}
                Reply::Refused { reason } => {
                    return Err(Error::Refused {
                        rank,
                        what: format!("to rank {peer}"),
                        reason,
                    });
                }
                other => {
                    return Err(Error::Protocol {
                        rank,
                        peer,
                        detail: format!("unexpected reply {other:?}"),
                    });
                }
            }
            links.insert(peer, s);
        }
        let mut waiting: BTreeSet<Rank> = peers.range(rank + 1..).copied().collect();
        let mut screen = Screen::new(&self.listener, rank);
        while !waiting.is_empty() {
            // in slices, so that a rank rank 0 knows to be lost ends the wait at once
            let admitted = loop {
                let slice = (Instant::now() + LOST_POLL).min(deadline);
                let admitted = Group::admit(
                    &self.env,
                    &mut screen,
                    "peer",
                    |r| waiting.contains(&r),
                    slice,
                );
                if admitted.is_some() || Instant::now() >= deadline {
                    break admitted;
                }
                if let Some((lost, detail)) = self.control.lost() {
                    return Err(Error::PeerGone {
                        rank,
                        peer: lost,
                        detail: format!(
                            "{detail}; rank {rank} was waiting for the connection of {}",
                            name_ranks(&waiting.iter().copied().collect::<Vec<_>>())
                        ),
                    });
                }
            };
            let Some((hello, mut s, _)) = admitted else {
                return Err(Error::Timeout {
                    rank,
                    peer: *waiting.iter().next().unwrap_or(&rank),
                    waited: self.timeout,
                    detail: format!(
                        "{} never connected",
                        name_ranks(&waiting.iter().copied().collect::<Vec<_>>())
                    ),
                });
            };
            let _ = s.set_write_timeout(Some(self.timeout));
            frame::write_control(&mut s, &Reply::Accepted)
                .map_err(|e| e.into_error(rank, hello.rank, "accepting", self.timeout))?;
            waiting.remove(&hello.rank);
            links.insert(hello.rank, s);
        }
        for s in links.values() {
            let _ = s.set_nodelay(true);
            let _ = s.set_read_timeout(Some(self.timeout));
            let _ = s.set_write_timeout(Some(self.timeout));
        }
        Ok(links)
    }
}

impl super::Job for Group {
    fn rank(&self) -> Rank {
        self.env.rank
    }

    fn world(&self) -> usize {
        self.env.world
    }

    fn agree(&self, mine: &Fingerprint) -> Result<()> {
        self.control.call(Call::Agree(mine.clone())).map(drop)
    }

    fn barrier(&self) -> Result<()> {
        self.control.call(Call::Barrier).map(drop)
    }

    fn decide(&self, prepared: std::result::Result<(), String>) -> Result<Decision> {
        self.control.decide(prepared)
    }

    fn finish(
        &self,
        mine: std::result::Result<serde_json::Value, String>,
    ) -> Result<Vec<serde_json::Value>> {
        self.control.call(Call::Finish(mine))
    }
}

#[cfg(test)]
mod tests;
