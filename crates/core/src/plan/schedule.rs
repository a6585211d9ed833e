//! The order in which every rank runs its transfers.

use crate::layout::{Layout, Rank};
use crate::region::Region;

use super::Transfer;

/// One total order on (source, destination) rank pairs, shared by every rank: by step, then
/// source, then destination. Step `k` pairs the source at position `p` among the source ranks
/// with the destination at position `(p + k) mod n` among the destination ranks (`n` the
/// larger count), so that each step's traffic spreads over distinct peers, as in a ring
/// all-to-all, whether the two sides share their ranks or not. Blocking sends and receives
/// that follow one total order cannot deadlock.
///
/// ```
/// use reshard_core::{DType, layout::LayoutSpec, plan::Schedule};
///
/// // four sources (ranks 0-3) and four destinations (ranks 4-7): step 0 pairs 0->4, 1->5, ...
/// let layout = |spec: &str, first| {
///     LayoutSpec::parse(spec).unwrap().resolve(&[8, 8], DType::Bf16, first).unwrap()
/// };
/// let (src, dst) = (layout("mesh=4 place=S(0)", 0), layout("mesh=4 place=S(1)", 4));
/// let s = Schedule::of(&src, &dst);
/// assert_eq!([s.step(0, 4), s.step(1, 5), s.step(2, 6), s.step(3, 7)], [0; 4]);
/// assert_eq!(s.step(1, 4), 3);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Position of each rank among the sources, indexed by rank.
    src_pos: Vec<Option<usize>>,
    /// Position of each rank among the destinations, indexed by rank.
    dst_pos: Vec<Option<usize>>,
    n: usize,
}

/// Each rank's position among `ranks` (sorted, without repeats), indexed by rank.
fn positions(ranks: impl IntoIterator<Item = Rank>) -> (Vec<Option<usize>>, usize) {
    let mut ranks: Vec<Rank> = ranks.into_iter().collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut pos = vec![None; ranks.last().map_or(0, |&r| r + 1)];
    for (i, &r) in ranks.iter().enumerate() {
        pos[r] = Some(i);
    }
    (pos, ranks.len())
}

impl Schedule {
    /// The schedule between the ranks that hold sources and the ranks that receive.
    pub fn new(
        src_ranks: impl IntoIterator<Item = Rank>,
        dst_ranks: impl IntoIterator<Item = Rank>,
    ) -> Schedule {
        let (src_pos, m) = positions(src_ranks);
        let (dst_pos, n) = positions(dst_ranks);
        Schedule {
            src_pos,
            dst_pos,
            n: m.max(n).max(1),
        }
    }

    /// The schedule of a reshard from `src` to `dst`.
    pub fn of(src: &Layout, dst: &Layout) -> Schedule {
        Schedule::new(
            src.mesh().ranks().iter().copied(),
            dst.mesh().ranks().iter().copied(),
        )
    }

    /// The step at which `from` sends to `to` (ranks outside the sides count as position 0).
    pub fn step(&self, from: Rank, to: Rank) -> usize {
        let at = |pos: &[Option<usize>], r: Rank| pos.get(r).copied().flatten().unwrap_or(0);
        (at(&self.dst_pos, to) + self.n - at(&self.src_pos, from)) % self.n
    }

    /// The sort key of a transfer: step, sender, destination, region (the sender of a
    /// relayed transfer is the rank that forwards it, [`Transfer::sender`]).
    pub fn key<'t>(&self, t: &'t Transfer) -> (usize, Rank, Rank, &'t Region) {
        let from = t.sender();
        (self.step(from, t.dst), from, t.dst, &t.region)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_step_pairs_each_rank_with_one_peer_at_most() {
        let cases: [(Vec<Rank>, Vec<Rank>); 6] = [
            ((0..4).collect(), (4..8).collect()),
            ((0..4).collect(), (0..2).collect()),
            ((0..2).collect(), (2..6).collect()),
            ((0..8).collect(), (3..5).collect()),
            (vec![1, 5, 9], vec![0, 2, 4, 6, 8, 10, 12]),
            ((0..16).step_by(2).collect(), (0..16).collect()),
        ];
        for (src, dst) in cases {
            let s = Schedule::new(src.iter().copied(), dst.iter().copied());
            let n = src.len().max(dst.len());
            for step in 0..n {
                let pairs: Vec<(Rank, Rank)> = src
                    .iter()
                    .flat_map(|&a| dst.iter().map(move |&b| (a, b)))
                    .filter(|&(a, b)| s.step(a, b) == step)
                    .collect();
                let senders: BTreeSet<Rank> = pairs.iter().map(|p| p.0).collect();
                let receivers: BTreeSet<Rank> = pairs.iter().map(|p| p.1).collect();
                assert_eq!(
                    senders.len(),
                    pairs.len(),
                    "{src:?} -> {dst:?}, step {step}"
                );
                assert_eq!(
                    receivers.len(),
                    pairs.len(),
                    "{src:?} -> {dst:?}, step {step}"
                );
            }
            // every pair has a step below n
            assert!(src.iter().all(|&a| dst.iter().all(|&b| s.step(a, b) < n)));
        }
    }

    #[test]
    fn ranks_shared_by_both_sides_keep_the_shift_schedule() {
        // the same four ranks on both sides: step k is rank r -> r + k mod 4
        let s = Schedule::new(0..4, 0..4);
        for r in 0..4 {
            for k in 0..4 {
                assert_eq!(s.step(r, (r + k) % 4), k);
            }
        }
    }
}
