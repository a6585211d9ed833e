use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::exec::baseline::{full_buffers, run_local_gather_broadcast};
use crate::exec::{ExecOptions, run_local, zeroed_shards};
use reshard_core::dtype::DType;
use reshard_core::evolve::{Evolution, Update};
use reshard_core::fill::Fill;
use reshard_core::layout::{Layout, LayoutSpec};
use reshard_core::plan::{GatherBroadcast, Plan};
use reshard_core::testing::arb_layout_pair;

fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, dtype, first)
        .unwrap()
}

fn options(session: &DeltaSession, version: u64, delta: DeltaOptions, chunk: usize) -> ExecOptions {
    ExecOptions {
        chunk_bytes: chunk,
        staging_bytes: (2 * chunk).max(64 << 20),
        timeout: Duration::from_secs(30),
        checksum: false,
        delta: Some(DeltaRefit {
            session: session.clone(),
            version,
            options: delta,
        }),
        stage: None,
    }
}

/// Sums a version's reports, one direction.
fn total(reports: &[DeltaReport], sent: bool) -> DeltaCounts {
    let mut t = DeltaCounts::default();
    for r in reports {
        let c = if sent { &r.sent } else { &r.received };
        t.delta += c.delta;
        t.dense += c.dense;
        t.bytes += c.bytes;
        t.dense_bytes += c.dense_bytes;
        t.changed += c.changed;
        t.elems += c.elems;
    }
    t
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    /// A delta refit over several versions leaves exactly every version in the destination
    /// shards (checked against the evolving fill, element by element), on random layouts:
    /// uneven, replicated, overlapping ranks, N-D, every dtype; densities from nothing to
    /// everything, blocks of every size, any chunk size.
    #[test]
    fn every_version_lands_exactly(
        (src, dst) in arb_layout_pair(),
        seed in any::<u64>(),
        density in prop::sample::select(vec![0.0, 1e-4, 0.01, 0.5, 1.0]),
        block_elems in prop_oneof![Just(1usize), 2usize..9, Just(4096)],
        chunk in prop_oneof![Just(1usize), 2usize..40, Just(4 << 20)],
        checksum in any::<bool>(),
    ) {
        let evolution = Evolution::new(Fill::Hash { seed }, Update::Density(density), seed, src.dtype()).unwrap();
        let plan = Plan::new(src, dst).unwrap();
        let session = DeltaSession::new();
        let delta = DeltaOptions { anchor: None, block_elems };
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        for version in 1..=4 {
            let sources = evolution.shards(plan.src(), version).unwrap();
            let options = ExecOptions { checksum, ..options(&session, version, delta, chunk) };
            run_local(&plan, &sources, &mut shards, &options).unwrap();
            evolution.verify_shards(plan.dst(), &shards, version).unwrap();
            let reports = session.take_reports();
            let (sent, got) = (total(&reports, true), total(&reports, false));
            // both ends agree on what moved
            prop_assert_eq!((sent.delta, sent.dense, sent.bytes), (got.delta, got.dense, got.bytes));
            prop_assert_eq!(sent.dense_bytes, plan.totals().bytes_remote);
            if version == 1 {
                prop_assert_eq!(sent.delta, 0);
            } else {
                // after the first, nothing is dense but for a encoding no smaller
                prop_assert!(reports.iter().all(|r| r.dense_to.iter().all(|d| d.1 == Dense::NotSmaller)));
                prop_assert!(reports.iter().all(|r| r.held == Some(version - 1)));
                if density == 0.0 {
                    prop_assert_eq!(sent.changed, 0);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Relay plans as deltas: each relaying rank forwards what its hop came as (the delta, or
    /// dense), and every version lands exactly, with the ranks scattered over hosts.
    #[test]
    fn relayed_versions_land_exactly(
        (src, dst, hosts, plan_options) in reshard_core::testing::arb_hosts_case(),
        seed in any::<u64>(),
        density in prop::sample::select(vec![0.0, 0.01, 0.5, 1.0]),
        block_elems in prop_oneof![2usize..9, Just(4096)],
        checksum in any::<bool>(),
    ) {
        use reshard_core::plan::Topology;
        let evolution = Evolution::new(Fill::Hash { seed }, Update::Density(density), seed, src.dtype()).unwrap();
        let plan = Plan::with_topology(src, dst, plan_options, Some(Topology::new(hosts, true))).unwrap();
        let session = DeltaSession::new();
        let delta = DeltaOptions { anchor: None, block_elems };
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        for version in 1..=4 {
            let sources = evolution.shards(plan.src(), version).unwrap();
            let options = ExecOptions { checksum, ..options(&session, version, delta, 4 << 20) };
            run_local(&plan, &sources, &mut shards, &options).unwrap();
            evolution.verify_shards(plan.dst(), &shards, version).unwrap();
            let reports = session.take_reports();
            if version > 1 {
                prop_assert!(reports.iter().all(|r| r.dense_to.iter().all(|d| d.1 == Dense::NotSmaller)), "{:?}", reports);
            }
        }
    }
}

/// An 8x8 bf16 tensor from two row shards to four column shards, 8-element blocks.
fn seed_plan() -> Plan {
    let src = layout("mesh=2 place=S(0)", &[64, 64], DType::Bf16, 0);
    let dst = layout("mesh=4 place=S(1)", &[64, 64], DType::Bf16, 2);
    Plan::new(src, dst).unwrap()
}

fn small() -> DeltaOptions {
    DeltaOptions {
        anchor: None,
        block_elems: 64,
    }
}

#[test]
fn a_sparse_version_sends_a_small_fraction_of_the_values() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 1 },
        Update::Density(0.01),
        9,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    for version in 1..=3 {
        let sources = evolution.shards(plan.src(), version).unwrap();
        run_local(
            &plan,
            &sources,
            &mut shards,
            &options(&session, version, small(), 1 << 20),
        )
        .unwrap();
        evolution
            .verify_shards(plan.dst(), &shards, version)
            .unwrap();
        let sent = total(&session.take_reports(), true);
        if version > 1 {
            assert_eq!(sent.delta, 8);
            assert!(sent.bytes * 10 < sent.dense_bytes, "{sent:?}");
            assert!(sent.changed > 0);
        }
    }
    // a base per transfer: one copy of every region sent, 64x64 bf16 in all
    assert_eq!(session.base_bytes(), 64 * 64 * 2);
}

#[test]
fn a_rank_that_missed_a_version_or_joins_late_gets_dense_and_the_report_says_why() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 2 },
        Update::Density(0.05),
        3,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    let run = |version: u64, shards: &mut BTreeMap<Rank, Vec<u8>>| {
        let sources = evolution.shards(plan.src(), version).unwrap();
        run_local(
            &plan,
            &sources,
            shards,
            &options(&session, version, small(), 1 << 20),
        )
        .unwrap();
        evolution
            .verify_shards(plan.dst(), shards, version)
            .unwrap();
        session.take_reports()
    };
    run(1, &mut shards);
    run(2, &mut shards);
    // rank 3 was restored from a checkpoint of version 1; rank 4 is new
    let old = evolution.shards(plan.dst(), 1).unwrap();
    shards.insert(3, old[&3].clone());
    session.with_rank(3, |s| s.set_held(Some(1)));
    shards.get_mut(&4).unwrap().fill(0);
    session.with_rank(4, RankDelta::forget);
    let reports = run(3, &mut shards);
    let of = |rank: Rank| reports.iter().find(|r| r.rank == rank).unwrap();
    assert_eq!(of(3).held, Some(1));
    assert_eq!(of(3).dense_from, vec![(0, Dense::Stale), (1, Dense::Stale)]);
    assert_eq!(of(4).held, None);
    assert_eq!(of(4).dense_from, vec![(0, Dense::Stale), (1, Dense::Stale)]);
    assert!(of(2).dense_from.is_empty() && of(5).dense_from.is_empty());
    assert_eq!(of(0).dense_to, vec![(3, Dense::Stale), (4, Dense::Stale)]);
    // and the next version is a delta for everyone again
    let reports = run(4, &mut shards);
    assert!(
        reports
            .iter()
            .all(|r| r.dense_from.is_empty() && r.dense_to.is_empty())
    );
}

#[test]
fn an_anchor_version_is_dense_everywhere() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 3 },
        Update::Density(0.01),
        4,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let anchored = DeltaOptions {
        anchor: Some(2),
        ..small()
    };
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    for version in 1..=5 {
        let sources = evolution.shards(plan.src(), version).unwrap();
        run_local(
            &plan,
            &sources,
            &mut shards,
            &options(&session, version, anchored, 4096),
        )
        .unwrap();
        evolution
            .verify_shards(plan.dst(), &shards, version)
            .unwrap();
        let reports = session.take_reports();
        let sent = total(&reports, true);
        match version {
            2 | 4 => {
                assert_eq!(sent.delta, 0);
                assert!(
                    reports
                        .iter()
                        .all(|r| r.dense_to.iter().all(|d| d.1 == Dense::Anchor))
                );
            }
            1 => assert_eq!(sent.delta, 0),
            _ => assert_eq!(sent.delta, 8),
        }
    }
}

