//! Membership in an MPI job: its control plane (barrier, decision, reports, verdict) and which
//! ranks share a host.

use std::os::raw::c_int;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::AsRaw;

use mpi::Threading;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use reshard_core::agreement::Fingerprint;
use reshard_core::error::{Error, Result};
use reshard_core::layout::{Layout, Rank};

use crate::control::{Action, Call, Event, Lost, Machine, Msg, Settled};
use crate::{Chunking, Decision, Job};

use super::datatype::{WHOLE_TRANSFER_LIMIT, fits_datatypes};
use super::{CONTROL_TAG, MpiTransport};
use reshard_core::error::Field;

/// This process's membership in the MPI job; finalizes MPI when dropped.
pub struct MpiJob {
    world: SimpleCommunicator,
    /// The other ranks on this host, with their process ids.
    neighbours: std::collections::BTreeMap<Rank, u32>,
    /// Which host every rank runs on.
    hosts: reshard_core::topology::HostMap,
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
    pub fn hosts(&self) -> &reshard_core::topology::HostMap {
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
    fn control(&self, call: Call) -> Result<Settled> {
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
                    Action::Done(o) => done = Some(Settled::Done(o)),
                    Action::Decided(o) => done = Some(Settled::Decided(o)),
                }
            }
            done
        };
        let mut outcome = perform(machine.handle(Instant::now(), Event::Call(call)));
        let mut from = if rank == 0 { 1 } else { 0 };
        loop {
            if let Some(o) = outcome {
                return Ok(o);
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
pub(super) fn send_json<T: serde::Serialize>(
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
pub(super) fn recv_json<T: serde::de::DeserializeOwned>(
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
pub(super) fn abort_job(world: &SimpleCommunicator, rank: Rank) -> ! {
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
        self.control(Call::Agree(mine.clone()))?
            .done(self.rank())
            .map(drop)
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }

    fn finish(
        &self,
        mine: std::result::Result<serde_json::Value, String>,
    ) -> Result<Vec<serde_json::Value>> {
        self.control(Call::Finish(mine))?.done(self.rank())
    }

    fn decide(&self, prepared: std::result::Result<(), String>) -> Result<Decision> {
        self.control(Call::Decide(prepared))?.decided(self.rank())
    }
}

/// Every rank's [`HostId`], gathered (collective: every rank calls it once, at start): the
/// other ranks that share this rank's host, and the host map of the job.
fn same_host_peers(
    world: &SimpleCommunicator,
) -> Result<(
    std::collections::BTreeMap<Rank, u32>,
    reshard_core::topology::HostMap,
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
        reshard_core::topology::HostMap::from_indices(&indices)?,
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
