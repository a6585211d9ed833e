use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::exec::delta::{DeltaOptions, DeltaRefit, DeltaSession, StageRefit};
use crate::exec::{ExecOptions, run_local, zeroed_shards};
use reshard_core::dtype::DType;
use reshard_core::evolve::{Evolution, Update};
use reshard_core::fill::Fill;
use reshard_core::layout::LayoutSpec;
use reshard_core::plan::Plan;
use reshard_core::testing::arb_layout_pair;

fn options(
    session: &DeltaSession,
    version: u64,
    delta: Option<usize>,
    chunk: usize,
) -> ExecOptions {
    ExecOptions {
        chunk_bytes: chunk,
        staging_bytes: (2 * chunk).max(64 << 20),
        delta: delta.map(|block_elems| DeltaRefit {
            session: session.clone(),
            version,
            options: DeltaOptions {
                anchor: None,
                block_elems,
            },
        }),
        stage: Some(StageRefit {
            session: session.clone(),
            version,
        }),
        ..ExecOptions::default()
    }
}

/// Stages `version` from `sources` beside `live` (every rank of the plan as a thread), and
/// returns the shadows it staged into.
fn prepare(
    plan: &Plan,
    sources: &BTreeMap<Rank, Vec<u8>>,
    live: &BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> reshard_core::error::Result<BTreeMap<Rank, Vec<u8>>> {
    let mut shadows = live.clone();
    run_local(plan, sources, &mut shadows, options)?;
    Ok(shadows)
}

/// Commits (or aborts) `version` on every rank of the plan; the total pause's reports.
fn decide(
    plan: &Plan,
    session: &DeltaSession,
    version: u64,
    shadows: &BTreeMap<Rank, Vec<u8>>,
    live: &mut BTreeMap<Rank, Vec<u8>>,
    commit: bool,
) -> Vec<CommitReport> {
    let mut reports = Vec::new();
    for rank in plan.ranks() {
        match commit {
            true => {
                let shadow: Vec<&[u8]> =
                    shadows.get(&rank).map(Vec::as_slice).into_iter().collect();
                let mut mine: Vec<&mut [u8]> = live
                    .get_mut(&rank)
                    .map(Vec::as_mut_slice)
                    .into_iter()
                    .collect();
                reports.push(session.commit(rank, version, &shadow, &mut mine).unwrap());
            }
            false => session.abort(rank, version).unwrap(),
        }
    }
    reports
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// A stream of staged refits, each committed or aborted at random, dense or as deltas:
    /// preparing never touches the live shards; a commit leaves exactly the version staged,
    /// an abort exactly the one served before, and the next refit lands exactly either way,
    /// on random layouts (uneven, replicated, overlapping ranks, N-D, every dtype).
    #[test]
    fn a_staged_version_lands_whole_at_commit_and_never_before(
        (src, dst) in arb_layout_pair(),
        seed in any::<u64>(),
        density in prop::sample::select(vec![0.0, 0.01, 0.5, 1.0]),
        delta in prop_oneof![Just(None), Just(Some(4usize)), Just(Some(4096usize))],
        chunk in prop_oneof![Just(3usize), Just(4 << 20)],
        commits in prop::collection::vec(any::<bool>(), 4),
    ) {
        let evolution = Evolution::new(Fill::Hash { seed }, Update::Density(density), seed, src.dtype()).unwrap();
        let plan = Plan::new(src, dst).unwrap();
        let session = DeltaSession::new();
        let mut live = zeroed_shards(plan.dst()).unwrap();
        let mut serving = None;
        for (version, &commit) in (1..).zip(&commits) {
            let sources = evolution.shards(plan.src(), version).unwrap();
            let before = live.clone();
            let shadows = prepare(&plan, &sources, &live, &options(&session, version, delta, chunk)).unwrap();
            prop_assert_eq!(&live, &before);
            for r in plan.ranks() {
                prop_assert_eq!(session.staged(r), Some(version));
                prop_assert_eq!(session.serving(r), serving);
            }
            evolution.verify_shards(plan.dst(), &shadows, version).unwrap();
            let reports = decide(&plan, &session, version, &shadows, &mut live, commit);
            if commit {
                evolution.verify_shards(plan.dst(), &live, version).unwrap();
                serving = Some(version);
                if delta.is_some() && version > 1 && serving == Some(version) {
                    // what came as a delta is applied as its patch, not copied
                    let copied: u64 = reports.iter().map(|r| r.copied_bytes).sum();
                    prop_assert!(copied <= plan.totals().bytes_local + plan.totals().bytes_remote);
                }
            } else {
                prop_assert_eq!(&live, &before);
            }
            for r in plan.ranks() {
                prop_assert_eq!(session.staged(r), None);
                prop_assert_eq!(session.serving(r), serving);
            }
        }
    }
}

fn seed_plan() -> Plan {
    let src = LayoutSpec::parse("mesh=2 place=S(0)")
        .unwrap()
        .resolve(&[64, 64], DType::Bf16, 0)
        .unwrap();
    let dst = LayoutSpec::parse("mesh=4 place=S(1)")
        .unwrap()
        .resolve(&[64, 64], DType::Bf16, 2)
        .unwrap();
    Plan::new(src, dst).unwrap()
}

/// Stages and commits `version` on the seed plan, as deltas of 64-element blocks.
fn refit(
    plan: &Plan,
    evolution: &Evolution,
    session: &DeltaSession,
    live: &mut BTreeMap<Rank, Vec<u8>>,
    version: u64,
) -> Vec<CommitReport> {
    let sources = evolution.shards(plan.src(), version).unwrap();
    let shadows = prepare(
        plan,
        &sources,
        live,
        &options(session, version, Some(64), 4 << 20),
    )
    .unwrap();
    decide(plan, session, version, &shadows, live, true)
}

#[test]
fn a_delta_commit_applies_patches_and_copies_nothing_that_came_as_one() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 3 },
        Update::Density(0.01),
        3,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut live = zeroed_shards(plan.dst()).unwrap();
    // the first version comes dense: copied whole
    let first = refit(&plan, &evolution, &session, &mut live, 1);
    let copied: u64 = first.iter().map(|r| r.copied_bytes).sum();
    assert_eq!(copied, plan.totals().bytes_remote);
    assert!(first.iter().all(|r| r.patches == 0));
    // the second as deltas: applied, nothing copied
    let second = refit(&plan, &evolution, &session, &mut live, 2);
    evolution.verify_shards(plan.dst(), &live, 2).unwrap();
    assert!(second.iter().all(|r| r.copied_bytes == 0), "{second:?}");
    let patches: u64 = second.iter().map(|r| r.patches).sum();
    assert_eq!(patches, 8);
    let changed: u64 = second.iter().map(|r| r.changed).sum();
    assert!(changed > 0 && changed < 64 * 64 / 10, "{changed}");
}

