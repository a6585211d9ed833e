//! Ranks as threads of one process. A send hands the receiver a view of the sender's shard and
//! the receiver copies straight from it into its own shard: one copy per byte, no staging.
//!
//! Faults can be injected ([`Fault`]) so that the failure paths of the executor are tested
//! deterministically: a rank that dies mid-transfer, or one that stalls.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

use super::{Incoming, Outgoing, Transport};

/// A failure to inject into one rank of a local run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The rank dies after handling (sending or receiving) `after_chunks` chunks: its links
    /// close, as a killed process's sockets do.
    Die {
        /// The rank that dies.
        rank: Rank,
        /// Chunks it handles before it dies.
        after_chunks: u64,
    },
    /// The rank stops sending for `for_` before failing, with its links open: a hung peer.
    Stall {
        /// The rank that stalls.
        rank: Rank,
        /// How long it stalls.
        for_: Duration,
    },
    /// When the `chunk`-th chunk the rank handles (counted from 0 over its sends and
    /// receives, as for `Die`) is one it receives, its first byte is flipped after it lands:
    /// a byte changed on the way, which only `--checksum` notices.
    Corrupt {
        /// The rank whose received chunk is corrupted.
        rank: Rank,
        /// The chunk's number among those the rank handles.
        chunk: u64,
    },
}

impl Fault {
    fn rank(&self) -> Rank {
        match *self {
            Fault::Die { rank, .. } | Fault::Stall { rank, .. } | Fault::Corrupt { rank, .. } => {
                rank
            }
        }
    }
}

/// Builds the endpoints of a local run: one channel per (sender, receiver) pair.
#[derive(Clone, Debug)]
pub struct LocalFabric {
    /// How long a receiver waits for a peer's next chunk before giving up.
    pub timeout: Duration,
    /// The failures to inject; a rank takes the first one that names it.
    pub faults: Vec<Fault>,
}

impl LocalFabric {
    /// A fabric without faults whose receivers wait `timeout`.
    pub fn new(timeout: Duration) -> LocalFabric {
        LocalFabric {
            timeout,
            faults: Vec::new(),
        }
    }

    /// One endpoint for every rank in `ranks`, linked along `pairs` (sender, receiver).
    pub fn endpoints<'buf>(
        &self,
        ranks: &[Rank],
        pairs: impl IntoIterator<Item = (Rank, Rank)>,
    ) -> BTreeMap<Rank, LocalEndpoint<'buf>> {
        let mut endpoints: BTreeMap<Rank, LocalEndpoint<'buf>> = ranks
            .iter()
            .map(|&rank| {
                let fault = self.faults.iter().copied().find(|f| f.rank() == rank);
                let endpoint = LocalEndpoint {
                    rank,
                    outboxes: Mutex::new(BTreeMap::new()),
                    inboxes: BTreeMap::new(),
                    timeout: self.timeout,
                    fault,
                    handled_chunks: AtomicU64::new(0),
                };
                (rank, endpoint)
            })
            .collect();
        for (from, to) in pairs {
            let (tx, rx) = mpsc::channel();
            if let Some(e) = endpoints.get_mut(&from) {
                e.outboxes
                    .get_mut()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(to, tx);
            }
            if let Some(e) = endpoints.get_mut(&to) {
                e.inboxes.insert(from, Mutex::new(Some(rx)));
            }
        }
        endpoints
    }
}

/// What goes from one rank to another.
#[derive(Debug)]
enum Message<'buf> {
    /// A chunk, read by the receiver straight from the sender's shard.
    Chunk(Outgoing<'buf>),
    /// The checksums of every chunk sent before (`--checksum`).
    Sums(Vec<u32>),
}

/// One rank's end of a local run.
#[derive(Debug)]
pub struct LocalEndpoint<'buf> {
    rank: Rank,
    outboxes: Mutex<BTreeMap<Rank, Sender<Message<'buf>>>>,
    inboxes: BTreeMap<Rank, Mutex<Option<Receiver<Message<'buf>>>>>,
    timeout: Duration,
    fault: Option<Fault>,
    handled_chunks: AtomicU64,
}

