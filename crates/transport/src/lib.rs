//! Transports move the chunks of transfers between ranks; the executor decides what moves when.
//!
//! A transport sees one chunk at a time: an [`Outgoing`] on the sending rank (a byte range of a
//! region of its source shard) and an [`Incoming`] on the receiving rank (the same range of the
//! same region, to land in its destination shard). It may pack and unpack through a message
//! ([`Outgoing::pack_into`], [`Incoming::unpack_from`]: two copies, as over a socket) or,
//! when the sender's memory is reachable, copy straight from shard to shard
//! ([`Incoming::copy_from`]: one copy).

#![warn(missing_docs)]

pub mod carrier;
pub mod control;
pub mod frame;
pub mod group;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ring;
pub mod screen;
pub mod segment;
pub mod shm;
pub mod tcp;

use reshard_core::error::Field;
use std::ops::Range;

pub use control::Decision;
pub use local::{Fault, LocalEndpoint, LocalFabric};

use reshard_core::agreement::Fingerprint;
use reshard_core::copy::{Cast, CopyGeometry, Place};
use reshard_core::error::Result;
use reshard_core::layout::Rank;
use reshard_core::region::Region;

/// Where a transfer lands on its receiver, as both ends know it from the plan: in the
/// receiver's destination shard (the values of the tensor), or in a buffer beside it (a
/// quantization's partial amax or scales, a relaying rank's staging). A transport that writes
/// straight into a receiver's shard (shm) does so only for the first: the others land where
/// the receiver alone can say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lands {
    /// In the receiver's destination shard.
    Shard,
    /// In a buffer beside the shard, which only the receiver can name.
    Aside,
}

/// A chunk of a transfer as its sender offers it: bytes `range` of `region`'s row-major stream,
/// read from the sender's source shard.
#[derive(Clone, Debug)]
pub struct Outgoing<'buf> {
    /// The sending rank.
    pub from: Rank,
    /// The receiving rank.
    pub to: Rank,
    /// The sender's whole source shard, holding `src_box`.
    pub src: &'buf [u8],
    /// The box of the tensor that `src` holds.
    pub src_box: &'buf Region,
    /// The box of the tensor the transfer moves, inside `src_box`.
    pub region: &'buf Region,
    /// Bytes per element on the wire: the destination dtype's.
    pub elem_bytes: usize,
    /// Bytes `range` of the region's stream in the destination dtype (wire bytes).
    pub range: Range<usize>,
    /// The conversion from the source shard's dtype (`--dst-dtype`), done while packing, so
    /// that the wire carries destination bytes; `None` when both sides share one dtype.
    pub cast: Option<Cast>,
    /// Where the transfer lands on the receiver.
    pub lands: Lands,
}

impl Outgoing<'_> {
    /// The copy of this chunk's region from the source shard to `dst`, converting on the way
    /// when the chunk has a cast. Every transport packs or writes through it.
    pub fn geometry(&self, dst: Place<'_>) -> CopyGeometry {
        CopyGeometry::converting(
            self.region,
            Place::Within(self.src_box),
            dst,
            self.elem_bytes,
            self.cast.clone(),
        )
    }

    /// Bytes of the chunk, as on the wire.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the chunk holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Packs the chunk into `out`, which must be exactly [`Outgoing::len`] bytes.
    pub fn pack_into(&self, out: &mut [u8]) {
        self.geometry(Place::Stream)
            .copy(self.src, out, self.range.clone());
    }
}

/// A chunk of a transfer as its receiver expects it.
#[derive(Debug)]
pub struct Incoming<'a> {
    /// The sending rank.
    pub from: Rank,
    /// The receiving rank.
    pub to: Rank,
    /// The receiver's whole destination shard, holding `dst_box`.
    pub dst: &'a mut [u8],
    /// The box of the tensor that `dst` holds.
    pub dst_box: &'a Region,
    /// The sender's source box (for transports that read the sender's memory directly).
    pub src_box: &'a Region,
    /// The box of the tensor the transfer moves, inside `dst_box`.
    pub region: &'a Region,
    /// Bytes per element on the wire: the destination dtype's.
    pub elem_bytes: usize,
    /// Bytes `range` of the region's stream in the destination dtype (wire bytes).
    pub range: Range<usize>,
    /// Where the transfer lands: [`Lands::Shard`] when `dst` is the receiver's destination
    /// shard.
    pub lands: Lands,
}

