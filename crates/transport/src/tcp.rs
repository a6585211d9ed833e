//! Processes and hosts over TCP: one authenticated stream per pair of peers that exchange
//! data (see [`super::group`]), framed chunks, and no copy of our own where it can be avoided:
//! runs of at least [`VECTORED_MIN_RUN`] bytes go between the shards and the socket with
//! vectored I/O; shorter runs are packed into a bounded staging buffer.

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::region::Region;

use super::frame::{self, FrameError};
use super::{Incoming, Outgoing, Receive, Transport};

/// Runs at least this long move straight between shard and socket.
pub const VECTORED_MIN_RUN: usize = 1024;
/// At most this many runs per system call (Linux's IOV_MAX is 1024).
const MAX_IOVECS: usize = 512;

/// One rank's links to its peers.
#[derive(Debug)]
pub struct TcpTransport {
    rank: Rank,
    timeout: Duration,
    writers: BTreeMap<Rank, Mutex<TcpStream>>,
    readers: BTreeMap<Rank, Mutex<TcpStream>>,
    /// One more handle per link, never locked, for [`Transport::abort`].
    shutdown_handles: Vec<TcpStream>,
    send_staging: Mutex<Vec<u8>>,
    recv_staging: Mutex<Vec<u8>>,
    /// Sizes of the two staging buffers, readable without their locks.
    staging_sizes: [AtomicU64; 2],
    peak_staging: AtomicU64,
}

impl TcpTransport {
    /// Wraps connected, authenticated streams (from [`super::group::Group::connect_peers`]).
    pub fn new(
        rank: Rank,
        links: BTreeMap<Rank, TcpStream>,
        timeout: Duration,
    ) -> Result<TcpTransport> {
        let mut writers = BTreeMap::new();
        let mut readers = BTreeMap::new();
        let mut shutdown_handles = Vec::new();
        for (peer, stream) in links {
            let clone = || {
                stream.try_clone().map_err(|e| Error::Io {
                    path: format!("socket to rank {peer}"),
                    source: e,
                })
            };
            readers.insert(peer, Mutex::new(clone()?));
            shutdown_handles.push(clone()?);
            writers.insert(peer, Mutex::new(stream));
        }
        Ok(TcpTransport {
            rank,
            timeout,
            writers,
            readers,
            shutdown_handles,
            send_staging: Mutex::new(Vec::new()),
            recv_staging: Mutex::new(Vec::new()),
            staging_sizes: [AtomicU64::new(0), AtomicU64::new(0)],
            peak_staging: AtomicU64::new(0),
        })
    }

    /// The rank these links belong to.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The stream that writes to `peer`, locked.
    pub fn writer(&self, peer: Rank) -> Result<MutexGuard<'_, TcpStream>> {
        let w = self.writers.get(&peer).ok_or_else(|| Error::Protocol {
            rank: self.rank,
            peer,
            detail: "no link to this peer: the plans of the two ranks disagree".into(),
        })?;
        Ok(w.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The stream that reads from `peer`, locked.
    pub fn reader(&self, peer: Rank) -> Result<MutexGuard<'_, TcpStream>> {
        let r = self.readers.get(&peer).ok_or_else(|| Error::Protocol {
            rank: self.rank,
            peer,
            detail: "no link from this peer: the plans of the two ranks disagree".into(),
        })?;
        Ok(r.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The error for a failed frame exchange with `peer` while moving `what`.
    pub fn fail(&self, peer: Rank, what: String, e: FrameError) -> Error {
        e.into_error(self.rank, peer, &what, self.timeout)
    }

    /// Staging buffer `which` (0: send, 1: receive), grown to at least `len` bytes.
    fn stage(&self, which: usize, len: usize) -> std::sync::MutexGuard<'_, Vec<u8>> {
        let staging = [&self.send_staging, &self.recv_staging][which];
        let mut buf = staging.lock().unwrap_or_else(|p| p.into_inner());
        if buf.len() < len {
            buf.resize(len, 0);
            self.staging_sizes[which].store(len as u64, Ordering::Relaxed);
            let total = self
                .staging_sizes
                .iter()
                .map(|s| s.load(Ordering::Relaxed))
                .sum();
            self.peak_staging.fetch_max(total, Ordering::Relaxed);
        }
        buf
    }
}

/// Notices of the shm transport go as control frames on the same streams as the data.
impl super::carrier::Carrier for TcpTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn tell<T: serde::Serialize>(&self, peer: Rank, notice: &T, what: &str) -> Result<()> {
        let mut w = self.writer(peer)?;
        frame::write_control(&mut *w, notice).map_err(|e| self.fail(peer, what.into(), e))
    }

