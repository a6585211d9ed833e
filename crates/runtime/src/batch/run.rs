//! Runs a batch: packs the small tensors, exchanges the quantized tensors' partial amax and
//! stages their scales, runs every move as one rank's steps, unpacks.

use std::collections::BTreeMap;
use std::time::Instant;

use super::quant::{QuantBuffers, prepare};
use super::{Batch, Buffer, RankBatch};
use crate::exec::threads::{RankThread, joined};
use crate::exec::{ExecOptions, RankStats, RunStats, cut_chunk, run_steps};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_transport::{LocalFabric, Transport};

/// Checks a rank's buffers (`what`: source, destination or scale) against its part of the
/// batch, before any byte moves.
fn check(rank: Rank, expected: &[Buffer], what: &str, lens: &[usize]) -> Result<()> {
    if lens.len() != expected.len() {
        return Err(Error::Batch {
            what: "rank",
            name: rank.to_string(),
            reason: format!(
                "expected {} {what} buffers, got {}",
                expected.len(),
                lens.len()
            ),
        });
    }
    for (buffer, &len) in expected.iter().zip(lens) {
        if buffer.len != len {
            return Err(Error::Batch {
                what: "buffer",
                name: buffer.name.clone(),
                reason: format!(
                    "rank {rank}'s {what} buffer holds {len} bytes, but its layout needs {}",
                    buffer.len
                ),
            });
        }
    }
    Ok(())
}

/// Checks all three kinds of a rank's buffers.
fn check_all(rb: &RankBatch, src: &[usize], dst: &[usize], scales: &[usize]) -> Result<()> {
    check(rb.rank, &rb.src, "source", src)?;
    check(rb.rank, &rb.dst, "destination", dst)?;
    check(rb.rank, &rb.scales, "scale", scales)
}

/// The options every rank of `batch` runs with: when any tensor converts, chunks of whole
/// elements of every dtype for every transfer, so that the ends of a transfer cut it alike
/// whether or not their own other steps convert.
fn batch_options(batch: &Batch, options: &ExecOptions) -> ExecOptions {
    ExecOptions {
        chunk_bytes: cut_chunk(options.chunk_bytes, batch.converts()),
        ..options.clone()
    }
}

/// Runs `rank`'s part of `batch` over `transport`: `src`, `dst` and `scales` are its source,
/// destination and scale buffers, in the order of [`Batch::buffers`] and
/// [`Batch::scale_buffers`] (no scale buffers when nothing is quantized).
pub fn run_rank_batch<T>(
    batch: &Batch,
    rb: &RankBatch,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    scales: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let lens = |b: &[&mut [u8]]| b.iter().map(|b| b.len()).collect::<Vec<_>>();
    let src_lens: Vec<usize> = src.iter().map(|b| b.len()).collect();
    check_all(rb, &src_lens, &lens(dst), &lens(scales))?;
    let (mut root_blobs, mut received) = rb.blobs()?;
    rb.pack(batch, src, &mut root_blobs);
    let mut quant = rb.quant_buffers(batch)?;
    run_packed(
        batch,
        rb,
        src,
        &root_blobs,
        &mut quant,
        &mut received,
        dst,
        scales,
        transport,
        &batch_options(batch, options),
    )
}

