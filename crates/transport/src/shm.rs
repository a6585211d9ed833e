//! Processes on one host: chunks pass through a shared-memory ring per (sender, receiver) pair
//! ([`super::ring`]). The sender packs straight from its shard into a slot and the receiver
//! unpacks straight from the slot into its shard: two copies at full memory speed, on two
//! cores at once, with staging bounded by the slots. (Cross-memory attach, one copy per byte,
//! was measured slower here: the kernel pins every page it copies.) Rings live in unnamed
//! files, so a killed process leaves nothing behind.
//!
//! When a receiver's destination shard lives in shared memory
//! ([`ShmTransport::exchange_destinations`]), a same-host sender writes the chunks that land
//! in it ([`Lands::Shard`]) straight there instead: one copy per byte, converting or
//! quantizing as it writes, then a short notice of the bytes written. Chunks that land beside
//! the shard (a quantization's partial amax and scales) still take the ring.
//!
//! The sender announces each ring once over the job's own links (its [`Carrier`]: TCP, or MPI
//! under `mpirun`). Peers on other hosts (with `--transport auto`) go through the carrier's
//! data path instead.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::region::Region;

pub use super::carrier::Carrier;
use super::ring::{Ring, RingError, SLOTS};
use super::segment::{PeerBuffer, SharedBuffer};
use super::{Chunking, Incoming, Lands, Outgoing, Transport};

/// Largest slot: measured best here (a slot's bookkeeping is noise, and the slots of a ring
/// stay in cache between the packing core and the unpacking one).
const MAX_SLOT_BYTES: usize = 128 << 10;
const MIN_SLOT_BYTES: usize = 4 << 10;

/// What two peers tell each other over their carrier.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Notice {
    /// Before the first reshard, from a receiver to its senders: its destination shard lives
    /// in a shared buffer (process, descriptor, bytes, box), so senders may write into it.
    Destination {
        pid: u32,
        fd: i32,
        len: u64,
        offset: Vec<u64>,
        extent: Vec<u64>,
    },
    /// The same, when the destination shard is private: senders use a ring.
    NoDestination,
    /// A sender wrote bytes `start..end` of a transfer straight into the receiver's shard.
    Written { start: u64, end: u64 },
    /// The sender's new ring: where to find it.
    Ring { pid: u32, fd: i32 },
    /// The receiver has mapped the ring: the sender may close its descriptor.
    Opened,
    /// After the last chunk to this receiver, the checksum of every chunk (`--checksum`).
    Sums(Vec<u32>),
}

/// A receiver's destination shard, mapped here for writing.
#[derive(Debug)]
struct Target {
    buffer: Mutex<PeerBuffer>,
    region: Region,
}

/// Shared-memory rings (or direct writes) for same-host peers, the carrier for the others.
#[derive(Debug)]
pub struct ShmTransport<C> {
    links: C,
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
    /// Receivers whose destination shards this rank writes into directly.
    targets: BTreeMap<Rank, Target>,
    /// Senders that write into this rank's shared destination shard.
    writers: std::collections::BTreeSet<Rank>,
    /// Bytes this rank has written straight into receivers' shards.
    written: AtomicU64,
}

