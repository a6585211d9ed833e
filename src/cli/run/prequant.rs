//! `run` of an already-quantized source (an fp8 `--dtype` with `--quant`): the fp8 values and
//! their scales move together as two coupled reshards ([`QuantizedMove`]). The source is the
//! `normal` fill, made in f32 and quantized naively ([`quantize_tensor`]): every source rank
//! holds its boxes of those values and scales, and `--verify` checks every destination's
//! boxes of both, after every repetition. `--dump` writes `rank<R>.bin` and
//! `rank<R>.scale.bin`, `--dump-src` `src<R>.bin` and `src<R>.scale.bin`.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

use reshard::convert::reference::{QuantizedTensor, first_difference, quantize_tensor, slice};
use reshard::error::Field;
use reshard::exec::{self, ExecOptions};
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
    if let Some((offset, expected, found, mismatches)) = first_difference(&want_values, values) {
        return Err(Error::VerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    if let Some((offset, expected, found, mismatches)) = first_difference(&want_scales, scales) {
        return Err(Error::ScalesVerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    Ok(())
}

/// Rank -> local buffer.
type Shards = BTreeMap<Rank, Vec<u8>>;

/// The value and scale shards of the source ranks among `ranks`, cut from the quantized
/// source `q`, and dumped with `--dump-src` (`src<R>.bin`, `src<R>.scale.bin`).
fn source_shards(
    args: &RunArgs,
    mv: &QuantizedMove,
    q: &QuantizedTensor,
    ranks: impl IntoIterator<Item = Rank>,
) -> Result<(Shards, Shards), Error> {
    let (mut values, mut scales) = (BTreeMap::new(), BTreeMap::new());
    for r in ranks {
        if let Some((v, s)) = boxes(q, mv.values.src(), mv.scales.src(), r) {
            values.insert(r, v);
            scales.insert(r, s);
        }
    }
    if let Some(dir) = &args.dump_src {
        dump_named(dir, "src", values.iter().map(|(&r, b)| (r, b.as_slice())))?;
        for (rank, buf) in &scales {
            write_whole(dir, &format!("src{rank}.scale.bin"), |f| f.write_all(buf))?;
        }
    }
    Ok((values, scales))
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
        None => threads(args, mv, fill, options),
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
) -> Result<(), Failure> {
    let (values, scales) = (&mv.values, &mv.scales);
    check_memory(
        values.src().shard_bytes() + values.dst().shard_bytes(),
        values.src().shape(),
    )?;
    let q = source(mv, fill)?;
    let (src_values, src_scales) =
        source_shards(args, mv, &q, values.src().mesh().ranks().iter().copied())?;
    let mut dst_values = exec::zeroed_shards(values.dst())?;
    let mut dst_scales = exec::zeroed_shards(scales.dst())?;
    let (mut times, mut summary, mut verified) = (Vec::new(), None, false);
    for i in 0..args.warmup + args.iters {
        if args.verify {
            dst_values.values_mut().for_each(|s| poison(s));
            dst_scales.values_mut().for_each(|s| poison(s));
        }
        let a = exec::run_local(values, &src_values, &mut dst_values, options)?;
        let b = exec::run_local(scales, &src_scales, &mut dst_scales, options)?;
        if i >= args.warmup {
            times.push((a.elapsed + b.elapsed).as_secs_f64());
        }
        summary = Some((
            a.bytes_remote() + b.bytes_remote(),
            a.bytes_local() + b.bytes_local(),
            a.peak_staging_bytes().max(b.peak_staging_bytes()),
        ));
        if args.verify {
            for (&r, v) in &dst_values {
                let s = dst_scales.get(&r).map_or(&[][..], Vec::as_slice);
                verify(mv, &q, r, v, s)?;
            }
            verified = true;
        }
    }
    if let Some(dir) = &args.dump {
        dump(dir, dst_values.iter().map(|(&r, b)| (r, b.as_slice())))?;
        dump_scales(dir, dst_scales.iter().map(|(&r, b)| (r, b.as_slice())))?;
    }
    let (bytes_remote, bytes_local, peak_staging) = summary.unwrap_or_default();
    let summary = Summary {
        times,
        bytes_remote,
        bytes_local,
        // between threads: no shared-memory writes
        bytes_direct: 0,
        peak_staging,
    };
    report(args, values, &summary, "local", verified);
    Ok(())
}

/// This rank's share between processes: both reshards, its checks and dumps.
fn rank_part(
    args: &RunArgs,
    mv: &QuantizedMove,
    fill: Fill,
    options: &ExecOptions,
    world: &World,
) -> Result<serde_json::Value, Error> {
    let rank = world.rank().unwrap_or(0);
    let (values, scales) = (&mv.values, &mv.scales);
    let q = source(mv, fill)?;
    let own = |layout: &Layout| -> BTreeMap<Rank, Vec<u8>> {
        layout
            .local_region(rank)
            .map(|_| (rank, vec![0u8; layout.local_bytes(rank) as usize]))
            .into_iter()
            .collect()
    };
    let (src_values, src_scales) = source_shards(args, mv, &q, [rank])?;
    let (mut dst_values, mut dst_scales) = (own(values.dst()), own(scales.dst()));
    let run = run_options(options);
    let mut times = Vec::new();
    let mut last = None;
    let mut verified = args.verify && dst_values.is_empty();
    for i in 0..args.warmup + args.iters {
        if args.verify {
            dst_values.values_mut().for_each(|s| poison(s));
            dst_scales.values_mut().for_each(|s| poison(s));
        }
        world.barrier()?;
        let started = Instant::now();
        let a = world.run(values, &src_values, &mut dst_values, &run)?;
        let b = world.run(scales, &src_scales, &mut dst_scales, &run)?;
        if i >= args.warmup {
            times.push(started.elapsed().as_secs_f64());
        }
        last = Some((a, b));
        if args.verify {
            for (&r, v) in &dst_values {
                let s = dst_scales.get(&r).map_or(&[][..], Vec::as_slice);
                verify(mv, &q, r, v, s)?;
                verified = true;
            }
        }
    }
    if let Some(dir) = &args.dump {
        dump(dir, dst_values.iter().map(|(&r, b)| (r, b.as_slice())))?;
        dump_scales(dir, dst_scales.iter().map(|(&r, b)| (r, b.as_slice())))?;
    }
    let (a, b) = last.expect("at least one iteration");
    Ok(serde_json::json!({
        "transport": world.options().transport.name(),
        "times": times,
        "bytes_remote": a.bytes_remote() + b.bytes_remote(),
        "bytes_local": a.bytes_local() + b.bytes_local(),
        "peak_staging": a.peak_staging_bytes().max(b.peak_staging_bytes()),
        "verified": verified,
    }))
}
