//! Runs a whole plan with every rank as a thread of this process.

use reshard_core::error::Field;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::options::ExecOptions;
use super::quant::QuantJob;
use super::relay::{self, Rounds};
use super::run::{RankJob, run_rank};
use super::stats::{RankStats, RunStats};
use super::steps::check_buffers;
use crate::exec::threads::{RankThread, joined};
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{Plan, QuantRankPlan, RankPlan};
use reshard_core::region::Region;
use reshard_transport::{Fault, LocalFabric};

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
pub fn run_local(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    run_local_with_faults(plan, src, dst, options, &[])
}

/// [`run_local`] of a quantizing plan ([`Plan::quantized`]): `dst` receives the fp8 values
/// and `scales` every destination rank's scale shard ([`zeroed_scale_shards`]), row-major in
/// the scale dtype.
pub fn run_local_quantized(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    scales: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    run_local_all(plan, src, dst, Some(scales), options, &[])
}

/// Most ranks [`run_local`] runs (two threads each); see [`reshard_core::limits`].
pub use reshard_core::limits::MAX_LOCAL_RANKS;

/// [`run_local`] with injected faults, for testing failure handling.
pub fn run_local_with_faults(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<RunStats> {
    run_local_all(plan, src, dst, None, options, faults)
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
    if rank_plans.values().any(RankPlan::relays) {
        let boxes = (&src_boxes, &dst_boxes);
        return run_local_relayed(plan, &rank_plans, boxes, src, dst, options, faults);
    }
    let mut pairs: BTreeSet<(Rank, Rank)> = plan
        .transfers()
        .iter()
        .filter(|t| !t.is_local())
        .map(|t| (t.src, t.dst))
        .collect();
    // quantizing: every rank's part, its staging, and the links of the amax exchange
    let quant_parts: BTreeMap<Rank, QuantRankPlan> = match plan.quant() {
        Some(q) => rank_plans
            .values()
            .map(|rp| (rp.rank, q.for_rank(plan.src(), plan.dst(), rp)))
            .collect(),
        None => BTreeMap::new(),
    };
    let mut stages: BTreeMap<Rank, Vec<u8>> = match plan.quant() {
        Some(q) => quant_parts
            .iter()
            .map(|(&r, p)| (r, vec![0u8; p.stage_bytes(q.scale_bytes())]))
            .collect(),
        None => BTreeMap::new(),
    };
    for (&r, p) in &quant_parts {
        pairs.extend(p.amax_peers().map(|peer| (r, peer)));
    }
    let fabric = LocalFabric {
        timeout: options.timeout,
        faults: faults.to_vec(),
    };
    let mut endpoints = fabric.endpoints(&ranks, pairs);
    tracing::debug!(
        ranks = ranks.len(),
        transfers = plan.transfers().len(),
        chunk_bytes = options.chunk_bytes,
        "local run"
    );

    let started = Instant::now();
    let mut dst_shards: BTreeMap<Rank, &mut Vec<u8>> =
        dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut stage_slices: BTreeMap<Rank, &mut [u8]> = stages
        .iter_mut()
        .map(|(&r, b)| (r, b.as_mut_slice()))
        .collect();
    let mut scale_shards: BTreeMap<Rank, &mut [u8]> = scales
        .map(|m| m.iter_mut().map(|(&r, b)| (r, b.as_mut_slice())).collect())
        .unwrap_or_default();
    let results: Vec<Result<RankStats>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&rank| {
                let quant = plan.quant().map(|q| QuantJob {
                    tensor: "tensor",
                    plan: q,
                    rank: &quant_parts[&rank],
                    stage: stage_slices.remove(&rank).unwrap_or_default(),
                    scales: scale_shards.remove(&rank),
                });
                let job = RankJob {
                    quant,
                    plan: &rank_plans[&rank],
                    src_layout: plan.src(),
                    src: src_boxes.get(&rank).zip(src.get(&rank).map(Vec::as_slice)),
                    dst: dst_boxes
                        .get(&rank)
                        .zip(dst_shards.remove(&rank).map(Vec::as_mut_slice)),
                    dst_dtype: plan.dst().dtype(),
                };
                let endpoint = endpoints.remove(&rank);
                std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(scope, move || match endpoint {
                        // the endpoint lives as long as the thread: a rank that fails closes its links
                        Some(endpoint) => run_rank(job, &endpoint, options),
                        None => Ok(RankStats::default()),
                    })
            })
            .collect();
        handles
            .into_iter()
            .zip(&ranks)
            .map(|(h, &rank)| joined(h, rank, RankThread::Rank))
            .collect()
    });
    let elapsed = started.elapsed();
    let stats = RunStats::gather(elapsed, results)?;
    tracing::debug!(?elapsed, bytes = stats.bytes_remote(), "local run done");
    Ok(stats)
}

