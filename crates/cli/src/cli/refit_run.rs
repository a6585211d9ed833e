//! `reshard refit --run`: the whole model moved for real, one rank per process, by the batched
//! reshard and by per-tensor gather+broadcast in turn, on the same buffers, every repetition
//! of both verified.

use clap::Args;
use serde::Serialize;

use reshard::agreement::Fingerprint;
use reshard::batch::baseline::{BatchBaseline, run_rank_batch_baseline};
use reshard::batch::{
    Batch, BatchOptions, DEFAULT_PACK_BELOW, Fusion, RankBatch, Tensor, run_rank_batch,
};
use reshard::error::Field;
use reshard::exec::ExecOptions;
use reshard::fill::Fill;
use reshard::model::Refit;
use reshard::runtime::{Links, World};
use reshard::{Error, Layout, PlanOptions, Side};

use super::Failure;
use super::exec_args::{ExecArgs, TransportKind, check_memory};
use super::measure::{Measured, Method, MethodJson, conclude};
use super::refit_quant::QuantCheck;
use super::units::{bytes, parse_bytes};

#[derive(Args, Debug)]
pub struct RefitRunArgs {
    /// Execute the refit: one rank per process (under `reshard launch --nproc N` or `mpirun`),
    /// every tensor filled, moved by reshard and by gather+broadcast in turn, both verified.
    #[arg(long)]
    pub run: bool,
    #[command(flatten)]
    pub exec: ExecArgs,
    /// Timed repetitions of each method.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Untimed repetitions of each method first.
    #[arg(long, default_value_t = 1)]
    pub warmup: u32,
    /// Tensors smaller than this whose source is fully replicated (norms, biases, routers)
    /// go in one packed broadcast per source rank; 0 sends every tensor by reshard.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_PACK_BELOW.to_string())]
    pub pack_below: String,
}

/// The batch of a refit's tensors that `keep` takes, with the fused buffers whose members it
/// all takes, and the refit index of each of its tensors. The fp8 weights of a refit into an
/// fp8 engine are quantized in flight, their scales fused like their weights; with
/// `source_dtype`, their destinations hold the source's dtype instead (what
/// gather+broadcast moves when the refit quantizes). Tensors cast into another float dtype
/// keep it either way: the batch's senders cast them as they pack, gather+broadcast's
/// receivers as they keep them.
pub fn batch_of(
    refit: &Refit,
    plan: PlanOptions,
    pack_below: u64,
    keep: impl Fn(usize) -> bool,
    source_dtype: bool,
) -> Result<(Batch, Vec<usize>), Error> {
    let ids: Vec<usize> = (0..refit.tensors.len()).filter(|&i| keep(i)).collect();
    let mut index = vec![None; refit.tensors.len()];
    ids.iter()
        .enumerate()
        .for_each(|(k, &i)| index[i] = Some(k));
    let tensors = ids
        .iter()
        .map(|&i| {
            let t = &refit.tensors[i];
            let dst = match source_dtype && refit.quant_plan(i).is_some() {
                true => Layout::new(
                    t.dst.shape().to_vec(),
                    t.src.dtype(),
                    t.dst.mesh().clone(),
                    t.dst.placements().to_vec(),
                )?,
                false => t.dst.clone(),
            };
            let quant = match source_dtype {
                true => None,
                false => refit.quant_plan(i).cloned(),
            };
            Ok(Tensor {
                quant,
                ..Tensor::new(t.name.clone(), t.src.clone(), dst)
            })
        })
        .collect::<Result<Vec<_>, reshard::error::LayoutError>>()
        .map_err(|source| Error::Layout {
            side: Side::Dst,
            source,
        })?;
    let fusion = |side| {
        let index = &index;
        move |f: &reshard::model::Fused| {
            let members: Option<Vec<usize>> = f.members.iter().map(|&m| index[m]).collect();
            members.map(|members| Fusion {
                name: f.name.clone(),
                side,
                dim: f.dim,
                members,
            })
        }
    };
    let fusions = refit
        .src_fused
        .iter()
        .filter_map(fusion(Side::Src))
        .chain(refit.dst_fused.iter().filter_map(fusion(Side::Dst)))
        .collect();
    let batch = Batch::new(
        tensors,
        fusions,
        BatchOptions {
            plan,
            pack_below,
            direct: None,
        },
    )?;
    Ok((batch, ids))
}

