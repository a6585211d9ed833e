//! `bench --quant`: the quantizing reshard (the senders quantize as they pack, the wire
//! carries fp8 values and their scales) against two ways of quantizing after the move, on
//! the receivers: (a) the same reshard in the source's dtype, then every destination
//! quantizes the shard it got, and (b) gather+broadcast of the source's dtype, then every
//! destination quantizes its box. Destination shards hold whole blocks (the case checks it),
//! so every receiver quantizes alone. Each repetition of each method is verified, values and
//! scales, against the naive reference.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use reshard::convert::quantize_shard;
use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, QuantJob, RankJob};
use reshard::fill::Fill;
use reshard::plan::QuantPlan;
use reshard::runtime::{AnyTransport, Destination, Links};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Plan, Rank, Region};

use super::BenchArgs;
use super::driver::{CaseResult, poison};
use super::suite::Case;
use crate::cli::measure::Measured;
use crate::cli::quant_check;

/// The three methods of a quantizing case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// Quantize in flight.
    Reshard,
    /// (a) the reshard in the source's dtype, then quantize on the receivers.
    ReshardThenQuantize,
    /// (b) gather+broadcast in the source's dtype, then quantize on the receivers.
    GatherBroadcast,
}

/// The order in repetition `i`: each method goes first, second and third in turn.
fn order(i: u32) -> [Method; 3] {
    use Method::*;
    crate::cli::measure::in_turn([Reshard, ReshardThenQuantize, GatherBroadcast], i)
}

fn convert_error(source: reshard::convert::ConvertError) -> Error {
    Error::Convert {
        tensor: "tensor".into(),
        source,
    }
}

/// One receiver's quantization after the move: `received` (its shard in the source's dtype)
/// into `values` and `scales`.
fn quantize_received(
    q: &QuantPlan,
    shard: &Region,
    plain: &Plan,
    received: &[u8],
    values: &mut [u8],
    scales: &mut [u8],
) -> Result<(), Error> {
    quantize_shard(
        q.quant,
        &q.grid,
        shard,
        plain.dst().dtype(),
        received,
        values,
        scales,
    )
    .map_err(convert_error)
}

/// Every destination quantizing what it received, each on a thread of its own as the ranks
/// would; returns the time they took together.
fn quantize_all(
    q: &QuantPlan,
    plain: &Plan,
    received: &BTreeMap<Rank, Vec<u8>>,
    values: &mut BTreeMap<Rank, Vec<u8>>,
    scales: &mut BTreeMap<Rank, Vec<u8>>,
) -> Result<Duration, Error> {
    let started = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = values
            .iter_mut()
            .zip(scales.values_mut())
            .filter_map(|((r, v), sc)| {
                let shard = plain.dst().local_region(*r)?;
                let got = received.get(r)?;
                Some(s.spawn(move || quantize_received(q, &shard, plain, got, v, sc)))
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or_else(|_| Err(quantize_panicked())))
    })?;
    Ok(started.elapsed())
}

fn quantize_panicked() -> Error {
    Error::Internal {
        rank: 0,
        detail: "a receiver's quantization panicked".into(),
    }
}