/// [`run_local`] of a relay plan: round after round ([`super::relay`]), every rank a thread
/// of each round, each round on links of its own.
fn run_local_relayed(
    plan: &Plan,
    rank_plans: &BTreeMap<Rank, RankPlan>,
    (src_boxes, dst_boxes): (&BTreeMap<Rank, Region>, &BTreeMap<Rank, Region>),
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<RunStats> {
    let elem_bytes = plan.dst().dtype().size();
    let slab = relay::slab_bytes(options);
    let rounds: BTreeMap<Rank, Rounds> = rank_plans
        .iter()
        .map(|(&r, p)| Ok((r, Rounds::of(p, elem_bytes, slab)?)))
        .collect::<Result<_>>()?;
    let mut staging: BTreeMap<Rank, relay::Staging> = rounds
        .iter()
        .map(|(&r, rs)| Ok((r, relay::staging_for(rs, r)?)))
        .collect::<Result<_>>()?;
    let count = rounds.values().map(|r| r.rounds.len()).max().unwrap_or(0);
    let started = Instant::now();
    let mut totals: BTreeMap<Rank, RankStats> = BTreeMap::new();
    for j in 0..count {
        let pairs: BTreeSet<(Rank, Rank)> = rounds
            .values()
            .filter_map(|rs| rs.rounds.get(j))
            .flat_map(|round| round.sends.iter().map(|l| (l.from, l.to)))
            .collect();
        let fabric = LocalFabric {
            timeout: options.timeout,
            faults: faults.to_vec(),
        };
        let ranks: Vec<Rank> = rounds
            .iter()
            .filter(|(_, rs)| rs.rounds.len() > j)
            .map(|(&r, _)| r)
            .collect();
        let mut endpoints = fabric.endpoints(&ranks, pairs);
        let mut dst_shards: BTreeMap<Rank, &mut Vec<u8>> =
            dst.iter_mut().map(|(&r, b)| (r, b)).collect();
        let mut stagings: BTreeMap<Rank, &mut relay::Staging> =
            staging.iter_mut().map(|(&r, b)| (r, b)).collect();
        let results: Vec<Result<RankStats>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|&rank| {
                    let job = RankJob {
                        plan: &rank_plans[&rank],
                        src_layout: plan.src(),
                        src: src_boxes.get(&rank).zip(src.get(&rank).map(Vec::as_slice)),
                        dst: dst_boxes
                            .get(&rank)
                            .zip(dst_shards.remove(&rank).map(Vec::as_mut_slice)),
                        dst_dtype: plan.dst().dtype(),
                        quant: None,
                    };
                    let endpoint = endpoints.remove(&rank);
                    let staging = stagings.remove(&rank);
                    let rounds = &rounds[&rank];
                    std::thread::Builder::new()
                        .name(format!("rank {rank}"))
                        .spawn_scoped(scope, move || match (endpoint, staging) {
                            (Some(endpoint), Some(staging)) => {
                                let (recv_into, send_from) = relay::halves(staging, j);
                                relay::run_round(
                                    job, rounds, j, send_from, recv_into, &endpoint, options,
                                )
                            }
                            _ => Ok(RankStats::default()),
                        })
                })
                .collect();
            handles
                .into_iter()
                .zip(&ranks)
                .map(|(h, &rank)| joined(h, rank, RankThread::Rank))
                .collect()
        });
        let stats = RunStats::gather(started.elapsed(), results)?;
        for s in stats.ranks {
            totals
                .entry(s.rank)
                .or_insert(RankStats {
                    rank: s.rank,
                    ..RankStats::default()
                })
                .absorb(&s);
        }
    }
    for (r, rs) in &rounds {
        if let Some(t) = totals.get_mut(r) {
            t.peak_staging_bytes += 2 * rs.staging_bytes() as u64;
        }
    }
    Ok(RunStats {
        elapsed: started.elapsed(),
        ranks: totals.into_values().collect(),
    })
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