/// The `run` object added to the refit JSON.
#[derive(Serialize)]
pub struct RunJson {
    transport: String,
    iters: u32,
    verified: bool,
    pack_below: u64,
    dst_bytes: u64,
    /// Into an fp8 engine: bytes of the destinations' scale shards.
    #[serde(skip_serializing_if = "Option::is_none")]
    scale_bytes: Option<u64>,
    reshard: MethodJson,
    gather_broadcast: MethodJson,
    speedup: f64,
}

/// What every rank of a `refit --run` runs: the batch of every tensor (the fp8 weights
/// quantized in flight), and gather+broadcast's batch (every tensor in its source dtype: the
/// same batch when nothing is quantized).
struct Work {
    batch: Batch,
    /// Refit index of each of the batch's tensors.
    ids: Vec<usize>,
    /// Gather+broadcast's own batch, when the refit quantizes.
    full: Option<(Batch, Vec<usize>)>,
    baseline: BatchBaseline,
    /// Every tensor's fill, by refit index.
    fills: Vec<Fill>,
}

impl Work {
    fn baseline_batch(&self) -> (&Batch, &[usize]) {
        match &self.full {
            Some((b, ids)) => (b, ids),
            None => (&self.batch, &self.ids),
        }
    }
}

/// Runs this rank's part; rank 0 returns the report.
///
/// `fingerprint` describes the model and both parallelisms: every rank of the job must run
/// alike ([`Job::agree`]); this adds the batch's every tensor and the run's options.
pub fn main(
    args: &RefitRunArgs,
    refit: &Refit,
    plan: PlanOptions,
    fingerprint: Fingerprint,
) -> Result<Option<RunJson>, Failure> {
    let pack_below = parse_bytes(Field::Flag("--pack-below"), &args.pack_below)?;
    let options = args.exec.options()?;
    let fingerprint = fingerprint.with("--min-split-bytes", plan.min_split_bytes);
    let (batch, ids) = batch_of(refit, plan, pack_below, |_| true, false)?;
    let full = match refit.quant.is_some() {
        true => Some(batch_of(refit, plan, pack_below, |_| true, true)?),
        false => None,
    };
    let fingerprint = agreed(args, &batch, &options, pack_below, fingerprint);
    let baseline = BatchBaseline::new(full.as_ref().map_or(&batch, |f| &f.0))?;
    let fills = (0..refit.tensors.len())
        .map(|i| fill_of(i, refit.quant_plan(i).is_some()))
        .collect();
    let work = Work {
        batch,
        ids,
        full,
        baseline,
        fills,
    };
    let kind = args.exec.transport;
    let threads = || {
        Failure::Input(Error::InvalidOption {
            field: Field::Flag("--run"),
            value: kind.name().into(),
            reason: format!(
                "a refit runs one rank per process: start it with `reshard launch --nproc {} -- refit ... --run` (or under mpirun)",
                refit.world()
            ),
        })
    };
    if kind == TransportKind::Local {
        return Err(threads());
    }
    let world = args.exec.join(&options)?;
    if world.job().is_none() {
        return Err(threads());
    }
    let ready = world.check_size(refit.world().saturating_sub(1));
    world.agree("refit --run", ready, || fingerprint)?;
    run_processes(args, &work, pack_below, &options, &world)
}

