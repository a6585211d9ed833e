//! `run` of an already-quantized source (an fp8 `--dtype` with `--quant`): the fp8 values and
//! their scales move together as two coupled tensors ([`QuantizedMove`]), in one exchange
//! ([`World::run_quantized_move`]: one schedule, one stream per peer pair). The source is the
//! `normal` fill, made in f32 and quantized naively ([`quantize_tensor`]): every source rank
//! holds its boxes of those values and scales, and `--verify` checks every destination's
//! boxes of both, after every repetition. Between processes the links are opened once,
//! before the first repetition. `--dump` writes `rank<R>.bin` and
//! `rank<R>.scale.bin`, `--dump-src` `src<R>.bin` and `src<R>.scale.bin`.

use std::collections::BTreeMap;
use std::io::Write;

use reshard::batch::{Batch, RankBatch, run_rank_batch};
use reshard::convert::reference::{QuantizedTensor, quantize_tensor, slice};
use reshard::error::Field;
use reshard::exec::ExecOptions;
use reshard::fill::Fill;
use reshard::layout::{Layout, LayoutSpec};
use reshard::plan::QuantizedMove;
use reshard::runtime::harness::{Checked, Compare, Comparison, Sample, compare};
use reshard::runtime::refit::check;
use reshard::runtime::{AnyTransport, Links, World};
use reshard::{DType, Error, Rank};

use super::args::RunArgs;
use super::dump::{dump, dump_named, dump_scales, write_whole};
use super::method::Move;
use super::report::{process_report, report};
use crate::cli::Failure;
use crate::cli::exec_args::{check_memory, run_options, with_plan};
use reshard::runtime::harness::poison;

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

/// Checks `rank`'s values and scales against the source's boxes of them; returns the bytes
/// checked.
fn verify(
    mv: &QuantizedMove,
    q: &QuantizedTensor,
    rank: Rank,
    values: &[u8],
    scales: &[u8],
) -> Result<u64, Error> {
    let Some((want_values, want_scales)) = boxes(q, mv.values.dst(), mv.scales.dst(), rank) else {
        return Ok(0);
    };
    check::compare(rank, (&want_values, values), Some((&want_scales, scales)))
}

/// Rank -> its buffers `[values, scales]` ([`reshard::batch::Batch::quantized`]).
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

/// The coupled move of this process's ranks: every rank's buffers between threads
/// ([`World::run_quantized_move`]), or this rank's over links opened once.
struct Moving<'a, 'w> {
    mv: &'a QuantizedMove,
    q: QuantizedTensor,
    sources: Shards,
    dests: Shards,
    world: &'w World,
    options: &'a ExecOptions,
    /// Between processes: the batch, this rank's part of it, and its links.
    own: Option<(Batch, RankBatch, AnyTransport<'w>)>,
}

impl Compare for Moving<'_, '_> {
    type Method = Move;
    fn methods(&self) -> Vec<Move> {
        vec![Move]
    }
    fn connect(&mut self, _: Move) -> Result<(), Error> {
        let Some(rank) = self.world.rank() else {
            return Ok(());
        };
        let batch = Batch::quantized(self.mv)?;
        let rb = batch.rank_batch(rank)?;
        let layouts = [self.mv.values.src(), self.mv.scales.src()];
        let transport = self.world.connect(&Links::of_batch(&rb), layouts, None)?;
        self.own = Some((batch, rb, transport));
        Ok(())
    }
    fn poison(&mut self, _: Move) {
        self.dests.values_mut().flatten().for_each(|s| poison(s));
    }
    fn run(&mut self, _: Move) -> Result<Sample, Error> {
        let Some((batch, rb, transport)) = &self.own else {
            let run = run_options(self.options);
            let stats =
                self.world
                    .run_quantized_move(self.mv, &self.sources, &mut self.dests, &run)?;
            return Ok(Sample::of_run(&stats));
        };
        let src: Vec<&[u8]> = self.sources.values().flatten().map(Vec::as_slice).collect();
        let mut dst: Vec<&mut [u8]> = self
            .dests
            .values_mut()
            .flatten()
            .map(Vec::as_mut_slice)
            .collect();
        let stats = run_rank_batch(
            batch,
            rb,
            &src,
            &mut dst,
            &mut [],
            &**transport,
            self.options,
        )?;
        Ok(Sample::of_rank(&stats))
    }
    fn verify(&mut self, _: Move) -> Result<Checked, Error> {
        let mut checked = Checked::default();
        for (&r, b) in &self.dests {
            let (values, scales) = (
                part(b, QuantizedMove::VALUES),
                part(b, QuantizedMove::SCALES),
            );
            let bytes = verify(self.mv, &self.q, r, values, scales)?;
            checked = checked + Checked::new(bytes, (values.len() + scales.len()) as u64);
        }
        Ok(checked)
    }
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
    let values = &mv.values;
    let Some(rank) = world.rank().filter(|_| world.job().is_some()) else {
        check_memory(
            values.src().shard_bytes() + values.dst().shard_bytes(),
            values.src().shape(),
        )?;
        let (moving, found) = measure(args, mv, fill, options, world, None)?;
        dump_destinations(args, &moving.dests)?;
        report(args, values, &found.of(Move), "local", found.verified);
        return Ok(());
    };
    let highest = values.ranks().last().copied().unwrap_or(0);
    let bytes = |l: &Layout| l.local_bytes(rank);
    let ready = world.check_size(highest).and_then(|()| {
        check_memory(
            bytes(values.src()) + bytes(values.dst()),
            values.src().shape(),
        )
    });
    world.agree("run", ready, || {
        let fp = with_plan(reshard::agreement::Fingerprint::new("run"), "", values)
            .with("--quant (source)", mv.quant.scheme)
            .with("--scale-dtype (source)", mv.quant.scale_dtype)
            .with("--fill", fill)
            .with("--iters", args.iters)
            .with("--warmup", args.warmup)
            .with("--verify", args.verify);
        args.exec.agreed(options, fp)
    })?;
    let outcome =
        measure(args, mv, fill, options, world, Some(rank)).and_then(|(moving, found)| {
            dump_destinations(args, &moving.dests)?;
            Ok(serde_json::json!({
                "transport": world.options().transport.name(),
                "run": found.of(Move).report(),
                "verified": found.verified,
            }))
        });
    process_report(args, values, world, outcome)
}

/// The buffers of this process's ranks (every rank's between threads, `rank`'s between
/// processes) and the harness's repetitions of the move on them.
fn measure<'a, 'w>(
    args: &RunArgs,
    mv: &'a QuantizedMove,
    fill: Fill,
    options: &'a ExecOptions,
    world: &'w World,
    rank: Option<Rank>,
) -> Result<(Moving<'a, 'w>, Comparison<Move>), Error> {
    let q = source(mv, fill)?;
    let ranks = |layout: &Layout| -> Vec<Rank> {
        match rank {
            Some(r) => vec![r],
            None => layout.mesh().ranks().to_vec(),
        }
    };
    let sources = source_shards(args, mv, &q, ranks(mv.values.src()))?;
    let dests = destination_shards(mv, ranks(mv.values.dst()))?;
    let mut moving = Moving {
        mv,
        q,
        sources,
        dests,
        world,
        options,
        own: None,
    };
    let found = compare(&mut moving, args.repeat(), world.job(), &mut || {})?;
    Ok((moving, found))
}
