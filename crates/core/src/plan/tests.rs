use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::dtype::DType;
use crate::layout::LayoutSpec;
use crate::testing::{arb_layout_pair, reference_shard};

fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, dtype, first)
        .unwrap()
}

pub(in crate::plan) fn arb_options() -> impl Strategy<Value = PlanOptions> {
    prop_oneof![
        Just(PlanOptions::default()),
        Just(PlanOptions { min_split_bytes: 0 }),
        (1u64..64).prop_map(|min_split_bytes| PlanOptions { min_split_bytes }),
    ]
}

/// The invariants every plan keeps, checked against the reference boxes.
pub(in crate::plan) fn check_invariants(plan: &Plan) -> Result<(), TestCaseError> {
    let (src, dst) = (plan.src(), plan.dst());
    let src_box = |r: Rank| src.local_region(r);
    let mut by_dst: BTreeMap<Rank, Vec<&Transfer>> = BTreeMap::new();
    for t in plan.transfers() {
        prop_assert!(!t.region.is_empty(), "empty transfer {t:?}");
        by_dst.entry(t.dst).or_default().push(t);
    }
    for (p, &r) in dst.mesh().ranks().iter().enumerate() {
        let target = dst.region_at(p);
        // the reference agrees on the destination box's size
        let reference = reference_shard(
            dst.shape(),
            dst.mesh().dims(),
            dst.placements(),
            &dst.mesh().coords(p),
        );
        prop_assert_eq!(
            reference
                .shape
                .iter()
                .map(|&d| d as u64)
                .collect::<Vec<_>>(),
            target.extent.clone()
        );
        let mine = by_dst.remove(&r).unwrap_or_default();
        let mut covered = 0u64;
        for (i, t) in mine.iter().enumerate() {
            prop_assert!(
                target.contains(&t.region),
                "{t:?} outside the destination box {target}"
            );
            let held = src_box(t.src);
            prop_assert!(held.is_some(), "{t:?}: the sender is not a source rank");
            prop_assert!(
                held.unwrap().contains(&t.region),
                "{t:?}: the sender does not hold it"
            );
            for u in &mine[i + 1..] {
                prop_assert!(
                    t.region.intersect(&u.region).is_none(),
                    "{t:?} overlaps {u:?}"
                );
            }
            covered += t.region.volume();
        }
        // disjoint pieces inside the box whose volumes add up to it tile it exactly once
        prop_assert_eq!(covered, target.volume(), "rank {} is not tiled", r);
        // local first: everything this rank already holds is copied locally, nothing else is
        let own = src_box(r)
            .and_then(|b| b.intersect(&target))
            .map_or(0, |b| b.volume());
        let local: u64 = mine
            .iter()
            .filter(|t| t.is_local())
            .map(|t| t.region.volume())
            .sum();
        prop_assert_eq!(local, own, "rank {} sends itself the wrong amount", r);
    }
    prop_assert!(
        by_dst.is_empty(),
        "transfers to ranks outside the destination"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn plans_tile_every_destination_exactly_once((src, dst) in arb_layout_pair(), options in arb_options()) {
        let plan = Plan::with_options(src, dst, options).unwrap();
        check_invariants(&plan)?;
    }

    /// A rank planning alone gets exactly its part of the full plan.
    #[test]
    fn rank_local_planning_matches_the_full_plan((src, dst) in arb_layout_pair(), options in arb_options()) {
        let plan = Plan::with_options(src.clone(), dst.clone(), options).unwrap();
        let all = plan.rank_plans();
        for r in plan.ranks() {
            let alone = rank_plan(&src, &dst, r, &options).unwrap();
            prop_assert_eq!(&alone, &plan.for_rank(r));
            prop_assert_eq!(&alone, &all[&r]);
        }
        let again = Plan::with_options(src, dst, options).unwrap();
        prop_assert_eq!(again.transfers(), plan.transfers());
    }

    /// Symmetric replica cases: every source rank serves its share, within 5%, when pieces are
    /// large enough to split among the replicas (`min_split_bytes` each).
    #[test]
    fn replicas_share_the_sending(
        replicas in 2usize..=4,
        tp in prop::sample::select(vec![1usize, 2, 4]),
        dst_parts in prop::sample::select(vec![1usize, 2, 4, 8]),
        dst_dim in 0usize..2,
        rows in 1u64..=4,
        cols in 1u64..=4,
    ) {
        let shape = [rows * 2048, cols * 2048];
        let src = layout(&format!("mesh={replicas}x{tp} place=R,S(0)"), &shape, DType::Bf16, 0);
        let dst = layout(&format!("mesh={dst_parts} place=S({dst_dim})"), &shape, DType::Bf16, replicas * tp);
        let plan = Plan::new(src, dst).unwrap();
        let totals = plan.totals();
        let fair = totals.bytes_remote as f64 / (replicas * tp) as f64;
        prop_assert!(
            totals.max_rank_send_bytes as f64 <= 1.05 * fair,
            "max sent {} vs fair share {fair}", totals.max_rank_send_bytes
        );
    }
}

#[test]
fn the_seed_example() {
    let src = layout("mesh=2 place=S(0)", &[8, 8], DType::Bf16, 0);
    let dst = layout("mesh=4 place=S(1)", &[8, 8], DType::Bf16, 2);
    let plan = Plan::new(src, dst).unwrap();
    let got: Vec<(Rank, Rank, Region)> = plan
        .transfers()
        .iter()
        .map(|t| (t.src, t.dst, t.region.clone()))
        .collect();
    let mut want = Vec::new();
    for s in 0..2u64 {
        for d in 0..4u64 {
            want.push((
                s as Rank,
                d as Rank + 2,
                Region::from_ranges(&[s * 4..s * 4 + 4, d * 2..d * 2 + 2]),
            ));
        }
    }
    assert_eq!(got, want);
    let t = plan.totals();
    assert_eq!((t.bytes_remote, t.bytes_local, t.messages), (128, 0, 8));
    assert_eq!((t.max_rank_send_bytes, t.max_rank_recv_bytes), (64, 32));
    // all-gather between the 2 sources (128 bytes), then 4 broadcasts of 128 bytes
    assert_eq!(t.gather_broadcast_bytes, 640);
}

#[test]
fn colocated_ranks_copy_locally() {
    // TP4 rows -> TP2 columns on the same ranks 0..4 (ranks 2, 3 only send).
    let src = layout("mesh=4 place=S(0)", &[8, 8], DType::F32, 0);
    let dst = layout("mesh=2 ranks=0..2 place=S(1)", &[8, 8], DType::F32, 0);
    let plan = Plan::new(src, dst).unwrap();
    let t = plan.totals();
    assert_eq!(t.bytes_local, 2 * 2 * 4 * 4); // each destination holds 2x4 of its 8x4
    assert_eq!(t.bytes_remote, 256 - t.bytes_local);
    // gather inside ranks 0..4 then nothing to broadcast: both destinations hold it
    assert_eq!(t.gather_broadcast_bytes, 3 * 256);
}

#[test]
fn two_replicas_each_serve_half() {
    // training DP2 x TP2, inference TP4 columns: NCCL's reshard would use one replica only
    let src = layout("mesh=2x2 place=R,S(0)", &[4096, 4096], DType::Bf16, 0);
    let dst = layout("mesh=4 place=S(1)", &[4096, 4096], DType::Bf16, 4);
    let plan = Plan::new(src, dst).unwrap();
    let mut sent: BTreeMap<Rank, u64> = BTreeMap::new();
    for t in plan.transfers() {
        *sent.entry(t.src).or_default() += t.bytes(2);
    }
    let total = plan.src().total_bytes();
    assert_eq!(sent.len(), 4);
    assert!(sent.values().all(|&b| b == total / 4), "{sent:?}");
}

#[test]
fn many_replicas_into_one_rank() {
    // DP8 replicated -> 1 rank: every replica sends an eighth, not one replica all of it
    let src = layout("mesh=8 place=R", &[1 << 12, 1 << 10], DType::F32, 0);
    let dst = layout("mesh=1 place=R", &[1 << 12, 1 << 10], DType::F32, 8);
    let plan = Plan::new(src, dst).unwrap();
    assert_eq!(plan.transfers().len(), 8);
    assert!(
        plan.transfers()
            .iter()
            .all(|t| t.bytes(4) == (16 << 20) / 8)
    );
    // and a small tensor is not split into tiny messages
    let src = layout("mesh=8 place=R", &[64], DType::F32, 0);
    let dst = layout("mesh=1 place=R", &[64], DType::F32, 8);
    assert_eq!(Plan::new(src, dst).unwrap().transfers().len(), 1);
}

#[test]
fn mismatched_sides_are_rejected() {
    let a = layout("mesh=2 place=S(0)", &[8, 8], DType::Bf16, 0);
    let b = layout("mesh=2 place=S(0)", &[8, 4], DType::Bf16, 2);
    assert_eq!(
        Plan::new(a.clone(), b).unwrap_err().to_string(),
        "shape: the sides disagree: src has shape 8x8, dst has shape 8x4"
    );
    // a float destination dtype is converted in flight; an integer one is refused
    let c = layout("mesh=2 place=S(0)", &[8, 8], DType::F32, 2);
    assert_eq!(Plan::new(a.clone(), c).unwrap().elem_bytes(), 4);
    let d = layout("mesh=2 place=S(0)", &[8, 8], DType::I32, 2);
    let err = Plan::new(a, d).unwrap_err().to_string();
    assert!(
        err.contains("dst_dtype: cannot convert bf16 to i32"),
        "{err}"
    );
}

#[test]
fn plans_deepseek_scale_shapes_without_materializing() {
    // 256 stacked experts of 7168x2048 (over 2^32 elements): EP16 -> TP32 over the last dim
    let shape = [256, 7168, 2048];
    let src = layout("mesh=16 place=S(0)", &shape, DType::Bf16, 0);
    let dst = layout("mesh=32 place=S(2)", &shape, DType::Bf16, 16);
    let plan = Plan::new(src, dst).unwrap();
    let t = plan.totals();
    assert_eq!(t.bytes_remote, 256 * 7168 * 2048 * 2);
    assert_eq!(t.messages, 16 * 32);
    assert_eq!(t.max_rank_recv_bytes, 256 * 7168 * 64 * 2);
}

#[test]
fn replicated_sides_plan_one_transfer_per_destination() {
    // dp=64 -> dp=64, every piece large enough to split 64 ways: each destination replica takes
    // the whole tensor from its own source replica, instead of 1/64 from each of them (64 x 64)
    let shape = [4096, 1024];
    let src = layout("mesh=64 place=R", &shape, DType::U8, 0);
    let dst = layout("mesh=64 place=R", &shape, DType::U8, 64);
    let plan = Plan::new(src.clone(), dst.clone()).unwrap();
    assert_eq!(plan.transfers().len(), 64);
    let senders: std::collections::BTreeSet<Rank> =
        plan.transfers().iter().map(|t| t.src).collect();
    assert_eq!(
        senders.len(),
        64,
        "every source replica serves one destination"
    );
    for r in plan.ranks() {
        let alone = rank_plan(&src, &dst, r, &PlanOptions::default()).unwrap();
        assert_eq!(alone, plan.for_rank(r));
    }
}

#[test]
fn fewer_destination_replicas_draw_on_disjoint_sources() {
    // 4 source replicas, 2 destination replicas: each destination takes half from two sources
    let shape = [4096, 1024];
    let src = layout("mesh=4 place=R", &shape, DType::U8, 0);
    let dst = layout("mesh=2 place=R", &shape, DType::U8, 4);
    let plan = Plan::new(src, dst).unwrap();
    assert_eq!(plan.transfers().len(), 4);
    let mut sent: BTreeMap<Rank, u64> = BTreeMap::new();
    for t in plan.transfers() {
        *sent.entry(t.src).or_default() += t.bytes(1);
    }
    assert_eq!(sent.len(), 4, "{sent:?}");
    assert!(sent.values().all(|&b| b == 4096 * 1024 / 2), "{sent:?}");
    // replicas of a sharded destination box too: dp2 x tp2 from 4 replicas
    let src = layout("mesh=4 place=R", &shape, DType::U8, 0);
    let dst = layout("mesh=2x2 place=R,S(0)", &shape, DType::U8, 4);
    let plan = Plan::new(src, dst).unwrap();
    let mut sent: BTreeMap<Rank, u64> = BTreeMap::new();
    for t in plan.transfers() {
        *sent.entry(t.src).or_default() += t.bytes(1);
    }
    assert!(sent.values().all(|&b| b == 4096 * 1024 / 2), "{sent:?}");
}

#[test]
fn a_million_replicas_on_each_side_plan() {
    // `holders.contains` scanned all 10^6 replicas for each of the 10^6 destinations
    let src = layout("mesh=1000x1000 place=R,R", &[8, 8], DType::Bf16, 0);
    let dst = layout("mesh=1000x1000 place=R,R", &[8, 8], DType::Bf16, 1_000_000);
    let plan = Plan::new(src, dst).unwrap();
    assert_eq!(plan.transfers().len(), 1_000_000);
    assert_eq!(plan.totals().bytes_remote, 128 * 1_000_000);
}