#[test]
fn with_checksum_a_wrong_base_fails_naming_the_transfer() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 4 },
        Update::Density(0.01),
        5,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    for version in 1..=2 {
        let sources = evolution.shards(plan.src(), version).unwrap();
        run_local(
            &plan,
            &sources,
            &mut shards,
            &options(&session, version, small(), 4096),
        )
        .unwrap();
    }
    // rank 5's shard changes behind the session's back
    shards.get_mut(&5).unwrap()[7] ^= 0x40;
    let sources = evolution.shards(plan.src(), 3).unwrap();
    let checked = ExecOptions {
        checksum: true,
        ..options(&session, 3, small(), 4096)
    };
    let err = run_local(&plan, &sources, &mut shards, &checked).unwrap_err();
    assert!(
        err.to_string().contains("rank 5: the delta from rank 0")
            && err.to_string().contains("did not hold version 2"),
        "{err}"
    );
    // the rank that failed holds no version now: the next refit sends it everything
    assert_eq!(session.held(5), None);
    assert_eq!(session.held(4), Some(3));
    let sources = evolution.shards(plan.src(), 4).unwrap();
    run_local(
        &plan,
        &sources,
        &mut shards,
        &options(&session, 4, small(), 4096),
    )
    .unwrap();
    evolution.verify_shards(plan.dst(), &shards, 4).unwrap();
}

