//! Processes on one host: chunks pass through a shared-memory ring per (sender, receiver) pair
//! ([`super::ring`]). The sender packs straight from its shard into a slot and the receiver
//! unpacks straight from the slot into its shard: two copies at full memory speed, on two
//! cores at once, with staging bounded by the slots. (Cross-memory attach, one copy per byte,
//! was measured slower here: the kernel pins every page it copies.) Rings live in unnamed
//! files, so a killed process leaves nothing behind.
//!
//! The sender announces each ring once over the job's TCP link. Peers on other hosts (with
//! `--transport auto`) go through the TCP data path instead.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::exec::copy::{CopyGeometry, Place};
use crate::layout::Rank;

use super::frame;
use super::ring::{Ring, RingError, SLOTS};
use super::tcp::TcpTransport;
use super::{Incoming, Outgoing, Transport};

/// Largest slot: measured best here (a slot's bookkeeping is noise, and the slots of a ring
/// stay in cache between the packing core and the unpacking one).
const MAX_SLOT_BYTES: usize = 128 << 10;
const MIN_SLOT_BYTES: usize = 4 << 10;

/// What the two ends of a ring tell each other over the TCP link.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Notice {
    /// The sender's new ring: where to find it.
    Ring { pid: u32, fd: i32 },
    /// The receiver has mapped the ring: the sender may close its descriptor.
    Opened,
}

/// Shared-memory rings for same-host peers, TCP for the others.
#[derive(Debug)]
pub struct ShmTransport {
    links: TcpTransport,
    /// Peers reached through memory, with their process ids.
    local_peers: BTreeMap<Rank, u32>,
    slot_bytes: usize,
    timeout: Duration,
    /// Rings this rank fills, one per receiver, created at the first send.
    outgoing: Mutex<BTreeMap<Rank, Arc<Ring>>>,
    /// Rings this rank drains, one per sender, opened at the first receive.
    incoming: Mutex<BTreeMap<Rank, Arc<Ring>>>,
    /// Receivers that have mapped this rank's ring to them.
    opened: Mutex<std::collections::BTreeSet<Rank>>,
}

impl ShmTransport {
    /// `local_peers` (rank -> process id) go through memory, every other peer through TCP.
    /// The rings this rank creates hold at most `staging_bytes` together.
    pub fn new(
        links: TcpTransport,
        local_peers: BTreeMap<Rank, u32>,
        staging_bytes: usize,
        timeout: Duration,
    ) -> ShmTransport {
        let rings = local_peers.len().max(1);
        let slot_bytes = (staging_bytes / (SLOTS as usize * rings))
            .clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES)
            / MIN_SLOT_BYTES
            * MIN_SLOT_BYTES;
        ShmTransport {
            links,
            local_peers,
            slot_bytes,
            timeout,
            outgoing: Mutex::new(BTreeMap::new()),
            incoming: Mutex::new(BTreeMap::new()),
            opened: Mutex::new(std::collections::BTreeSet::new()),
        }
    }

    fn rank(&self) -> Rank {
        self.links.rank()
    }

    fn ring_error(&self, peer: Rank, e: RingError, what: String) -> Error {
        match e {
            RingError::PeerGone => Error::PeerGone {
                rank: self.rank(),
                peer,
                detail: format!("its process exited while moving {what}"),
            },
            RingError::TimedOut => Error::Timeout {
                rank: self.rank(),
                peer,
                waited: self.timeout,
                detail: format!("{what} did not move"),
            },
            RingError::Aborted => Error::PeerGone {
                rank: self.rank(),
                peer,
                detail: format!("the ring was abandoned while moving {what}"),
            },
            RingError::Os(e) => Error::Protocol {
                rank: self.rank(),
                peer,
                detail: format!("{what}: {e}"),
            },
        }
    }

    /// The ring to `peer`, created and announced the first time.
    fn outgoing(&self, peer: Rank) -> Result<Arc<Ring>> {
        let mut rings = self.outgoing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = rings.get(&peer) {
            return Ok(r.clone());
        }
        let ring = Ring::create(self.slot_bytes).map_err(|e| Error::Io {
            path: "a shared-memory ring".into(),
            source: e,
        })?;
        let notice = Notice::Ring {
            pid: std::process::id(),
            fd: ring.fd(),
        };
        let mut w = self.links.writer(peer)?;
        frame::write_control(&mut *w, &notice)
            .map_err(|e| self.links.fail(peer, "the ring's address".into(), e))?;
        let ring = Arc::new(ring);
        rings.insert(peer, ring.clone());
        Ok(ring)
    }

    /// The ring from `peer`, opened the first time from its announcement.
    fn incoming(&self, peer: Rank) -> Result<Arc<Ring>> {
        let mut rings = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = rings.get(&peer) {
            return Ok(r.clone());
        }
        // the peer's acknowledgements of this rank's ring may come first
        let (pid, fd) = loop {
            match self.notice(peer, "the ring's address")? {
                Notice::Ring { pid, fd } => break (pid, fd),
                Notice::Opened => {
                    self.opened
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(peer);
                }
            }
        };
        if Some(&pid) != self.local_peers.get(&peer) {
            return Err(Error::Protocol {
                rank: self.rank(),
                peer,
                detail: format!("announced a ring of process {pid}, not of its own process"),
            });
        }
        let ring = Ring::open(pid, fd).map_err(|e| Error::Protocol {
            rank: self.rank(),
            peer,
            detail: format!("cannot map its ring: {e}"),
        })?;
        let mut w = self.links.writer(peer)?;
        frame::write_control(&mut *w, &Notice::Opened).map_err(|e| {
            self.links
                .fail(peer, "the ring's acknowledgement".into(), e)
        })?;
        let ring = Arc::new(ring);
        rings.insert(peer, ring.clone());
        Ok(ring)
    }

    fn notice(&self, peer: Rank, what: &str) -> Result<Notice> {
        let mut r = self.links.reader(peer)?;
        frame::read_control(&mut *r).map_err(|e| self.links.fail(peer, what.into(), e))
    }
}