/// Every rank a thread of this process: the three methods on the same buffers.
pub(super) fn threads(
    args: &BenchArgs,
    case: &Case,
    (plain, q): (&Plan, &QuantPlan),
    fill: Fill,
    options: &ExecOptions,
    bar: &ProgressBar,
) -> Result<CaseResult, Error> {
    let (plan, gb) = (&case.plan, &case.baseline);
    let reference = quant_check::reference(plan, fill)?;
    let mut sources = fill.shards(plan.src())?;
    let mut values = exec::zeroed_shards(plan.dst())?;
    let mut scales = exec::zeroed_scale_shards(plan)?;
    let mut received = exec::zeroed_shards(plain.dst())?;
    let mut full = baseline::full_buffers(gb)?;
    let received_bytes = received.values().map(|r| r.len() as u64).max().unwrap_or(0);
    let full_bytes = if full.is_empty() { 0 } else { gb.full_bytes() };
    let (mut ours, mut then, mut gbq) = Default::default();
    let mut checked = 0;
    for i in 0..args.repetitions() {
        let timed = i >= args.warmup;
        for method in order(i) {
            for buf in values
                .values_mut()
                .chain(scales.values_mut())
                .chain(received.values_mut())
            {
                poison(buf);
            }
            if method == Method::GatherBroadcast {
                full.values_mut().for_each(|f| poison(f));
            }
            let (stats, after, measured, extra): (_, _, &mut Measured, _) = match method {
                Method::Reshard => (
                    exec::run_local_quantized(plan, &sources, &mut values, &mut scales, options)?,
                    Duration::ZERO,
                    &mut ours,
                    0,
                ),
                Method::ReshardThenQuantize => {
                    let stats = exec::run_local(plain, &sources, &mut received, options)?;
                    let after = quantize_all(q, plain, &received, &mut values, &mut scales)?;
                    (stats, after, &mut then, received_bytes)
                }
                Method::GatherBroadcast => {
                    let stats = baseline::run_local_gather_broadcast(
                        gb,
                        &mut sources,
                        &mut received,
                        &mut full,
                        options,
                    )?;
                    let after = quantize_all(q, plain, &received, &mut values, &mut scales)?;
                    (stats, after, &mut gbq, received_bytes + full_bytes)
                }
            };
            bar.inc(1);
            if let Some(reference) = &reference {
                for (&r, v) in &values {
                    let none = Vec::new();
                    quant_check::verify(plan, reference, r, v, scales.get(&r).unwrap_or(&none))?;
                }
                checked += 1;
            }
            if timed {
                measured.times.push((stats.elapsed + after).as_secs_f64());
                measured.wire_bytes = stats.bytes_remote();
                measured.peak_extra = stats.peak_staging_bytes().saturating_add(extra);
            }
        }
    }
    Ok(CaseResult {
        reshard: ours,
        gather_broadcast: gbq,
        reshard_then_quantize: Some(then),
        values_only: None,
        verified: checked == 3 * args.repetitions(),
    })
}

