//! Topology-aware source choice: which host, and which rank of it, serves each piece, and
//! where bytes that several ranks of one host need cross into it once (relay).
//!
//! With a [`Topology`], for every piece of a destination rank's shard:
//! 1. a rank that holds the piece copies it locally, as without hosts;
//! 2. otherwise, if source ranks on the destination's own host hold it, they serve it (split
//!    among them as without hosts): no byte crosses a host link;
//! 3. otherwise the piece crosses: it is split along its outermost splittable dim among the
//!    source hosts that hold it (when large enough, as for replicas), each part dealt to a
//!    host at a rotation that depends on the destination host and the boxes, and within that
//!    host to one of its holders, so that every host's link and every rank serve an equal
//!    share.
//!
//! Relay: the destination ranks of one host that hold the same box (its replicas there) all
//! need every piece of case 3. With relay on, the piece crosses once, to one of them (the
//! relaying rank, chosen per source box in turn so that the duty spreads), and the others get
//! it from that rank over shared memory: their transfers carry `via`. The crossing parts are
//! exactly those the first replica would receive without relay, so a relay plan moves a subset
//! of the bytes of the plan without relay over every host link, never more.
//!
//! Everything here depends only on the layouts, the host map and the piece, so a rank still
//! computes its own part alone ([`super::rank_plan_on`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use super::assign::{Receiver, split_dim, split_part};
use super::{PlanOptions, Transfer};
use crate::error::Result;
use crate::layout::{Layout, Rank};
use crate::region::Region;
use crate::topology::HostMap;

/// The hosts of a job, as the planner uses them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The host of every rank.
    pub hosts: Arc<HostMap>,
    /// Whether bytes that several ranks of one host need cross into it once (`--relay`).
    pub relay: bool,
}

impl Topology {
    /// The hosts of `hosts`, relaying as `relay` says.
    pub fn new(hosts: HostMap, relay: bool) -> Topology {
        Topology {
            hosts: Arc::new(hosts),
            relay,
        }
    }

    /// The host map must name every rank of both layouts.
    pub(super) fn check(&self, src: &Layout, dst: &Layout) -> Result<()> {
        self.hosts
            .check_covers(src.mesh().ranks().iter().chain(dst.mesh().ranks()).copied())
    }

    /// The destination ranks on the host of the rank at `position` that hold its box, in mesh
    /// order (the rank itself among them).
    pub(super) fn group(&self, dst: &Layout, position: usize) -> Vec<Rank> {
        let index = dst.piece_index(&dst.mesh().coords(position));
        let home = self.hosts.host_of(dst.mesh().ranks()[position]);
        self.on_host(dst.holders(&index), home)
    }

    /// The ranks of `ranks` on `host`, in their order.
    pub(super) fn on_host(&self, ranks: impl IntoIterator<Item = Rank>, host: usize) -> Vec<Rank> {
        ranks
            .into_iter()
            .filter(|&r| self.hosts.host_of(r) == host)
            .collect()
    }
}

/// What a piece's choice needs besides the piece: its holders and whether the receiver is one.
pub(super) struct Piece<'a> {
    pub region: Region,
    pub holders: &'a [Rank],
    pub holds: bool,
    pub box_id: usize,
}

/// Chooses who sends `piece` to `receiver`, whose host's replicas of its box are `group`
/// (see the module docs). With `with_forwards`, a relaying receiver's part also lists the
/// transfers it forwards to the rest of its group.
#[allow(clippy::too_many_arguments)]
pub(super) fn assign(
    piece: Piece<'_>,
    receiver: &Receiver,
    group: &[Rank],
    elem_bytes: usize,
    options: &PlanOptions,
    topology: &Topology,
    with_forwards: bool,
    out: &mut Vec<Transfer>,
) {
    let Piece {
        region,
        holders,
        holds,
        box_id,
    } = piece;
    let home = topology.hosts.host_of(receiver.rank);
    let near = topology.on_host(holders.iter().copied(), home);
    if holds || !near.is_empty() {
        // a local copy, or served from this host: no byte crosses a link
        super::assign::assign(
            region, &near, holds, receiver, box_id, elem_bytes, options, out,
        );
        return;
    }
    let crossing = Crossing {
        holders,
        hosts: &topology.hosts,
        home,
        shard_position: receiver.shard_position,
        box_id,
        elem_bytes,
        options,
    };
    if !(topology.relay && group.len() > 1) {
        let slot = group
            .iter()
            .position(|&r| r == receiver.rank)
            .unwrap_or_default();
        crossing.deal(region, slot, receiver.rank, out);
        return;
    }
    let via = group[box_id % group.len()];
    let start = out.len();
    crossing.deal(region, 0, via, out);
    if receiver.rank != via {
        for t in &mut out[start..] {
            t.dst = receiver.rank;
            t.via = Some(via);
        }
    } else if with_forwards {
        let hops = out[start..].to_vec();
        for &member in group.iter().filter(|&&m| m != via) {
            out.extend(hops.iter().map(|h| Transfer {
                src: h.src,
                dst: member,
                region: h.region.clone(),
                via: Some(via),
            }));
        }
    }
}

