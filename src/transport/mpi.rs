//! The site's MPI (behind the `mpi` feature): every rank is an MPI process started by
//! `mpirun`, and the control plane is MPI's own. Each transfer moves as one `MPI_Send`/`MPI_Recv`
//! of subarray datatypes that describe the region in place in both shards, so MPI packs (or
//! copies once) as it does best, with its own bounded pipelining. This is how reshard runs on
//! clusters that already have MPI, InfiniBand included.
//!
//! The transport also carries the [`super::shm`] transport's notices (its
//! [`super::shm::Carrier`]), so that under `mpirun` peers on one host can move their bytes
//! through shared memory, which OpenMPI does not do for strided regions in one copy.
//!
//! Failure handling is MPI's: when a process dies, `mpirun` ends the job.

use std::os::raw::c_int;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::AsRaw;

use mpi::Threading;
use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::agreement::Fingerprint;
use crate::copy::{CopyGeometry, Place};
use crate::error::{Error, Result};
use crate::layout::{Layout, Rank};
use crate::region::Region;

use super::control::{Action, Call, Event, Lost, Machine, Msg};
use super::{Chunking, Incoming, Job, Outgoing, Receive, Transport};

const DATA_TAG: i32 = 17;
/// Transfers up to this size move whole, as one message of a derived datatype; larger ones
/// (beyond what MPI's int counts and sizes safely describe) move in packed chunks.
const WHOLE_TRANSFER_LIMIT: usize = 1 << 30;

/// Whether subarray datatypes can describe the regions of a tensor of `shape`: they count in
/// C ints, so every dim, in bytes for the innermost, must fit.
fn fits_datatypes(shape: &[u64], elem_bytes: usize) -> bool {
    shape.iter().enumerate().all(|(d, &n)| {
        let n = if d + 1 == shape.len() {
            n.saturating_mul(elem_bytes as u64)
        } else {
            n
        };
        n <= c_int::MAX as u64
    })
}

/// A committed MPI datatype for `region` inside the dense row-major buffer of `holder`
/// (elements of `elem` bytes, counted as bytes). Free it with [`free_datatype`].
///
/// Panics if a dimension exceeds `i32`: callers keep to `WHOLE_TRANSFER_LIMIT`.
pub fn subarray(holder: &Region, region: &Region, elem: usize) -> ffi::MPI_Datatype {
    let int = |v: u64| c_int::try_from(v).expect("dimension within MPI's int range");
    let (mut sizes, mut subsizes, mut starts): (Vec<c_int>, Vec<c_int>, Vec<c_int>) = (
        holder.extent.iter().map(|&e| int(e)).collect(),
        region.extent.iter().map(|&e| int(e)).collect(),
        (0..holder.ndim())
            .map(|d| int(region.offset[d] - holder.offset[d]))
            .collect(),
    );
    if holder.ndim() == 0 {
        (sizes, subsizes, starts) = (vec![1], vec![1], vec![0]);
    }
    let n = sizes.len();
    let e = elem as c_int;
    // the innermost dim counted in bytes
    sizes[n - 1] *= e;
    subsizes[n - 1] *= e;
    starts[n - 1] *= e;
    let mut t = std::mem::MaybeUninit::<ffi::MPI_Datatype>::uninit();
    // SAFETY: the arrays hold `n` entries each and outlive the calls; MPI writes the new type.
    unsafe {
        ffi::MPI_Type_create_subarray(
            n as c_int,
            sizes.as_ptr(),
            subsizes.as_ptr(),
            starts.as_ptr(),
            ffi::MPI_ORDER_C as c_int,
            ffi::RSMPI_UINT8_T,
            t.as_mut_ptr(),
        );
        let mut t = t.assume_init();
        ffi::MPI_Type_commit(&mut t);
        t
    }
}

/// Frees a datatype made by [`subarray`].
pub fn free_datatype(mut t: ffi::MPI_Datatype) {
    // SAFETY: a type this module committed, freed once.
    unsafe { ffi::MPI_Type_free(&mut t) };
}
const CONTROL_TAG: i32 = 18;
/// Notices of the shm transport riding on MPI ([`super::shm::Carrier`]): a tag of their own,
/// so that they never match a data message or the job's reports.
const NOTICE_TAG: i32 = 19;
/// The checksums of a sender's chunks (`--checksum`), after its data: a tag of their own too.
const SUMS_TAG: i32 = 20;

