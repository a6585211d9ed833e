//! The site's MPI (behind the `mpi` feature): every rank is an MPI process started by
//! `mpirun`, and the control plane is MPI's own. Each transfer moves as one `MPI_Send`/`MPI_Recv`
//! of subarray datatypes that describe the region in place in both shards, so MPI packs (or
//! copies once) as it does best, with its own bounded pipelining. This is how reshard runs on
//! clusters that already have MPI, InfiniBand included.
//!
//! The transport also carries the [`crate::shm`] transport's notices (its
//! [`crate::carrier::Carrier`]), so that under `mpirun` peers on one host can move their bytes
//! through shared memory, which OpenMPI does not do for strided regions in one copy.
//!
//! Failure handling is MPI's: when a process dies, `mpirun` ends the job.

mod datatype;
mod job;

use std::os::raw::c_int;
use std::sync::{Mutex, MutexGuard};

use mpi::ffi;
use mpi::raw::AsRaw;

use mpi::datatype::Equivalence;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

use crate::{Chunking, Incoming, Outgoing, Receive, Transport};

pub use datatype::{free_datatype, subarray};
pub use job::MpiJob;
use job::{abort_job, recv_json, send_json};

const DATA_TAG: i32 = 17;
const CONTROL_TAG: i32 = 18;
/// Notices of the shm transport riding on MPI ([`crate::carrier::Carrier`]): a tag of their own,
/// so that they never match a data message or the job's reports.
const NOTICE_TAG: i32 = 19;
/// The checksums of a sender's chunks (`--checksum`), after its data: a tag of their own too.
const SUMS_TAG: i32 = 20;

/// Chunks as MPI messages: contiguous runs go straight from and to the shards, strided ones
/// through a staging buffer of one chunk per direction.
pub struct MpiTransport<'a> {
    world: &'a SimpleCommunicator,
    rank: Rank,
    staging: [Mutex<Vec<u8>>; 2],
    /// Whether regions of this tensor can be described by subarray datatypes.
    datatypes: bool,
    /// Whole transfers when datatypes describe them (up to [`WHOLE_TRANSFER_LIMIT`]),
    /// requested chunks otherwise: fixed here, alike on every rank of the job.
    chunking: Chunking,
    /// Posted sends, completed by `finish`.
    pending: Mutex<Vec<Pending>>,
}

/// A posted send: its request, and what must live until it completes.
struct Pending {
    request: ffi::MPI_Request,
    datatype: Option<ffi::MPI_Datatype>,
    _buffer: Option<Vec<u8>>,
}

impl MpiTransport<'_> {
    /// Posts a send (`MPI_Isend`) of `count` items of `t` at `ptr` to `to`, and keeps it,
    /// with the datatype and buffer it uses, in `pending` until `finish` completes it.
    ///
    /// # Safety
    /// `ptr` must stay valid and unchanged until the request completes: inside `buffer`
    /// (kept here), or in a shard borrowed for the transport's lifetime.
    #[allow(clippy::too_many_arguments)]
    unsafe fn post_send(
        &self,
        ptr: *const u8,
        count: c_int,
        t: ffi::MPI_Datatype,
        to: Rank,
        tag: i32,
        datatype: Option<ffi::MPI_Datatype>,
        buffer: Option<Vec<u8>>,
    ) {
        let mut request = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: the caller keeps `ptr` valid; MPI fills `request`.
        unsafe {
            ffi::MPI_Isend(
                ptr.cast(),
                count,
                t,
                to as c_int,
                tag,
                self.world.as_raw(),
                request.as_mut_ptr(),
            );
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Pending {
                    request: request.assume_init(),
                    datatype,
                    _buffer: buffer,
                });
        }
    }
}

// SAFETY: MPI was initialized with MPI_THREAD_MULTIPLE (checked in `MpiJob::init`), so the
// communicator may be used from the send and receive threads at once; the staging buffers are
// behind locks.
unsafe impl Sync for MpiTransport<'_> {}

impl MpiTransport<'_> {
    fn stage(&self, which: usize, len: usize) -> MutexGuard<'_, Vec<u8>> {
        let mut buf = self.staging[which]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if buf.len() < len {
            buf.resize(len, 0);
        }
        buf
    }

    fn check_len(&self, len: usize, peer: Rank) -> Result<()> {
        if len > i32::MAX as usize {
            return Err(Error::Protocol {
                rank: self.rank,
                peer,
                detail: format!(
                    "a chunk of {len} bytes is over MPI's 2^31 count limit; lower --chunk-bytes"
                ),
            });
        }
        Ok(())
    }
}

