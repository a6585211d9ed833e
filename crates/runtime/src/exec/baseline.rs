//! Runs the gather+broadcast baseline ([`GatherBroadcast`]) on the same executor and transports
//! as a reshard: the gather and the broadcast are two reshards into a full-tensor buffer, then
//! every destination rank copies its box out of the full tensor.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{ExecOptions, RankJob, RankStats, RunStats, check_buffers, run_local, run_rank_any};
use crate::exec::threads::{RankThread, joined};
use reshard_core::copy::{Cast, CopyGeometry, Place};
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::plan::{GatherBroadcast, RankPlan};
use reshard_core::region::Region;
use reshard_transport::Transport;

/// One rank's part of the baseline: its plans for both phases and its buffers.
pub struct BaselineJob<'a> {
    pub baseline: &'a GatherBroadcast,
    /// This rank's part of the gather, if it gathers.
    pub gather: Option<&'a RankPlan>,
    /// This rank's part of the broadcast, if it sends or receives in it.
    pub broadcast: Option<&'a RankPlan>,
    /// The rank's source box and shard, if it is a source.
    pub src: Option<(&'a Region, &'a [u8])>,
    /// A buffer of the whole tensor, if [`GatherBroadcast::needs_full_buffer`] says so.
    pub full: Option<&'a mut [u8]>,
    /// The rank's destination box and shard, if it is a destination.
    pub dst: Option<(&'a Region, &'a mut [u8])>,
}

/// Runs one rank's part of the baseline over `transport`: gather, broadcast, keep.
pub fn run_rank_gather_broadcast<T>(
    rank: Rank,
    job: BaselineJob<'_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let BaselineJob {
        baseline,
        gather,
        broadcast,
        src,
        full,
        dst,
    } = job;
    check_full(baseline, rank, full.as_ref().map(|f| f.len()))?;
    // A rank that keeps the whole tensor gathers or receives it straight into its shard.
    let (mut full, dst) = match (full, dst) {
        (None, Some((_, d))) if baseline.gets_tensor(rank) => (Some(d), None),
        (full, dst) => (full, dst),
    };
    let dst_layout = baseline.dst();
    let whole = Region::full(dst_layout.shape());
    let elem_bytes = dst_layout.dtype().size();
    let mut stats = RankStats {
        rank,
        ..RankStats::default()
    };
    let mut add = |s: RankStats| stats.absorb(&s);
    if let (Some(plan), Some(gather)) = (gather, &baseline.gather) {
        let work = RankJob {
            quant: None,
            plan,
            src_layout: gather.src(),
            src,
            dst: full.as_deref_mut().map(|f| (&whole, f)),
            dst_dtype: gather.dst().dtype(),
        };
        add(run_rank_any(work, transport, options)?);
    }
    // The tensor a holder broadcasts and keeps from: its gathered copy, or its source shard
    // when the source is fully replicated.
    let holds_all = baseline.holders.binary_search(&rank).is_ok();
    if let (Some(plan), Some(broadcast)) = (broadcast, &baseline.broadcast) {
        let (send_from, receive_into) = if holds_all {
            (full.as_deref().or(src.map(|s| s.1)), None)
        } else {
            (None, full.as_deref_mut())
        };
        let work = RankJob {
            quant: None,
            plan,
            src_layout: broadcast.src(),
            src: send_from.map(|s| (&whole, s)),
            dst: receive_into.map(|f| (&whole, f)),
            dst_dtype: broadcast.dst().dtype(),
        };
        add(run_rank_any(work, transport, options)?);
    }
    if let Some((dst_box, dst)) = dst {
        let tensor = full.as_deref().or(src.filter(|_| holds_all).map(|s| s.1));
        let Some(tensor) = tensor else {
            return Err(Error::MissingBuffer {
                side: Side::Dst,
                rank,
            });
        };
        stats.bytes_local += keep_slice(tensor, &whole, dst_box, dst, elem_bytes, baseline.cast());
    }
    Ok(stats)
}

/// Copies `rank`'s destination box out of the full tensor in `full`, converting it with
/// `cast` when the destination has a dtype of its own (`elem_bytes` is the destination's).
pub fn keep_slice(
    full: &[u8],
    whole: &Region,
    dst_box: &Region,
    dst: &mut [u8],
    elem_bytes: usize,
    cast: Option<Cast>,
) -> u64 {
    let g = CopyGeometry::converting(
        dst_box,
        Place::Within(whole),
        Place::Within(dst_box),
        elem_bytes,
        cast,
    );
    g.copy(full, dst, 0..g.len());
    g.len() as u64
}

/// Checks a rank's full-tensor buffer before any byte moves.
fn check_full(baseline: &GatherBroadcast, rank: Rank, full: Option<usize>) -> Result<()> {
    let expected = baseline.full_bytes();
    match (baseline.needs_full_buffer(rank), full) {
        (true, None) => Err(Error::MissingBuffer {
            side: Side::Dst,
            rank,
        }),
        // a rank that keeps the whole tensor may still receive it apart from its shard
        (false, Some(_)) if !baseline.gets_tensor(rank) => Err(Error::UnexpectedBuffer {
            side: Side::Dst,
            rank,
        }),
        (_, Some(got)) if got as u64 != expected => Err(Error::BufferSize {
            side: Side::Dst,
            rank,
            extent: reshard_core::error::Dims(baseline.dst().shape().to_vec()),
            expected,
            got: got as u64,
        }),
        _ => Ok(()),
    }
}

