use proptest::prelude::*;

use super::*;
use crate::DType;
use crate::layout::{Layout, LayoutSpec};
use crate::testing::arb_layout_pair;

fn layout(spec: &str) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(&[8, 8], DType::Bf16, 0)
        .unwrap()
}

#[test]
fn groups_of_whole_replicas_are_kept() {
    // two TP2 replicas on ranks 2..6, as `run --stage --rolling 2` has them
    let dst = layout("mesh=2x2 ranks=2..6 place=R,S(1)");
    assert_eq!(
        rolling_groups(&dst.replicas(), 2).unwrap(),
        vec![vec![2, 3], vec![4, 5]]
    );
    assert_eq!(
        rolling_groups(&dst.replicas(), 1).unwrap(),
        vec![vec![2, 3, 4, 5]]
    );
    // replicas along the inner axis: each replica's ranks are not contiguous, and a group
    // is one replica still
    let dst = layout("mesh=2x2 ranks=0..4 place=S(0),R");
    assert_eq!(dst.replicas(), vec![vec![0, 2], vec![1, 3]]);
    assert_eq!(
        rolling_groups(&dst.replicas(), 2).unwrap(),
        vec![vec![0, 2], vec![1, 3]]
    );
    // ranks listed out of order: replicas by their lowest rank, each in rank order
    assert_eq!(
        rolling_groups(&[vec![7, 6], vec![1, 0], vec![3, 2]], 3).unwrap(),
        vec![vec![0, 1], vec![2, 3], vec![6, 7]]
    );
}

#[test]
fn a_group_that_cuts_a_replica_is_refused_naming_it() {
    // one TP4 replica committed in two halves
    let dst = layout("mesh=4 ranks=4..8 place=S(1)");
    let e = rolling_groups(&dst.replicas(), 2).unwrap_err();
    match &e {
        Error::CutReplica {
            count,
            replica,
            groups,
            replicas,
            ranks,
        } => {
            assert_eq!(*count, 2);
            assert_eq!(replica, &vec![4, 5, 6, 7]);
            assert_eq!(groups, &vec![0, 1]);
            assert_eq!((*replicas, *ranks), (1, 4));
        }
        other => panic!("{other}"),
    }
    assert_eq!(
        e.to_string(),
        "rolling: 2 is invalid: it cuts the inference replica of ranks 4,5,6,7 across commit groups 0 and 1, so that replica would serve a mix of two versions between their commits; the 4 destination ranks form 1 replica, and each group must hold whole replicas"
    );
    // three TP2 replicas in six groups: the first replica is cut first
    let e = rolling_groups(&[vec![0, 1], vec![2, 3], vec![4, 5]], 6).unwrap_err();
    assert!(
        e.to_string()
            .contains("the inference replica of ranks 0,1 across commit groups 0 and 1"),
        "{e}"
    );
    // three TP2 replicas in two groups of three ranks: the middle one is cut
    let e = rolling_groups(&[vec![0, 1], vec![2, 3], vec![4, 5]], 2).unwrap_err();
    assert!(
        matches!(&e, Error::CutReplica { replica, groups, .. } if replica == &vec![2, 3] && groups == &vec![0, 1]),
        "{e}"
    );
}

#[test]
fn a_count_that_does_not_divide_the_ranks_is_refused() {
    for count in [0, 3, 5] {
        let e = rolling_groups(&[vec![2, 3], vec![4, 5]], count).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "rolling: {count} is invalid: must divide the 4 destination ranks (2 replicas) into groups of equal size, each of whole replicas"
            )
        );
    }
    assert!(rolling_groups(&[], 1).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Random destination layouts (replicas along any axes, ranks in any order) and group
    /// counts: a grouping is accepted exactly when the count divides the replicas; every
    /// accepted group is a union of whole replicas, of equal size, together every rank once;
    /// every refusal names a replica the equal cut of the ranks really cuts, and the groups
    /// it falls into.
    #[test]
    fn groups_are_whole_replicas(
        (_, dst) in arb_layout_pair(),
        count in 1usize..=12,
    ) {
        let replicas = dst.replicas();
        let n = dst.mesh().size();
        prop_assert!(replicas.iter().all(|r| r.len() == n / replicas.len()));
        let mut ordered = replicas.clone();
        ordered.iter_mut().for_each(|r| r.sort_unstable());
        ordered.sort_unstable_by_key(|r| r[0]);
        let of = |rank: Rank| ordered.iter().position(|r| r.contains(&rank)).unwrap();
        match rolling_groups(&replicas, count) {
            Ok(groups) => {
                prop_assert!(replicas.len().is_multiple_of(count));
                prop_assert_eq!(groups.len(), count);
                let mut all: Vec<Rank> = groups.concat();
                all.sort_unstable();
                let mut expected = dst.mesh().ranks().to_vec();
                expected.sort_unstable();
                prop_assert_eq!(all, expected);
                for g in &groups {
                    prop_assert_eq!(g.len(), n / count);
                    // every replica that meets the group lies inside it
                    for &rank in g {
                        prop_assert!(ordered[of(rank)].iter().all(|r| g.contains(r)));
                    }
                }
            }
            Err(Error::CutReplica { count: c, replica, groups, replicas: r, ranks }) => {
                prop_assert!(!replicas.len().is_multiple_of(count));
                prop_assert_eq!((c, r, ranks), (count, replicas.len(), n));
                // a replica of the layout
                prop_assert!(ordered.contains(&replica));
                // cut: the equal cut of the ranks, replica after replica, puts its ranks into
                // the groups named, more than one
                let size = n / count;
                let at = ordered.iter().take_while(|r| **r != replica).map(Vec::len).sum::<usize>();
                let mut cut: Vec<usize> = (at..at + replica.len()).map(|p| p / size).collect();
                cut.dedup();
                prop_assert!(groups.len() >= 2);
                prop_assert_eq!(cut, groups);
            }
            Err(Error::InvalidOption { field, value, .. }) => {
                prop_assert!(!n.is_multiple_of(count));
                prop_assert_eq!(field, Field::Rolling);
                prop_assert_eq!(value, count.to_string());
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }
}