/// `fingerprint` with the batch (every tensor's name, shape, dtype, both layouts and
/// quantization, and the fused buffers, as one digest) and the run's options.
fn agreed(
    args: &RefitRunArgs,
    batch: &Batch,
    options: &ExecOptions,
    pack_below: u64,
    fingerprint: Fingerprint,
) -> Fingerprint {
    let describe = |name: &str, src: &reshard::Layout, dst: &reshard::Layout| {
        let shape: Vec<String> = src.shape().iter().map(u64::to_string).collect();
        format!(
            "{} {} {} src {} dst {} {}",
            name,
            shape.join(","),
            src.dtype(),
            src,
            dst,
            dst.dtype()
        )
    };
    let tensors = batch.tensors().iter().map(|t| {
        let scheme = t.quant.as_ref().map(|q| q.quant.scheme.to_string());
        format!(
            "{} {}",
            describe(&t.name, &t.src, &t.dst),
            scheme.unwrap_or_default()
        )
    });
    let fusions = batch
        .fusions()
        .iter()
        .map(|f| format!("{} {:?} {} {:?}", f.name, f.side, f.dim, f.members));
    let fingerprint = fingerprint
        .with("tensors", batch.tensors().len())
        .with_digest("tensor layouts", tensors.chain(fusions))
        .with("--pack-below", pack_below)
        .with("--iters", args.iters)
        .with("--warmup", args.warmup);
    args.exec.agreed(options, fingerprint)
}

/// Every tensor's contents: a hash of the element index, seeded by the tensor's position, so
/// that a block landing in the wrong place, in its own tensor or in another, does not verify.
/// A tensor quantized to fp8 gets finite values of varied magnitude instead (`normal`, also
/// seeded by its position), as the quantizer refuses NaN and infinities.
fn fill_of(tensor: usize, quantized: bool) -> Fill {
    let seed = tensor as u64;
    match quantized {
        true => Fill::Normal { seed },
        false => Fill::Hash { seed },
    }
}

/// Overwrites buffers with a pattern no fill produces everywhere, before every repetition (the
/// destination buffers, and the baseline's full-tensor buffer before each of its own), so
/// that no repetition can verify on the bytes of the one before. Within a repetition the full
/// buffer passes from tensor to tensor unpoisoned: each tensor's own seed keeps the bytes one
/// left behind from verifying as the next one's.
fn poison<'b>(bufs: impl IntoIterator<Item = &'b mut Vec<u8>>) {
    bufs.into_iter()
        .for_each(|b| reshard::memory::fill_around_caches(b, 0xA5));
}

/// Checks every piece of this rank's destination buffers against its tensor's fill (`ids`:
/// the refit index of each of the batch's tensors); the quantized tensors' pieces are
/// [`QuantCheck`]'s.
fn verify(
    batch: &Batch,
    ids: &[usize],
    fills: &[Fill],
    rb: &RankBatch,
    dst: &[Vec<u8>],
) -> Result<(), Error> {
    for (buffer, bytes) in rb.dst.iter().zip(dst) {
        for p in &buffer.pieces {
            let t = &batch.tensors()[p.tensor];
            if t.quant.is_some() {
                continue;
            }
            let layout = &t.dst;
            let piece = &bytes[p.bytes.clone()];
            // the fill in the source dtype, cast as torch's `.to()` casts it
            fills[ids[p.tensor]].verify_converted(
                t.src.dtype(),
                layout,
                &p.region,
                piece,
                (rb.rank, p.bytes.start as u64),
            )?;
        }
    }
    Ok(())
}

