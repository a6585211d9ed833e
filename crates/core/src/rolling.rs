//! Rolling commit groups (`--rolling G`): a staged refit's destination ranks commit one group
//! after the other, so that the other groups serve meanwhile. Each group must be made of whole
//! inference replicas (the ranks that together hold one copy of every tensor): a replica cut
//! between two groups would serve a mix of two versions between their commits.
//!
//! The replicas come from the destination: a layout's own ([`crate::Layout::replicas`]) for
//! one tensor, the inference parallelism's engines for a whole model.
//!
//! ```
//! use reshard_core::rolling::rolling_groups;
//! // two TP2 replicas: two groups of one replica each, or one group of both
//! let replicas = vec![vec![2, 3], vec![4, 5]];
//! assert_eq!(rolling_groups(&replicas, 2).unwrap(), vec![vec![2, 3], vec![4, 5]]);
//! assert_eq!(rolling_groups(&replicas, 1).unwrap(), vec![vec![2, 3, 4, 5]]);
//! // four groups would commit each replica shard by shard
//! let e = rolling_groups(&replicas, 4).unwrap_err().to_string();
//! assert!(e.contains("cuts the inference replica of ranks 2,3 across commit groups 0 and 1"), "{e}");
//! ```

use crate::error::{Error, Field, Result};
use crate::layout::Rank;

/// Commit groups of the destination ranks, given as their `replicas`, in `count` groups of
/// equal size: the replicas in order of their lowest rank (each in rank order, as inference
/// engines number their replicas' ranks), cut into `count` consecutive runs of as many ranks.
///
/// Refused when `count` does not divide the ranks into groups of equal size
/// ([`Error::InvalidOption`]), or when a cut falls inside a replica ([`Error::CutReplica`],
/// naming the first such replica and the groups its ranks fall into).
pub fn rolling_groups(replicas: &[Vec<Rank>], count: usize) -> Result<Vec<Vec<Rank>>> {
    let ordered = ordered(replicas);
    let total: usize = ordered.iter().map(Vec::len).sum();
    if count == 0 || total == 0 || !total.is_multiple_of(count) {
        return Err(Error::InvalidOption {
            field: Field::Rolling,
            value: count.to_string(),
            reason: format!(
                "must divide the {total} destination ranks ({}) into groups of equal size, each of whole replicas",
                match ordered.len() {
                    1 => "1 replica".to_string(),
                    n => format!("{n} replicas"),
                }
            ),
        });
    }
    let size = total / count;
    let mut groups: Vec<Vec<Rank>> = vec![Vec::with_capacity(size); count];
    let mut at = 0;
    for replica in &ordered {
        let first = at / size;
        let last = (at + replica.len() - 1) / size;
        if first != last {
            return Err(Error::CutReplica {
                count,
                replica: replica.clone(),
                groups: (first..=last).collect(),
                replicas: ordered.len(),
                ranks: total,
            });
        }
        groups[first].extend_from_slice(replica);
        at += replica.len();
    }
    Ok(groups)
}

/// The replicas without empty ones, each in rank order, in order of their lowest rank.
fn ordered(replicas: &[Vec<Rank>]) -> Vec<Vec<Rank>> {
    let mut out: Vec<Vec<Rank>> = replicas
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| {
            let mut r = r.clone();
            r.sort_unstable();
            r
        })
        .collect();
    out.sort_unstable_by_key(|r| r[0]);
    out
}

#[cfg(test)]
mod tests;
