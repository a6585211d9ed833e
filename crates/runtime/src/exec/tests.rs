use std::time::Duration;

use proptest::prelude::*;

use std::collections::BTreeMap;

use super::*;
use reshard_core::dtype::DType;
use reshard_core::error::{Error, Result};
use reshard_core::fill::Fill;
use reshard_core::layout::LayoutSpec;
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::Plan;
use reshard_core::plan::PlanOptions;
use reshard_core::region::Region;
use reshard_core::testing::{arb_layout_pair, reference_shards};
use reshard_transport::{Fault, Outgoing, Receive, Transport};

fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, dtype, first)
        .unwrap()
}

fn small_chunks(chunk_bytes: usize) -> ExecOptions {
    ExecOptions {
        chunk_bytes,
        staging_bytes: 2 * chunk_bytes,
        timeout: Duration::from_secs(30),
        ..ExecOptions::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    /// Plan + run equals materializing the global tensor and slicing it, byte for byte.
    #[test]
    fn runs_match_the_reference(
        (src, dst) in arb_layout_pair(),
        seed in any::<u64>(),
        chunk_bytes in prop_oneof![Just(1usize), 2usize..48, Just(4 << 20)],
        min_split_bytes in prop_oneof![Just(0u64), Just(64 << 10), 1u64..32],
        checksum in any::<bool>(),
    ) {
        let fill = Fill::Hash { seed };
        let plan = Plan::with_options(src, dst, PlanOptions { min_split_bytes }).unwrap();
        // The library's own fill of the source agrees with the reference's slicing.
        let sources = reference_shards(plan.src(), fill);
        prop_assert_eq!(&fill.shards(plan.src()).unwrap(), &sources);
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        let options = ExecOptions { checksum, ..small_chunks(chunk_bytes) };
        let stats = run_local(&plan, &sources, &mut shards, &options).unwrap();
        prop_assert_eq!(&shards, &reference_shards(plan.dst(), fill));
        let totals = plan.totals();
        prop_assert_eq!(stats.bytes_remote(), totals.bytes_remote);
        prop_assert_eq!(stats.bytes_local(), totals.bytes_local);
    }
}

#[test]
fn bad_buffers_are_rejected_before_any_byte_moves() {
    let src = layout("mesh=2 place=S(0)", &[8, 8], DType::Bf16, 0);
    let dst = layout("mesh=4 place=S(1)", &[8, 8], DType::Bf16, 2);
    let plan = Plan::new(src, dst).unwrap();
    let mut sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    shards.get_mut(&5).unwrap().push(0);
    let err = run_local(&plan, &sources, &mut shards, &ExecOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "dst: rank 5's buffer has 33 bytes, but its shard 8x2 needs 32"
    );
    assert!(
        shards.values().all(|b| b.iter().all(|&x| x == 0)),
        "a byte moved"
    );
    shards.get_mut(&5).unwrap().pop();
    sources.remove(&1);
    let err = run_local(&plan, &sources, &mut shards, &ExecOptions::default()).unwrap_err();
    assert_eq!(err.to_string(), "src: no local buffer given for rank 1");
    let options = ExecOptions {
        chunk_bytes: 64 << 20,
        ..ExecOptions::default()
    };
    let err = run_local(
        &plan,
        &Fill::Index.shards(plan.src()).unwrap(),
        &mut shards,
        &options,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("chunk_bytes: 67108864 is invalid"),
        "{err}"
    );
}

fn faulty_run(fault: Fault) -> Error {
    let src = layout("mesh=4 place=S(0)", &[64, 64], DType::F32, 0);
    let dst = layout("mesh=2 place=S(1)", &[64, 64], DType::F32, 4);
    let plan = Plan::new(src, dst).unwrap();
    let sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    let options = ExecOptions {
        chunk_bytes: 256,
        staging_bytes: 512,
        timeout: Duration::from_millis(300),
        ..ExecOptions::default()
    };
    run_local_with_faults(&plan, &sources, &mut shards, &options, &[fault]).unwrap_err()
}

#[test]
fn a_dead_sender_fails_every_receiver_quickly() {
    let err = faulty_run(Fault::Die {
        rank: 1,
        after_chunks: 3,
    });
    let Error::Incomplete { failures } = &err else {
        panic!("{err}");
    };
    // the dead rank itself and both destinations that needed its rows fail, each saying what
    // did not arrive; senders still feeding a failed destination may fail too
    let text = err.to_string();
    assert!(
        text.contains("rank 1: peer rank 1 is gone: this rank was killed"),
        "{text}"
    );
    for receiver in [4, 5] {
        assert!(
            text.contains(&format!("rank {receiver}: peer rank 1 is gone")),
            "{text}"
        );
        let arrived = format!("rank {receiver}: ");
        assert!(text.matches(&arrived).count() >= 2, "{text}");
    }
    assert!(text.contains("did not arrive"), "{text}");
    // a closed link is noticed at once, as a reset connection: no timeout is waited for
    assert!(
        !failures.iter().any(|e| e.to_string().contains("timed out")),
        "{err}"
    );
}

#[test]
fn a_stalled_sender_times_out_every_receiver() {
    let err = faulty_run(Fault::Stall {
        rank: 2,
        for_: Duration::from_millis(900),
    });
    let text = err.to_string();
    assert!(
        text.contains("rank 4: timed out after 300ms waiting for peer rank 2"),
        "{text}"
    );
    assert!(
        text.contains("rank 5: timed out after 300ms waiting for peer rank 2"),
        "{text}"
    );
}

/// A byte changed on the way lands unnoticed without `--checksum`, and with it fails the
/// receiver, naming the transfer (sender, receiver, offset, extent) and the chunk.
#[test]
fn a_corrupted_chunk_fails_its_receiver_under_checksum() {
    let src = layout("mesh=4 place=S(0)", &[64, 64], DType::F32, 0);
    let dst = layout("mesh=2 place=S(1)", &[64, 64], DType::F32, 4);
    let plan = Plan::new(src, dst).unwrap();
    let sources = Fill::Index.shards(plan.src()).unwrap();
    // rank 4 takes 8 chunks of 256 bytes from each sender: its 11th is the 4th of the second
    let fault = Fault::Corrupt { rank: 4, chunk: 10 };
    let run = |checksum| {
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        let options = ExecOptions {
            chunk_bytes: 256,
            staging_bytes: 512,
            checksum,
            ..ExecOptions::default()
        };
        let ran = run_local_with_faults(&plan, &sources, &mut shards, &options, &[fault]);
        (ran, shards)
    };
    let (ran, shards) = run(false);
    assert!(ran.is_ok(), "{ran:?}");
    assert!(Fill::Index.verify_shards(plan.dst(), &shards).is_err());

    let (ran, _) = run(true);
    let err = ran.unwrap_err();
    let second = plan.rank_plans()[&4].recvs[1].clone();
    let text = err.to_string();
    let named = format!(
        "rank 4: checksum mismatch in the transfer from rank {} to rank 4 at offset {:?} extent 16x32: chunk 2 (bytes 512..768 of the transfer)",
        second.src, second.region.offset
    );
    assert!(text.contains(&named), "{text}");
    // the corrupted transfer is reported as not arrived, the others' data is whole
    assert!(
        text.contains("rank 4: 1 transfers (2048 bytes) did not arrive"),
        "{text}"
    );
    assert!(!text.contains("rank 5"), "{text}");
}

#[test]
fn a_dead_receiver_fails_its_senders() {
    let err = faulty_run(Fault::Die {
        rank: 4,
        after_chunks: 0,
    });
    let text = err.to_string();
    assert!(
        text.contains("rank 4: peer rank 4 is gone: this rank was killed"),
        "{text}"
    );
}

#[test]
fn staging_stays_bounded_for_large_transfers() {
    // 32 MiB through 1 MiB chunks: the local transport copies shard to shard, no staging
    let src = layout("mesh=2 place=S(0)", &[2048, 4096], DType::F32, 0);
    let dst = layout("mesh=2 place=S(1)", &[2048, 4096], DType::F32, 2);
    let plan = Plan::new(src, dst).unwrap();
    let sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards = zeroed_shards(plan.dst()).unwrap();
    let options = ExecOptions {
        chunk_bytes: 1 << 20,
        staging_bytes: 2 << 20,
        ..ExecOptions::default()
    };
    let stats = run_local(&plan, &sources, &mut shards, &options).unwrap();
    assert!(stats.peak_staging_bytes() <= options.staging_bytes as u64);
    assert_eq!(
        stats.ranks.iter().map(|r| r.chunks_received).sum::<u64>(),
        32
    );
    Fill::Index.verify_shards(plan.dst(), &shards).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The gather+broadcast baseline leaves the same destination shards as the reference, and
    /// moves exactly the bytes the plan totals predict for it.
    #[test]
    fn baseline_matches_the_reference(
        (src, dst) in arb_layout_pair(),
        seed in any::<u64>(),
        chunk_bytes in prop_oneof![Just(3usize), Just(4 << 20)],
    ) {
        use crate::exec::baseline::{full_buffers, run_local_gather_broadcast};
        use reshard_core::plan::GatherBroadcast;
        let fill = Fill::Hash { seed };
        let gb = GatherBroadcast::new(&src, &dst).unwrap();
        let mut sources = reference_shards(&src, fill);
        // whatever an earlier repetition left in the buffers must not matter
        let stale = |bufs: &mut BTreeMap<Rank, Vec<u8>>| {
            bufs.values_mut().for_each(|b| b.fill(seed as u8))
        };
        let mut shards = zeroed_shards(&dst).unwrap();
        let mut full = full_buffers(&gb).unwrap();
        stale(&mut shards);
        stale(&mut full);
        let stats = run_local_gather_broadcast(
            &gb, &mut sources, &mut shards, &mut full, &small_chunks(chunk_bytes),
        ).unwrap();
        prop_assert_eq!(&shards, &reference_shards(&dst, fill));
        prop_assert_eq!(&sources, &reference_shards(&src, fill));
        prop_assert_eq!(stats.bytes_remote(), reshard_core::plan::report::gather_broadcast_bytes(&src, &dst));
        prop_assert_eq!(stats.bytes_remote(), gb.wire_bytes());
    }
}

#[test]
fn baseline_rejects_a_missing_full_buffer() {
    use crate::exec::baseline::{full_buffers, run_local_gather_broadcast};
    use reshard_core::plan::GatherBroadcast;
    let src = layout("mesh=2 place=S(0)", &[8, 8], DType::Bf16, 0);
    let dst = layout("mesh=4 place=S(1)", &[8, 8], DType::Bf16, 2);
    let gb = GatherBroadcast::new(&src, &dst).unwrap();
    let mut sources = Fill::Index.shards(&src).unwrap();
    let mut shards = zeroed_shards(&dst).unwrap();
    let mut full = full_buffers(&gb).unwrap();
    assert_eq!(full.len(), 6);
    full.remove(&3);
    let err = run_local_gather_broadcast(
        &gb,
        &mut sources,
        &mut shards,
        &mut full,
        &ExecOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("rank 3"), "{err}");
    assert!(shards.values().all(|s| s.iter().all(|&b| b == 0)));
}

#[test]
fn baseline_of_replicated_sides_moves_what_the_reshard_moves() {
    use crate::exec::baseline::{full_buffers, run_local_gather_broadcast};
    use reshard_core::plan::GatherBroadcast;
    for (src_spec, dst_spec) in [
        ("mesh=2 place=R", "mesh=4 place=R"),
        ("mesh=2 place=S(0)", "mesh=2x2 place=R,R"),
        ("mesh=2 place=R", "mesh=4 place=S(1)"),
    ] {
        let src = layout(src_spec, &[16, 8], DType::F32, 0);
        let dst = layout(dst_spec, &[16, 8], DType::F32, 2);
        let gb = GatherBroadcast::new(&src, &dst).unwrap();
        let mut sources = Fill::Index.shards(&src).unwrap();
        let mut shards = zeroed_shards(&dst).unwrap();
        let mut full = full_buffers(&gb).unwrap();
        // destinations that keep the whole tensor receive it in place
        assert_eq!(
            !full.contains_key(&2),
            gb.keeps_all(2),
            "{src_spec} -> {dst_spec}"
        );
        let stats = run_local_gather_broadcast(
            &gb,
            &mut sources,
            &mut shards,
            &mut full,
            &ExecOptions::default(),
        )
        .unwrap();
        Fill::Index.verify_shards(&dst, &shards).unwrap();
        assert_eq!(stats.bytes_remote(), gb.wire_bytes());
        if src.replication() == 2 && gb.keeps_all(2) {
            let plan = Plan::new(src, dst).unwrap();
            assert_eq!(stats.bytes_remote(), plan.totals().bytes_remote);
        }
    }
}

/// A transport that lands a rank's receives out of order, every other one, and then fails:
/// the executor's report must name exactly the transfers that did not land.
struct LandsEveryOther;

impl<'buf> Transport<'buf> for LandsEveryOther {
    fn name(&self) -> &'static str {
        "every-other"
    }

    fn sends_block(&self) -> bool {
        false
    }

    fn send(&self, _: Outgoing<'buf>) -> Result<()> {
        Ok(())
    }

    fn recv(&self, chunk: reshard_transport::Incoming<'_>) -> Result<()> {
        Err(Error::Internal {
            rank: chunk.to,
            detail: "not used".into(),
        })
    }

    fn recv_all(
        &self,
        expected: &[Receive<'_>],
        _: &mut [&mut [u8]],
        _: usize,
        landed: &mut dyn FnMut(usize),
    ) -> Result<()> {
        (0..expected.len())
            .rev()
            .filter(|i| i % 2 == 1)
            .for_each(landed);
        Err(Error::PeerGone {
            rank: expected[0].to,
            peer: expected[0].from,
            detail: "gone".into(),
        })
    }
}

#[test]
fn transfers_that_land_out_of_order_are_accounted_one_by_one() {
    // rank 4 receives a row block from each of ranks 0-3
    let src = layout("mesh=4 place=S(1)", &[8, 8], DType::F32, 0);
    let dst = layout("mesh=1 place=R", &[8, 8], DType::F32, 4);
    let plan = Plan::new(src.clone(), dst.clone()).unwrap();
    let mine = plan.for_rank(4);
    assert_eq!(mine.recvs.len(), 4);
    let mut shard = vec![0u8; dst.local_bytes(4) as usize];
    let dst_box = dst.local_region(4).unwrap();
    let work = RankJob {
        plan: &mine,
        src_layout: &src,
        src: None,
        dst: Some((&dst_box, &mut shard)),
        dst_dtype: dst.dtype(),
        quant: None,
    };
    let err = run_rank(work, &LandsEveryOther, &ExecOptions::default()).unwrap_err();
    // the even places of the schedule never landed
    let mut missing: Vec<Rank> = [0, 2].iter().map(|&i| mine.recvs[i].src).collect();
    missing.sort_unstable();
    let Error::Incomplete { failures } = err else {
        panic!("{err}");
    };
    let Some(Error::NotArrived {
        transfers,
        from,
        bytes,
        ..
    }) = failures.get(1)
    else {
        panic!("{failures:?}");
    };
    assert_eq!(*transfers, 2);
    assert_eq!(*bytes, 2 * 8 * 2 * 4);
    let mut from = from.clone();
    from.sort_unstable();
    assert_eq!(from, missing);
}

/// A transport that reports its first transfer landed twice and the rest once, and returns
/// as if all went well: the rank must refuse the duplicate rather than count its bytes twice.
struct LandsFirstTwice;

impl<'buf> Transport<'buf> for LandsFirstTwice {
    fn name(&self) -> &'static str {
        "first-twice"
    }

    fn sends_block(&self) -> bool {
        false
    }

    fn send(&self, _: Outgoing<'buf>) -> Result<()> {
        Ok(())
    }

    fn recv(&self, chunk: reshard_transport::Incoming<'_>) -> Result<()> {
        Err(Error::Internal {
            rank: chunk.to,
            detail: "not used".into(),
        })
    }

    fn recv_all(
        &self,
        expected: &[Receive<'_>],
        _: &mut [&mut [u8]],
        _: usize,
        landed: &mut dyn FnMut(usize),
    ) -> Result<()> {
        landed(0);
        (0..expected.len()).for_each(landed);
        Ok(())
    }
}

#[test]
fn a_transfer_reported_twice_fails_the_rank() {
    let src = layout("mesh=4 place=S(1)", &[8, 8], DType::F32, 0);
    let dst = layout("mesh=1 place=R", &[8, 8], DType::F32, 4);
    let plan = Plan::new(src.clone(), dst.clone()).unwrap();
    let mine = plan.for_rank(4);
    let mut shard = vec![0u8; dst.local_bytes(4) as usize];
    let dst_box = dst.local_region(4).unwrap();
    let work = RankJob {
        plan: &mine,
        src_layout: &src,
        src: None,
        dst: Some((&dst_box, &mut shard)),
        dst_dtype: dst.dtype(),
        quant: None,
    };
    let err = run_rank(work, &LandsFirstTwice, &ExecOptions::default()).unwrap_err();
    // every transfer landed once: the error is the duplicate alone, with no report missing
    assert!(
        matches!(&err, Error::Protocol { rank: 4, peer, detail }
            if *peer == mine.recvs[0].src && detail.contains("landed twice")),
        "{err}"
    );
}

/// The byte ranges, in a 2-D destination shard whose box is `shard`, of the rows of `block`
/// (a box inside it), top to bottom.
fn block_rows(shard: &Region, block: &Region, elem: usize) -> Vec<std::ops::Range<usize>> {
    let cols = shard.extent[1] as usize;
    let (row0, col0) = (
        (block.offset[0] - shard.offset[0]) as usize,
        (block.offset[1] - shard.offset[1]) as usize,
    );
    let width = block.extent[1] as usize;
    (0..block.extent[0] as usize)
        .map(|r| {
            let start = ((row0 + r) * cols + col0) * elem;
            start..start + width * elem
        })
        .collect()
}

/// Swaps the bytes of two equally shaped blocks of `buf`, given by their rows.
fn swap_blocks(buf: &mut [u8], a: &[std::ops::Range<usize>], b: &[std::ops::Range<usize>]) {
    for (ra, rb) in a.iter().zip(b) {
        let saved = buf[ra.clone()].to_vec();
        buf.copy_within(rb.clone(), ra.start);
        buf[rb.clone()].copy_from_slice(&saved);
    }
}

/// A real plan's result, verified under `fill`, then disturbed by `disturb` on `rank`'s shard:
/// the verification's verdict on it.
fn verdict_after(
    plan: &Plan,
    fill: Fill,
    rank: Rank,
    disturb: impl FnOnce(&Plan, &mut [u8]),
) -> Result<()> {
    let sources = fill.shards(plan.src())?;
    let mut shards = zeroed_shards(plan.dst())?;
    run_local(plan, &sources, &mut shards, &ExecOptions::default()).unwrap();
    fill.verify_shards(plan.dst(), &shards).unwrap();
    disturb(plan, shards.get_mut(&rank).unwrap());
    fill.verify_shards(plan.dst(), &shards)
}

/// The two transfers that land in `rank`'s shard, as rows of its buffer.
fn two_landing_spots(plan: &Plan, rank: Rank) -> [Vec<std::ops::Range<usize>>; 2] {
    let shard = plan.dst().local_region(rank).unwrap();
    let elem = plan.elem_bytes();
    let spots: Vec<_> = plan
        .transfers()
        .iter()
        .filter(|t| t.dst == rank)
        .map(|t| block_rows(&shard, &t.region, elem))
        .collect();
    assert_eq!(spots.len(), 2, "{:?}", plan.transfers());
    [spots[0].clone(), spots[1].clone()]
}

/// For every dtype, under the default fill: two transfers that land in each other's place, a
/// block copied one row off, and a single flipped byte are each caught, and named.
#[test]
fn the_default_fill_catches_misplaced_blocks_and_flipped_bytes_for_every_dtype() {
    for dtype in DType::ALL {
        // rank 3 gets a 4x16 block from each source: rows 0..4 from rank 0, 4..8 from rank 1
        let src = layout("mesh=2 place=S(0)", &[8, 64], dtype, 0);
        let dst = layout("mesh=4 place=S(1)", &[8, 64], dtype, 2);
        let plan = Plan::new(src, dst).unwrap();
        let fill = Fill::default();
        let elem = dtype.size();

        let swapped = verdict_after(&plan, fill, 3, |plan, buf| {
            let [a, b] = two_landing_spots(plan, 3);
            swap_blocks(buf, &a, &b);
        });
        assert!(
            matches!(swapped, Err(Error::VerifyFailed { rank: 3, .. })),
            "{dtype}: two swapped transfers: {swapped:?}"
        );

        // local row 1 copied over row 0: one row of 16 elements, off by one row
        let shifted = verdict_after(&plan, fill, 3, |_, buf| {
            buf.copy_within(16 * elem..32 * elem, 0);
        });
        assert!(
            matches!(shifted, Err(Error::VerifyFailed { rank: 3, .. })),
            "{dtype}: a row shifted by one: {shifted:?}"
        );

        let at = 5 * 16 * elem + elem - 1;
        let flipped = verdict_after(&plan, fill, 4, |_, buf| buf[at] ^= 0xff);
        assert!(
            matches!(
                flipped,
                Err(Error::VerifyFailed { rank: 4, offset, mismatches: 1, .. }) if offset == at as u64
            ),
            "{dtype}: a flipped byte: {flipped:?}"
        );
    }
}

/// The issue that made `hash` the default: with 8192 columns of bf16, the index fill repeats
/// every 8 rows, so rows r and r + 8 swapped verify under `index`; under the default fill they
/// do not.
#[test]
fn rows_eight_apart_swapped_pass_the_index_fill_but_not_the_default() {
    let src = layout("mesh=2 place=S(0)", &[16, 8192], DType::Bf16, 0);
    let dst = layout("mesh=1 place=R", &[16, 8192], DType::Bf16, 2);
    let plan = Plan::new(src, dst).unwrap();
    let swap = |plan: &Plan, buf: &mut [u8]| {
        let [a, b] = two_landing_spots(plan, 2);
        swap_blocks(buf, &a, &b);
    };
    assert!(verdict_after(&plan, Fill::Index, 2, swap).is_ok());
    let caught = verdict_after(&plan, Fill::default(), 2, swap);
    assert!(
        matches!(
            caught,
            Err(Error::VerifyFailed { rank: 2, offset: 0, mismatches, .. }) if mismatches > 8192
        ),
        "{caught:?}"
    );
}

/// `layout` with elements of `dtype`.
fn retyped(layout: &Layout, dtype: DType) -> Layout {
    Layout::new(
        layout.shape().to_vec(),
        dtype,
        layout.mesh().clone(),
        layout.placements().to_vec(),
    )
    .unwrap()
}

const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::Bf16, DType::F16];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    /// With `--dst-dtype`, senders and local copies cast while they copy: every destination
    /// element is the source's fill cast exactly, at any chunk size (cut to whole elements),
    /// with and without checksums, and the byte counts are destination bytes.
    #[test]
    fn converting_runs_match_the_cast_fill(
        (src, dst) in arb_layout_pair(),
        from in prop::sample::select(FLOATS.to_vec()),
        to in prop::sample::select(FLOATS.to_vec()),
        seed in any::<u64>(),
        chunk_bytes in prop_oneof![Just(1usize), 2usize..48, Just(4 << 20)],
        checksum in any::<bool>(),
    ) {
        let fill = Fill::Hash { seed };
        let plan = Plan::new(retyped(&src, from), retyped(&dst, to)).unwrap();
        let sources = fill.shards(plan.src()).unwrap();
        let mut shards = zeroed_shards(plan.dst()).unwrap();
        let options = ExecOptions { checksum, ..small_chunks(chunk_bytes) };
        let stats = run_local(&plan, &sources, &mut shards, &options).unwrap();
        prop_assert!(fill.verify_shards_converted(from, plan.dst(), &shards).is_ok());
        let totals = plan.totals();
        prop_assert_eq!(stats.bytes_remote(), totals.bytes_remote);
        prop_assert_eq!(stats.bytes_local(), totals.bytes_local);
        prop_assert_eq!(
            stats.bytes_remote() + stats.bytes_local(),
            plan.dst().shard_bytes()
        );
    }
}

#[test]
fn converted_chunks_hold_whole_elements() {
    assert_eq!(cut_chunk(1, false), 1);
    assert_eq!(cut_chunk(13, false), 13);
    assert_eq!(cut_chunk(1, true), 8);
    assert_eq!(cut_chunk(13, true), 8);
    assert_eq!(cut_chunk(4 << 20, true), 4 << 20);
}

#[test]
fn integer_and_unscaled_fp8_destinations_are_refused_by_the_plan() {
    let src = layout("mesh=2 place=S(0)", &[8, 8], DType::F32, 0);
    for to in [DType::I32, DType::Bool, DType::Fp8E4M3, DType::U8] {
        let dst = layout("mesh=4 place=S(1)", &[8, 8], to, 2);
        let err = Plan::new(src.clone(), dst).unwrap_err();
        assert!(matches!(err, Error::Convert { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("dst_dtype") && text.contains(&to.to_string()),
            "{text}"
        );
    }
}