#[test]
fn a_change_that_vanishes_in_the_wire_dtype_sends_nothing() {
    // f32 masters trained with a tiny learning rate, cast to bf16 on the way: only the
    // elements whose bf16 changed are sent (those near zero), not those whose f32 did
    let src = layout("mesh=2 place=S(0)", &[64, 64], DType::F32, 0);
    let dst = layout("mesh=2 place=S(1)", &[64, 64], DType::Bf16, 2);
    let plan = Plan::new(src, dst).unwrap();
    let training = Update::Training { lr: 1e-7 };
    let evolution = Evolution::new(Fill::Normal { seed: 5 }, training, 6, DType::F32).unwrap();
    let session = DeltaSession::new();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    let mut before = BTreeMap::new();
    for version in 1..=3 {
        let sources = evolution.shards(plan.src(), version).unwrap();
        run_local(
            &plan,
            &sources,
            &mut shards,
            &options(&session, version, small(), 4096),
        )
        .unwrap();
        evolution
            .verify_shards(plan.dst(), &shards, version)
            .unwrap();
        let sent = total(&session.take_reports(), true);
        if version > 1 {
            let changed: usize = shards
                .iter()
                .map(|(r, now)| {
                    let was: &Vec<u8> = &before[r];
                    now.chunks(2)
                        .zip(was.chunks(2))
                        .filter(|(a, b)| a != b)
                        .count()
                })
                .sum();
            let masters_changed = 64 * 64;
            assert_eq!(sent.changed, changed as u64, "{sent:?}");
            assert!(
                changed * 4 < masters_changed,
                "{changed} of {masters_changed}"
            );
        }
        before = shards.clone();
    }
}

