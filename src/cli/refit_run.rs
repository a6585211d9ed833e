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
use reshard::{Error, PlanOptions, Side};

use super::Failure;
use super::exec_args::{ExecArgs, TransportKind, check_memory};
use super::measure::{Measured, Method, MethodJson, conclude};
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

/// The batch of a refit: every tensor, and the fused buffers of both sides.
pub fn batch_of(refit: &Refit, plan: PlanOptions, pack_below: u64) -> Result<Batch, Error> {
    let tensors = refit
        .tensors
        .iter()
        .map(|t| Tensor {
            name: t.name.clone(),
            src: t.src.clone(),
            dst: t.dst.clone(),
        })
        .collect();
    let fusion = |side| {
        move |f: &reshard::model::Fused| Fusion {
            name: f.name.clone(),
            side,
            dim: f.dim,
            members: f.members.clone(),
        }
    };
    let fusions = refit
        .src_fused
        .iter()
        .map(fusion(Side::Src))
        .chain(refit.dst_fused.iter().map(fusion(Side::Dst)))
        .collect();
    Batch::new(tensors, fusions, BatchOptions { plan, pack_below })
}

/// The `run` object added to the refit JSON.
#[derive(Serialize)]
pub struct RunJson {
    transport: String,
    iters: u32,
    verified: bool,
    pack_below: u64,
    dst_bytes: u64,
    reshard: MethodJson,
    gather_broadcast: MethodJson,
    speedup: f64,
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
    let batch = batch_of(refit, plan, pack_below)?;
    let fingerprint = agreed(args, &batch, &options, pack_below, fingerprint);
    let baseline = BatchBaseline::new(&batch)?;
    let kind = args.exec.transport;
    let threads = || {
        Failure::Input(Error::InvalidOption {
            field: Field::Flag("--run"),
            value: kind.name().into(),
            reason: format!(
                "a refit runs one rank per process: start it with `reshard launch --nproc {} -- refit ... --run` (or under mpirun)",
                batch.world()
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
    let ready = world.check_size(batch.world().saturating_sub(1));
    world.agree("refit --run", ready, || fingerprint)?;
    run_processes(args, &batch, &baseline, pack_below, &options, &world)
}

/// `fingerprint` with the batch (every tensor's name, shape, dtype and both layouts, and
/// the fused buffers, as one digest) and the run's options.
fn agreed(
    args: &RefitRunArgs,
    batch: &Batch,
    options: &ExecOptions,
    pack_below: u64,
    fingerprint: Fingerprint,
) -> Fingerprint {
    let tensors = batch.tensors().iter().map(|t| {
        let shape: Vec<String> = t.src.shape().iter().map(u64::to_string).collect();
        format!(
            "{} {} {} src {} dst {}",
            t.name,
            shape.join(","),
            t.src.dtype(),
            t.src,
            t.dst
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
fn fill_of(tensor: usize) -> Fill {
    Fill::Hash {
        seed: tensor as u64,
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

/// Checks every piece of this rank's destination buffers against its tensor's fill.
fn verify(batch: &Batch, rb: &RankBatch, dst: &[Vec<u8>]) -> Result<(), Error> {
    for (buffer, bytes) in rb.dst.iter().zip(dst) {
        for p in &buffer.pieces {
            let layout = &batch.tensors()[p.tensor].dst;
            let piece = &bytes[p.bytes.clone()];
            fill_of(p.tensor).verify_region(
                layout,
                &p.region,
                piece,
                (rb.rank, p.bytes.start as u64),
            )?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_processes(
    args: &RefitRunArgs,
    batch: &Batch,
    baseline: &BatchBaseline,
    pack_below: u64,
    options: &ExecOptions,
    world: &World,
) -> Result<Option<RunJson>, Failure> {
    let outcome = run_rank(args, batch, baseline, options, world);
    let Some(reports) = conclude(world, outcome)? else {
        return Ok(None);
    };
    let name = reports.transport();
    let reports = reports.ranks;
    let dst_bytes: u64 = reports
        .iter()
        .map(|r| r["dst_bytes"].as_u64().unwrap_or(0))
        .sum();
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
        speedup: gather_broadcast.median_s / reshard.median_s.max(1e-12),
        reshard,
        gather_broadcast,
    }))
}

/// This rank's buffers, links and both methods in turn; the report for rank 0.
fn run_rank(
    args: &RefitRunArgs,
    batch: &Batch,
    baseline: &BatchBaseline,
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
    // MPI's datatypes cover every tensor the job's links will move
    let connect =
        |links: &Links| world.connect(links, batch.tensors().iter().map(|t| &t.src), None);
    let rank = job.rank();
    let rb = batch.rank_batch(rank)?;
    let mine = baseline.for_rank(rank)?;
    let full_len = baseline.full_bytes(rank);
    let src_len: usize = rb.src.iter().map(|b| b.len).sum();
    let dst_len: usize = rb.dst.iter().map(|b| b.len).sum();
    let shape = batch
        .tensors()
        .first()
        .map(|t| t.src.shape().to_vec())
        .unwrap_or_default();
    check_memory((src_len + dst_len + full_len) as u64, &shape)?;
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
            fill_of(p.tensor).fill_region(layout, &p.region, &mut bytes[p.bytes.clone()]);
        }
    }
    let mut dst = rb
        .dst
        .iter()
        .map(|b| zeroed(b.len, "destination buffer"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut full = zeroed(full_len, "full-tensor buffer")?;

    // Both methods' links, opened one after the other by every rank.
    job.barrier()?;
    let reshard_transport = connect(&Links::of_batch(&rb))?;
    job.barrier()?;
    let mut links = Links::default();
    for p in mine.parts.iter().flat_map(|(g, b)| [g, b]).flatten() {
        links.senders.extend(p.senders());
        links.receivers.extend(p.receivers());
    }
    let baseline_transport = connect(&links)?;

    let srcs: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
    let (mut reshard, mut gather_broadcast) = (Measured::default(), Measured::default());
    let mut checked = 0;
    for i in 0..args.warmup + args.iters {
        let timed = i >= args.warmup;
        for method in Method::order(i) {
            poison(&mut dst);
            if method == Method::GatherBroadcast {
                poison([&mut full]);
            }
            match method {
                Method::Reshard => reshard.repeat(job, timed, 0, || {
                    let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
                    run_rank_batch(batch, &rb, &srcs, &mut dsts, &*reshard_transport, options)
                })?,
                Method::GatherBroadcast => {
                    gather_broadcast.repeat(job, timed, full_len as u64, || {
                        let mut dsts: Vec<&mut [u8]> =
                            dst.iter_mut().map(Vec::as_mut_slice).collect();
                        let transport = &*baseline_transport;
                        run_rank_batch_baseline(
                            batch, baseline, &mine, &rb, &srcs, &mut dsts, &mut full, transport,
                            options,
                        )
                    })?
                }
            }
            verify(batch, &rb, &dst)?;
            checked += 1;
        }
    }
    Ok(serde_json::json!({
        "transport": reshard_transport.name(),
        "verified": checked == 2 * (args.warmup + args.iters),
        "dst_bytes": dst_len,
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