impl<'buf> LocalEndpoint<'buf> {
    /// Applies an injected `Die` fault once its time has come: closes every link and fails.
    fn check_alive(&self) -> Result<()> {
        let Some(Fault::Die { after_chunks, .. }) = self.fault else {
            return Ok(());
        };
        if self.handled_chunks.load(Ordering::Relaxed) < after_chunks {
            return Ok(());
        }
        self.outboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        for inbox in self.inboxes.values() {
            inbox.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
        Err(Error::PeerGone {
            rank: self.rank,
            peer: self.rank,
            detail: "this rank was killed by an injected fault".into(),
        })
    }

    /// Hands `message` to `peer`.
    fn post(&self, peer: Rank, message: Message<'buf>) -> Result<()> {
        let outboxes = self.outboxes.lock().unwrap_or_else(|p| p.into_inner());
        let outbox = outboxes.get(&peer).ok_or_else(|| Error::Protocol {
            rank: self.rank,
            peer,
            detail: "no link to this peer: the plans of the two ranks disagree".into(),
        })?;
        outbox.send(message).map_err(|_| Error::PeerGone {
            rank: self.rank,
            peer,
            detail: "it exited before receiving everything".into(),
        })
    }

    /// Waits for `peer`'s next message; `what` says what was awaited, in an error.
    fn take(&self, peer: Rank, what: &dyn Fn() -> String) -> Result<Message<'buf>> {
        let inbox = self.inboxes.get(&peer).ok_or_else(|| Error::Protocol {
            rank: self.rank,
            peer,
            detail: "no link from this peer: the plans of the two ranks disagree".into(),
        })?;
        let got = match inbox.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(rx) => rx.recv_timeout(self.timeout),
            None => Err(RecvTimeoutError::Disconnected),
        };
        match got {
            Ok(message) => Ok(message),
            Err(RecvTimeoutError::Timeout) => Err(Error::Timeout {
                rank: self.rank,
                peer,
                waited: self.timeout,
                detail: format!("{} never arrived", what()),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(Error::PeerGone {
                rank: self.rank,
                peer,
                detail: format!("it exited before sending {}", what()),
            }),
        }
    }
}

impl<'buf> Transport<'buf> for LocalEndpoint<'buf> {
    fn name(&self) -> &'static str {
        "local"
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        let peer = chunk.to;
        self.check_alive()?;
        if let Some(Fault::Stall { for_, .. }) = self.fault {
            std::thread::sleep(for_);
            return Err(Error::Timeout {
                rank: self.rank,
                peer,
                waited: for_,
                detail: "this rank was stalled by an injected fault".into(),
            });
        }
        self.post(peer, Message::Chunk(chunk))?;
        self.handled_chunks.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn recv(&self, mut chunk: Incoming<'_>) -> Result<()> {
        let peer = chunk.from;
        self.check_alive()?;
        let (range, region) = (chunk.range.clone(), chunk.region);
        let what = || format!("bytes {range:?} of {region}");
        let out = match self.take(peer, &what)? {
            Message::Chunk(out) => out,
            Message::Sums(_) => {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer,
                    detail: format!("sent its checksums while {} was due", what()),
                });
            }
        };
        chunk.copy_from(&out).map_err(|detail| Error::Protocol {
            rank: self.rank,
            peer,
            detail,
        })?;
        let handled = self.handled_chunks.fetch_add(1, Ordering::Relaxed);
        if let Some(Fault::Corrupt { chunk: bad, .. }) = self.fault
            && bad == handled
            && !chunk.range.is_empty()
        {
            flip_first_byte(&mut chunk);
        }
        Ok(())
    }

    fn send_sums(&self, to: Rank, sums: Vec<u32>) -> Result<()> {
        self.check_alive()?;
        self.post(to, Message::Sums(sums))
    }

    fn recv_sums(&self, from: Rank) -> Result<Vec<u32>> {
        self.check_alive()?;
        match self.take(from, &|| "its checksums".to_string())? {
            Message::Sums(sums) => Ok(sums),
            Message::Chunk(out) => Err(Error::Protocol {
                rank: self.rank,
                peer: from,
                detail: format!(
                    "sent bytes {:?} of {} while its checksums were due",
                    out.range, out.region
                ),
            }),
        }
    }
}

/// Flips the first byte of a chunk where it landed in the destination shard.
fn flip_first_byte(chunk: &mut Incoming<'_>) {
    let g = CopyGeometry::new(
        chunk.region,
        Place::Stream,
        Place::Within(chunk.dst_box),
        chunk.elem_bytes,
    );
    let mut first = None;
    g.for_each_run(chunk.range.clone(), |_, at, _| {
        first.get_or_insert(at);
    });
    if let Some(at) = first {
        chunk.dst[at] ^= 0x5a;
    }
}