#[test]
fn commits_and_aborts_refuse_what_is_not_staged() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 5 },
        Update::Density(0.01),
        5,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut live = zeroed_shards(plan.dst()).unwrap();
    refit(&plan, &evolution, &session, &mut live, 1);
    let sources = evolution.shards(plan.src(), 2).unwrap();
    let shadows = prepare(
        &plan,
        &sources,
        &live,
        &options(&session, 2, Some(64), 4 << 20),
    )
    .unwrap();
    // a second staging before this one is resolved
    let again = prepare(
        &plan,
        &sources,
        &live,
        &options(&session, 3, Some(64), 4 << 20),
    );
    let e = again.unwrap_err().to_string();
    assert!(e.contains("version 2 is still staged"), "{e}");
    // another version than staged
    let shadow = [shadows[&2].as_slice()];
    let mut mine = [live.get_mut(&2).unwrap().as_mut_slice()];
    let e = session
        .commit(2, 3, &shadow, &mut mine)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot commit version 3: it holds version 2 staged"),
        "{e}"
    );
    // onto shards that serve another version now
    session.with_rank(2, |s| s.set_held(Some(7)));
    let e = session
        .commit(2, 2, &shadow, &mut mine)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("it was staged onto version 1, but the shards serve version 7"),
        "{e}"
    );
    // buffers of other sizes
    session.with_rank(2, |s| s.set_held(Some(1)));
    let short = [&shadows[&2][1..]];
    let e = session
        .commit(2, 2, &short, &mut mine)
        .unwrap_err()
        .to_string();
    assert!(e.contains("staged for"), "{e}");
    // nothing written by any refusal
    assert!(evolution.verify_shards(plan.dst(), &live, 1).is_ok());
    session.abort(2, 2).unwrap();
    let e = session.abort(2, 2).unwrap_err().to_string();
    assert!(
        e.contains("cannot abort version 2: it holds no staged version"),
        "{e}"
    );
}