#[test]
fn the_baseline_runs_as_a_delta_too() {
    // gathered to one rank, then broadcast: both hops carry only what changed
    let src = layout("mesh=2 place=S(0)", &[64, 64], DType::Bf16, 0);
    let dst = layout("mesh=2 place=S(1)", &[64, 64], DType::Bf16, 2);
    let gb = GatherBroadcast::new(&src, &dst).unwrap();
    let evolution = Evolution::new(
        Fill::Hash { seed: 6 },
        Update::Density(0.01),
        7,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut shards = zeroed_shards(&dst).unwrap();
    let mut full = full_buffers(&gb).unwrap();
    for version in 1..=3 {
        let mut sources = evolution.shards(&src, version).unwrap();
        run_local_gather_broadcast(
            &gb,
            &mut sources,
            &mut shards,
            &mut full,
            &options(&session, version, small(), 4096),
        )
        .unwrap();
        evolution.verify_shards(&dst, &shards, version).unwrap();
        let sent = total(&session.take_reports(), true);
        if version > 1 {
            assert!(sent.delta > 0 && sent.dense == 0, "{sent:?}");
        }
    }
}

#[test]
fn bad_delta_options_are_refused_naming_the_field() {
    let plan = seed_plan();
    let session = DeltaSession::new();
    let sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    let zero = DeltaOptions {
        anchor: Some(0),
        ..small()
    };
    let err = run_local(
        &plan,
        &sources,
        &mut shards,
        &options(&session, 1, zero, 4096),
    )
    .unwrap_err();
    assert!(err.to_string().starts_with("delta_anchor: 0"), "{err}");
}

#[test]
fn a_relaying_rank_forwards_the_deltas_its_hops_came_as() {
    use reshard_core::plan::Topology;
    use reshard_core::topology::HostMap;
    // two replicas of a TP2 engine on the second host: each region crosses once
    let src = layout("mesh=2 place=S(0)", &[64, 64], DType::Bf16, 0);
    let dst = layout("mesh=2x2 place=R,S(0)", &[64, 64], DType::Bf16, 2);
    let hosts = HostMap::from_indices(&[0, 0, 1, 1, 1, 1]).unwrap();
    let plan = Plan::with_topology(
        src,
        dst,
        Default::default(),
        Some(Topology::new(hosts, true)),
    )
    .unwrap();
    let relaying: Vec<Rank> = (2..6)
        .filter(|&r| plan.rank_part(r).forwards().count() > 0)
        .collect();
    assert!(!relaying.is_empty(), "the plan relays");
    let evolution = Evolution::new(
        Fill::Hash { seed: 8 },
        Update::Density(0.01),
        9,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    for version in 1..=3 {
        let sources = evolution.shards(plan.src(), version).unwrap();
        let checked = ExecOptions {
            checksum: true,
            ..options(&session, version, small(), 4096)
        };
        run_local(&plan, &sources, &mut shards, &checked).unwrap();
        evolution
            .verify_shards(plan.dst(), &shards, version)
            .unwrap();
        let reports = session.take_reports();
        for r in reports.iter().filter(|r| relaying.contains(&r.rank)) {
            // the forwards: as deltas once there is a base, dense before
            assert_eq!(r.sent.delta > 0, version > 1, "{r:?}");
            assert_eq!(r.sent.delta + r.sent.dense, 1, "{r:?}");
        }
        // what crosses between the hosts: one copy of each region (the sources' sends)
        let crossing: u64 = reports
            .iter()
            .filter(|r| r.rank < 2)
            .map(|r| r.sent.dense_bytes)
            .sum();
        assert_eq!(crossing, 64 * 64 * 2);
    }
}

/// A rank that dies or stalls in the middle of a delta refit fails every rank that needed it
/// (within the timeout, never a hang); the ranks whose refit failed hold no version
/// afterwards, and the next refit brings every shard back exactly.
#[test]
fn a_rank_that_fails_mid_refit_fails_its_peers_and_the_next_refit_heals() {
    use crate::exec::run_local_with_faults;
    use reshard_transport::Fault;
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 10 },
        Update::Density(0.05),
        11,
        DType::Bf16,
    )
    .unwrap();
    for fault in [
        Fault::Die {
            rank: 1,
            after_chunks: 1,
        },
        Fault::Stall {
            rank: 0,
            for_: Duration::from_millis(900),
        },
    ] {
        let session = DeltaSession::new();
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        let quick = |version| ExecOptions {
            timeout: Duration::from_millis(300),
            ..options(&session, version, small(), 4096)
        };
        for version in 1..=2 {
            let sources = evolution.shards(plan.src(), version).unwrap();
            run_local(&plan, &sources, &mut shards, &quick(version)).unwrap();
        }
        let sources = evolution.shards(plan.src(), 3).unwrap();
        let started = std::time::Instant::now();
        let err =
            run_local_with_faults(&plan, &sources, &mut shards, &quick(3), &[fault]).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(20), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("is gone") || text.contains("timed out"),
            "{text}"
        );
        // every destination needed both sources: none holds a version now
        for r in 2..6 {
            assert_eq!(session.held(r), None, "rank {r} after {fault:?}");
        }
        let sources = evolution.shards(plan.src(), 4).unwrap();
        run_local(&plan, &sources, &mut shards, &quick(4)).unwrap();
        evolution.verify_shards(plan.dst(), &shards, 4).unwrap();
        let reports = session.take_reports();
        let last: Vec<_> = reports.iter().filter(|r| r.version == 4).collect();
        assert!(
            last.iter()
                .filter(|r| r.rank >= 2)
                .all(|r| r.held.is_none())
        );
    }
}
