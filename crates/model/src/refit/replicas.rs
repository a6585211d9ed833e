//! The inference replicas of a refit: the sets of inference ranks that together hold one
//! whole copy of every tensor and serve as one. A staged refit's rolling commit
//! ([`reshard_core::rolling`]) commits whole replicas only, so that none serves a mix of two
//! versions.

use std::collections::BTreeMap;

use reshard_core::error::Result;
use reshard_core::layout::Rank;
use reshard_core::rolling::rolling_groups;

use super::Refit;

impl Refit {
    /// The inference replicas, each in rank order, in order of their lowest rank: the
    /// engines of the inference parallelism ([`Refit::infer_engines`]: a data-parallel
    /// replica's `tp x pp` ranks), joined wherever a tensor's copy spans several of them
    /// (vLLM's expert layers split over the `tp x dp` ranks of a stage, so that a model with
    /// experts and `dp > 1` is one replica). Two ranks are in one replica when an engine
    /// holds both, or when they hold parts of the same copy of a tensor (they differ along a
    /// sharding axis of its inference layout, not only along replicated ones).
    ///
    /// ```
    /// use reshard_model::{Inference, Model, Ranks, Refit, Rules, Training};
    /// let model = Model::load("qwen3-0.6b").unwrap();
    /// let infer = Inference::parse("tp=2,pp=2,dp=2").unwrap();
    /// let refit = Refit::new(&model, &Training::parse("tp=2").unwrap(), &infer,
    ///     &Rules::default(), Ranks::Disjoint).unwrap();
    /// // inference ranks 2..10: two engines of tp x pp ranks
    /// assert_eq!(refit.replicas(), vec![vec![2, 3, 4, 5], vec![6, 7, 8, 9]]);
    /// assert_eq!(refit.rolling_groups(2).unwrap(), refit.replicas());
    /// assert!(refit.rolling_groups(4).is_err()); // each engine committed in two halves
    /// ```
    pub fn replicas(&self) -> Vec<Vec<Rank>> {
        let mut sets = Sets::default();
        for engine in &self.infer_engines {
            sets.join(engine);
        }
        for t in &self.tensors {
            for copy in t.dst.replicas() {
                sets.join(&copy);
            }
        }
        sets.groups()
    }

    /// The commit groups of a rolling commit in `count` groups: whole [`Refit::replicas`],
    /// in `count` groups of equal size ([`rolling_groups`]); refused naming a replica that
    /// `count` would cut.
    pub fn rolling_groups(&self, count: usize) -> Result<Vec<Vec<Rank>>> {
        rolling_groups(&self.replicas(), count)
    }
}

/// Disjoint sets of ranks (union-find, with path halving).
#[derive(Default)]
struct Sets {
    parent: BTreeMap<Rank, Rank>,
}

impl Sets {
    fn find(&mut self, rank: Rank) -> Rank {
        let mut r = *self.parent.entry(rank).or_insert(rank);
        loop {
            let p = self.parent[&r];
            if p == r {
                return r;
            }
            let grand = self.parent[&p];
            self.parent.insert(r, grand);
            r = grand;
        }
    }

    /// Puts `ranks` in one set.
    fn join(&mut self, ranks: &[Rank]) {
        let Some((&first, rest)) = ranks.split_first() else {
            return;
        };
        self.find(first);
        for &r in rest {
            let (a, b) = (self.find(first), self.find(r));
            if a != b {
                self.parent.insert(a.max(b), a.min(b));
            }
        }
    }

    /// Every set, in rank order, in order of its lowest rank.
    fn groups(mut self) -> Vec<Vec<Rank>> {
        let ranks: Vec<Rank> = self.parent.keys().copied().collect();
        let mut by_root: BTreeMap<Rank, Vec<Rank>> = BTreeMap::new();
        for r in ranks {
            let root = self.find(r);
            by_root.entry(root).or_default().push(r);
        }
        let mut out: Vec<Vec<Rank>> = by_root.into_values().collect();
        out.sort_unstable_by_key(|g| g[0]);
        out
    }
}

#[cfg(test)]
mod tests;
