//! One rank's part of a plan: what it sends, receives, copies locally and forwards.

use crate::layout::Rank;
use crate::region::Region;

use super::Transfer;

/// The sends, receives and local copies of one rank, in the order it should run them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank whose part this is.
    pub rank: Rank,
    /// Remote transfers this rank sends, in schedule order: its own, and the relayed ones it
    /// forwards (whose `via` is this rank; it receives their region from their `src` in a
    /// transfer of its own, a hop, and passes it on to `dst`).
    pub sends: Vec<Transfer>,
    /// Remote transfers this rank receives, in schedule order (a relayed one from its `via`).
    pub recvs: Vec<Transfer>,
    /// Copies from this rank's source buffer into its own destination buffer.
    pub locals: Vec<Transfer>,
    /// The hops among `sends` and `recvs`: transfers to a relaying rank whose region it
    /// forwards, sorted. Empty without relay.
    pub hops: Vec<Transfer>,
}

impl RankPlan {
    /// The part of `rank`, with nothing in it yet.
    pub fn new(rank: Rank) -> RankPlan {
        RankPlan {
            rank,
            ..RankPlan::default()
        }
    }

    /// Files `t` among this rank's sends, receives, local copies or forwards, if it concerns
    /// this rank (a local copy belongs to the rank that makes it). A relayed transfer from this
    /// rank goes to `relayed`: it marks the hop this rank sends.
    pub(super) fn take(&mut self, t: &Transfer, relayed: &mut Vec<Transfer>) {
        if t.is_local() {
            if t.src == self.rank {
                self.locals.push(t.clone());
            }
        } else if let Some(via) = t.via {
            if via == self.rank {
                self.sends.push(t.clone());
            }
            if t.dst == self.rank {
                self.recvs.push(t.clone());
            }
            if t.src == self.rank {
                relayed.push(t.clone());
            }
        } else if t.src == self.rank {
            self.sends.push(t.clone());
        } else if t.dst == self.rank {
            self.recvs.push(t.clone());
        }
    }

    /// Marks the hops among the sends and receives: a transfer from `s` to `v` of a region
    /// that `v` forwards (known from `relayed`, the relayed transfers from this rank, and from
    /// this rank's own forwards).
    pub(super) fn mark_hops(&mut self, relayed: &[Transfer]) {
        let forwarded: std::collections::BTreeSet<(Rank, Rank, &Region)> = relayed
            .iter()
            .chain(self.forwards())
            .filter_map(|t| t.via.map(|v| (t.src, v, &t.region)))
            .collect();
        let mut hops: Vec<Transfer> = self
            .sends
            .iter()
            .chain(&self.recvs)
            .filter(|t| t.via.is_none() && forwarded.contains(&(t.src, t.dst, &t.region)))
            .cloned()
            .collect();
        hops.sort_unstable();
        hops.dedup();
        self.hops = hops;
    }

    /// The relayed transfers this rank forwards, among its sends.
    pub fn forwards(&self) -> impl Iterator<Item = &Transfer> {
        self.sends.iter().filter(|t| t.via == Some(self.rank))
    }

    /// Whether `t`, one of this rank's sends or receives, is a hop ([`RankPlan::hops`]).
    pub fn is_hop(&self, t: &Transfer) -> bool {
        self.hops.binary_search(t).is_ok()
    }

    /// Whether this rank takes part in a relay: it sends or receives a hop, forwards, or
    /// receives a forwarded transfer.
    pub fn relays(&self) -> bool {
        !self.hops.is_empty()
            || self
                .sends
                .iter()
                .chain(&self.recvs)
                .any(|t| t.via.is_some())
    }

    /// The ranks this rank receives from (local copies aside).
    pub fn senders(&self) -> std::collections::BTreeSet<Rank> {
        self.recvs.iter().map(Transfer::sender).collect()
    }

    /// The ranks this rank sends to (local copies aside), forwards included.
    pub fn receivers(&self) -> std::collections::BTreeSet<Rank> {
        self.sends.iter().map(|t| t.dst).collect()
    }

    /// Every rank this rank exchanges data with.
    pub fn peers(&self) -> std::collections::BTreeSet<Rank> {
        &self.senders() | &self.receivers()
    }
}
