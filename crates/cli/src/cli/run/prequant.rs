//! `run` of an already-quantized source (an fp8 `--dtype` with `--quant`): the fp8 values and
//! their scales move together as two coupled tensors ([`QuantizedMove`]), in one exchange
//! ([`World::run_quantized_move`]: one schedule, one stream per peer pair). The source is the
//! `normal` fill, made in f32 and quantized naively ([`quantize_tensor`]): every source rank
//! holds its boxes of those values and scales, and `--verify` checks every destination's
//! boxes of both, after every repetition. `--dump` writes `rank<R>.bin` and
//! `rank<R>.scale.bin`, `--dump-src` `src<R>.bin` and `src<R>.scale.bin`.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

use reshard::convert::reference::{QuantizedTensor, quantize_tensor, slice};
use reshard::error::Field;
use reshard::exec::ExecOptions;
use reshard::fill::Fill;
use reshard::layout::{Layout, LayoutSpec};
use reshard::plan::QuantizedMove;
use reshard::runtime::World;
use reshard::{DType, Error, Rank};

use super::{
    RunArgs, Summary, check_memory, dump, dump_named, dump_scales, poison, report, run_options,
    with_plan, write_whole,
};
use crate::cli::Failure;

/// The source: the `normal` fill in f32, quantized block by block.
fn source(mv: &QuantizedMove, fill: Fill) -> Result<QuantizedTensor, Error> {
    check_fill(fill)?;
    let shape = mv.values.src().shape();
    let whole = LayoutSpec::parse("mesh=1 place=R")
        .and_then(|s| s.resolve(shape, DType::F32, 0))
        .map_err(|source| Error::Layout {
            side: reshard::Side::Src,
            source,
        })?;
    let tensor = fill.shard(&whole, 0)?.unwrap_or_default();
    quantize_tensor(mv.quant, &mv.grid, DType::F32, &tensor).map_err(convert)
}

/// Only the `normal` fill has finite values to quantize (`bench` of an already-quantized
/// source makes its source alike).
pub(in crate::cli) fn check_fill(fill: Fill) -> Result<(), Error> {
    match fill {
        Fill::Normal { .. } => Ok(()),
        _ => Err(Error::InvalidOption {
            field: Field::Flag("--fill"),
            value: fill.to_string(),
            reason: "an already-quantized source is the normal fill quantized: give normal or normal:SEED".into(),
        }),
    }
}

fn convert(source: reshard::convert::ConvertError) -> Error {
    Error::Convert {
        tensor: "tensor".into(),
        source,
    }
}

/// `rank`'s boxes of the values (of `values`) and the scales (of `scales`).
fn boxes(
    q: &QuantizedTensor,
    values: &Layout,
    scales: &Layout,
    rank: Rank,
) -> Option<(Vec<u8>, Vec<u8>)> {
    let v = values.local_region(rank)?;
    let s = scales.local_region(rank)?;
    Some((
        slice(&q.values, values.shape(), 1, &v),
        slice(&q.scales, scales.shape(), q.scale_bytes, &s),
    ))
}

/// Checks `rank`'s values and scales against the source's boxes of them.
fn verify(
    mv: &QuantizedMove,
    q: &QuantizedTensor,
    rank: Rank,
    values: &[u8],
    scales: &[u8],
) -> Result<(), Error> {
    let Some((want_values, want_scales)) = boxes(q, mv.values.dst(), mv.scales.dst(), rank) else {
        return Ok(());
    };
    crate::cli::quant_check::compare(rank, (&want_values, values), Some((&want_scales, scales)))
}

/// Rank -> its buffers `[values, scales]` ([`QuantizedMove::batch`]).
type Shards = BTreeMap<Rank, Vec<Vec<u8>>>;

/// A rank's buffer of `which` ([`QuantizedMove::VALUES`] or [`QuantizedMove::SCALES`]).
fn part(buffers: &[Vec<u8>], which: usize) -> &[u8] {
    buffers.get(which).map_or(&[][..], Vec::as_slice)
}

/// Every rank's buffer of `which`, for the dumps.
fn parts(shards: &Shards, which: usize) -> impl Iterator<Item = (Rank, &[u8])> {
    shards.iter().map(move |(&r, b)| (r, part(b, which)))
}

/// The value and scale buffers of the source ranks among `ranks`, cut from the quantized
/// source `q`, and dumped with `--dump-src` (`src<R>.bin`, `src<R>.scale.bin`).
fn source_shards(
    args: &RunArgs,
    mv: &QuantizedMove,
    q: &QuantizedTensor,
    ranks: impl IntoIterator<Item = Rank>,
) -> Result<Shards, Error> {
    let shards: Shards = ranks
        .into_iter()
        .filter_map(|r| boxes(q, mv.values.src(), mv.scales.src(), r).map(|(v, s)| (r, vec![v, s])))
        .collect();
    if let Some(dir) = &args.dump_src {
        dump_named(dir, "src", parts(&shards, QuantizedMove::VALUES))?;
        for (rank, buf) in parts(&shards, QuantizedMove::SCALES) {
            write_whole(dir, &format!("src{rank}.scale.bin"), |f| f.write_all(buf))?;
        }
    }
    Ok(shards)
}