/// A piece that must cross into host `home`: who may send it, and the keys of the rotation.
struct Crossing<'a> {
    holders: &'a [Rank],
    hosts: &'a HostMap,
    home: usize,
    shard_position: usize,
    box_id: usize,
    elem_bytes: usize,
    options: &'a PlanOptions,
}

impl Crossing<'_> {
    /// Splits `region` among the source hosts and deals the parts to `to`; `slot` (the
    /// receiver's place among its host's replicas, without relay) shifts the rotation so that
    /// replicas draw on different hosts.
    fn deal(&self, region: Region, slot: usize, to: Rank, out: &mut Vec<Transfer>) {
        let mut by_host: BTreeMap<usize, Vec<Rank>> = BTreeMap::new();
        for &h in self.holders {
            by_host.entry(self.hosts.host_of(h)).or_default().push(h);
        }
        let hosts: Vec<Vec<Rank>> = by_host.into_values().collect();
        let n = hosts.len();
        if n == 0 {
            return;
        }
        let bytes = region.volume().saturating_mul(self.elem_bytes as u64);
        let wanted = bytes
            .checked_div(self.options.min_split_bytes)
            .map_or(n as u64, |parts| parts.clamp(1, n as u64));
        // hosts, positions and box ids are below 2^24 (see `limits`): no overflow
        let rotation = (self.home + self.box_id + slot * wanted as usize) % n;
        let pick = |p: usize| {
            let ranks = &hosts[(rotation + p) % n];
            ranks[(self.shard_position + self.box_id + slot + p) % ranks.len()]
        };
        match split_dim(&region, wanted) {
            None => out.push(Transfer::direct(pick(0), to, region)),
            Some((dim, parts)) => {
                for p in 0..parts {
                    let part = split_part(&region, dim, parts, p);
                    out.push(Transfer::direct(pick(p as usize), to, part));
                }
            }
        }
    }
}

/// The bytes into and out of one host (its link, each way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostLink {
    /// The host, by its number in the map.
    pub host: usize,
    /// Bytes the host's ranks send to other hosts.
    #[serde(rename = "out")]
    pub out_bytes: u64,
    /// Bytes the host's ranks receive from other hosts.
    #[serde(rename = "in")]
    pub in_bytes: u64,
}

/// The bytes on every host's link for a set of transfers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostLinks {
    /// One entry per host of the map, by host number.
    pub links: Vec<HostLink>,
}

impl HostLinks {
    /// Counts every transfer whose sender ([`Transfer::sender`]) and receiver are on
    /// different hosts: out of the sender's host, into the receiver's. A relayed transfer
    /// crosses in its hop (a transfer of its own), then moves inside the host.
    pub fn of(hosts: &HostMap, transfers: &[Transfer], elem_bytes: usize) -> HostLinks {
        let mut links: Vec<HostLink> = (0..hosts.num_hosts())
            .map(|host| HostLink {
                host,
                ..HostLink::default()
            })
            .collect();
        let mut link = |host: usize| {
            if host >= links.len() {
                let from = links.len();
                links.extend((from..=host).map(|host| HostLink {
                    host,
                    ..HostLink::default()
                }));
            }
            host
        };
        let mut moves = Vec::new();
        for t in transfers.iter().filter(|t| !t.is_local()) {
            let (from, to) = (hosts.host_of(t.sender()), hosts.host_of(t.dst));
            if from != to {
                moves.push((link(from), link(to), t.bytes(elem_bytes)));
            }
        }
        for (from, to, bytes) in moves {
            links[from].out_bytes = links[from].out_bytes.saturating_add(bytes);
            links[to].in_bytes = links[to].in_bytes.saturating_add(bytes);
        }
        HostLinks { links }
    }

    /// The most bytes into or out of one host: what bounds a reshard across hosts.
    pub fn busiest(&self) -> u64 {
        self.links
            .iter()
            .map(|l| l.in_bytes.max(l.out_bytes))
            .max()
            .unwrap_or(0)
    }

    /// Adds `other`'s bytes host by host (the links of several phases or tensors).
    pub fn add(&mut self, other: &HostLinks) {
        for l in &other.links {
            while self.links.len() <= l.host {
                let host = self.links.len();
                self.links.push(HostLink {
                    host,
                    ..HostLink::default()
                });
            }
            let mine = &mut self.links[l.host];
            mine.out_bytes = mine.out_bytes.saturating_add(l.out_bytes);
            mine.in_bytes = mine.in_bytes.saturating_add(l.in_bytes);
        }
    }
}

#[cfg(test)]
mod tests;
