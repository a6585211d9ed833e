use super::*;
use crate::JoinOptions;
use crate::exec::delta::{DeltaOptions, DeltaRefit};
use reshard_core::dtype::DType;
use reshard_core::evolve::{Evolution, Update};
use reshard_core::fill::Fill;
use reshard_core::layout::LayoutSpec;
use reshard_core::plan::Plan;

fn plan() -> Plan {
    let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap();
    let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap();
    let shape = [256, 256];
    Plan::new(
        src.resolve(&shape, DType::Bf16, 0).unwrap(),
        dst.resolve(&shape, DType::Bf16, 2).unwrap(),
    )
    .unwrap()
}

/// A stream of `versions` by `method` (deltas when `delta`), committed in `groups`.
fn stream(
    method: Method,
    delta: bool,
    groups: Vec<Vec<Rank>>,
    fail_at: Option<u64>,
) -> Vec<Result<VersionServed>> {
    let plan = plan();
    let world = World::join(JoinOptions::default()).unwrap();
    let evolution = Evolution::new(
        Fill::Hash { seed: 1 },
        Update::Density(0.01),
        1,
        DType::Bf16,
    )
    .unwrap();
    let live = plan
        .dst()
        .mesh()
        .ranks()
        .iter()
        .map(|&r| (r, vec![vec![0u8; plan.dst().local_bytes(r) as usize]]))
        .collect();
    let session = DeltaSession::new();
    let mut rollout = Rollout::new(
        method,
        session.clone(),
        live,
        ServeOptions::default(),
        groups,
    )
    .unwrap();
    let mut out = Vec::new();
    for version in 1..=3 {
        let mut sources = evolution.shards(plan.src(), version).unwrap();
        if fail_at == Some(version) {
            sources.get_mut(&0).unwrap().pop();
        }
        let mut options = RunOptions::default();
        options.delta = delta.then(|| DeltaRefit {
            session: session.clone(),
            version,
            options: DeltaOptions::default(),
        });
        let served = rollout.refit(&world, version, &options, |bufs, options| {
            let mut dst: BTreeMap<Rank, Vec<u8>> = bufs
                .iter_mut()
                .map(|(&r, b)| (r, std::mem::take(&mut b[0])))
                .collect();
            let result = world.run(&plan, &sources, &mut dst, options).map(|_| ());
            for (r, b) in dst {
                bufs.get_mut(&r).unwrap()[0] = b;
            }
            result
        });
        let expected = match (&served, fail_at) {
            (Ok(_), _) => Some(version),
            (Err(_), Some(f)) if method == Method::Staged => Some(f - 1),
            _ => None,
        };
        for &r in plan.dst().mesh().ranks() {
            let live = rollout.live(r).unwrap();
            let live = read(&live);
            match expected {
                Some(v) if v > 0 => evolution
                    .verify_shard_from(DType::Bf16, plan.dst(), r, &live[0], v)
                    .unwrap(),
                _ => {}
            }
            assert_eq!(session.serving(r), expected.filter(|&v| v > 0), "rank {r}");
        }
        out.push(served);
    }
    out
}

#[test]
fn a_staged_stream_commits_every_version_whole_and_no_pass_sees_a_mix() {
    for delta in [false, true] {
        for served in stream(Method::Staged, delta, Vec::new(), None) {
            let served = served.unwrap();
            assert_eq!(served.outcome, "commit");
            assert_eq!(served.ranks.len(), 4);
            assert!(!served.mixed(), "{served:?}");
            assert!(
                served
                    .ranks
                    .iter()
                    .all(|r| r.serving == Some(served.version))
            );
            assert!(served.ranks.iter().all(|r| r.staging_bytes == 256 * 64 * 2));
        }
    }
}

#[test]
fn a_rolling_commit_reports_each_group() {
    let groups = vec![vec![2, 3], vec![4, 5]];
    for served in stream(Method::Staged, true, groups, None) {
        let served = served.unwrap();
        let groups = served.groups();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].0, vec![2, 3]);
        assert!(!served.mixed());
    }
    // two TP2 replicas: a group each, or a replica cut in halves
    let replicas = [vec![2, 3], vec![4, 5]];
    assert!(rolling_groups(&replicas, 3).is_err());
    assert!(rolling_groups(&replicas, 4).is_err());
    assert_eq!(
        rolling_groups(&replicas, 2).unwrap(),
        vec![vec![2, 3], vec![4, 5]]
    );
}

#[test]
fn in_place_the_engine_waits_for_the_whole_refit() {
    for served in stream(Method::InPlace, false, Vec::new(), None) {
        let served = served.unwrap();
        assert_eq!(served.outcome, "in place");
        assert_eq!(
            served
                .ranks
                .iter()
                .map(|r| r.passes_during_refit)
                .sum::<u64>(),
            0
        );
        assert!(served.pause_s() >= served.refit_s * 0.99, "{served:?}");
    }
}

#[test]
fn a_version_that_fails_to_prepare_leaves_every_rank_on_the_one_before() {
    let out = stream(Method::Staged, true, Vec::new(), Some(2));
    assert!(out[0].is_ok());
    let e = out[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 0"), "{e}");
    // the stream goes on from the version served
    assert!(out[2].is_ok());
}