/// Notices of the shm transport go as small MPI messages with their own tag.
impl crate::carrier::Carrier for MpiTransport<'_> {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn tell<T: serde::Serialize>(&self, peer: Rank, notice: &T, what: &str) -> Result<()> {
        send_json(self.world, peer, NOTICE_TAG, notice).map_err(|e| Error::Protocol {
            rank: self.rank,
            peer,
            detail: format!("cannot encode the notice of {what}: {e}"),
        })
    }

    fn hear<T: serde::de::DeserializeOwned>(&self, peer: Rank, what: &str) -> Result<T> {
        recv_json(self.world, peer, NOTICE_TAG).map_err(|e| Error::Protocol {
            rank: self.rank,
            peer,
            detail: format!("sent an unreadable notice while {what} was due: {e}"),
        })
    }
}

impl<'buf> Transport<'buf> for MpiTransport<'_> {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn chunking(&self) -> Chunking {
        self.chunking
    }

    /// Sends are posted (`MPI_Isend`) and completed in `finish`, like MPI_Alltoallw's: the
    /// executor posts them all, then receives, from one thread. (Carrying the shm transport,
    /// whose sends may block, they are posted from its send thread instead.)
    fn sends_block(&self) -> bool {
        false
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        self.check_len(chunk.len(), chunk.to)?;
        // derived datatypes move bytes as they are: a converted chunk is packed
        let whole = self.datatypes
            && chunk.cast.is_none()
            && chunk.range.start == 0
            && chunk.len() as u64 == chunk.region.volume() * chunk.elem_bytes as u64;
        let (datatype, buffer) = if whole {
            (
                Some(subarray(chunk.src_box, chunk.region, chunk.elem_bytes)),
                None,
            )
        } else {
            // a piece of a huge transfer: packed into a buffer of its own, kept until done
            let g = chunk.geometry(Place::Stream);
            let mut packed = vec![0u8; chunk.len()];
            g.copy(chunk.src, &mut packed, chunk.range.clone());
            (None, Some(packed))
        };
        let (ptr, count, t) = match (&datatype, &buffer) {
            (Some(t), _) => (chunk.src.as_ptr(), 1, *t),
            // SAFETY: reading MPI's predefined byte type, set once MPI is initialized
            (None, Some(b)) => (b.as_ptr(), b.len() as c_int, unsafe { ffi::RSMPI_UINT8_T }),
            (None, None) => unreachable!("one of the two is set above"),
        };
        // SAFETY: the datatype describes `region` inside `src_box`, whose buffer `src` stays
        // valid and unchanged for 'buf; a packed buffer lives in `pending` until completion.
        unsafe { self.post_send(ptr, count, t, chunk.to, DATA_TAG, datatype, buffer) };
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        for mut p in pending {
            // SAFETY: a request this transport posted, waited for once.
            unsafe { ffi::MPI_Wait(&mut p.request, ffi::RSMPI_STATUS_IGNORE) };
            if let Some(t) = p.datatype {
                free_datatype(t);
            }
        }
        Ok(())
    }

    fn recv(&self, chunk: Incoming<'_>) -> Result<()> {
        let from = chunk.from;
        self.check_len(chunk.len(), from)?;
        if self.datatypes
            && chunk.range.start == 0
            && chunk.len() as u64 == chunk.region.volume() * chunk.elem_bytes as u64
        {
            let t = subarray(chunk.dst_box, chunk.region, chunk.elem_bytes);
            let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
            let mut count: c_int = 0;
            // SAFETY: the type describes `region` inside `dst_box`, whose buffer is `dst`,
            // borrowed mutably; MPI fills the status.
            unsafe {
                ffi::MPI_Recv(
                    chunk.dst.as_mut_ptr().cast(),
                    1,
                    t,
                    from as c_int,
                    DATA_TAG,
                    self.world.as_raw(),
                    status.as_mut_ptr(),
                );
                ffi::MPI_Get_count(status.as_ptr(), t, &mut count);
            }
            free_datatype(t);
            if count != 1 {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: from,
                    detail: format!("the transfer of {} arrived incomplete", chunk.region),
                });
            }
            return Ok(());
        }
        let g = CopyGeometry::new(
            chunk.region,
            Place::Stream,
            Place::Within(chunk.dst_box),
            chunk.elem_bytes,
        );
        let peer = self.world.process_at_rank(from as i32);
        let mut buf = self.stage(1, chunk.len());
        let status = peer.receive_into_with_tag(&mut buf[..chunk.len()], DATA_TAG);
        let got = status.count(u8::equivalent_datatype()) as usize;
        if got != chunk.len() {
            return Err(Error::Protocol {
                rank: self.rank,
                peer: from,
                detail: format!("a chunk of {got} bytes arrived, {} expected", chunk.len()),
            });
        }
        g.copy(&buf[..chunk.len()], chunk.dst, chunk.range.clone());
        Ok(())
    }

    /// With subarray datatypes, every receive is posted at once (`MPI_Irecv`), as
    /// MPI_Alltoallw does, and completes as its data comes (`MPI_Waitany`); packed chunks
    /// of huge transfers are taken in order.
    fn recv_all(
        &self,
        expected: &[Receive<'_>],
        dst_bufs: &mut [&mut [u8]],
        chunk: usize,
        landed: &mut dyn FnMut(usize),
    ) -> Result<()> {
        // a posted receive matches the next message from its sender, so either every
        // transfer moves as one message or all go in order
        let whole = |e: &Receive<'_>| self.chunking.chunk_bytes(e.len(), chunk) >= e.len();
        if !expected.iter().all(whole) {
            return super::recv_in_order(self, expected, dst_bufs, chunk, landed);
        }
        // every check before the first receive is posted: once posted, MPI may write into
        // `dst_bufs` until the request completes, so nothing may return early in between
        for e in expected {
            self.check_len(e.len(), e.from)?;
        }
        let mut indices = Vec::with_capacity(expected.len());
        let mut types = Vec::with_capacity(expected.len());
        let mut requests = Vec::with_capacity(expected.len());
        for (i, e) in expected.iter().enumerate() {
            if e.is_empty() {
                // nothing is sent for an empty transfer
                landed(i);
                continue;
            }
            let t = subarray(e.dst_box, e.region, e.elem_bytes);
            let base = dst_bufs[e.buffer][e.bytes.clone()].as_mut_ptr();
            let mut request = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
            // SAFETY: the type describes `region` inside `dst_box`, whose bytes start at
            // `base`; `dst_bufs` stays borrowed, and untouched, until every request is
            // complete below, and the regions of distinct transfers do not overlap.
            unsafe {
                ffi::MPI_Irecv(
                    base.cast(),
                    1,
                    t,
                    e.from as c_int,
                    DATA_TAG,
                    self.world.as_raw(),
                    request.as_mut_ptr(),
                );
                requests.push(request.assume_init());
            }
            indices.push(i);
            types.push(t);
        }
        let mut failure = None;
        for _ in 0..requests.len() {
            let mut which: c_int = 0;
            let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
            let mut count: c_int = 0;
            // SAFETY: requests this transport posted; MPI marks each completed one inactive
            // and fills the status.
            unsafe {
                ffi::MPI_Waitany(
                    requests.len() as c_int,
                    requests.as_mut_ptr(),
                    &mut which,
                    status.as_mut_ptr(),
                );
                let Ok(k) = usize::try_from(which) else {
                    break;
                };
                ffi::MPI_Get_count(status.as_ptr(), types[k], &mut count);
                let e = &expected[indices[k]];
                if count == 1 {
                    landed(indices[k]);
                } else if failure.is_none() {
                    failure = Some(Error::Protocol {
                        rank: self.rank,
                        peer: e.from,
                        detail: format!("the transfer of {} arrived incomplete", e.region),
                    });
                }
            }
        }
        types.into_iter().for_each(free_datatype);
        failure.map_or(Ok(()), Err)
    }

    /// The sums are posted (`MPI_Isend`) like the data, from a buffer kept until `finish`:
    /// every rank posts its sends before it receives, so a blocking send could wait forever.
    fn send_sums(&self, to: Rank, sums: Vec<u32>) -> Result<()> {
        let bytes: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
        self.check_len(bytes.len(), to)?;
        let (ptr, count) = (bytes.as_ptr(), bytes.len() as c_int);
        // SAFETY: `bytes` moves into `pending`, where it lives until the request is complete
        // in `finish`; moving a Vec does not move its heap buffer.
        unsafe {
            self.post_send(
                ptr,
                count,
                ffi::RSMPI_UINT8_T,
                to,
                SUMS_TAG,
                None,
                Some(bytes),
            )
        };
        Ok(())
    }

    fn recv_sums(&self, from: Rank) -> Result<Vec<u32>> {
        let (bytes, _) = self
            .world
            .process_at_rank(from as c_int)
            .receive_vec_with_tag::<u8>(SUMS_TAG);
        if bytes.len() % 4 != 0 {
            return Err(Error::Protocol {
                rank: self.rank,
                peer: from,
                detail: format!(
                    "sent checksums of {} bytes, not a multiple of 4",
                    bytes.len()
                ),
            });
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// MPI cannot cancel what other ranks wait for: a rank that fails ends the whole job,
    /// which `mpirun` then reports, instead of leaving the others blocked.
    fn abort(&self) {
        abort_job(self.world, self.rank);
    }

    fn peak_staging_bytes(&self) -> u64 {
        self.staging
            .iter()
            .map(|s| s.lock().map_or(0, |b| b.len() as u64))
            .sum()
    }
}
