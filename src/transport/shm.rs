//! Processes on one host: the receiver copies straight from the sender's memory into its own
//! shard with cross-memory attach (`process_vm_readv`, as OpenMPI's shared-memory transport
//! does for large messages): one copy per byte, no staging, and no shared segment that a
//! killed process could leave behind.
//!
//! Control goes over the job's TCP links: the sender announces where its shard lives
//! (`Ready`), the receiver copies its regions in bounded chunks, then says `Done`; the sender
//! keeps its shard unchanged until every receiver is done ([`Transport::finish`]). Peers on
//! other hosts (with `--transport auto`) are served by the TCP data path instead.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::exec::copy::{CopyGeometry, Place};
use crate::layout::Rank;

use super::frame;
use super::tcp::TcpTransport;
use super::{Incoming, Outgoing, Transport};

/// At most this many runs per system call (Linux's IOV_MAX is 1024).
const MAX_IOVECS: usize = 512;

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Notice {
    /// The sender's source shard: process, address and length.
    Ready { pid: u32, addr: u64, len: u64 },
    /// The receiver has copied everything it needs from the sender.
    Done,
}

/// Where a peer's source shard lives.
#[derive(Clone, Copy, Debug)]
struct Remote {
    pid: libc::pid_t,
    addr: u64,
    len: u64,
}

/// Cross-memory-attach transport for same-host peers, TCP for the others.
#[derive(Debug)]
pub struct ShmTransport {
    links: TcpTransport,
    /// Peers reached through memory; the others go through `links`.
    local_peers: BTreeSet<Rank>,
    announced: Mutex<BTreeSet<Rank>>,
    remotes: Mutex<BTreeMap<Rank, Remote>>,
}

impl ShmTransport {
    /// `local_peers` are read through memory; every other peer through the TCP data path.
    pub fn new(links: TcpTransport, local_peers: BTreeSet<Rank>) -> ShmTransport {
        ShmTransport {
            links,
            local_peers,
            announced: Mutex::new(BTreeSet::new()),
            remotes: Mutex::new(BTreeMap::new()),
        }
    }

    fn rank(&self) -> Rank {
        self.links.rank()
    }

    fn notify(&self, peer: Rank, notice: &Notice) -> Result<()> {
        let mut w = self.links.writer(peer)?;
        frame::write_control(&mut *w, notice)
            .map_err(|e| self.links.fail(peer, format!("{notice:?}"), e))
    }

    fn expect(&self, peer: Rank, what: &str) -> Result<Notice> {
        let mut r = self.links.reader(peer)?;
        frame::read_control(&mut *r).map_err(|e| self.links.fail(peer, what.to_string(), e))
    }

