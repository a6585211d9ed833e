use std::collections::BTreeSet;

use proptest::prelude::*;

use crate::{Inference, Model, Ranks, Refit, Rules, Training};
use reshard_core::Error;
use reshard_core::layout::Rank;

fn refit(model: &str, train: &str, infer: &str, ranks: Ranks) -> Refit {
    Refit::new(
        &Model::load(model).unwrap(),
        &Training::parse(train).unwrap(),
        &Inference::parse(infer).unwrap(),
        &Rules::default(),
        ranks,
    )
    .unwrap()
}

/// What a replica is, checked on every tensor: each replica holds one whole copy of it
/// (the ranks of some copy all inside), and no copy is split between two replicas; together
/// the replicas are the inference ranks, each once.
fn check_replicas(refit: &Refit, replicas: &[Vec<Rank>]) {
    let all: Vec<Rank> = replicas.concat();
    let expected: Vec<Rank> = (refit.infer_base..refit.infer_base + refit.infer_ranks).collect();
    let mut sorted = all.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, expected, "{replicas:?}");
    for replica in replicas {
        let inside: BTreeSet<Rank> = replica.iter().copied().collect();
        for t in &refit.tensors {
            let copies = t.dst.replicas();
            let whole = |c: &Vec<Rank>| c.iter().all(|r| inside.contains(r));
            let outside = |c: &Vec<Rank>| c.iter().all(|r| !inside.contains(r));
            assert!(copies.iter().any(whole), "{}: {replica:?}", t.name);
            assert!(
                copies.iter().all(|c| whole(c) || outside(c)),
                "{}: a copy split by {replica:?}",
                t.name
            );
        }
    }
}

#[test]
fn a_dense_model_has_one_replica_per_engine() {
    // tp x pp ranks per engine, the embedding and lm_head on other stages than the layers
    let r = refit("qwen3-0.6b", "tp=2", "tp=2,pp=2,dp=3", Ranks::Disjoint);
    let replicas = r.replicas();
    assert_eq!(replicas, r.infer_engines);
    assert_eq!(
        replicas,
        vec![vec![2, 3, 4, 5], vec![6, 7, 8, 9], vec![10, 11, 12, 13]]
    );
    check_replicas(&r, &replicas);
    // colocated: from rank 0
    let r = refit("qwen3-0.6b", "tp=4", "tp=2,dp=2", Ranks::Colocated);
    assert_eq!(r.replicas(), vec![vec![0, 1], vec![2, 3]]);
}

#[test]
fn experts_split_over_the_engines_make_them_one_replica() {
    // vLLM splits a stage's experts over all its tp x dp ranks, with ep or without: no
    // engine holds a whole copy of them
    for infer in ["tp=2,dp=2", "tp=2,dp=2,ep", "tp=1,pp=2,dp=2"] {
        let r = refit("qwen3-30b-a3b", "tp=2,ep=2", infer, Ranks::Disjoint);
        assert!(r.infer_engines.len() > 1, "{infer}");
        let replicas = r.replicas();
        assert_eq!(replicas, vec![(2..6).collect::<Vec<_>>()], "{infer}");
        check_replicas(&r, &replicas);
        assert!(r.rolling_groups(1).is_ok());
        let e = r.rolling_groups(2).unwrap_err();
        assert!(
            matches!(&e, Error::CutReplica { replica, groups, .. } if replica == &replicas[0] && groups == &vec![0, 1]),
            "{infer}: {e}"
        );
    }
}

#[test]
fn without_engines_the_layouts_alone_join_the_ranks() {
    // a refit built by hand: its tensors' copies join the ranks, stages stay apart
    let mut r = refit("qwen3-0.6b", "tp=2", "tp=2,pp=2", Ranks::Disjoint);
    r.infer_engines.clear();
    assert_eq!(r.replicas(), vec![vec![2, 3], vec![4, 5]]);
}

#[test]
fn rolling_groups_are_whole_engines() {
    let r = refit("qwen3-0.6b", "tp=2", "tp=2,dp=4", Ranks::Disjoint);
    assert_eq!(r.rolling_groups(4).unwrap(), r.replicas());
    assert_eq!(
        r.rolling_groups(2).unwrap(),
        vec![vec![2, 3, 4, 5], vec![6, 7, 8, 9]]
    );
    let e = r.rolling_groups(8).unwrap_err().to_string();
    assert!(
        e.contains("cuts the inference replica of ranks 2,3 across commit groups 0 and 1"),
        "{e}"
    );
    assert!(e.starts_with("rolling: 8 is invalid"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Random inference parallelisms of a dense and of an MoE model: the replicas hold a
    /// whole copy of every tensor each, no copy split between two; a dense model's are its
    /// engines.
    #[test]
    fn replicas_hold_whole_copies(
        tp in prop::sample::select(vec![1usize, 2, 4]),
        pp in 1usize..=3,
        dp in 1usize..=3,
        moe in any::<bool>(),
        ep in any::<bool>(),
    ) {
        let model = if moe { "qwen3-30b-a3b" } else { "qwen3-0.6b" };
        let infer = format!("tp={tp},pp={pp},dp={dp}{}", if ep { ",ep" } else { "" });
        let r = refit(model, "tp=2", &infer, Ranks::Disjoint);
        let replicas = r.replicas();
        check_replicas(&r, &replicas);
        if !moe || dp == 1 {
            prop_assert_eq!(&replicas, &r.infer_engines);
        } else {
            prop_assert_eq!(replicas.len(), 1);
        }
    }
}
