//! Runs a whole plan with every rank as a thread of this process: each rank's part lowered
//! to its program, all run by the one driver ([`super::driver`]).

use reshard_core::error::Field;
use std::collections::BTreeMap;
use std::time::Instant;

use super::driver::{RankRun, run_threads};
use super::lower::{PlanJob, QuantParts, Slot, lower_plan};
use super::options::ExecOptions;
use super::program::Buf;
use super::stats::RunStats;
use super::steps::check_buffers;
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{Plan, QuantRankPlan};
use reshard_core::region::Region;
use reshard_transport::Fault;

bench_pub! {
/// Runs a whole plan with every rank as a thread of this process (the `local` transport).
/// `src` holds every source rank's shard, `dst` every destination rank's shard (written in
/// place). Buffers are checked before any byte moves; on failure the error lists every rank
/// that did not complete.
///
/// ```
/// use std::collections::BTreeMap;
/// use reshard_core::{DType, Plan, fill::Fill, layout::LayoutSpec};
/// use reshard_runtime::exec;
/// let shape = [8, 8];
/// let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&shape, DType::Bf16, 0).unwrap();
/// let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&shape, DType::Bf16, 2).unwrap();
/// let plan = Plan::new(src, dst).unwrap();
/// let srcs = Fill::Index.shards(plan.src()).unwrap();
/// let mut dsts = exec::zeroed_shards(plan.dst()).unwrap();
/// exec::run_local(&plan, &srcs, &mut dsts, &exec::ExecOptions::default()).unwrap();
/// assert!(Fill::Index.verify_shards(plan.dst(), &dsts).is_ok());
/// ```
fn run_local(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    run_local_with_faults(plan, src, dst, options, &[])
}
}

bench_pub! {
/// [`run_local`] of a quantizing plan ([`Plan::quantized`]): `dst` receives the fp8 values
/// and `scales` every destination rank's scale shard ([`zeroed_scale_shards`]), row-major in
/// the scale dtype.
fn run_local_quantized(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    scales: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    run_local_all(plan, src, dst, Some(scales), options, &[])
}
}

/// Most ranks `run_local` runs (two threads each); see [`reshard_core::limits`].
pub use reshard_core::limits::MAX_LOCAL_RANKS;