impl<C: Carrier> ShmTransport<C> {
    /// `local_peers` (rank -> process id) go through memory, every other peer through
    /// `links`. The rings this rank creates hold at most `staging_bytes` together.
    pub fn new(
        links: C,
        local_peers: BTreeMap<Rank, u32>,
        staging_bytes: usize,
        timeout: Duration,
    ) -> ShmTransport<C> {
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
            targets: BTreeMap::new(),
            writers: std::collections::BTreeSet::new(),
            written: AtomicU64::new(0),
        }
    }

    /// Lets same-host senders write straight into this rank's destination shard when it lives
    /// in a [`SharedBuffer`] (one copy per byte, by the senders), and learns the same of this
    /// rank's receivers. Call once, before the first reshard, on every rank: `senders` and
    /// `receivers` are this rank's peers in each direction. Only the chunks that land in the
    /// shard ([`Lands::Shard`]) go that way; the rest (partial amax, scales) take the ring.
    pub fn exchange_destinations(
        &mut self,
        destination: Option<(&SharedBuffer, &Region)>,
        senders: &std::collections::BTreeSet<Rank>,
        receivers: &std::collections::BTreeSet<Rank>,
    ) -> Result<()> {
        let notice = match destination.and_then(|(b, r)| b.fd().map(|fd| (b, r, fd))) {
            Some((buffer, region, fd)) => Notice::Destination {
                pid: std::process::id(),
                fd,
                len: buffer.len() as u64,
                offset: region.offset.clone(),
                extent: region.extent.clone(),
            },
            None => Notice::NoDestination,
        };
        for &peer in senders.iter().filter(|p| self.local_peers.contains_key(p)) {
            self.links
                .tell(peer, &notice, "the destination's address")?;
            if matches!(notice, Notice::Destination { .. }) {
                self.writers.insert(peer);
            }
        }
        for &peer in receivers
            .iter()
            .filter(|p| self.local_peers.contains_key(p))
        {
            match self.notice(peer, "the destination's address")? {
                Notice::Destination {
                    pid,
                    fd,
                    len,
                    offset,
                    extent,
                } if Some(&pid) == self.local_peers.get(&peer) && offset.len() == extent.len() => {
                    let buffer =
                        PeerBuffer::open(pid, fd, len as usize).map_err(|e| Error::Protocol {
                            rank: self.rank(),
                            peer,
                            detail: format!("cannot map its destination shard: {e}"),
                        })?;
                    let region = Region { offset, extent };
                    self.targets.insert(
                        peer,
                        Target {
                            buffer: Mutex::new(buffer),
                            region,
                        },
                    );
                }
                Notice::NoDestination => {}
                other => {
                    return Err(self.unexpected(peer, &other, "instead of its destination"));
                }
            }
        }
        Ok(())
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
        self.links.tell(peer, &notice, "the ring's address")?;
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
                Notice::Opened => self.note_opened(peer),
                other => {
                    return Err(self.unexpected(peer, &other, "instead of its ring's address"));
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
        self.links
            .tell(peer, &Notice::Opened, "the ring's acknowledgement")?;
        let ring = Arc::new(ring);
        rings.insert(peer, ring.clone());
        Ok(ring)
    }

    /// The error for a notice from `peer` that does not fit the protocol at this point.
    fn unexpected(&self, peer: Rank, got: &Notice, instead: &str) -> Error {
        Error::Protocol {
            rank: self.rank(),
            peer,
            detail: format!("sent {got:?} {instead}"),
        }
    }

    /// `peer` has mapped the ring this rank writes to it.
    fn note_opened(&self, peer: Rank) {
        self.opened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer);
    }

    /// Waits until every receiver has mapped the ring this rank created for it.
    fn rings_opened(&self) -> Result<()> {
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
                    Notice::Opened => self.note_opened(peer),
                    other => {
                        return Err(self.unexpected(peer, &other, "instead of opening its ring"));
                    }
                }
            }
        }
        Ok(())
    }

    fn notice(&self, peer: Rank, what: &str) -> Result<Notice> {
        self.links.hear(peer, what)
    }
}

