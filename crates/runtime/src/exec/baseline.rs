//! Runs the gather+broadcast baseline ([`GatherBroadcast`]) on the same executor and transports
//! as a reshard: the gather and the broadcast are two reshards into a full-tensor buffer, then
//! every destination rank copies its box out of the full tensor; all three phases of one
//! program ([`super::lower::lower_gather_broadcast`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::driver::{RankRun, run_threads};
use super::executor::run_program;
use super::lower::{BaselineParts, Slot, lower_gather_broadcast};
use super::program::Buf;
use super::{ExecOptions, RankStats, RunStats, check_buffers};
use reshard_core::copy::{Cast, CopyGeometry, Place};
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::plan::{GatherBroadcast, RankPlan};
use reshard_core::region::Region;
use reshard_transport::Transport;

/// One rank's part of the baseline: its plans for both phases and its buffers.
pub struct BaselineJob<'a> {
    /// The tensor's gather+broadcast.
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

bench_pub! {
/// Runs one rank's part of the baseline over `transport`: gather, broadcast, keep, as the
/// program lowered from its parts ([`lower_gather_broadcast`]).
fn run_rank_gather_broadcast<T>(
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
    let whole = Region::full(baseline.dst().shape());
    let parts = BaselineParts {
        rank,
        baseline,
        gather,
        broadcast,
        src: src.map(|(region, s)| Slot {
            region: Cow::Borrowed(region),
            buf: Buf::Src(0),
            bytes: 0..s.len(),
        }),
        full: full.as_ref().map(|f| (Buf::Dst(1), 0..f.len())),
        dst: dst.as_ref().map(|(region, d)| Slot {
            region: Cow::Borrowed(*region),
            buf: Buf::Dst(0),
            bytes: 0..d.len(),
        }),
        whole: Cow::Borrowed(&whole),
    };
    let program = lower_gather_broadcast(parts, options)?;
    let src: Vec<&[u8]> = src.map(|s| s.1).into_iter().collect();
    let mut dst = vec![dst.map_or(&mut [][..], |d| d.1), full.unwrap_or_default()];
    run_program(&program, &src, &mut dst, transport, options)
}
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

bench_pub! {
/// Runs the whole baseline with every rank as a thread of this process (the `local`
/// transport), phase after phase. `full` comes from [`full_buffers`].
fn run_local_gather_broadcast(
    baseline: &GatherBroadcast,
    src: &mut BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    full: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    options.validate()?;
    check_buffers(baseline.dst(), Side::Dst, dst)?;
    let ranks = baseline.ranks();
    for &rank in &ranks {
        check_full(baseline, rank, full.get(&rank).map(Vec::len))?;
    }
    // the source shards the phases read: the gathered replica's, or the holders' whole tensor
    let src_layout = match (&baseline.gather, &baseline.broadcast) {
        (Some(g), _) => Some(g.src()),
        (None, Some(b)) => Some(b.src()),
        (None, None) => None,
    };
    let whole = Region::full(baseline.dst().shape());
    let src_boxes: BTreeMap<Rank, Region> = ranks
        .iter()
        .filter_map(|&r| {
            let b = match src_layout {
                Some(l) => l.local_region(r),
                None => baseline
                    .holders
                    .binary_search(&r)
                    .is_ok()
                    .then(|| whole.clone()),
            };
            Some((r, b?))
        })
        .collect();
    if let Some(l) = src_layout {
        check_held(l, src)?;
    }
    let parts: BTreeMap<Rank, (Option<RankPlan>, Option<RankPlan>)> =
        ranks.iter().map(|&r| (r, baseline.rank_parts(r))).collect();
    let mut dsts: BTreeMap<Rank, &mut Vec<u8>> = dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut fulls: BTreeMap<Rank, &mut Vec<u8>> = full.iter_mut().map(|(&r, b)| (r, b)).collect();
    let dst_boxes: BTreeMap<Rank, Region> = ranks
        .iter()
        .filter_map(|&r| Some((r, baseline.dst().local_region(r)?)))
        .collect();
    let mut runs = Vec::with_capacity(ranks.len());
    for &rank in &ranks {
        let (gather, broadcast) = &parts[&rank];
        let shard = src
            .get(&rank)
            .map(Vec::as_slice)
            .filter(|_| src_boxes.contains_key(&rank));
        let d = dsts.remove(&rank).map(Vec::as_mut_slice);
        let f = fulls.remove(&rank).map(Vec::as_mut_slice);
        let dst_box = dst_boxes.get(&rank);
        let program = {
            let parts = BaselineParts {
                rank,
                baseline,
                gather: gather.as_ref(),
                broadcast: broadcast.as_ref(),
                src: src_boxes.get(&rank).zip(shard).map(|(region, s)| Slot {
                    region: Cow::Borrowed(region),
                    buf: Buf::Src(0),
                    bytes: 0..s.len(),
                }),
                full: f.as_ref().map(|f| (Buf::Dst(1), 0..f.len())),
                dst: d.as_ref().and(dst_box).map(|region| Slot {
                    region: Cow::Borrowed(region),
                    buf: Buf::Dst(0),
                    bytes: 0..d.as_ref().map_or(0, |d| d.len()),
                }),
                whole: Cow::Borrowed(&whole),
            };
            lower_gather_broadcast(parts, options)?
        };
        runs.push(RankRun {
            program,
            src: shard.into_iter().collect(),
            dst: vec![d.unwrap_or_default(), f.unwrap_or_default()],
        });
    }
    run_threads(runs, options, &[])
}
}

/// Checks that every rank of `layout` has a source buffer of its shard's size (other ranks'
/// buffers, of replicas that take no part, are left alone).
fn check_held(layout: &reshard_core::Layout, src: &BTreeMap<Rank, Vec<u8>>) -> Result<()> {
    for &r in layout.mesh().ranks() {
        let expected = layout.local_bytes(r);
        match src.get(&r) {
            None => {
                return Err(Error::MissingBuffer {
                    side: Side::Src,
                    rank: r,
                });
            }
            Some(b) if b.len() as u64 != expected => {
                return Err(Error::BufferSize {
                    side: Side::Src,
                    rank: r,
                    extent: reshard_core::error::Dims(
                        layout.local_region(r).map(|b| b.extent).unwrap_or_default(),
                    ),
                    expected,
                    got: b.len() as u64,
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}
