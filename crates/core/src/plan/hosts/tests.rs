use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::dtype::DType;
use crate::layout::LayoutSpec;
use crate::plan::tests::check_invariants;
use crate::plan::{Plan, rank_plan_on};
use crate::testing::arb_hosts_case;

/// What a relay plan keeps besides the invariants of every plan: every forwarded transfer
/// has its hop, to a rank of the destination's host that holds the same box.
fn check_relays(plan: &Plan, hosts: &HostMap) -> Result<(), TestCaseError> {
    let direct: BTreeSet<(Rank, Rank, &Region)> = plan
        .transfers()
        .iter()
        .filter(|t| t.via.is_none())
        .map(|t| (t.src, t.dst, &t.region))
        .collect();
    for t in plan.transfers() {
        let Some(via) = t.via else { continue };
        prop_assert!(via != t.dst && via != t.src, "{t:?}");
        prop_assert_eq!(hosts.host_of(via), hosts.host_of(t.dst), "{:?}", t);
        prop_assert_ne!(hosts.host_of(t.src), hosts.host_of(t.dst), "{:?}", t);
        prop_assert_eq!(
            plan.dst().local_region(via),
            plan.dst().local_region(t.dst),
            "{:?}: the relaying rank holds another box",
            t
        );
        prop_assert!(
            direct.contains(&(t.src, via, &t.region)),
            "{t:?} has no hop"
        );
    }
    Ok(())
}

/// No byte crosses into a host whose own source ranks hold it.
fn check_served_from_home(plan: &Plan, hosts: &HostMap) -> Result<(), TestCaseError> {
    let src = plan.src();
    for t in plan.transfers().iter().filter(|t| t.via.is_none()) {
        let home = hosts.host_of(t.dst);
        if hosts.host_of(t.src) == home {
            continue;
        }
        for &r in src.mesh().ranks() {
            let held = src.local_region(r).unwrap();
            prop_assert!(
                hosts.host_of(r) != home || !held.contains(&t.region),
                "{t:?} crosses, but rank {r} on host {home} holds it"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    /// Relay plans deliver every destination byte exactly once, hop by hop, and never load a
    /// host link more than the same plan without relay.
    #[test]
    fn relay_plans_tile_and_never_load_a_link_more((src, dst, hosts, options) in arb_hosts_case()) {
        let with = Plan::with_topology(
            src.clone(), dst.clone(), options, Some(Topology::new(hosts.clone(), true)),
        ).unwrap();
        let without = Plan::with_topology(
            src, dst, options, Some(Topology::new(hosts.clone(), false)),
        ).unwrap();
        for plan in [&with, &without] {
            check_invariants(plan)?;
            check_served_from_home(plan, &hosts)?;
        }
        check_relays(&with, &hosts)?;
        prop_assert!(without.transfers().iter().all(|t| t.via.is_none()));
        let (a, b) = (with.host_links().unwrap(), without.host_links().unwrap());
        prop_assert!(a.busiest() <= b.busiest(), "{a:?} vs {b:?}");
        for (x, y) in a.links.iter().zip(&b.links) {
            prop_assert!(x.in_bytes <= y.in_bytes && x.out_bytes <= y.out_bytes, "{x:?} vs {y:?}");
        }
        // the same bytes reach the destinations
        prop_assert_eq!(
            with.transfers().iter().map(|t| t.region.volume()).sum::<u64>(),
            without.transfers().iter().map(|t| t.region.volume()).sum::<u64>()
        );
    }

    /// Every rank planning alone gets exactly its part of the full plan, relays included.
    #[test]
    fn rank_local_planning_matches_the_full_plan_on_hosts(
        (src, dst, hosts, options) in arb_hosts_case(),
        relay in any::<bool>(),
    ) {
        let topology = Topology::new(hosts, relay);
        let plan = Plan::with_topology(src.clone(), dst.clone(), options, Some(topology.clone())).unwrap();
        let all = plan.rank_plans();
        for r in plan.ranks() {
            let alone = rank_plan_on(&src, &dst, r, &options, Some(&topology)).unwrap();
            prop_assert_eq!(&alone, &plan.for_rank(r));
            prop_assert_eq!(&alone, &all[&r]);
            // a relaying rank forwards exactly the hops it receives, to its host's replicas
            for f in alone.forwards() {
                let hop = Transfer::direct(f.src, r, f.region.clone());
                prop_assert!(alone.recvs.contains(&hop) && alone.is_hop(&hop), "{f:?}");
            }
        }
    }
}

fn layout(spec: &str, shape: &[u64], first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, DType::Bf16, first)
        .unwrap()
}

#[test]
fn relay_halves_the_busiest_link_from_tp4_to_dp2_tp2() {
    // TP4 on host 0 (ranks 0..4) -> DP2 x TP2 on host 1 (ranks 4..8)
    let shape = [8192, 8192];
    let src = layout("mesh=4 place=S(1)", &shape, 0);
    let dst = layout("mesh=2x2 place=R,S(1)", &shape, 4);
    let busiest = |relay| {
        let topology = Topology::new(HostMap::parse("2x4").unwrap(), relay);
        let plan = Plan::with_topology(
            src.clone(),
            dst.clone(),
            PlanOptions::default(),
            Some(topology),
        )
        .unwrap();
        plan.host_links().unwrap().busiest()
    };
    let tensor = 8192 * 8192 * 2;
    assert_eq!(busiest(false), 2 * tensor);
    assert_eq!(busiest(true), tensor);
}

#[test]
fn cross_host_bytes_spread_over_the_source_hosts() {
    // two source replicas, one per host 0 and 1; destinations on hosts 2 and 3
    let shape = [4096, 1024];
    let src = layout("mesh=2x2 place=R,S(0)", &shape, 0);
    let dst = layout("mesh=4 place=S(1)", &shape, 4);
    let hosts = HostMap::parse("0,0,1,1,2,2,3,3").unwrap();
    let plan = Plan::with_topology(
        src,
        dst,
        PlanOptions::default(),
        Some(Topology::new(hosts, true)),
    )
    .unwrap();
    let links = plan.host_links().unwrap().links;
    let tensor = 4096 * 1024 * 2;
    assert_eq!(links[0].out_bytes, tensor / 2, "{links:?}");
    assert_eq!(links[1].out_bytes, tensor / 2, "{links:?}");
    assert_eq!(links[2].in_bytes, tensor / 2, "{links:?}");
}

#[test]
fn a_source_on_the_destination_host_serves_it() {
    // replicas on hosts 0 and 1, destinations on host 1: nothing crosses
    let shape = [64, 64];
    let src = layout("mesh=2 place=R", &shape, 0);
    let dst = layout("mesh=2 place=S(0)", &shape, 2);
    let hosts = HostMap::parse("0,1,1,1").unwrap();
    let plan = Plan::with_topology(
        src,
        dst,
        PlanOptions::default(),
        Some(Topology::new(hosts, true)),
    )
    .unwrap();
    assert_eq!(plan.host_links().unwrap().busiest(), 0);
    assert!(plan.transfers().iter().all(|t| t.src == 1));
}

#[test]
fn without_hosts_plans_are_unchanged() {
    let shape = [64, 64];
    let src = layout("mesh=4 place=S(1)", &shape, 0);
    let dst = layout("mesh=2x2 place=R,S(1)", &shape, 4);
    let a = Plan::new(src.clone(), dst.clone()).unwrap();
    let b = Plan::with_topology(src, dst, PlanOptions::default(), None).unwrap();
    assert_eq!(a.transfers(), b.transfers());
    assert!(a.host_links().is_none());
}