fn run_processes(
    args: &RefitRunArgs,
    work: &Work,
    pack_below: u64,
    options: &ExecOptions,
    world: &World,
) -> Result<Option<RunJson>, Failure> {
    let outcome = run_rank(args, work, options, world);
    let Some(reports) = conclude(world, outcome)? else {
        return Ok(None);
    };
    let name = reports.transport();
    let reports = reports.ranks;
    let sum = |key: &str| -> u64 { reports.iter().map(|r| r[key].as_u64().unwrap_or(0)).sum() };
    let dst_bytes = sum("dst_bytes");
    let method = |key: &str| {
        let per_rank: Vec<&serde_json::Value> = reports.iter().map(|r| &r[key]).collect();
        MethodJson::of(&Measured::combine(&per_rank), dst_bytes)
    };
    let (reshard, gather_broadcast) = (method("reshard"), method("gather_broadcast"));
    Ok(Some(RunJson {
        transport: name,
        iters: args.iters,
        // what every rank's checks found (a failed one fails the job before this)
        verified: reports
            .iter()
            .all(|r| r["verified"].as_bool() == Some(true)),
        pack_below,
        dst_bytes,
        scale_bytes: work.full.as_ref().map(|_| sum("scale_bytes")),
        speedup: gather_broadcast.median_s / reshard.median_s.max(1e-12),
        reshard,
        gather_broadcast,
    }))
}