#[test]
fn after_an_abort_the_next_refit_sends_the_aborted_rank_dense_and_lands_exactly() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 9 },
        Update::Density(0.01),
        9,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut live = zeroed_shards(plan.dst()).unwrap();
    refit(&plan, &evolution, &session, &mut live, 1);
    let sources = evolution.shards(plan.src(), 2).unwrap();
    let shadows = prepare(
        &plan,
        &sources,
        &live,
        &options(&session, 2, Some(64), 4 << 20),
    )
    .unwrap();
    decide(&plan, &session, 2, &shadows, &mut live, false);
    evolution.verify_shards(plan.dst(), &live, 1).unwrap();
    let _ = session.take_reports();
    refit(&plan, &evolution, &session, &mut live, 3);
    evolution.verify_shards(plan.dst(), &live, 3).unwrap();
    let reports = session.take_reports();
    // the senders' bases are of version 2, the receivers hold 1: dense, and said why
    assert!(
        reports.iter().any(|r| r
            .dense_to
            .iter()
            .any(|&(_, why)| why == crate::exec::delta::Dense::Stale)),
        "{reports:?}"
    );
}

#[test]
fn a_failed_prepare_stages_nothing_and_leaves_the_shards_serving() {
    let plan = seed_plan();
    let evolution = Evolution::new(
        Fill::Hash { seed: 4 },
        Update::Density(0.01),
        4,
        DType::Bf16,
    )
    .unwrap();
    let session = DeltaSession::new();
    let mut live = zeroed_shards(plan.dst()).unwrap();
    refit(&plan, &evolution, &session, &mut live, 1);
    let mut sources = evolution.shards(plan.src(), 2).unwrap();
    // a source shard of the wrong size is refused before any byte moves
    sources.get_mut(&0).unwrap().pop();
    let before = live.clone();
    assert!(
        prepare(
            &plan,
            &sources,
            &live,
            &options(&session, 2, Some(64), 4 << 20)
        )
        .is_err()
    );
    assert_eq!(live, before);
    for r in plan.ranks() {
        assert_eq!(session.staged(r), None);
        assert_eq!(session.serving(r), Some(1));
    }
    // and the stream goes on
    refit(&plan, &evolution, &session, &mut live, 2);
    evolution.verify_shards(plan.dst(), &live, 2).unwrap();
}

#[test]
fn library_shadows_copy_the_live_shards_and_caller_shadows_must_fit() {
    let live = [vec![1u8, 2, 3], vec![4u8]];
    let bufs: Vec<&[u8]> = live.iter().map(Vec::as_slice).collect();
    assert_eq!(stage_shadows(0, &bufs).unwrap(), live.to_vec());
    let mut given = [vec![0u8; 3], vec![0u8; 1]];
    let mut refs: Vec<&mut [u8]> = given.iter_mut().map(Vec::as_mut_slice).collect();
    refresh_shadows(0, &mut refs, &bufs).unwrap();
    assert_eq!(given, live);
    let mut wrong = [vec![0u8; 2]];
    let mut refs: Vec<&mut [u8]> = wrong.iter_mut().map(Vec::as_mut_slice).collect();
    let e = refresh_shadows(3, &mut refs, &bufs)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 3's staging buffers must have the sizes of its shards"),
        "{e}"
    );
}