    fn hear<T: serde::de::DeserializeOwned>(&self, peer: Rank, what: &str) -> Result<T> {
        let mut r = self.reader(peer)?;
        frame::read_control(&mut *r).map_err(|e| self.fail(peer, what.into(), e))
    }
}

/// The `(offset, len)` pieces of bytes `range` of a region's stream inside the shard on the
/// source side (`on_src`) or the destination side of `g`.
pub fn segments(
    g: &CopyGeometry,
    range: std::ops::Range<usize>,
    on_src: bool,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    g.for_each_run(range, |s, d, len| {
        out.push((if on_src { s } else { d }, len))
    });
    out
}

/// Moves the position (`first` segment, `skip` bytes into it) past `n` more bytes.
fn advance(segs: &[(usize, usize)], first: &mut usize, skip: &mut usize, mut n: usize) {
    while n > 0 {
        let left = segs[*first].1 - *skip;
        if n < left {
            *skip += n;
            return;
        }
        n -= left;
        *first += 1;
        *skip = 0;
    }
}

/// `write_vectored` without the signal: `writev` to a peer that has gone raises SIGPIPE, which
/// the command line leaves at its default (so that `reshard plan | head` ends quietly), and a
/// killed peer would then take this process down without a word. `sendmsg` with
/// `MSG_NOSIGNAL` reports the broken pipe as an error instead, as `TcpStream::write` does.
fn send_vectored(w: &TcpStream, slices: &[IoSlice<'_>]) -> std::io::Result<usize> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(w);
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is ABI-compatible with `iovec` on Unix; sendmsg only reads the slices.
    msg.msg_iov = slices.as_ptr().cast_mut().cast();
    msg.msg_iovlen = slices.len() as _;
    // SAFETY: `fd` is an open socket owned by `w`, and `msg` points at `slices`, which live
    // for the whole call.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn write_all_vectored(
    w: &mut TcpStream,
    base: &[u8],
    segs: &[(usize, usize)],
) -> std::io::Result<()> {
    let mut first = 0; // first segment not fully written
    let mut skip = 0; // bytes of it already written
    while first < segs.len() {
        let end = (first + MAX_IOVECS).min(segs.len());
        let slices: Vec<IoSlice<'_>> = segs[first..end]
            .iter()
            .enumerate()
            .map(|(i, &(o, l))| {
                let s = if i == 0 { skip } else { 0 };
                IoSlice::new(&base[o + s..o + l])
            })
            .collect();
        let n = match send_vectored(w, &slices) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        advance(segs, &mut first, &mut skip, n);
    }
    Ok(())
}

/// Where a vectored transfer into a list of segments stands: the first segment not yet
/// complete, and how many of its bytes are in.
#[derive(Clone, Copy, Debug, Default)]
struct Cursor {
    first: usize,
    skip: usize,
}

/// One `readv` into what remains of `segs` (pieces of `base`): the bytes read, 0 at the end
/// of the stream.
fn read_some_vectored(
    r: &mut TcpStream,
    base: &mut [u8],
    segs: &[(usize, usize)],
    at: &mut Cursor,
) -> std::io::Result<usize> {
    let end = (at.first + MAX_IOVECS).min(segs.len());
    // carve disjoint slices: the segments of a region increase in offset
    let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(end - at.first);
    let mut rest: &mut [u8] = base;
    let mut consumed = 0;
    for (i, &(o, l)) in segs[at.first..end].iter().enumerate() {
        let s = if i == 0 { at.skip } else { 0 };
        let tail = std::mem::take(&mut rest);
        let (_, from) = tail.split_at_mut(o + s - consumed);
        let (piece, after) = from.split_at_mut(l - s);
        consumed = o + l;
        rest = after;
        slices.push(IoSliceMut::new(piece));
    }
    let n = r.read_vectored(&mut slices)?;
    advance(segs, &mut at.first, &mut at.skip, n);
    Ok(n)
}

/// [`read_some_vectored`] for a stream that must bring more: its end is an error, and an
/// interrupted read just reads nothing.
fn read_more_vectored(
    r: &mut TcpStream,
    base: &mut [u8],
    segs: &[(usize, usize)],
    at: &mut Cursor,
) -> std::io::Result<()> {
    match read_some_vectored(r, base, segs, at) {
        Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(e),
    }
}

fn read_exact_vectored(
    r: &mut TcpStream,
    base: &mut [u8],
    segs: &[(usize, usize)],
) -> std::io::Result<()> {
    let mut at = Cursor::default();
    while at.first < segs.len() {
        read_more_vectored(r, base, segs, &mut at)?;
    }
    Ok(())
}

/// One peer's stream in a batch receive ([`TcpTransport::recv_all`]): its transfers, in
/// order, and how far the current one has come.
#[derive(Debug)]
struct Inbound {
    peer: Rank,
    fd: std::os::fd::RawFd,
    /// Indices of the peer's transfers in the batch, in order, and the current one.
    transfers: Vec<usize>,
    next: usize,
    /// Bytes of the current transfer received in whole chunks.
    done: usize,
    /// The chunk being read straight into the shard, once its header is in.
    reading: Option<ChunkRead>,
}

/// A chunk on its way into the shard: its bytes of the transfer, their pieces in the shard,
/// and how far the reads have come.
#[derive(Debug)]
struct ChunkRead {
    range: std::ops::Range<usize>,
    segs: Vec<(usize, usize)>,
    at: Cursor,
}

/// What a chunk is, for errors.
fn describe(chunk: &Incoming<'_>) -> String {
    describe_bytes(&chunk.range, chunk.region, chunk.from)
}

fn describe_bytes(range: &std::ops::Range<usize>, region: &Region, from: Rank) -> String {
    format!("bytes {range:?} of {region} from rank {from}")
}

impl TcpTransport {
    /// Reads `chunk`'s header from `r`. A chunk of short runs then comes whole through the
    /// staging buffer and is done (`None`); one of long runs is left to vectored reads straight
    /// into the shard, along the pieces returned.
    fn begin_chunk(
        &self,
        r: &mut TcpStream,
        chunk: &mut Incoming<'_>,
    ) -> Result<Option<ChunkRead>> {
        let peer = chunk.from;
        frame::read_data_header(r, chunk.len() as u64)
            .map_err(|e| self.fail(peer, describe(chunk), e))?;
        let g = CopyGeometry::new(
            chunk.region,
            Place::Stream,
            Place::Within(chunk.dst_box),
            chunk.elem_bytes,
        );
        if g.run_bytes() >= VECTORED_MIN_RUN {
            return Ok(Some(ChunkRead {
                range: chunk.range.clone(),
                segs: segments(&g, chunk.range.clone(), false),
                at: Cursor::default(),
            }));
        }
        let mut buf = self.stage(1, chunk.len());
        r.read_exact(&mut buf[..chunk.len()])
            .map_err(|e| self.fail(peer, describe(chunk), e.into()))?;
        g.copy(&buf[..chunk.len()], chunk.dst, chunk.range.clone());
        Ok(None)
    }

    /// Takes the next step of `inbound`'s stream, which has bytes waiting: reads a chunk's
    /// header (and a chunk of short runs whole), or what has arrived of the chunk, into the
    /// destination shard. Calls `landed` for every transfer that completes.
    fn step(
        &self,
        inbound: &mut Inbound,
        expected: &[Receive<'_>],
        dst_bufs: &mut [&mut [u8]],
        chunk: usize,
        landed: &mut dyn FnMut(usize),
    ) -> Result<()> {
        let i = inbound.transfers[inbound.next];
        let e = &expected[i];
        let len = e.len();
        let dst = &mut dst_bufs[e.buffer][e.bytes.clone()];
        let mut r = self.reader(inbound.peer)?;
        match inbound.reading.as_mut() {
            None => {
                let size = self.chunking().chunk_bytes(len, chunk);
                let range = inbound.done..inbound.done.saturating_add(size).min(len);
                let end = range.end;
                inbound.reading = self.begin_chunk(&mut r, &mut e.chunk(dst, range))?;
                if inbound.reading.is_some() {
                    return Ok(());
                }
                inbound.done = end;
            }
            Some(c) => {
                read_more_vectored(&mut r, dst, &c.segs, &mut c.at).map_err(|err| {
                    let what = describe_bytes(&c.range, e.region, e.from);
                    self.fail(inbound.peer, what, err.into())
                })?;
                if c.at.first < c.segs.len() {
                    return Ok(());
                }
                inbound.done = c.range.end;
                inbound.reading = None;
            }
        }
        if inbound.done == len {
            landed(i);
            inbound.next += 1;
            inbound.done = 0;
        }
        Ok(())
    }
}

impl TcpTransport {
    /// Sends a chunk as one data frame; with `sum`, also sums it (CRC-32C, stream order).
    fn send_with(&self, chunk: Outgoing<'_>, sum: Option<&mut u32>) -> Result<()> {
        let peer = chunk.to;
        let what = || format!("bytes {:?} of {} to rank {peer}", chunk.range, chunk.region);
        let mut w = self.writer(peer)?;
        let g = chunk.geometry(Place::Stream);
        let header = |w: &mut TcpStream| frame::write_data_header(w, chunk.len() as u64);
        header(&mut w).map_err(|e| self.fail(peer, what(), e))?;
        // a converted chunk is packed: the wire carries destination bytes, not the shard's
        if g.run_bytes() >= VECTORED_MIN_RUN && chunk.cast.is_none() {
            if let Some(sum) = sum {
                *sum = reshard_core::checksum::region_sum(
                    chunk.src,
                    chunk.src_box,
                    chunk.region,
                    chunk.elem_bytes,
                    chunk.range.clone(),
                );
            }
            let segs = segments(&g, chunk.range.clone(), true);
            write_all_vectored(&mut w, chunk.src, &segs)
                .map_err(|e| self.fail(peer, what(), e.into()))
        } else {
            let mut buf = self.stage(0, chunk.len());
            match sum {
                Some(sum) => {
                    g.copy_summing(chunk.src, &mut buf[..chunk.len()], chunk.range.clone(), sum)
                }
                None => g.copy(chunk.src, &mut buf[..chunk.len()], chunk.range.clone()),
            }
            w.write_all(&buf[..chunk.len()])
                .map_err(|e| self.fail(peer, what(), e.into()))
        }
    }
}

impl<'buf> Transport<'buf> for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        self.send_with(chunk, None)
    }

    /// Short runs are summed as they are packed; long ones, which the kernel copies from the
    /// shard, in a pass of their own.
    fn send_summed(&self, chunk: Outgoing<'buf>) -> Result<u32> {
        let mut sum = 0;
        self.send_with(chunk, Some(&mut sum))?;
        Ok(sum)
    }

    fn recv(&self, mut chunk: Incoming<'_>) -> Result<()> {
        let mut r = self.reader(chunk.from)?;
        let Some(c) = self.begin_chunk(&mut r, &mut chunk)? else {
            return Ok(());
        };
        read_exact_vectored(&mut r, chunk.dst, &c.segs)
            .map_err(|e| self.fail(chunk.from, describe(&chunk), e.into()))
    }

    /// Reads from whichever peers have bytes waiting (`poll`), so that every sender's stream
    /// keeps moving instead of one at a time; each peer's transfers arrive in order.
    fn recv_all(
        &self,
        expected: &[Receive<'_>],
        dst_bufs: &mut [&mut [u8]],
        chunk: usize,
        landed: &mut dyn FnMut(usize),
    ) -> Result<()> {
        let mut inbound: Vec<Inbound> = Vec::new();
        for (i, e) in expected.iter().enumerate() {
            if e.is_empty() {
                // nothing comes on the wire for an empty transfer
                landed(i);
                continue;
            }
            match inbound.iter_mut().find(|p| p.peer == e.from) {
                Some(p) => p.transfers.push(i),
                None => inbound.push(Inbound {
                    peer: e.from,
                    fd: std::os::fd::AsRawFd::as_raw_fd(&*self.reader(e.from)?),
                    transfers: vec![i],
                    next: 0,
                    done: 0,
                    reading: None,
                }),
            }
        }
        let timeout_ms =
            libc::c_int::try_from(self.timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        loop {
            inbound.retain(|p| p.next < p.transfers.len());
            let Some(first) = inbound.first() else {
                return Ok(());
            };
            let mut fds: Vec<libc::pollfd> = inbound
                .iter()
                .map(|p| libc::pollfd {
                    fd: p.fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // SAFETY: `fds` holds `fds.len()` initialized entries for the whole call, and
            // every descriptor belongs to a stream this transport owns.
            let ready =
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if ready < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(self.fail(first.peer, "waiting for data".into(), err.into()));
            }
            if ready == 0 {
                let e = &expected[first.transfers[first.next]];
                return Err(Error::Timeout {
                    rank: self.rank,
                    peer: first.peer,
                    waited: self.timeout,
                    detail: format!("no byte of {} arrived from any sender", e.region),
                });
            }
            for (p, fd) in inbound.iter_mut().zip(&fds) {
                if fd.revents != 0 {
                    self.step(p, expected, dst_bufs, chunk, landed)?;
                }
            }
        }
    }

    /// The sums go as a control frame on the stream, after the data frames they sum.
    fn send_sums(&self, to: Rank, sums: Vec<u32>) -> Result<()> {
        super::carrier::Carrier::tell(self, to, &sums, "the checksums of its chunks")
    }

    fn recv_sums(&self, from: Rank) -> Result<Vec<u32>> {
        super::carrier::Carrier::hear(self, from, "the checksums of its chunks")
    }

    fn abort(&self) {
        // through clones, so that even a thread blocked inside a read or write is woken up
        for s in &self.shutdown_handles {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn peak_staging_bytes(&self) -> u64 {
        self.peak_staging.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    #[test]
    fn a_vanished_peer_is_an_error_not_a_signal() {
        // the command line's disposition: without MSG_NOSIGNAL, this process would die here
        // SAFETY: swapping one signal's disposition and restoring it below.
        let before = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut w = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (r, _) = listener.accept().unwrap();
        drop(r);
        let data = vec![7u8; 1 << 20];
        let segs: Vec<(usize, usize)> = (0..128).map(|i| (i * 8192, 4096)).collect();
        let mut result = Ok(());
        for _ in 0..1000 {
            result = write_all_vectored(&mut w, &data, &segs);
            if result.is_err() {
                break;
            }
        }
        // SAFETY: as above.
        unsafe { libc::signal(libc::SIGPIPE, before) };
        let e = result.expect_err("writing to a closed peer must fail");
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ),
            "{e}"
        );
    }
}