bench_pub! {
/// [`run_local`] with injected faults, for testing failure handling.
fn run_local_with_faults(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<RunStats> {
    run_local_all(plan, src, dst, None, options, faults)
}
}

fn run_local_all(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    scales: Option<&mut BTreeMap<Rank, Vec<u8>>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<RunStats> {
    options.validate()?;
    check_buffers(plan.src(), Side::Src, src)?;
    check_buffers(plan.dst(), Side::Dst, dst)?;
    let scales = match (plan.quant(), scales) {
        (None, None) => None,
        (Some(q), Some(scales)) => {
            check_scale_buffers(plan, q, scales)?;
            Some(scales)
        }
        (Some(q), None) => {
            return Err(Error::InvalidOption {
                field: Field::Quant,
                value: q.quant.scheme.to_string(),
                reason: "a quantizing plan writes scales too: give it their buffers".into(),
            });
        }
        (None, Some(_)) => {
            return Err(Error::InvalidOption {
                field: Field::Quant,
                value: "none".into(),
                reason: "scale buffers were given for a plan that does not quantize".into(),
            });
        }
    };
    let ranks = plan.ranks();
    if ranks.len() > MAX_LOCAL_RANKS {
        return Err(Error::InvalidOption {
            field: Field::Transport,
            value: "local".into(),
            reason: format!(
                "local runs every rank as threads of one process, and {} ranks is over its limit of {MAX_LOCAL_RANKS}",
                ranks.len()
            ),
        });
    }
    let rank_plans = plan.rank_plans();
    let src_boxes: BTreeMap<Rank, Region> = regions(plan.src());
    let dst_boxes: BTreeMap<Rank, Region> = regions(plan.dst());
    // quantizing: every rank's part of the scales and of the amax exchange
    let quant_parts: BTreeMap<Rank, QuantRankPlan> = match plan.quant() {
        Some(q) => rank_plans
            .values()
            .map(|rp| (rp.rank, q.for_rank(plan.src(), plan.dst(), rp)))
            .collect(),
        None => BTreeMap::new(),
    };
    let mut dst_shards: BTreeMap<Rank, &mut Vec<u8>> =
        dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut scale_shards: BTreeMap<Rank, &mut [u8]> = scales
        .map(|m| m.iter_mut().map(|(&r, b)| (r, b.as_mut_slice())).collect())
        .unwrap_or_default();
    fn slot(boxes: &BTreeMap<Rank, Region>, rank: Rank, buf: Buf, len: usize) -> Option<Slot<'_>> {
        boxes.get(&rank).map(|region| Slot {
            region: std::borrow::Cow::Borrowed(region),
            buf,
            bytes: 0..len,
        })
    }
    let mut runs = Vec::with_capacity(ranks.len());
    for &rank in &ranks {
        let src_shard = src.get(&rank).map(Vec::as_slice);
        let dst_shard = dst_shards.remove(&rank).map(Vec::as_mut_slice);
        let scale_shard = scale_shards.remove(&rank);
        let job = PlanJob {
            plan: &rank_plans[&rank],
            src_layout: plan.src(),
            dst_dtype: plan.dst().dtype(),
            src: slot(
                &src_boxes,
                rank,
                Buf::Src(0),
                src_shard.map_or(0, <[u8]>::len),
            ),
            dst: slot(
                &dst_boxes,
                rank,
                Buf::Dst(0),
                dst_shard.as_ref().map_or(0, |d| d.len()),
            ),
            quant: plan.quant().map(|q| QuantParts {
                tensor: "tensor",
                plan: q,
                rank: &quant_parts[&rank],
                scales: scale_shard.as_ref().map(|_| Buf::Dst(1)),
            }),
        };
        let program = lower_plan(&job, options)?;
        let mut dst_bufs: Vec<&mut [u8]> = vec![dst_shard.unwrap_or_default()];
        dst_bufs.extend(scale_shard);
        runs.push(RankRun {
            program,
            src: src_shard.into_iter().collect(),
            dst: dst_bufs,
        });
    }
    tracing::debug!(
        ranks = ranks.len(),
        transfers = plan.transfers().len(),
        chunk_bytes = options.chunk_bytes,
        "local run"
    );
    let started = Instant::now();
    let stats = run_threads(runs, options, faults);
    let elapsed = started.elapsed();
    let stats = stats?;
    tracing::debug!(?elapsed, bytes = stats.bytes_remote(), "local run done");
    Ok(stats)
}

fn regions(layout: &Layout) -> BTreeMap<Rank, Region> {
    layout
        .mesh()
        .ranks()
        .iter()
        .enumerate()
        .map(|(p, &r)| (r, layout.region_at(p)))
        .collect()
}

/// Checks that `scales` holds exactly every destination rank's scale shard of `q`.
fn check_scale_buffers(
    plan: &Plan,
    q: &reshard_core::plan::QuantPlan,
    scales: &BTreeMap<Rank, Vec<u8>>,
) -> Result<()> {
    let dst = plan.dst();
    if let Some(&r) = scales.keys().find(|r| dst.local_region(**r).is_none()) {
        return Err(Error::UnexpectedBuffer {
            side: Side::Dst,
            rank: r,
        });
    }
    for &r in dst.mesh().ranks() {
        let blocks = q.dst_scale_box(dst, r).expect("a destination rank");
        let expected = q.dst_scale_bytes(dst, r);
        match scales.get(&r) {
            None => {
                return Err(Error::MissingBuffer {
                    side: Side::Dst,
                    rank: r,
                });
            }
            Some(b) if b.len() as u64 != expected => {
                return Err(Error::BufferSize {
                    side: Side::Dst,
                    rank: r,
                    extent: reshard_core::error::Dims(blocks.extent),
                    expected,
                    got: b.len() as u64,
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A zero-filled scale shard for every destination rank of a quantizing plan (none for a
/// plan that does not quantize).
pub fn zeroed_scale_shards(plan: &Plan) -> Result<BTreeMap<Rank, Vec<u8>>> {
    let Some(q) = plan.quant() else {
        return Ok(BTreeMap::new());
    };
    let mut out = BTreeMap::new();
    for &r in plan.dst().mesh().ranks() {
        let buf = reshard_core::memory::zeroed(q.dst_scale_bytes(plan.dst(), r), || {
            format!("rank {r}'s scale shard")
        })?;
        out.insert(r, buf);
    }
    Ok(out)
}

/// A zero-filled local buffer for every rank of `layout`; [`Error::OutOfMemory`] when they do
/// not fit in memory.
pub fn zeroed_shards(layout: &Layout) -> Result<BTreeMap<Rank, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for &r in layout.mesh().ranks() {
        let buf = reshard_core::memory::zeroed(layout.local_bytes(r), || {
            format!("rank {r}'s destination shard")
        })?;
        out.insert(r, buf);
    }
    Ok(out)
}
