//! A rank's part of a relay plan, round by round: the bytes that cross into a host once, to a relaying
//! rank, which forwards them to the other ranks of its host, slab by slab.
//!
//! A hop (a transfer to a relaying rank of a region it forwards) is cut into slabs along its
//! outermost splittable dim, each about [`slab_bytes`] ([`slabs`]), and the rank's part runs in
//! rounds ([`Rounds`]): round `j` carries slab `j` of every hop, into a staging buffer of the
//! relaying rank, while the relaying rank forwards slab `j - 1` out of the other staging
//! buffer. So forwarding runs under the next slab's crossing (pipelined), and the staging is
//! two rounds' slabs, however large the hops. After each round the relaying rank copies the
//! slabs it staged into its own shard (it is a destination of them). Everything else (direct
//! transfers and local copies) runs in round 0.
//!
//! Each round is one phase of the rank's program ([`super::lower`]): its sends and receives follow the plan's schedule order,
//! one total order on transfers, and a transfer's slabs fall in the same round on both of its
//! ends, so no round can deadlock, and a rank enters a round only once it has done its part
//! of the one before (the data it forwards has landed). Checksums cover every hop and every
//! forward: each round's senders sum what they send.

use std::collections::BTreeMap;

use super::options::ExecOptions;
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::plan::{RankPlan, Transfer};
use reshard_core::region::Region;
use reshard_transport::Lands;

/// The slab size of a job: an eighth of the staging bound, so that a relaying rank's two
/// staging buffers hold two rounds of a few hops within it. Both ends compute the same.
pub fn slab_bytes(options: &ExecOptions) -> u64 {
    (options.staging_bytes as u64 / 8).max(1)
}

/// `region` cut into slabs of about `slab_bytes` (of `elem_bytes` elements) along its
/// outermost dim that is long enough, in order; one slab when it is small or cannot be cut.
pub fn slabs(region: &Region, elem_bytes: usize, slab_bytes: u64) -> Vec<Region> {
    let bytes = region.volume().saturating_mul(elem_bytes as u64);
    let wanted = bytes.div_ceil(slab_bytes.max(1)).max(1);
    match reshard_core::plan::split_dim(region, wanted) {
        None => vec![region.clone()],
        Some((dim, parts)) => (0..parts)
            .map(|p| reshard_core::plan::split_part(region, dim, parts, p))
            .filter(|r| !r.is_empty())
            .collect(),
    }
}

/// One transfer's slab as a round moves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leg {
    /// The sending rank.
    pub from: Rank,
    /// The receiving rank.
    pub to: Rank,
    /// The slab, in tensor coordinates.
    pub region: Region,
    /// Where the bytes lie on this rank: `None` in its shard (the source shard for a send,
    /// the destination shard for a receive), `Some(offset)` in a staging buffer (the one
    /// of the round before for a send, this round's for a receive), as a dense box.
    pub staged: Option<usize>,
    /// The sender forwards it out of its staging (a relayed transfer's second leg).
    pub forwarded: bool,
    /// Where it lands on the receiver: a hop's slabs in the relaying rank's staging, every
    /// other leg in the receiver's shard. Both ends set it alike (from [`RankPlan::is_hop`]).
    pub lands: Lands,
}

/// One round of a rank's part.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// The legs this rank sends, in schedule order.
    pub sends: Vec<Leg>,
    /// The legs this rank receives, in schedule order.
    pub recvs: Vec<Leg>,
    /// Local copies (round 0).
    pub locals: Vec<Transfer>,
    /// Bytes this round stages.
    pub staging_bytes: usize,
}

/// A rank's part of a relay plan, round by round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rounds {
    /// Round 0 first: round `j` carries slab `j` of every hop.
    pub rounds: Vec<Round>,
}

impl Rounds {
    /// The rounds of `plan` (see the module docs), each list in the plan's order.
    pub fn of(plan: &RankPlan, elem_bytes: usize, slab_bytes: u64) -> Result<Rounds> {
        let rank = plan.rank;
        let mut rounds = vec![Round {
            locals: plan.locals.clone(),
            ..Round::default()
        }];
        fn at(rounds: &mut Vec<Round>, j: usize) -> &mut Round {
            if rounds.len() <= j {
                rounds.resize_with(j + 1, Round::default);
            }
            &mut rounds[j]
        }
        let leg = |from, to, region: &Region| Leg {
            from,
            to,
            region: region.clone(),
            staged: None,
            forwarded: false,
            lands: Lands::Shard,
        };
        // where each hop's slabs land here: (sender, region, slab) -> offset
        let mut staged: BTreeMap<(Rank, &Region, usize), usize> = BTreeMap::new();
        for t in &plan.recvs {
            if let Some(via) = t.via {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    at(&mut rounds, j + 1).recvs.push(Leg {
                        forwarded: true,
                        ..leg(via, rank, s)
                    });
                }
            } else if plan.is_hop(t) {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    let round = at(&mut rounds, j);
                    let offset = round.staging_bytes;
                    round.staging_bytes += s.volume() as usize * elem_bytes;
                    round.recvs.push(Leg {
                        staged: Some(offset),
                        lands: Lands::Aside,
                        ..leg(t.src, rank, s)
                    });
                    staged.insert((t.src, &t.region, j), offset);
                }
            } else {
                at(&mut rounds, 0).recvs.push(leg(t.src, rank, &t.region));
            }
        }
        for t in &plan.sends {
            if t.via == Some(rank) {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    let Some(&offset) = staged.get(&(t.src, &t.region, j)) else {
                        return Err(Error::Protocol {
                            rank,
                            peer: t.src,
                            detail: format!(
                                "the plan forwards {} to rank {} without receiving it",
                                t.region, t.dst
                            ),
                        });
                    };
                    at(&mut rounds, j + 1).sends.push(Leg {
                        staged: Some(offset),
                        forwarded: true,
                        ..leg(rank, t.dst, s)
                    });
                }
            } else if plan.is_hop(t) {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    at(&mut rounds, j).sends.push(Leg {
                        lands: Lands::Aside,
                        ..leg(rank, t.dst, s)
                    });
                }
            } else {
                at(&mut rounds, 0).sends.push(leg(rank, t.dst, &t.region));
            }
        }
        Ok(Rounds { rounds })
    }

    /// The larger staging buffer a round needs.
    pub fn staging_bytes(&self) -> usize {
        self.rounds
            .iter()
            .map(|r| r.staging_bytes)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests;