    /// Where `peer`'s shard lives, waiting for its announcement the first time.
    fn remote(&self, peer: Rank) -> Result<Remote> {
        if let Some(r) = self
            .remotes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer)
        {
            return Ok(*r);
        }
        match self.expect(peer, "the announcement of its shard")? {
            Notice::Ready { pid, addr, len } => {
                let remote = Remote {
                    pid: pid as libc::pid_t,
                    addr,
                    len,
                };
                self.remotes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(peer, remote);
                Ok(remote)
            }
            Notice::Done => Err(Error::Protocol {
                rank: self.rank(),
                peer,
                detail: "said done before announcing its shard".into(),
            }),
        }
    }

    /// Reads `runs` (remote offset, local offset, len) from `remote` into `dst`.
    fn read_runs(
        &self,
        peer: Rank,
        remote: Remote,
        dst: &mut [u8],
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        for batch in runs.chunks(MAX_IOVECS) {
            for &(s, d, len) in batch {
                if (s + len) as u64 > remote.len || d + len > dst.len() {
                    return Err(Error::Protocol {
                        rank: self.rank(),
                        peer,
                        detail: format!(
                            "a run at {s}+{len} lies outside its shard of {} bytes",
                            remote.len
                        ),
                    });
                }
            }
            let mut pending: Vec<(usize, usize, usize)> = batch.to_vec();
            while !pending.is_empty() {
                let local: Vec<libc::iovec> = pending
                    .iter()
                    .map(|&(_, d, len)| libc::iovec {
                        // in bounds: checked above against `dst`
                        iov_base: dst[d..d + len].as_mut_ptr().cast(),
                        iov_len: len,
                    })
                    .collect();
                let far: Vec<libc::iovec> = pending
                    .iter()
                    .map(|&(s, _, len)| libc::iovec {
                        iov_base: (remote.addr as usize + s) as *mut libc::c_void,
                        iov_len: len,
                    })
                    .collect();
                // SAFETY: the local iovecs point into `dst`, which we borrow mutably; the remote
                // ones into the peer's announced shard, which the kernel checks, and which the
                // peer keeps unchanged until we say done.
                let n = unsafe {
                    libc::process_vm_readv(
                        remote.pid,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        far.as_ptr(),
                        far.len() as libc::c_ulong,
                        0,
                    )
                };
                if n < 0 {
                    return Err(self.cma_error(peer, std::io::Error::last_os_error()));
                }
                if n == 0 {
                    return Err(Error::PeerGone {
                        rank: self.rank(),
                        peer,
                        detail: "its memory could not be read (exited?)".into(),
                    });
                }
                // drop what was read; keep the rest of a partly read run
                let mut n = n as usize;
                let mut rest = Vec::with_capacity(pending.len());
                for (s, d, len) in pending {
                    if n >= len {
                        n -= len;
                    } else {
                        rest.push((s + n, d + n, len - n));
                        n = 0;
                    }
                }
                pending = rest;
            }
        }
        Ok(())
    }

    fn cma_error(&self, peer: Rank, e: std::io::Error) -> Error {
        let rank = self.rank();
        match e.raw_os_error() {
            Some(libc::ESRCH) => Error::PeerGone {
                rank,
                peer,
                detail: "its process is gone".into(),
            },
            Some(libc::EPERM) => Error::Refused {
                rank,
                what: format!("to the memory of rank {peer}"),
                reason: "cross-memory attach is not permitted (same user needed; see kernel.yama.ptrace_scope); use --transport tcp".into(),
            },
            _ => Error::Protocol {
                rank,
                peer,
                detail: format!("process_vm_readv: {e}"),
            },
        }
    }
}

impl<'buf> Transport<'buf> for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        if !self.local_peers.contains(&chunk.to) {
            return self.links.send(chunk);
        }
        let first = self
            .announced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(chunk.to);
        if first {
            self.notify(
                chunk.to,
                &Notice::Ready {
                    pid: std::process::id(),
                    addr: chunk.src.as_ptr() as u64,
                    len: chunk.src.len() as u64,
                },
            )?;
        }
        Ok(())
    }

    fn recv(&self, chunk: Incoming<'_>) -> Result<()> {
        let peer = chunk.from;
        if !self.local_peers.contains(&peer) {
            return self.links.recv(chunk);
        }
        let remote = self.remote(peer)?;
        let g = CopyGeometry::new(
            chunk.region,
            Place::Within(chunk.src_box),
            Place::Within(chunk.dst_box),
            chunk.elem_bytes,
        );
        let mut runs = Vec::new();
        g.for_each_run(chunk.range.clone(), |s, d, len| runs.push((s, d, len)));
        self.read_runs(peer, remote, chunk.dst, &runs)
    }

    fn finish(&self) -> Result<()> {
        // taken, so that the next reshard over this transport starts afresh
        let received = std::mem::take(&mut *self.remotes.lock().unwrap_or_else(|p| p.into_inner()));
        for &peer in received.keys() {
            self.notify(peer, &Notice::Done)?;
        }
        let announced =
            std::mem::take(&mut *self.announced.lock().unwrap_or_else(|p| p.into_inner()));
        for peer in announced {
            match self.expect(peer, "its done after reading this rank's shard")? {
                Notice::Done => {}
                other => {
                    return Err(Error::Protocol {
                        rank: self.rank(),
                        peer,
                        detail: format!("sent {other:?} instead of done"),
                    });
                }
            }
        }
        Ok(())
    }

    fn abort(&self) {
        Transport::abort(&self.links);
    }

    fn peak_staging_bytes(&self) -> u64 {
        Transport::peak_staging_bytes(&self.links)
    }
}