/// A rank's source and destination buffers of a batch.
type Buffers = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// A batch's buffers on one rank: the sources filled, the destinations zeroed.
fn buffers(batch: &Batch, ids: &[usize], fills: &[Fill], rb: &RankBatch) -> Result<Buffers, Error> {
    let rank = rb.rank;
    let zeroed = |len: usize, what: &str| {
        reshard::memory::zeroed(len as u64, || format!("rank {rank}'s {what}"))
    };
    let mut src = rb
        .src
        .iter()
        .map(|b| zeroed(b.len, "source buffer"))
        .collect::<Result<Vec<_>, _>>()?;
    for (buffer, bytes) in rb.src.iter().zip(&mut src) {
        for p in &buffer.pieces {
            let layout = &batch.tensors()[p.tensor].src;
            fills[ids[p.tensor]].fill_region(layout, &p.region, &mut bytes[p.bytes.clone()]);
        }
    }
    let dst = rb
        .dst
        .iter()
        .map(|b| zeroed(b.len, "destination buffer"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((src, dst))
}

/// This rank's buffers, links and both methods in turn; the report for rank 0.
fn run_rank(
    args: &RefitRunArgs,
    work: &Work,
    options: &ExecOptions,
    world: &World,
) -> Result<serde_json::Value, Error> {
    let Some(job) = world.job() else {
        return Err(Error::InvalidOption {
            field: Field::Flag("--run"),
            value: world.options().transport.name().into(),
            reason: "a refit runs one rank per process".into(),
        });
    };
    let rank = job.rank();
    let batch = &work.batch;
    let rb = batch.rank_batch(rank)?;
    let (base_batch, base_ids) = work.baseline_batch();
    let base_rb = match &work.full {
        Some((b, _)) => Some(b.rank_batch(rank)?),
        None => None,
    };
    let mine = work.baseline.for_rank(rank)?;
    let full_len = work.baseline.full_bytes(rank);
    let sizes = |rb: &RankBatch| -> u64 {
        let buffers = rb.src.iter().chain(&rb.dst).chain(&rb.scales);
        buffers.map(|b| b.len as u64).sum()
    };
    let shape = batch
        .tensors()
        .first()
        .map(|t| t.src.shape().to_vec())
        .unwrap_or_default();
    check_memory(
        sizes(&rb) + base_rb.as_ref().map_or(0, sizes) + full_len as u64,
        &shape,
    )?;
    let (src, mut dst) = buffers(batch, &work.ids, &work.fills, &rb)?;
    let mut base = match &base_rb {
        Some(b) => Some(buffers(base_batch, base_ids, &work.fills, b)?),
        None => None,
    };
    let mut scales = QuantCheck::scale_buffers(&rb)?;
    let quant = QuantCheck::new(batch, rank, |i| work.fills[work.ids[i]])?;
    let mut full = reshard::memory::zeroed(full_len as u64, || {
        format!("rank {rank}'s full-tensor buffer")
    })?;

    // Both methods' links, opened one after the other by every rank. MPI's datatypes cover
    // every tensor the job's links will move.
    let layouts = || {
        batch
            .tensors()
            .iter()
            .map(|t| &t.src)
            .chain(base_batch.tensors().iter().map(|t| &t.src))
    };
    job.barrier()?;
    let reshard_transport = world.connect(&Links::of_batch(&rb), layouts(), None)?;
    job.barrier()?;
    let mut links = Links::default();
    for p in mine.parts.iter().flat_map(|(g, b)| [g, b]).flatten() {
        links.senders.extend(p.senders());
        links.receivers.extend(p.receivers());
    }
    let baseline_transport = world.connect(&links, layouts(), None)?;

    let srcs: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
    let (mut reshard, mut gather_broadcast) = (Measured::default(), Measured::default());
    let mut checked = 0;
    for i in 0..args.warmup + args.iters {
        let timed = i >= args.warmup;
        for method in Method::order(i) {
            match method {
                Method::Reshard => {
                    poison(dst.iter_mut().chain(&mut scales));
                    reshard.repeat(job, timed, 0, || {
                        let mut dsts: Vec<&mut [u8]> =
                            dst.iter_mut().map(Vec::as_mut_slice).collect();
                        let mut scale_bufs: Vec<&mut [u8]> =
                            scales.iter_mut().map(Vec::as_mut_slice).collect();
                        run_rank_batch(
                            batch,
                            &rb,
                            &srcs,
                            &mut dsts,
                            &mut scale_bufs,
                            &*reshard_transport,
                            options,
                        )
                    })?;
                    verify(batch, &work.ids, &work.fills, &rb, &dst)?;
                    quant.verify(batch, &rb, &dst, &scales)?;
                }
                Method::GatherBroadcast => {
                    let (b_rb, b_src, b_dst) = match (&base_rb, &mut base) {
                        (Some(r), Some((s, d))) => (r, &*s, d),
                        _ => (&rb, &src, &mut dst),
                    };
                    poison(b_dst.iter_mut());
                    poison([&mut full]);
                    let b_srcs: Vec<&[u8]> = b_src.iter().map(Vec::as_slice).collect();
                    gather_broadcast.repeat(job, timed, full_len as u64, || {
                        let mut dsts: Vec<&mut [u8]> =
                            b_dst.iter_mut().map(Vec::as_mut_slice).collect();
                        let transport = &*baseline_transport;
                        run_rank_batch_baseline(
                            base_batch,
                            &work.baseline,
                            &mine,
                            b_rb,
                            &b_srcs,
                            &mut dsts,
                            &mut full,
                            transport,
                            options,
                        )
                    })?;
                    verify(base_batch, base_ids, &work.fills, b_rb, b_dst)?;
                }
            }
            checked += 1;
        }
    }
    let total = |b: &[reshard::batch::Buffer]| b.iter().map(|b| b.len as u64).sum::<u64>();
    Ok(serde_json::json!({
        "transport": reshard_transport.name(),
        "verified": checked == 2 * (args.warmup + args.iters),
        "dst_bytes": total(&rb.dst),
        "scale_bytes": total(&rb.scales),
        "reshard": reshard.report(),
        "gather_broadcast": gather_broadcast.report(),
    }))
}

/// The text lines of a run.
pub fn describe(run: &RunJson) -> String {
    let line = |name: &str, m: &MethodJson| {
        format!(
            "{name:<18} {:.3} s (min {:.3}, max {:.3}), {:.2} GB/s, {} on the wire, {} extra per rank\n",
            m.median_s,
            m.min_s,
            m.max_s,
            m.gbps,
            bytes(m.wire_bytes),
            bytes(m.peak_extra_bytes_per_rank)
        )
    };
    format!(
        "\nrun over {}, median of {}, every destination byte verified ({} of destination buffers; packed below {})\n{}{}speedup            {:.2}x\n",
        run.transport,
        run.iters,
        bytes(run.dst_bytes),
        bytes(run.pack_below),
        line("reshard", &run.reshard),
        line("gather+broadcast", &run.gather_broadcast),
        run.speedup
    )
}
