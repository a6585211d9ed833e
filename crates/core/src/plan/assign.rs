//! The balanced choice among the replicas that hold a piece: which holder serves which part
//! of it to a receiver. Below both the source choice ([`super::sources`]) and its host-aware
//! form ([`super::hosts`]), which use it.

use super::{PlanOptions, Transfer};
use crate::layout::{Layout, Rank};
use crate::region::Region;

/// A destination rank as the source choice sees it.
pub struct Receiver {
    /// Its global rank.
    pub rank: Rank,
    /// Its position among the ranks of one destination replica ([`Layout::shard_position`]).
    pub shard_position: usize,
    /// Which destination replica it belongs to, in `0..replicas`.
    pub replica: usize,
    /// How many destination ranks hold the same box (the destination's replication).
    pub replicas: usize,
}

impl Receiver {
    pub(super) fn at(dst: &Layout, position: usize) -> Receiver {
        Receiver {
            rank: dst.mesh().ranks()[position],
            shard_position: dst.shard_position(position),
            replica: dst.replica_index(position),
            replicas: dst.replication().max(1),
        }
    }
}

/// Chooses who sends `piece` (held by `holders`; `holds`: the receiver is one of them) to
/// `receiver`; see the module docs.
///
/// A piece is split into at most `ceil(holders / receiver.replicas)` parts: the replicas of a
/// destination box all ask for the same piece, so with `r` of them each needs only that many
/// parts for every holder to serve its share. Splitting every copy among all holders would
/// make `holders x replicas` transfers: quadratic in the data-parallel size when both sides
/// replicate (dp=10000 on both sides made up to 10^8 transfers per tensor). Replica `k` starts
/// `k x parts` holders further on, so that the replicas draw on disjoint holders.
#[allow(clippy::too_many_arguments)]
pub fn assign(
    piece: Region,
    holders: &[Rank],
    holds: bool,
    receiver: &Receiver,
    box_id: usize,
    elem_bytes: usize,
    options: &PlanOptions,
    out: &mut Vec<Transfer>,
) {
    if holds {
        out.push(Transfer::direct(receiver.rank, receiver.rank, piece));
        return;
    }
    let h = holders.len();
    let cap = h.div_ceil(receiver.replicas) as u64;
    let bytes = piece.volume().saturating_mul(elem_bytes as u64);
    let wanted = bytes
        .checked_div(options.min_split_bytes)
        .map_or(cap, |parts| parts.clamp(1, cap));
    // positions, box ids, replica numbers and `wanted` are at most 2^24 (a side's ranks, see
    // `limits`): no overflow
    let rotation = (receiver.shard_position + box_id + receiver.replica * wanted as usize) % h;
    let Some((dim, parts)) = split_dim(&piece, wanted) else {
        out.push(Transfer::direct(holders[rotation], receiver.rank, piece));
        return;
    };
    for p in 0..parts {
        let part = split_part(&piece, dim, parts, p);
        out.push(Transfer::direct(
            holders[(rotation + p as usize) % h],
            receiver.rank,
            part,
        ));
    }
}

/// Where to split `piece` into `wanted` parts: the outermost dim long enough, else the
/// longest dim (into as many parts as it is long); `None` when one part it is.
pub fn split_dim(piece: &Region, wanted: u64) -> Option<(usize, u64)> {
    if wanted <= 1 {
        return None;
    }
    match (0..piece.ndim()).find(|&d| piece.extent[d] >= wanted) {
        Some(d) => Some((d, wanted)),
        None => (0..piece.ndim())
            .max_by_key(|&d| (piece.extent[d], std::cmp::Reverse(d)))
            .filter(|&d| piece.extent[d] > 1)
            .map(|d| (d, piece.extent[d])),
    }
}

/// Part `p` of `parts` of `piece` cut along `dim`.
pub fn split_part(piece: &Region, dim: usize, parts: u64, p: u64) -> Region {
    let lo = piece.offset[dim];
    let len = piece.extent[dim];
    // in u128: p * len overflows u64 for pieces near 2^64 bytes
    let cut = |p: u64| lo + (p as u128 * len as u128 / parts as u128) as u64;
    let (a, b) = (cut(p), cut(p + 1));
    let mut part = piece.clone();
    part.offset[dim] = a;
    part.extent[dim] = b - a;
    part
}