/// This process's membership in the MPI job; finalizes MPI when dropped.
pub struct MpiJob {
    world: SimpleCommunicator,
    /// The other ranks on this host, with their process ids.
    neighbours: std::collections::BTreeMap<Rank, u32>,
    /// Which host every rank runs on.
    hosts: crate::topology::HostMap,
    // dropped last: finalizes MPI
    _universe: Universe,
}

impl MpiJob {
    /// Initializes MPI with full thread support (sends and receives run on two threads), and
    /// learns which ranks share this host (an all-gather: every rank calls `init`).
    pub fn init() -> Result<MpiJob> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::InvalidOption {
                field: Field::Transport,
                value: "mpi".into(),
                reason: "MPI is already initialized in this process".into(),
            })?;
        if threading != Threading::Multiple {
            return Err(Error::InvalidOption {
                field: Field::Transport,
                value: "mpi".into(),
                reason: format!(
                    "this MPI library provides {threading:?} threading, and reshard needs MPI_THREAD_MULTIPLE"
                ),
            });
        }
        let world = universe.world();
        let (neighbours, hosts) = same_host_peers(&world)?;
        Ok(MpiJob {
            world,
            neighbours,
            hosts,
            _universe: universe,
        })
    }

    /// The other ranks of this job that run on this host, with their process ids: the peers
    /// whose memory this process can map.
    pub fn same_host_peers(&self) -> &std::collections::BTreeMap<Rank, u32> {
        &self.neighbours
    }

    /// Which host every rank of the job runs on.
    pub fn hosts(&self) -> &crate::topology::HostMap {
        &self.hosts
    }

    /// Ends the whole job after `error` on this rank, for failures that the other ranks
    /// would otherwise wait on forever (inside MPI calls).
    pub fn abort(&self, error: &Error) -> ! {
        eprintln!("error: {error}");
        abort_job(&self.world, self.rank())
    }

    /// The data transport over this job's world communicator, for the tensors of `layouts`:
    /// subarray datatypes when they describe every tensor, packed chunks otherwise (both ends
    /// of a transfer must choose alike, so the choice covers all the job's tensors).
    pub fn transport<'l>(&self, layouts: impl IntoIterator<Item = &'l Layout>) -> MpiTransport<'_> {
        let fits = layouts
            .into_iter()
            .all(|l| fits_datatypes(l.shape(), l.dtype().size()));
        MpiTransport {
            world: &self.world,
            rank: self.world.rank() as Rank,
            staging: [Mutex::new(Vec::new()), Mutex::new(Vec::new())],
            datatypes: fits,
            chunking: if fits {
                Chunking::WholeUpTo(WHOLE_TRANSFER_LIMIT)
            } else {
                Chunking::Requested
            },
            pending: Mutex::new(Vec::new()),
        }
    }

    /// Runs one call of the control protocol ([`super::control`]) over MPI messages: the
    /// decisions are the tcp job's, from the same machine. MPI has no deadlines of its own
    /// (when a rank dies, `mpirun` ends the job), so the machine gets none either, and rank 0
    /// takes its members' messages in rank order with blocking receives.
    fn control(&self, call: Call) -> Result<Vec<serde_json::Value>> {
        let rank = self.rank();
        let mut machine = Machine::new(rank, self.world(), Duration::MAX);
        // sends what the machine says to send; the call's outcome, once settled
        let perform = |actions: Vec<Action>| {
            let mut done = None;
            for action in actions {
                match action {
                    Action::Send { to, msg } => {
                        for r in to {
                            // a `Msg` always encodes
                            let _ = send_json(&self.world, r, CONTROL_TAG, &msg);
                        }
                    }
                    Action::Done(o) => done = Some(o),
                }
            }
            done
        };
        let mut outcome = perform(machine.handle(Instant::now(), Event::Call(call)));
        let mut from = if rank == 0 { 1 } else { 0 };
        loop {
            if let Some(o) = outcome {
                return o;
            }
            if rank == 0 && from >= self.world() {
                return Err(Error::Internal {
                    rank,
                    detail: "the control protocol did not settle after every rank's message".into(),
                });
            }
            let event = match recv_json::<Msg>(&self.world, from, CONTROL_TAG) {
                Ok(msg) => Event::Message { from, msg },
                Err(e) => Event::Gone {
                    peer: from,
                    lost: Lost::Broken(format!("sent a malformed control message: {e}")),
                },
            };
            outcome = perform(machine.handle(Instant::now(), event));
            if rank == 0 {
                from += 1;
            }
        }
    }
}

