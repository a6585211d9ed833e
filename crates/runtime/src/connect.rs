//! Opening a rank's links: which transport carries each peer (the `auto` policy), moved here
//! from the command line so that every program joining a job chooses alike.

use reshard_core::error::Field;
use std::collections::BTreeSet;

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::region::Region;
use reshard_transport::group::Group;
use reshard_transport::segment::SharedBuffer;
use reshard_transport::shm::{Carrier, ShmTransport};
use reshard_transport::tcp::TcpTransport;
use reshard_transport::{Job, Transport};

use super::{JoinOptions, TransportKind};

/// Whichever transport a multi-process run uses.
pub type AnyTransport<'a> = Box<dyn for<'b> Transport<'b> + 'a>;

/// This rank's destination buffer in shared memory, and its box, when it has one: same-host
/// senders may write straight into it.
pub type Destination<'a> = Option<(&'a SharedBuffer, &'a Region)>;

/// The peers one rank exchanges data with, in each direction.
#[derive(Clone, Debug, Default)]
pub struct Links {
    /// The ranks it receives from.
    pub senders: BTreeSet<Rank>,
    /// The ranks it sends to.
    pub receivers: BTreeSet<Rank>,
}

impl Links {
    /// Every rank it exchanges data with, either way.
    pub fn peers(&self) -> BTreeSet<Rank> {
        self.senders.union(&self.receivers).copied().collect()
    }
}

/// Opens this rank's links for `options.transport` (tcp, shm or auto) to `links`' peers.
/// Every rank of the job must call it at the same point (it connects to peers and waits for
/// them).
pub(super) fn connect<'g>(
    group: &'g Group,
    links: &Links,
    destination: Destination<'_>,
    options: &JoinOptions,
) -> Result<AnyTransport<'g>> {
    let peers = links.peers();
    let tcp = TcpTransport::new(group.rank(), group.connect_peers(&peers)?, options.timeout)?;
    if options.transport == TransportKind::Tcp {
        return Ok(Box::new(tcp));
    }
    // the host map that every rank learned at rendezvous decides, so both ends of a link
    // choose alike
    let near = |p: Rank| group.same_host(p).then(|| group.pid(p));
    let alone = peers.iter().all(|&p| near(p).is_none());
    if options.transport == TransportKind::Auto && alone {
        return Ok(Box::new(tcp));
    }
    let shm = over_shm(tcp, links, near, destination, options, "tcp")?;
    Ok(Box::new(shm))
}

/// Opens this rank's links in an MPI job: MPI itself for `mpi`; for `auto` (and `shm`, where
/// every peer must be on this host) shared memory for the peers on this host and MPI for the
/// others. `layouts` are every tensor the links will move. Every rank of the job must call it
/// at the same point.
#[cfg(feature = "mpi")]
pub(super) fn connect_mpi<'j, 'l>(
    job: &'j reshard_transport::mpi::MpiJob,
    layouts: impl IntoIterator<Item = &'l reshard_core::Layout>,
    links: &Links,
    destination: Destination<'_>,
    options: &JoinOptions,
) -> Result<AnyTransport<'j>> {
    let kind = options.transport;
    let mpi = job.transport(layouts);
    let neighbours = job.same_host_peers();
    // what every rank decides alike, so that none waits on a rank that stopped here
    if kind == TransportKind::Shm && neighbours.len() + 1 < job.world() {
        return Err(Error::InvalidOption {
            field: Field::Transport,
            value: "shm".into(),
            reason: "the ranks of this job run on more than one host; use mpi or auto".into(),
        });
    }
    let near = |p: Rank| neighbours.get(&p).copied();
    let alone = links.peers().iter().all(|&p| near(p).is_none());
    if kind == TransportKind::Mpi || (kind == TransportKind::Auto && alone) {
        return Ok(Box::new(mpi));
    }
    match over_shm(mpi, links, near, destination, options, "mpi") {
        Ok(shm) => Ok(Box::new(shm)),
        // the peers wait on this rank in MPI calls that no timeout ends: end the job
        Err(e) => job.abort(&e),
    }
}

/// `carrier` with the peers for which `near` gives a process id (those on this host) moved
/// to shared memory. With `shm`, a peer elsewhere is an error that suggests `other` (the
/// carrier's own transport) or auto.
fn over_shm<C: Carrier>(
    carrier: C,
    links: &Links,
    near: impl Fn(Rank) -> Option<u32>,
    destination: Destination<'_>,
    options: &JoinOptions,
    other: &str,
) -> Result<ShmTransport<C>> {
    let peers = links.peers();
    if let (TransportKind::Shm, Some(&far)) = (
        options.transport,
        peers.iter().find(|&&p| near(p).is_none()),
    ) {
        return Err(Error::InvalidOption {
            field: Field::Transport,
            value: "shm".into(),
            reason: format!("rank {far} runs on another host; use {other} or auto"),
        });
    }
    let near = peers.iter().filter_map(|&p| near(p).map(|pid| (p, pid)));
    let mut shm = ShmTransport::new(
        carrier,
        near.collect(),
        options.staging_bytes,
        options.timeout,
    );
    // RESHARD_SHM_DIRECT=0 keeps senders out of the receivers' shards: rings only
    let direct = std::env::var("RESHARD_SHM_DIRECT").map_or(true, |v| v != "0");
    let destination = destination.filter(|_| direct);
    shm.exchange_destinations(destination, &links.senders, &links.receivers)?;
    Ok(shm)
}