impl<C: Carrier> ShmTransport<C> {
    /// Sends a chunk: straight into the receiver's shard (when it lands there and the
    /// receiver offered it), through a ring, or by the carrier; with `sum`, appends the
    /// chunk's CRC-32C to it as the bytes are copied.
    fn send_with<'buf>(&self, chunk: Outgoing<'buf>, mut sum: Option<&mut u32>) -> Result<()>
    where
        C: Transport<'buf>,
    {
        let Some(&pid) = self.local_peers.get(&chunk.to) else {
            return match sum {
                Some(sum) => {
                    *sum = self.links.send_summed(chunk)?;
                    Ok(())
                }
                None => self.links.send(chunk),
            };
        };
        let target = match chunk.lands {
            Lands::Shard => self.targets.get(&chunk.to),
            Lands::Aside => None,
        };
        if let Some(target) = target {
            // one copy: straight from this shard into the receiver's
            if target.region.ndim() != chunk.region.ndim() || !target.region.contains(chunk.region)
            {
                return Err(Error::Protocol {
                    rank: self.rank(),
                    peer: chunk.to,
                    detail: format!(
                        "its destination shard {} does not hold {}",
                        target.region, chunk.region
                    ),
                });
            }
            // converting as it writes, when the dtypes differ
            let g = chunk.geometry(Place::Within(&target.region));
            let mut buffer = target.buffer.lock().unwrap_or_else(|p| p.into_inner());
            let bytes = buffer.bytes_mut();
            if (target.region.volume() * chunk.elem_bytes as u64) as usize != bytes.len() {
                return Err(Error::Protocol {
                    rank: self.rank(),
                    peer: chunk.to,
                    detail: "its destination shard has another size than its box".into(),
                });
            }
            match sum {
                Some(sum) => g.copy_summing(chunk.src, bytes, chunk.range.clone(), sum),
                None => g.copy(chunk.src, bytes, chunk.range.clone()),
            }
            drop(buffer);
            self.written
                .fetch_add(chunk.range.len() as u64, Ordering::Relaxed);
            let written = Notice::Written {
                start: chunk.range.start as u64,
                end: chunk.range.end as u64,
            };
            let what = format!("bytes {:?} of {}", chunk.range, chunk.region);
            return self.links.tell(chunk.to, &written, &what);
        }
        let ring = self.outgoing(chunk.to)?;
        let g = chunk.geometry(Place::Stream);
        let deadline = Instant::now() + self.timeout;
        for piece in pieces(chunk.range.clone(), ring.slot_bytes()) {
            let len = piece.len();
            let sum = sum.as_deref_mut();
            ring.push(
                |slot| match sum {
                    Some(sum) => g.copy_summing(chunk.src, &mut slot[..len], piece.clone(), sum),
                    None => g.copy(chunk.src, &mut slot[..len], piece.clone()),
                },
                pid,
                deadline,
            )
            .map_err(|e| {
                self.ring_error(chunk.to, e, format!("bytes {piece:?} of {}", chunk.region))
            })?;
        }
        Ok(())
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

impl<'buf, C: Carrier + Transport<'buf>> Transport<'buf> for ShmTransport<C> {
    fn name(&self) -> &'static str {
        "shm"
    }

    /// The carrier's rule, for every peer: both ends of a transfer must cut it alike, and
    /// the data to other hosts moves as the carrier moves it best (MPI: whole transfers of
    /// derived datatypes). Memory moves cut chunks into slots anyway.
    fn chunking(&self) -> Chunking {
        self.links.chunking()
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        self.send_with(chunk, None)
    }

    /// Sums the chunk as it copies it, into the receiver's shard or a ring slot.
    fn send_summed(&self, chunk: Outgoing<'buf>) -> Result<u32> {
        let mut sum = 0;
        self.send_with(chunk, Some(&mut sum))?;
        Ok(sum)
    }

    fn recv(&self, chunk: Incoming<'_>) -> Result<()> {
        let peer = chunk.from;
        let Some(&pid) = self.local_peers.get(&peer) else {
            return self.links.recv(chunk);
        };
        if chunk.lands == Lands::Shard && self.writers.contains(&peer) {
            // the sender writes into this shard itself: wait for its word
            let what = format!("bytes {:?} of {}", chunk.range, chunk.region);
            loop {
                match self.notice(peer, &what)? {
                    Notice::Written { start, end }
                        if start as usize == chunk.range.start
                            && end as usize == chunk.range.end =>
                    {
                        return Ok(());
                    }
                    Notice::Opened => self.note_opened(peer),
                    other => {
                        return Err(self.unexpected(
                            peer,
                            &other,
                            &format!("while {what} was due"),
                        ));
                    }
                }
            }
        }
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

    /// To a same-host peer, the sums go as a notice after the last ring slot or `Written`
    /// notice; to others, as the carrier sends them.
    fn send_sums(&self, to: Rank, sums: Vec<u32>) -> Result<()> {
        if !self.local_peers.contains_key(&to) {
            return self.links.send_sums(to, sums);
        }
        self.links
            .tell(to, &Notice::Sums(sums), "the checksums of its chunks")
    }

    fn recv_sums(&self, from: Rank) -> Result<Vec<u32>> {
        if !self.local_peers.contains_key(&from) {
            return self.links.recv_sums(from);
        }
        let what = "the checksums of its chunks";
        loop {
            match self.notice(from, what)? {
                Notice::Sums(sums) => return Ok(sums),
                // its acknowledgement of this rank's ring may come first
                Notice::Opened => self.note_opened(from),
                other => {
                    return Err(self.unexpected(from, &other, &format!("while {what} were due")));
                }
            }
        }
    }

    /// Waits until every receiver has mapped its ring, and the carrier's sends are done: only
    /// then may this rank go away. The carrier finishes even when the rings failed, so that
    /// nothing it posted still reads the shards.
    fn finish(&self) -> Result<()> {
        let rings = self.rings_opened();
        // and the carrier's own sends to peers on other hosts
        let carrier = Transport::finish(&self.links);
        rings.and(carrier)
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

    fn direct_bytes(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}