/// Sends `msg` to rank `to` as one JSON message with `tag`: the job's reports and the shm
/// transport's notices.
fn send_json<T: serde::Serialize>(
    world: &SimpleCommunicator,
    to: Rank,
    tag: i32,
    msg: &T,
) -> serde_json::Result<()> {
    let bytes = serde_json::to_vec(msg)?;
    world
        .process_at_rank(to as c_int)
        .send_with_tag(&bytes[..], tag);
    Ok(())
}

/// Waits for the next JSON message from rank `from` with `tag`.
fn recv_json<T: serde::de::DeserializeOwned>(
    world: &SimpleCommunicator,
    from: Rank,
    tag: i32,
) -> serde_json::Result<T> {
    let (bytes, _) = world
        .process_at_rank(from as c_int)
        .receive_vec_with_tag::<u8>(tag);
    serde_json::from_slice(&bytes)
}

/// Ends the whole job from this rank (`MPI_Abort` does not return).
fn abort_job(world: &SimpleCommunicator, rank: Rank) -> ! {
    tracing::error!(rank, "aborting the MPI job");
    // SAFETY: a valid communicator; MPI_Abort does not return.
    unsafe { ffi::MPI_Abort(world.as_raw(), 1) };
    std::process::exit(1)
}

impl Job for MpiJob {
    fn rank(&self) -> Rank {
        self.world.rank() as Rank
    }

    fn world(&self) -> usize {
        self.world.size() as usize
    }

    fn agree(&self, mine: &Fingerprint) -> Result<()> {
        self.control(Call::Agree(mine.clone())).map(drop)
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }

    fn finish(
        &self,
        mine: std::result::Result<serde_json::Value, String>,
    ) -> Result<Vec<serde_json::Value>> {
        self.control(Call::Finish(mine))
    }
}

/// Every rank's [`HostId`], gathered (collective: every rank calls it once, at start): the
/// other ranks that share this rank's host, and the host map of the job.
fn same_host_peers(
    world: &SimpleCommunicator,
) -> Result<(
    std::collections::BTreeMap<Rank, u32>,
    crate::topology::HostMap,
)> {
    let me = HostId::here();
    let mut all = vec![0u8; HostId::BYTES * world.size() as usize];
    world.all_gather_into(&me.bytes[..], &mut all[..]);
    let neighbours = all
        .chunks(HostId::BYTES)
        .enumerate()
        .filter(|&(r, id)| r != world.rank() as usize && id[..16] == me.bytes[..16])
        .map(|(r, id)| {
            let pid = u32::from_le_bytes(id[16..].try_into().expect("4 bytes"));
            (r, pid)
        })
        .collect();
    let names: Vec<&[u8]> = all.chunks(HostId::BYTES).map(|id| &id[..16]).collect();
    let mut seen: std::collections::HashMap<&[u8], usize> = Default::default();
    let indices: Vec<usize> = names
        .iter()
        .map(|&n| {
            let next = seen.len();
            *seen.entry(n).or_insert(next)
        })
        .collect();
    Ok((
        neighbours,
        crate::topology::HostMap::from_indices(&indices)?,
    ))
}

/// Which host (kernel and process namespace) a process runs on, and its process id, as
/// fixed-size bytes that every rank gathers: two ranks share memory when their first 16 bytes
/// are equal.
struct HostId {
    bytes: [u8; HostId::BYTES],
}

impl HostId {
    /// Hashes of the host name and of the kernel's boot id with the process id namespace,
    /// then the process id.
    const BYTES: usize = 20;

    fn here() -> HostId {
        let mut name = [0u8; 256];
        // SAFETY: writes at most `name.len()` bytes into `name`.
        let named = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
        let name_len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        let name = if named { &name[..name_len] } else { &[] };
        // the boot id as well: two containers of one name on two machines do not look alike;
        // and the process id namespace, in which `/proc/<pid>` of a peer means that peer
        let mut kernel = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        kernel.truncate(kernel.trim_ascii_end().len());
        if let Ok(ns) = std::fs::metadata("/proc/self/ns/pid") {
            use std::os::unix::fs::MetadataExt;
            kernel.extend_from_slice(&ns.dev().to_le_bytes());
            kernel.extend_from_slice(&ns.ino().to_le_bytes());
        }
        let mut bytes = [0u8; HostId::BYTES];
        bytes[..8].copy_from_slice(&fnv1a(name).to_le_bytes());
        bytes[8..16].copy_from_slice(&fnv1a(&kernel).to_le_bytes());
        bytes[16..].copy_from_slice(&std::process::id().to_le_bytes());
        HostId { bytes }
    }
}

/// 64-bit FNV-1a: a stable hash, the same in every process.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

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
impl super::shm::Carrier for MpiTransport<'_> {
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