/// A zeroed full-tensor buffer for every rank that needs one; [`Error::OutOfMemory`] when
/// they do not fit in memory.
pub fn full_buffers(baseline: &GatherBroadcast) -> Result<BTreeMap<Rank, Vec<u8>>> {
    let bytes = baseline.full_bytes();
    let mut out = BTreeMap::new();
    for r in baseline.ranks() {
        if baseline.needs_full_buffer(r) {
            let buf = reshard_core::memory::zeroed(bytes, || format!("rank {r}'s full tensor"))?;
            out.insert(r, buf);
        }
    }
    Ok(out)
}

/// Runs the whole baseline with every rank as a thread of this process (the `local`
/// transport), phase after phase. `full` comes from [`full_buffers`]; buffers move between
/// the phases' maps and are all back in place on return, also on error.
pub fn run_local_gather_broadcast(
    baseline: &GatherBroadcast,
    src: &mut BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    full: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    options.validate()?;
    check_buffers(baseline.dst(), Side::Dst, dst)?;
    for rank in baseline.ranks() {
        check_full(baseline, rank, full.get(&rank).map(Vec::len))?;
    }
    let started = Instant::now();
    let mut per_rank: BTreeMap<Rank, RankStats> = BTreeMap::new();
    let mut add = |stats: RunStats| {
        for s in stats.ranks {
            per_rank
                .entry(s.rank)
                .or_insert(RankStats {
                    rank: s.rank,
                    ..RankStats::default()
                })
                .absorb(&s);
        }
    };
    if let Some(gather) = &baseline.gather {
        let members = gather.src().mesh().ranks();
        let mut sources = take(src, members);
        let (mut targets, in_place) = take_tensors(baseline, full, dst, members);
        let ran = run_local(gather, &sources, &mut targets, options);
        src.append(&mut sources);
        put_back(targets, &in_place, full, dst);
        add(ran?);
    }
    if let Some(broadcast) = &baseline.broadcast {
        let holders = broadcast.src().mesh().ranks();
        let (sources, in_place) = if baseline.gather.is_some() {
            take_tensors(baseline, full, dst, holders)
        } else {
            (take(src, holders), Vec::new())
        };
        let (mut targets, received_in_place) =
            take_tensors(baseline, full, dst, broadcast.dst().mesh().ranks());
        let ran = run_local(broadcast, &sources, &mut targets, options);
        if baseline.gather.is_some() {
            put_back(sources, &in_place, full, dst);
        } else {
            src.extend(sources);
        }
        put_back(targets, &received_in_place, full, dst);
        add(ran?);
    }
    // every destination rank keeps its box, all at once as separate processes would
    let whole = Region::full(baseline.dst().shape());
    let elem_bytes = baseline.dst().dtype().size();
    let cast = baseline.cast();
    let layout = baseline.dst();
    let kept: Vec<(Rank, Result<u64>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = dst
            .iter_mut()
            .filter(|(rank, _)| !(baseline.keeps_all(**rank) && baseline.gets_tensor(**rank)))
            .map(|(&rank, shard)| {
                let tensor = full
                    .get(&rank)
                    .or_else(|| src.get(&rank))
                    .map(Vec::as_slice);
                let dst_box = layout.local_region(rank);
                let whole = &whole;
                let cast = cast.clone();
                (
                    rank,
                    std::thread::Builder::new().spawn_scoped(scope, move || {
                        match (tensor, dst_box) {
                            (Some(t), Some(dst_box)) if t.len() as u64 == baseline.full_bytes() => {
                                Ok(keep_slice(t, whole, &dst_box, shard, elem_bytes, cast))
                            }
                            _ => Err(Error::MissingBuffer {
                                side: Side::Dst,
                                rank,
                            }),
                        }
                    }),
                )
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, h)| (rank, joined(h, rank, RankThread::Rank)))
            .collect()
    });
    let mut kept_stats = RunStats::default();
    for (rank, k) in kept {
        kept_stats.ranks.push(RankStats {
            rank,
            bytes_local: k?,
            ..RankStats::default()
        });
    }
    add(kept_stats);
    Ok(RunStats {
        elapsed: started.elapsed(),
        ranks: per_rank.into_values().collect(),
    })
}

/// Moves the whole-tensor buffers of `ranks` out of `full`, or out of `dst` for the ranks that
/// keep the whole tensor in their shard (returned second).
fn take_tensors(
    baseline: &GatherBroadcast,
    full: &mut BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    ranks: &[Rank],
) -> (BTreeMap<Rank, Vec<u8>>, Vec<Rank>) {
    let in_place: Vec<Rank> = ranks
        .iter()
        .copied()
        .filter(|&r| !baseline.needs_full_buffer(r))
        .collect();
    let mut taken = take(full, ranks);
    taken.append(&mut take(dst, &in_place));
    (taken, in_place)
}

/// Undoes [`take_tensors`].
fn put_back(
    mut taken: BTreeMap<Rank, Vec<u8>>,
    in_place: &[Rank],
    full: &mut BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
) {
    dst.append(&mut take(&mut taken, in_place));
    full.append(&mut taken);
}

/// Moves the buffers of `ranks` out of `from`.
fn take(from: &mut BTreeMap<Rank, Vec<u8>>, ranks: &[Rank]) -> BTreeMap<Rank, Vec<u8>> {
    ranks
        .iter()
        .filter_map(|r| from.remove(r).map(|b| (*r, b)))
        .collect()
}