impl Incoming<'_> {
    /// Bytes of the chunk, as on the wire.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the chunk holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Unpacks a message of exactly [`Incoming::len`] bytes into the destination shard.
    pub fn unpack_from(&mut self, msg: &[u8]) {
        let g = CopyGeometry::new(
            self.region,
            Place::Stream,
            Place::Within(self.dst_box),
            self.elem_bytes,
        );
        g.copy(msg, self.dst, self.range.clone());
    }

    /// Copies the matching chunk straight from the sender's shard: one copy per byte.
    /// Returns a description of the mismatch if `out` is not the chunk this side expects.
    pub fn copy_from(&mut self, out: &Outgoing<'_>) -> Result<(), String> {
        if out.from != self.from
            || out.region != self.region
            || out.range != self.range
            || out.elem_bytes != self.elem_bytes
            || out.lands != self.lands
        {
            return Err(format!(
                "expected bytes {:?} of {} from rank {} (landing {:?}), got bytes {:?} of {} \
                 from rank {} (landing {:?})",
                self.range,
                self.region,
                self.from,
                self.lands,
                out.range,
                out.region,
                out.from,
                out.lands
            ));
        }
        out.geometry(Place::Within(self.dst_box))
            .copy(out.src, self.dst, self.range.clone());
        Ok(())
    }
}

/// A whole transfer as its receiver expects it: from whom, what, and where it lands.
#[derive(Clone, Debug)]
pub struct Receive<'a> {
    /// The sending rank.
    pub from: Rank,
    /// The receiving rank.
    pub to: Rank,
    /// The box of the tensor the transfer moves.
    pub region: &'a Region,
    /// The sender's source box (for transports that read the sender's memory directly).
    pub src_box: &'a Region,
    /// The receiver's box holding `region`.
    pub dst_box: &'a Region,
    /// Bytes per element on the wire: the destination dtype's.
    pub elem_bytes: usize,
    /// Which destination buffer holds `dst_box`, and at which bytes.
    pub buffer: usize,
    /// The bytes of that buffer that hold `dst_box`.
    pub bytes: Range<usize>,
    /// Whether that buffer is the receiver's destination shard.
    pub lands: Lands,
}

impl Receive<'_> {
    /// Bytes of the transfer.
    pub fn len(&self) -> usize {
        self.region.volume() as usize * self.elem_bytes
    }

    /// Whether the transfer moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes `range` of the transfer as one chunk, landing in `dst` (the bytes `self.bytes`
    /// of buffer `self.buffer`).
    pub fn chunk<'d>(&'d self, dst: &'d mut [u8], range: Range<usize>) -> Incoming<'d> {
        Incoming {
            from: self.from,
            to: self.to,
            dst,
            dst_box: self.dst_box,
            src_box: self.src_box,
            region: self.region,
            elem_bytes: self.elem_bytes,
            range,
            lands: self.lands,
        }
    }
}

/// The control plane of a multi-process run: a barrier, the two-phase decision on a staged
/// version, and a common verdict.
pub trait Job {
    /// This process's rank.
    fn rank(&self) -> Rank;

    /// Number of processes in the job.
    fn world(&self) -> usize;

    /// Checks, before any byte moves, that every rank is about to run the same job: rank 0
    /// compares every rank's fingerprint with its own (one exchange, right after joining).
    /// On a difference every rank returns [`reshard_core::Error::Disagreement`], naming the first
    /// rank that differs, the field and both values.
    fn agree(&self, mine: &Fingerprint) -> Result<()>;

    /// Waits until every rank has called `barrier`; fails on every rank if one failed before.
    fn barrier(&self) -> Result<()>;

    /// The two-phase decision on a staged version, after its data movement: one at a time,
    /// any number a job (one per version), each its own exchange: every rank votes `Ok` when it holds its whole next version, staged
    /// and checked, or says why not; rank 0 decides [`Decision::Commit`] only when every rank
    /// did, [`Decision::Abort`] (naming the ranks that did not, and why) otherwise, and every
    /// rank gets the decision. A rank that voted prepared and lost rank 0 before the decision
    /// came returns [`reshard_core::Error::InDoubt`]: it must neither commit nor drop what it
    /// staged. What holds when a rank dies around the decision: [`control`].
    fn decide(&self, prepared: std::result::Result<(), String>) -> Result<Decision>;