/// The slot-sized pieces of a chunk's byte range.
fn pieces(
    range: std::ops::Range<usize>,
    slot: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    (range.start..range.end)
        .step_by(slot)
        .map(move |s| s..(s + slot).min(range.end))
}

impl<'buf> Transport<'buf> for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        let Some(&pid) = self.local_peers.get(&chunk.to) else {
            return self.links.send(chunk);
        };
        let ring = self.outgoing(chunk.to)?;
        let g = CopyGeometry::new(
            chunk.region,
            Place::Within(chunk.src_box),
            Place::Stream,
            chunk.elem_bytes,
        );
        let deadline = Instant::now() + self.timeout;
        for piece in pieces(chunk.range.clone(), ring.slot_bytes()) {
            let len = piece.len();
            ring.push(
                |slot| g.copy(chunk.src, &mut slot[..len], piece.clone()),
                pid,
                deadline,
            )
            .map_err(|e| {
                self.ring_error(chunk.to, e, format!("bytes {piece:?} of {}", chunk.region))
            })?;
        }
        Ok(())
    }

    fn recv(&self, chunk: Incoming<'_>) -> Result<()> {
        let peer = chunk.from;
        let Some(&pid) = self.local_peers.get(&peer) else {
            return self.links.recv(chunk);
        };
        let ring = self.incoming(peer)?;
        let g = CopyGeometry::new(
            chunk.region,
            Place::Stream,
            Place::Within(chunk.dst_box),
            chunk.elem_bytes,
        );
        let deadline = Instant::now() + self.timeout;
        for piece in pieces(chunk.range.clone(), ring.slot_bytes()) {
            let len = piece.len();
            ring.pull(
                |slot| g.copy(&slot[..len], chunk.dst, piece.clone()),
                pid,
                deadline,
            )
            .map_err(|e| {
                self.ring_error(peer, e, format!("bytes {piece:?} of {}", chunk.region))
            })?;
        }
        Ok(())
    }

    /// Waits until every receiver has mapped its ring: only then may this rank go away.
    fn finish(&self) -> Result<()> {
        let created: Vec<Rank> = self
            .outgoing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .copied()
            .collect();
        for peer in created {
            while !self
                .opened
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&peer)
            {
                match self.notice(peer, "the acknowledgement of its ring")? {
                    Notice::Opened => {
                        self.opened
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(peer);
                    }
                    Notice::Ring { .. } => {
                        return Err(Error::Protocol {
                            rank: self.rank(),
                            peer,
                            detail: "announced a ring that this rank's plan never reads".into(),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    fn abort(&self) {
        for rings in [&self.outgoing, &self.incoming] {
            if let Ok(rings) = rings.try_lock() {
                rings.values().for_each(|r| r.abort());
            }
        }
        Transport::abort(&self.links);
    }

    fn peak_staging_bytes(&self) -> u64 {
        let rings = self.outgoing.lock().map_or(0, |r| r.len());
        Transport::peak_staging_bytes(&self.links)
            + (rings * SLOTS as usize * self.slot_bytes) as u64
    }
}
