//! Runs a batch: packs the small tensors, runs every move as one rank's steps, unpacks.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{Batch, RankBatch};
use crate::error::{Error, Result, Side};
use crate::exec::threads::{RankThread, joined};
use crate::exec::{ExecOptions, RankStats, RunStats, run_steps};
use crate::layout::Rank;
use crate::transport::{LocalFabric, Transport};

/// Checks a rank's buffers against its part of the batch, before any byte moves.
fn check(rb: &RankBatch, side: Side, lens: &[usize]) -> Result<()> {
    let expected = if side == Side::Src { &rb.src } else { &rb.dst };
    if lens.len() != expected.len() {
        return Err(Error::Batch {
            what: "rank",
            name: rb.rank.to_string(),
            reason: format!(
                "expected {} {side} buffers, got {}",
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
                    "rank {}'s {side} buffer holds {len} bytes, but its layout needs {}",
                    rb.rank, buffer.len
                ),
            });
        }
    }
    Ok(())
}

/// Runs `rank`'s part of `batch` over `transport`: `src` and `dst` are its buffers, in the
/// order of [`Batch::buffers`].
pub fn run_rank_batch<T>(
    batch: &Batch,
    rb: &RankBatch,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    check(
        rb,
        Side::Src,
        &src.iter().map(|b| b.len()).collect::<Vec<_>>(),
    )?;
    check(
        rb,
        Side::Dst,
        &dst.iter().map(|b| b.len()).collect::<Vec<_>>(),
    )?;
    let (mut root_blobs, mut received) = rb.blobs()?;
    rb.pack(batch, src, &mut root_blobs);
    run_packed(
        batch,
        rb,
        src,
        &root_blobs,
        &mut received,
        dst,
        transport,
        options,
    )
}

/// Runs `rank`'s steps once its rooted blobs are packed, then unpacks what it received: the
/// blobs follow the rank's own buffers, on both sides.
#[allow(clippy::too_many_arguments)]
fn run_packed<'buf, T: Transport<'buf> + ?Sized>(
    batch: &Batch,
    rb: &'buf RankBatch,
    src: &[&'buf [u8]],
    root_blobs: &'buf [Vec<u8>],
    received: &mut [Vec<u8>],
    dst: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats> {
    let steps = rb.steps();
    let mut stats = {
        let all_src: Vec<&'buf [u8]> = src
            .iter()
            .copied()
            .chain(root_blobs.iter().map(Vec::as_slice))
            .collect();
        let mut all_dst: Vec<&mut [u8]> = dst
            .iter_mut()
            .map(|b| &mut **b)
            .chain(received.iter_mut().map(Vec::as_mut_slice))
            .collect();
        run_steps(&steps, &all_src, &mut all_dst, transport, options)?
    };
    stats.rank = rb.rank;
    stats.bytes_local += rb.unpack(batch, root_blobs, received, dst);
    let blobs: usize = root_blobs.iter().chain(&*received).map(Vec::len).sum();
    stats.peak_staging_bytes += blobs as u64;
    Ok(stats)
}

/// Runs a whole batch with every rank as a thread of this process. `src` and `dst` hold every
/// rank's buffers in the order of [`Batch::buffers`].
pub fn run_local_batch(
    batch: &Batch,
    src: &BTreeMap<Rank, Vec<Vec<u8>>>,
    dst: &mut BTreeMap<Rank, Vec<Vec<u8>>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    options.validate()?;
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
        check(rb, Side::Src, &lens(src.get(&r)))?;
        check(rb, Side::Dst, &lens(dst.get(&r)))?;
    }
    let pairs: std::collections::BTreeSet<(Rank, Rank)> = plans
        .values()
        .flat_map(|rb| rb.moves.iter())
        .filter(|m| m.from != m.to)
        .map(|m| (m.from, m.to))
        .collect();
    // blobs live outside the threads, as long as the links that lend them
    let mut blobs: BTreeMap<Rank, super::Blobs> = plans
        .iter()
        .map(|(&r, rb)| Ok((r, rb.blobs()?)))
        .collect::<Result<_>>()?;
    let fabric = LocalFabric {
        timeout: options.timeout,
        faults: Vec::new(),
    };
    let mut endpoints = fabric.endpoints(&ranks, pairs);
    let started = Instant::now();
    let mut dst_by_rank: BTreeMap<Rank, &mut Vec<Vec<u8>>> =
        dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let results: Vec<Result<RankStats>> = std::thread::scope(|scope| {
        let handles: Vec<_> = blobs
            .iter_mut()
            .map(|(&rank, (root_blobs, received))| {
                let rb = &plans[&rank];
                let srcs: Vec<&[u8]> = src
                    .get(&rank)
                    .unwrap_or(&empty)
                    .iter()
                    .map(Vec::as_slice)
                    .collect();
                let dsts = dst_by_rank.remove(&rank);
                let endpoint = endpoints.remove(&rank);
                let spawned = std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(scope, move || -> Result<RankStats> {
                        rb.pack(batch, &srcs, root_blobs);
                        let root_blobs: &Vec<Vec<u8>> = root_blobs;
                        let mut mine: Vec<&mut [u8]> = match dsts {
                            Some(d) => d.iter_mut().map(Vec::as_mut_slice).collect(),
                            None => Vec::new(),
                        };
                        let endpoint = endpoint.ok_or_else(|| Error::Internal {
                            rank,
                            detail: "the rank has no endpoint".into(),
                        })?;
                        let endpoint = &endpoint;
                        run_packed(
                            batch, rb, &srcs, root_blobs, received, &mut mine, endpoint, options,
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
