use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::exec::{run_local, run_local_with_faults, zeroed_shards};
use reshard_core::dtype::DType;
use reshard_core::fill::Fill;
use reshard_core::layout::{Layout, LayoutSpec};
use reshard_core::plan::{Plan, PlanOptions, Topology};
use reshard_core::testing::{arb_hosts_case, reference_shards};
use reshard_core::topology::HostMap;
use reshard_transport::Fault;

fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, dtype, first)
        .unwrap()
}

fn options(chunk_bytes: usize, staging_bytes: usize, checksum: bool) -> ExecOptions {
    ExecOptions {
        chunk_bytes,
        staging_bytes,
        timeout: Duration::from_secs(30),
        checksum,
        delta: None,
        stage: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    /// Relay plans run over local threads give every destination exactly the reference's
    /// bytes, whatever the slabs (staging bounds down to two bytes) and chunks.
    #[test]
    fn relay_runs_match_the_reference(
        (src, dst, hosts, plan_options) in arb_hosts_case(),
        relay in any::<bool>(),
        seed in any::<u64>(),
        chunk_bytes in prop_oneof![Just(1usize), 2usize..24, Just(4 << 20)],
        staging_factor in prop_oneof![Just(2usize), 3usize..16, Just(1 << 10)],
        checksum in any::<bool>(),
    ) {
        let fill = Fill::Hash { seed };
        let topology = Topology::new(hosts, relay);
        let plan = Plan::with_topology(src, dst, plan_options, Some(topology)).unwrap();
        let sources = reference_shards(plan.src(), fill);
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        let options = options(chunk_bytes, chunk_bytes * staging_factor, checksum);
        let stats = run_local(&plan, &sources, &mut shards, &options).unwrap();
        prop_assert_eq!(&shards, &reference_shards(plan.dst(), fill));
        let totals = plan.totals();
        prop_assert_eq!(stats.bytes_remote(), totals.bytes_remote);
        prop_assert_eq!(stats.bytes_local(), totals.bytes_local);
    }
}

/// TP4 on host 0 -> DP2 x TP2 on host 1, the example of relay.
fn tp4_to_dp2_tp2(shape: &[u64], dtype: DType) -> Plan {
    let src = layout("mesh=4 place=S(1)", shape, dtype, 0);
    let dst = layout("mesh=2x2 place=R,S(1)", shape, dtype, 4);
    let topology = Topology::new(HostMap::parse("2x4").unwrap(), true);
    Plan::with_topology(src, dst, PlanOptions::default(), Some(topology)).unwrap()
}

#[test]
fn hops_are_cut_into_slabs_and_forwarded_a_round_later() {
    let plan = tp4_to_dp2_tp2(&[64, 64], DType::U8);
    // rank 4 relays the piece of source 0 (16 columns: 64x16 bytes) to rank 6
    let rp = plan.for_rank(4);
    let rounds = Rounds::of(&rp, 1, 256).unwrap();
    assert!(rp.relays() && rp.forwards().count() > 0);
    let hop_slabs = |j: usize| {
        rounds.rounds[j]
            .recvs
            .iter()
            .filter(|l| l.staged.is_some())
            .count()
    };
    assert_eq!(rounds.rounds.len(), 5, "{rounds:#?}");
    assert!((0..4).all(|j| hop_slabs(j) == 1));
    assert_eq!(hop_slabs(4), 0);
    // every forward leg reads a slab staged the round before, and is that slab
    for (j, round) in rounds.rounds.iter().enumerate() {
        for l in round.sends.iter().filter(|l| l.forwarded) {
            let before = &rounds.rounds[j - 1];
            let hop = before.recvs.iter().find(|h| h.staged == l.staged).unwrap();
            assert_eq!(hop.region, l.region);
        }
    }
    assert_eq!(rounds.staging_bytes(), 256);
}

#[test]
fn slabs_tile_their_region() {
    let r = Region {
        offset: vec![3, 0],
        extent: vec![10, 7],
    };
    for slab in [1u64, 7, 8, 50, 70, 1000] {
        let s = slabs(&r, 1, slab);
        assert_eq!(s.iter().map(Region::volume).sum::<u64>(), 70, "{slab}");
        for (a, b) in s.iter().zip(s.iter().skip(1)) {
            assert!(a.intersect(b).is_none());
        }
        assert!(s.iter().all(|x| r.contains(x)));
    }
    assert_eq!(slabs(&r, 1, 1000).len(), 1);
    assert_eq!(slabs(&r, 1, 7).len(), 10);
}

#[test]
fn a_relaying_rank_that_dies_fails_the_run_without_hanging() {
    let plan = tp4_to_dp2_tp2(&[256, 256], DType::Bf16);
    let sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    let options = ExecOptions {
        timeout: Duration::from_secs(5),
        ..options(1024, 8192, false)
    };
    let faults = [Fault::Die {
        rank: 4,
        after_chunks: 1,
    }];
    let err = run_local_with_faults(&plan, &sources, &mut shards, &options, &faults).unwrap_err();
    assert!(err.to_string().contains("rank 4"), "{err}");
}

#[test]
fn a_byte_changed_in_a_forward_fails_the_checksum() {
    let plan = tp4_to_dp2_tp2(&[64, 64], DType::Bf16);
    let sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    // rank 6 only receives: its every chunk is a direct hop or a forward from rank 4
    let faults = [Fault::Corrupt { rank: 6, chunk: 1 }];
    let err = run_local_with_faults(
        &plan,
        &sources,
        &mut shards,
        &options(512, 4096, true),
        &faults,
    )
    .unwrap_err();
    assert!(err.to_string().contains("checksum"), "{err}");
}