/// Zeroed destination buffers `[values, scales]` for the destination ranks among `ranks`.
fn destination_shards(
    mv: &QuantizedMove,
    ranks: impl IntoIterator<Item = Rank>,
) -> Result<Shards, Error> {
    let (values, scales) = (mv.values.dst(), mv.scales.dst());
    ranks
        .into_iter()
        .filter(|&r| values.local_region(r).is_some())
        .map(|r| {
            let zeroed = |layout: &Layout, what: &str| {
                reshard::memory::zeroed(layout.local_bytes(r), || {
                    format!("rank {r}'s destination {what}")
                })
            };
            Ok((r, vec![zeroed(values, "shard")?, zeroed(scales, "scales")?]))
        })
        .collect()
}

/// Poisons every destination buffer (so that `--verify` sees what a run did not write),
/// runs the move once, and checks every destination rank's values and scales. Returns the
/// run's stats and the seconds of the call (links, when it opens them, included; the checks
/// not).
fn once(
    args: &RunArgs,
    mv: &QuantizedMove,
    q: &QuantizedTensor,
    sources: &Shards,
    dests: &mut Shards,
    options: &ExecOptions,
    world: &World,
) -> Result<(reshard::exec::RunStats, f64), Error> {
    if args.verify {
        dests.values_mut().flatten().for_each(|s| poison(s));
    }
    let started = Instant::now();
    let stats = world.run_quantized_move(mv, sources, dests, &run_options(options))?;
    let seconds = started.elapsed().as_secs_f64();
    if args.verify {
        for (&r, b) in dests.iter() {
            verify(
                mv,
                q,
                r,
                part(b, QuantizedMove::VALUES),
                part(b, QuantizedMove::SCALES),
            )?;
        }
    }
    Ok((stats, seconds))
}

/// Writes every destination rank's values and scales (`--dump`).
fn dump_destinations(args: &RunArgs, dests: &Shards) -> Result<(), Error> {
    if let Some(dir) = &args.dump {
        dump(dir, parts(dests, QuantizedMove::VALUES))?;
        dump_scales(dir, parts(dests, QuantizedMove::SCALES))?;
    }
    Ok(())
}

pub(super) fn main(
    args: &RunArgs,
    mv: &QuantizedMove,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<(), Failure> {
    // the fill is checked before any byte moves, on every process alike
    check_fill(fill)?;
    match world.job() {
        None => threads(args, mv, fill, options, world),
        Some(_) => {
            let rank = world.rank().unwrap_or(0);
            let highest = mv.values.ranks().last().copied().unwrap_or(0);
            let bytes = |l: &Layout| l.local_bytes(rank);
            let ready = world.check_size(highest).and_then(|()| {
                check_memory(
                    bytes(mv.values.src()) + bytes(mv.values.dst()),
                    mv.values.src().shape(),
                )
            });
            world.agree("run", ready, || {
                let fp = with_plan(reshard::agreement::Fingerprint::new("run"), "", &mv.values)
                    .with("--quant (source)", mv.quant.scheme)
                    .with("--scale-dtype (source)", mv.quant.scale_dtype)
                    .with("--fill", fill)
                    .with("--iters", args.iters)
                    .with("--warmup", args.warmup)
                    .with("--verify", args.verify);
                args.exec.agreed(options, fp)
            })?;
            let outcome = rank_part(args, mv, fill, options, world);
            super::process_report(args, &mv.values, world, outcome)
        }
    }
}

fn threads(
    args: &RunArgs,
    mv: &QuantizedMove,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<(), Failure> {
    let values = &mv.values;
    check_memory(
        values.src().shard_bytes() + values.dst().shard_bytes(),
        values.src().shape(),
    )?;
    let q = source(mv, fill)?;
    let sources = source_shards(args, mv, &q, values.src().mesh().ranks().iter().copied())?;
    let mut dests = destination_shards(mv, values.dst().mesh().ranks().iter().copied())?;
    let (mut times, mut summary) = (Vec::new(), None);
    for i in 0..args.warmup + args.iters {
        let (stats, _) = once(args, mv, &q, &sources, &mut dests, options, world)?;
        if i >= args.warmup {
            times.push(stats.elapsed.as_secs_f64());
        }
        summary = Some((
            stats.bytes_remote(),
            stats.bytes_local(),
            stats.peak_staging_bytes(),
        ));
    }
    dump_destinations(args, &dests)?;
    let (bytes_remote, bytes_local, peak_staging) = summary.unwrap_or_default();
    let summary = Summary {
        times,
        bytes_remote,
        bytes_local,
        // between threads: no shared-memory writes
        bytes_direct: 0,
        peak_staging,
    };
    report(args, values, &summary, "local", args.verify);
    Ok(())
}

/// This rank's share between processes: the move, its checks and dumps.
fn rank_part(
    args: &RunArgs,
    mv: &QuantizedMove,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<serde_json::Value, Error> {
    let rank = world.rank().unwrap_or(0);
    let q = source(mv, fill)?;
    let sources = source_shards(args, mv, &q, [rank])?;
    let mut dests = destination_shards(mv, [rank])?;
    let mut times = Vec::new();
    let mut last = None;
    for i in 0..args.warmup + args.iters {
        world.barrier()?;
        let (stats, seconds) = once(args, mv, &q, &sources, &mut dests, options, world)?;
        if i >= args.warmup {
            times.push(seconds);
        }
        last = Some(stats);
    }
    dump_destinations(args, &dests)?;
    let stats = last.expect("at least one iteration");
    Ok(serde_json::json!({
        "transport": world.options().transport.name(),
        "times": times,
        "bytes_remote": stats.bytes_remote(),
        "bytes_local": stats.bytes_local(),
        "peak_staging": stats.peak_staging_bytes(),
        "verified": args.verify,
    }))
}