    /// Every rank reports how its part went and rank 0 decides for all: every rank's report on
    /// rank 0 (indexed by rank), nothing elsewhere, or [`reshard_core::Error::JobFailed`] on every rank.
    fn finish(
        &self,
        mine: std::result::Result<serde_json::Value, String>,
    ) -> Result<Vec<serde_json::Value>>;
}

/// Moves chunks between ranks. One endpoint per rank; `send` and `recv` are called from
/// different threads of that rank, each in the plan's schedule order.
pub trait Transport<'buf>: Sync {
    /// Short name for reports (`local`, `tcp`, ...).
    fn name(&self) -> &'static str;

    /// How this transport cuts transfers into chunks: a rule fixed when it is built, so that
    /// both ends of a transfer, built alike, cut it alike. A transport that moves whole
    /// regions itself (MPI with derived datatypes) says so here.
    fn chunking(&self) -> Chunking {
        Chunking::Requested
    }

    /// Whether `send` may block until the receiver takes the chunk. If not, the executor
    /// posts every send before it receives, on one thread.
    fn sends_block(&self) -> bool {
        true
    }

    /// Hands one chunk to the transport. It may return before the receiver has it, but the
    /// chunk's source memory stays valid and unchanged for `'buf`.
    fn send(&self, chunk: Outgoing<'buf>) -> Result<()>;

    /// [`Transport::send`] for `--checksum`: also returns the chunk's sum, the CRC-32C of its
    /// bytes in stream order ([`reshard_core::checksum::region_sum`]). The default sums the
    /// chunk first, in a pass of its own; a transport that reads the bytes anyway, to pack or
    /// copy them, sums them as it goes ([`CopyGeometry::copy_summing`]).
    fn send_summed(&self, chunk: Outgoing<'buf>) -> Result<u32> {
        if chunk.cast.is_some() {
            // the sum is over the wire bytes, the converted ones: converted into a temporary
            // of one chunk and summed in the same pass (the transport converts again as it
            // sends; transports that pack anyway sum as they pack instead)
            let mut packed = vec![0u8; chunk.len()];
            let mut sum = 0;
            chunk.geometry(Place::Stream).copy_summing(
                chunk.src,
                &mut packed,
                chunk.range.clone(),
                &mut sum,
            );
            self.send(chunk)?;
            return Ok(sum);
        }
        let sum = reshard_core::checksum::region_sum(
            chunk.src,
            chunk.src_box,
            chunk.region,
            chunk.elem_bytes,
            chunk.range.clone(),
        );
        self.send(chunk)?;
        Ok(sum)
    }

    /// Waits (within the transport's timeout) for the next chunk from `chunk.from` and writes
    /// it into the destination shard.
    fn recv(&self, chunk: Incoming<'_>) -> Result<()>;

    /// Receives every transfer of `expected` into `dst_bufs`, each cut into chunks as
    /// [`Transport::chunking`] says for `chunk`, and calls `landed(i)` once transfer `i`
    /// is complete. Transfers from one peer complete in their order; the default takes all of
    /// them one after another through [`Transport::recv`], while a transport that can wait on
    /// several peers at once takes each peer's next chunk as it comes.
    fn recv_all(
        &self,
        expected: &[Receive<'_>],
        dst_bufs: &mut [&mut [u8]],
        chunk: usize,
        landed: &mut dyn FnMut(usize),
    ) -> Result<()> {
        recv_in_order(self, expected, dst_bufs, chunk, landed)
    }

    /// Sends `sums` to `to` after every chunk this rank sends it: the checksums of those
    /// chunks, in order (`--checksum`). A transport that carries them overrides this and
    /// [`Transport::recv_sums`]; the others refuse the option.
    fn send_sums(&self, to: Rank, sums: Vec<u32>) -> Result<()> {
        let _ = (to, sums);
        Err(no_sums(self.name()))
    }

    /// Waits (within the transport's timeout) for the checksums `from` sent with
    /// [`Transport::send_sums`], after every chunk it sent this rank.
    fn recv_sums(&self, from: Rank) -> Result<Vec<u32>> {
        let _ = from;
        Err(no_sums(self.name()))
    }

    /// Breaks every link at once, so that a rank that failed stops its other thread and its
    /// peers notice now rather than after their timeout.
    fn abort(&self) {}

    /// Called once after every send and receive of this rank: waits until the peers no longer
    /// need this rank's memory.
    fn finish(&self) -> Result<()> {
        Ok(())
    }

    /// The most staging memory this endpoint has held at once, in bytes.
    fn peak_staging_bytes(&self) -> u64 {
        0
    }

    /// Bytes this endpoint has written straight into receivers' destination shards since it
    /// was built (one copy per byte, no message or ring for the receiver to copy out of):
    /// what shows a run took that path.
    fn direct_bytes(&self) -> u64 {
        0
    }
}

/// How a transport cuts a transfer into chunks ([`Transport::chunking`]), applied to the
/// chunk size the executor asks for in each run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Chunking {
    /// Chunks of the size the executor asks for.
    #[default]
    Requested,
    /// Transfers of at most this many bytes as one chunk, however large (MPI moves them
    /// itself, described by derived datatypes); larger ones in chunks of the asked size.
    WholeUpTo(usize),
}

impl Chunking {
    /// The chunk size for a transfer of `transfer_bytes`, given the executor's `requested`
    /// size: at least one byte, so that cutting always advances.
    pub fn chunk_bytes(self, transfer_bytes: usize, requested: usize) -> usize {
        match self {
            Chunking::WholeUpTo(limit) if transfer_bytes <= limit => transfer_bytes,
            _ => requested,
        }
        .max(1)
    }
}

/// The refusal of a transport that cannot carry checksums.
fn no_sums(transport: &'static str) -> reshard_core::Error {
    reshard_core::Error::InvalidOption {
        field: Field::Checksum,
        value: transport.into(),
        reason: format!("the {transport} transport cannot carry checksums"),
    }
}

/// The default [`Transport::recv_all`]: every transfer in turn, chunk by chunk, through
/// [`Transport::recv`].
pub fn recv_in_order<'buf, T: Transport<'buf> + ?Sized>(
    transport: &T,
    expected: &[Receive<'_>],
    dst_bufs: &mut [&mut [u8]],
    chunk: usize,
    landed: &mut dyn FnMut(usize),
) -> Result<()> {
    for (i, e) in expected.iter().enumerate() {
        let len = e.len();
        let chunk = transport.chunking().chunk_bytes(len, chunk);
        for start in (0..len).step_by(chunk) {
            let dst = &mut dst_bufs[e.buffer][e.bytes.clone()];
            transport.recv(e.chunk(dst, start..start.saturating_add(chunk).min(len)))?;
        }
        landed(i);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Chunking, Incoming, Lands, Outgoing};
    use reshard_core::region::Region;

    /// Both ends of a transfer must agree on where it lands: a sender's chunk for the
    /// receiver's shard is not the one the receiver expects beside it (its scales, say).
    #[test]
    fn a_chunk_that_lands_elsewhere_than_expected_is_refused() {
        let region = Region::full(&[2, 4]);
        let src = [7u8; 8];
        let mut dst = [0u8; 8];
        let out = Outgoing {
            from: 0,
            to: 1,
            src: &src,
            src_box: &region,
            region: &region,
            elem_bytes: 1,
            range: 0..8,
            cast: None,
            lands: Lands::Shard,
        };
        let mut inc = Incoming {
            from: 0,
            to: 1,
            dst: &mut dst,
            dst_box: &region,
            src_box: &region,
            region: &region,
            elem_bytes: 1,
            range: 0..8,
            lands: Lands::Aside,
        };
        let err = inc.copy_from(&out).unwrap_err();
        assert!(
            err.contains("landing Aside") && err.contains("landing Shard"),
            "{err}"
        );
        inc.lands = Lands::Shard;
        inc.copy_from(&out).unwrap();
        assert_eq!(dst, src);
    }

    #[test]
    fn chunking_rules_cut_transfers_alike_at_both_ends() {
        // the asked size, never zero
        assert_eq!(Chunking::Requested.chunk_bytes(100, 16), 16);
        assert_eq!(Chunking::Requested.chunk_bytes(100, 0), 1);
        // whole transfers up to the limit, the asked size beyond it
        let whole = Chunking::WholeUpTo(1000);
        assert_eq!(whole.chunk_bytes(1000, 16), 1000);
        assert_eq!(whole.chunk_bytes(1001, 16), 16);
        assert_eq!(whole.chunk_bytes(0, 16), 1);
    }
}