/// This process is one rank of a job: its share of the three methods, in turn, on the same
/// buffers. Returns the report for rank 0 and the transport's name.
#[allow(clippy::too_many_arguments)]
pub(super) fn rank<'j, J: Job + ?Sized>(
    args: &BenchArgs,
    case: &Case,
    (plain, q): (&Plan, &QuantPlan),
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    bar: &ProgressBar,
) -> Result<(serde_json::Value, String), Error> {
    let rank = job.rank();
    let (plan, gb) = (&case.plan, &case.baseline);
    let (src, dst) = (plan.src(), plan.dst());
    let mine = plan.rank_part(rank);
    let part = q.for_rank(src, dst, &mine);
    let mine_plain = plain.rank_part(rank);
    let (gather, broadcast) = gb.rank_parts(rank);

    let src_box = src.local_region(rank);
    let dst_box = dst.local_region(rank);
    let source = fill.shard(src, rank)?;
    let shared = |len: u64| SharedBuffer::new(len as usize);
    let mut stage = vec![0u8; part.stage_bytes(q.scale_bytes())];
    // in shared memory, so that same-host senders quantize straight into it
    let mut values = dst_box
        .as_ref()
        .map(|_| shared(dst.local_bytes(rank)))
        .transpose()?;
    let mut scales = dst_box
        .as_ref()
        .map(|_| vec![0u8; q.dst_scale_bytes(dst, rank) as usize]);
    let mut received = dst_box
        .as_ref()
        .map(|_| shared(plain.dst().local_bytes(rank)))
        .transpose()?;
    let mut full = gb
        .needs_full_buffer(rank)
        .then(|| shared(gb.full_bytes()))
        .transpose()?;
    // only the destinations check, so only they build the reference
    let reference = match dst_box {
        Some(_) => quant_check::reference(plan, fill)?,
        None => None,
    };
    let whole = Region::full(dst.shape());

    // The three methods' links, opened one after the other by every rank. The quantizing
    // reshard's same-host senders write the values straight into the value shard; its
    // scales and partial amax travel as transfers of their own, through rings.
    job.barrier()?;
    let mut links = Links::of_plan(&mine);
    links.senders.extend(part.amax_peers());
    links.receivers.extend(part.amax_peers());
    let ours_transport = connect(
        &links,
        dst_box
            .as_ref()
            .and_then(|b| values.as_ref().map(|v| (v, b)))
            .filter(|_| !mine.relays()),
    )?;
    job.barrier()?;
    let plain_transport = connect(
        &Links::of_plan(&mine_plain),
        dst_box
            .as_ref()
            .and_then(|b| received.as_ref().map(|s| (s, b))),
    )?;
    job.barrier()?;
    let baseline_links = Links::of_plans([&gather, &broadcast].into_iter().flatten());
    let tensor = full
        .as_ref()
        .or(received.as_ref().filter(|_| gb.gets_tensor(rank)));
    let baseline_transport = connect(&baseline_links, tensor.map(|f| (f, &whole)))?;

    let received_bytes = received.as_ref().map_or(0, |r| r.len() as u64);
    let full_bytes = full.as_ref().map_or(0, |f| f.len() as u64);
    let (mut ours, mut then, mut gbq) = (
        Measured::default(),
        Measured::default(),
        Measured::default(),
    );
    let mut checked = 0;
    for i in 0..args.repetitions() {
        let timed = i >= args.warmup;
        for method in order(i) {
            for buf in [values.as_deref_mut(), scales.as_deref_mut()]
                .into_iter()
                .flatten()
            {
                poison(buf);
            }
            if let Some(r) = received.as_deref_mut() {
                poison(r);
            }
            if let (Method::GatherBroadcast, Some(f)) = (method, full.as_deref_mut()) {
                poison(f);
            }
            // after the move, a destination quantizes what it received
            let quantize = |received: Option<&[u8]>,
                            values: Option<&mut [u8]>,
                            scales: Option<&mut [u8]>|
             -> Result<(), Error> {
                match (&dst_box, received, values, scales) {
                    (Some(b), Some(r), Some(v), Some(s)) => quantize_received(q, b, plain, r, v, s),
                    _ => Ok(()),
                }
            };
            match method {
                Method::Reshard => ours.repeat(job, timed, 0, || {
                    let work = RankJob {
                        plan: &mine,
                        src_layout: src,
                        src: src_box.as_ref().zip(source.as_deref()),
                        dst: dst_box.as_ref().zip(values.as_deref_mut()),
                        dst_dtype: dst.dtype(),
                        quant: Some(QuantJob {
                            tensor: "tensor",
                            plan: q,
                            rank: &part,
                            stage: &mut stage,
                            scales: scales.as_deref_mut(),
                        }),
                    };
                    exec::run_rank(work, &*ours_transport, options)
                })?,
                Method::ReshardThenQuantize => then.repeat(job, timed, received_bytes, || {
                    let work = RankJob {
                        plan: &mine_plain,
                        src_layout: plain.src(),
                        src: src_box.as_ref().zip(source.as_deref()),
                        dst: dst_box.as_ref().zip(received.as_deref_mut()),
                        dst_dtype: plain.dst().dtype(),
                        quant: None,
                    };
                    let stats = exec::run_rank(work, &*plain_transport, options)?;
                    quantize(
                        received.as_deref(),
                        values.as_deref_mut(),
                        scales.as_deref_mut(),
                    )?;
                    Ok(stats)
                })?,
                Method::GatherBroadcast => {
                    gbq.repeat(job, timed, received_bytes + full_bytes, || {
                        let work = BaselineJob {
                            baseline: gb,
                            gather: gather.as_ref(),
                            broadcast: broadcast.as_ref(),
                            src: src_box.as_ref().zip(source.as_deref()),
                            full: full.as_deref_mut(),
                            dst: dst_box.as_ref().zip(received.as_deref_mut()),
                        };
                        let stats = baseline::run_rank_gather_broadcast(
                            rank,
                            work,
                            &*baseline_transport,
                            options,
                        )?;
                        quantize(
                            received.as_deref(),
                            values.as_deref_mut(),
                            scales.as_deref_mut(),
                        )?;
                        Ok(stats)
                    })?
                }
            }
            bar.inc(1);
            if let (Some(reference), Some(v), Some(s)) = (&reference, &values, &scales) {
                quant_check::verify(plan, reference, rank, v, s)?;
            }
            checked += 1;
        }
    }
    let report = serde_json::json!({
        "reshard": ours.report(),
        "gather_broadcast": gbq.report(),
        "reshard_then_quantize": then.report(),
        "verified": checked == 3 * args.repetitions(),
    });
    Ok((report, ours_transport.name().to_string()))
}
