//! Runs a batch: each rank's part checked against its buffers, lowered to its program
//! ([`super::lower`]: the amax exchange and the scales of the quantized tensors, every move
//! in one schedule, the small tensors packed and unpacked) and run by the executor, or, for
//! every rank as threads, by the driver.

use std::collections::BTreeMap;

use super::lower::lower_batch;
use super::{Batch, Buffer, RankBatch};
use crate::exec::driver::{RankRun, run_threads};
use crate::exec::{ExecOptions, RankStats, RunStats, run_program};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_transport::Transport;

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
pub(crate) fn check_all(
    rb: &RankBatch,
    src: &[usize],
    dst: &[usize],
    scales: &[usize],
) -> Result<()> {
    check(rb.rank, &rb.src, "source", src)?;
    check(rb.rank, &rb.dst, "destination", dst)?;
    check(rb.rank, &rb.scales, "scale", scales)
}

bench_pub! {
/// Runs `rank`'s part of `batch` over `transport`: `src`, `dst` and `scales` are its source,
/// destination and scale buffers, in the order of [`Batch::buffers`] and
/// [`Batch::scale_buffers`] (no scale buffers when nothing is quantized). Lowers its part
/// ([`lower_batch`]) and runs the program.
fn run_rank_batch<T>(
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
    let program = lower_batch(batch, rb, options)?;
    let mut all_dst: Vec<&mut [u8]> = dst
        .iter_mut()
        .map(|b| &mut **b)
        .chain(scales.iter_mut().map(|b| &mut **b))
        .collect();
    run_program(&program, src, &mut all_dst, transport, options)
}
}

/// A rank's buffers of each kind between threads: every rank's, by rank.
pub type RankBuffers = BTreeMap<Rank, Vec<Vec<u8>>>;

bench_pub! {
/// Runs a whole batch with every rank as a thread of this process. `src`, `dst` and `scales`
/// hold every rank's buffers in the order of [`Batch::buffers`] and [`Batch::scale_buffers`]
/// (`scales` may be left empty when nothing is quantized).
fn run_local_batch(
    batch: &Batch,
    src: &RankBuffers,
    dst: &mut RankBuffers,
    scales: &mut RankBuffers,
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
        check_all(
            rb,
            &lens(src.get(&r)),
            &lens(dst.get(&r)),
            &lens(scales.get(&r)),
        )?;
    }
    let mut dst_by_rank: BTreeMap<Rank, &mut Vec<Vec<u8>>> =
        dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut scales_by_rank: BTreeMap<Rank, &mut Vec<Vec<u8>>> =
        scales.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut runs = Vec::with_capacity(plans.len());
    for (&rank, rb) in &plans {
        let mut bufs: Vec<&mut [u8]> = slices(dst_by_rank.remove(&rank));
        bufs.extend(slices(scales_by_rank.remove(&rank)));
        runs.push(RankRun {
            program: lower_batch(batch, rb, options)?,
            src: src
                .get(&rank)
                .unwrap_or(&empty)
                .iter()
                .map(Vec::as_slice)
                .collect(),
            dst: bufs,
        });
    }
    run_threads(runs, options, &[])
}
}

/// A rank's buffers as the executor takes them.
fn slices(buffers: Option<&mut Vec<Vec<u8>>>) -> Vec<&mut [u8]> {
    buffers.map_or_else(Vec::new, |b| b.iter_mut().map(Vec::as_mut_slice).collect())
}