/// Runs `rank`'s steps once its rooted blobs are packed: the amax exchange and the scales of
/// its quantized tensors, then every move; then unpacks what it received. The staged scales
/// and the blobs follow the rank's own buffers ([`RankBatch`] says in which order).
#[allow(clippy::too_many_arguments)]
fn run_packed<'buf, T: Transport<'buf> + ?Sized>(
    batch: &Batch,
    rb: &'buf RankBatch,
    src: &[&'buf [u8]],
    root_blobs: &'buf [Vec<u8>],
    quant: &'buf mut QuantBuffers,
    received: &mut [Vec<u8>],
    dst: &mut [&mut [u8]],
    scales: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats> {
    let staging = quant.len();
    let (casts, staged) = prepare(batch, rb, src, quant, transport, options)?;
    let steps = rb.steps(Some(&casts))?;
    let mut stats = {
        let all_src: Vec<&'buf [u8]> = src
            .iter()
            .copied()
            .chain(staged.iter().map(Vec::as_slice))
            .chain(root_blobs.iter().map(Vec::as_slice))
            .collect();
        let mut all_dst: Vec<&mut [u8]> = dst
            .iter_mut()
            .map(|b| &mut **b)
            .chain(scales.iter_mut().map(|b| &mut **b))
            .chain(received.iter_mut().map(Vec::as_mut_slice))
            .collect();
        run_steps(&steps, &all_src, &mut all_dst, transport, options)?
    };
    stats.rank = rb.rank;
    stats.bytes_local += rb.unpack(batch, root_blobs, received, dst);
    let blobs: usize = root_blobs.iter().chain(&*received).map(Vec::len).sum();
    stats.peak_staging_bytes += (blobs + staging) as u64;
    Ok(stats)
}

/// A rank's buffers as the executor takes them.
fn slices(buffers: Option<&mut Vec<Vec<u8>>>) -> Vec<&mut [u8]> {
    buffers.map_or_else(Vec::new, |b| b.iter_mut().map(Vec::as_mut_slice).collect())
}

/// A rank's buffers of each kind between threads: every rank's, by rank.
pub type RankBuffers = BTreeMap<Rank, Vec<Vec<u8>>>;

/// Runs a whole batch with every rank as a thread of this process. `src`, `dst` and `scales`
/// hold every rank's buffers in the order of [`Batch::buffers`] and [`Batch::scale_buffers`]
/// (`scales` may be left empty when nothing is quantized).
pub fn run_local_batch(
    batch: &Batch,
    src: &RankBuffers,
    dst: &mut RankBuffers,
    scales: &mut RankBuffers,
    options: &ExecOptions,
) -> Result<RunStats> {
    options.validate()?;
    let options = &batch_options(batch, options);
    let ranks: Vec<Rank> = (0..batch.world()).collect();
    let plans: BTreeMap<Rank, RankBatch> = ranks
        .iter()
        .map(|&r| Ok((r, batch.rank_batch(r)?)))
        .collect::<Result<_>>()?;
    let empty: Vec<Vec<u8>> = Vec::new();
    for (&r, rb) in &plans {
        let lens = |m: Option<&Vec<Vec<u8>>>| -> Vec<usize> {
            m.unwrap_or(&empty).iter().map(Vec::len).collect()
        };
        check_all(
            rb,
            &lens(src.get(&r)),
            &lens(dst.get(&r)),
            &lens(scales.get(&r)),
        )?;
    }
    let pairs: std::collections::BTreeSet<(Rank, Rank)> = plans
        .values()
        .flat_map(|rb| rb.moves.iter().chain(&rb.amax))
        .filter(|m| m.from != m.to)
        .map(|m| (m.from, m.to))
        .collect();
    // blobs and staging live outside the threads, as long as the links that lend them
    let mut blobs: BTreeMap<Rank, (super::Blobs, QuantBuffers)> = plans
        .iter()
        .map(|(&r, rb)| Ok((r, (rb.blobs()?, rb.quant_buffers(batch)?))))
        .collect::<Result<_>>()?;
    let fabric = LocalFabric {
        timeout: options.timeout,
        faults: Vec::new(),
    };
    let mut endpoints = fabric.endpoints(&ranks, pairs);
    let started = Instant::now();
    let mut dst_by_rank: BTreeMap<Rank, &mut Vec<Vec<u8>>> =
        dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut scales_by_rank: BTreeMap<Rank, &mut Vec<Vec<u8>>> =
        scales.iter_mut().map(|(&r, b)| (r, b)).collect();
    let results: Vec<Result<RankStats>> = std::thread::scope(|scope| {
        let handles: Vec<_> = blobs
            .iter_mut()
            .map(|(&rank, ((root_blobs, received), quant))| {
                let rb = &plans[&rank];
                let srcs: Vec<&[u8]> = src
                    .get(&rank)
                    .unwrap_or(&empty)
                    .iter()
                    .map(Vec::as_slice)
                    .collect();
                let dsts = dst_by_rank.remove(&rank);
                let scales = scales_by_rank.remove(&rank);
                let endpoint = endpoints.remove(&rank);
                let spawned = std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(scope, move || -> Result<RankStats> {
                        rb.pack(batch, &srcs, root_blobs);
                        let root_blobs: &Vec<Vec<u8>> = root_blobs;
                        let (mut dsts, mut scales) = (slices(dsts), slices(scales));
                        let endpoint = endpoint.ok_or_else(|| Error::Internal {
                            rank,
                            detail: "the rank has no endpoint".into(),
                        })?;
                        let endpoint = &endpoint;
                        run_packed(
                            batch,
                            rb,
                            &srcs,
                            root_blobs,
                            quant,
                            received,
                            &mut dsts,
                            &mut scales,
                            endpoint,
                            options,
                        )
                    });
                (rank, spawned)
            })
            .collect();
        // a thread that could not start dropped its endpoint: its peers see it gone
        handles
            .into_iter()
            .map(|(rank, h)| joined(h, rank, RankThread::Rank))
            .collect()
    });
    RunStats::gather(started.elapsed(), results)
}
