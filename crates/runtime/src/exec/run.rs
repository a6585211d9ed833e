//! Runs one rank's steps on a transport: the sends, the local copies, the receives, and the
//! report of what did not arrive.

use std::collections::BTreeMap;

use super::options::ExecOptions;
use super::progress::{Due, Progress, Sent};
use super::quant::{self, QuantJob};
use super::stats::RankStats;
use super::steps::{Step, Steps, check_job, check_steps, cut_chunk};
use crate::exec::threads::{RankThread, joined};
use reshard_core::checksum;
use reshard_core::copy::{Cast, CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{RankPlan, Transfer};
use reshard_core::region::Region;
use reshard_transport::{Lands, Outgoing, Receive, Transport};

/// One rank's share of a run: its plan and its shards.
pub struct RankJob<'buf, 'dst> {
    pub plan: &'buf RankPlan,
    /// The source layout: where every sender's shard lies.
    pub src_layout: &'buf Layout,
    /// The rank's source box and shard, if it is a source.
    pub src: Option<(&'buf Region, &'buf [u8])>,
    /// The rank's destination box and shard, if it is a destination.
    pub dst: Option<(&'buf Region, &'dst mut [u8])>,
    /// The destination's dtype (`--dst-dtype`): when it differs from the source layout's,
    /// this rank converts what it sends and copies locally, and its destination shard holds
    /// elements of this dtype.
    pub dst_dtype: reshard_core::DType,
    /// With `--quant`: the amax exchange before the values, the scales beside them.
    pub quant: Option<QuantJob<'buf, 'dst>>,
}

/// Runs one rank's part of a plan over `transport`.
pub fn run_rank<'buf, T: Transport<'buf> + ?Sized>(
    job: RankJob<'buf, '_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats> {
    let RankJob {
        plan,
        src_layout,
        src,
        dst,
        dst_dtype,
        quant,
    } = job;
    let rank = plan.rank;
    if plan.relays() {
        return Err(Error::Internal {
            rank,
            detail: "a relay plan runs round by round (exec::run_rank_relayed)".into(),
        });
    }
    // transfers move destination elements; the sender converts while it packs
    let elem_bytes = dst_dtype.size();
    let quant_plan = quant.as_ref().map(|q| (q.plan, q.rank));
    let cast = match &quant {
        Some(_) => None,
        None => Cast::between(src_layout.dtype(), dst_dtype).map_err(|source| Error::Convert {
            tensor: "tensor".into(),
            source,
        })?,
    };
    check_job(
        plan,
        src_layout.dtype().size(),
        elem_bytes,
        src,
        dst.as_ref().map(|(b, d)| (*b, d.len())),
    )?;
    if let Some(q) = &quant {
        quant::check(q, rank, src.is_some())?;
    }
    // every sender's box, for the receives
    let senders: BTreeMap<Rank, Region> = plan
        .recvs
        .iter()
        .map(|t| {
            let b = src_layout
                .local_region(t.src)
                .ok_or_else(|| Error::Protocol {
                    rank,
                    peer: t.src,
                    detail: "the plan receives from a rank that is not a source".into(),
                })?;
            Ok((t.src, b))
        })
        .collect::<Result<_>>()?;
    // quantizing: the amax first (exchanged where a block straddles source shards), then
    // the scales this rank stages for its scale transfers, and the cast of its values
    let (cast, staged, scale_shard) = match quant {
        None => (cast, None, None),
        Some(q) => {
            let (prepared, scales) = quant::prepare(q, rank, src_layout, src, transport, options)?;
            (Some(prepared.cast), Some(prepared.staged), scales)
        }
    };
    let src_len = src.map_or(0, |s| s.1.len());
    let dst_len = dst.as_ref().map_or(0, |d| d.1.len());
    let step = |t: &'buf Transfer, src_box: &'buf Region, dst_box: &'buf Region| Step {
        from: t.src,
        to: t.dst,
        region: &t.region,
        elem_bytes,
        src_box,
        dst_box,
        src_at: Some((0, 0..src_len)),
        dst_at: Some((0, 0..dst_len)),
        cast: cast.clone(),
        // the values: into the destination shard (the scales follow, aside)
        lands: Lands::Shard,
    };
    let (src_box, dst_box) = (src.map(|s| s.0), dst.as_ref().map(|d| d.0));
    let mut steps = Steps {
        rank,
        ..Steps::default()
    };
    if let Some(src_box) = src_box {
        steps.sends = plan
            .sends
            .iter()
            .map(|t| step(t, src_box, &t.region))
            .collect();
        if let Some(dst_box) = dst_box {
            steps.locals = plan
                .locals
                .iter()
                .map(|t| step(t, src_box, dst_box))
                .collect();
        }
    }
    if let Some(dst_box) = dst_box {
        steps.recvs = plan
            .recvs
            .iter()
            .map(|t| Step {
                src_box: &senders[&t.src],
                src_at: None,
                ..step(t, &t.region, dst_box)
            })
            .collect();
    }
    let mut src_bufs: Vec<&'buf [u8]> = src.map(|s| s.1).into_iter().collect();
    let mut dst_bufs: Vec<&mut [u8]> = dst.map(|d| d.1).into_iter().collect();
    // the scales ride after the values, in the same order on both ends of every pair
    let sender_blocks: BTreeMap<Rank, Region> = match quant_plan {
        Some((qp, _)) => senders
            .iter()
            .map(|(&r, b)| (r, qp.grid.blocks_touching(b)))
            .collect(),
        None => BTreeMap::new(),
    };
    if let Some((qp, part)) = quant_plan {
        let src_buf = staged.filter(|_| src.is_some()).map(|s| {
            src_bufs.push(s);
            src_bufs.len() - 1
        });
        let dst_buf = scale_shard.map(|s| {
            dst_bufs.push(s);
            dst_bufs.len() - 1
        });
        let extra = quant::scale_steps(qp, part, &sender_blocks, src_buf, dst_buf);
        steps.sends.extend(extra.sends);
        steps.recvs.extend(extra.recvs);
        steps.locals.extend(extra.locals);
    }
    run_steps(&steps, &src_bufs, &mut dst_bufs, transport, options)
}

/// Runs one rank's steps over `transport`: the sends on one thread, the local copies and the
/// receives on another (or all on one when the transport's sends never block). A failure on
/// either side breaks every link; the error lists exactly what did not arrive.
pub fn run_steps<'buf, T: Transport<'buf> + ?Sized>(
    steps: &Steps<'buf, '_>,
    src_bufs: &[&'buf [u8]],
    dst_bufs: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats> {
    let rank = steps.rank;
    let converts = [&steps.sends, &steps.recvs, &steps.locals]
        .iter()
        .any(|list| list.iter().any(|s| s.cast.is_some()));
    let chunk = cut_chunk(options.chunk_bytes, converts);
    check_steps(steps, src_bufs, dst_bufs)?;
    let mut stats = RankStats {
        rank,
        ..RankStats::default()
    };
    // `check_steps` made sure every slot is in range
    let source = |s: &Step<'_>| -> &'buf [u8] {
        let (b, bytes) = s.src_at.clone().expect("checked");
        &src_bufs[b][bytes]
    };

    let send_all = || -> Result<Sent> {
        let mut sent = Sent::default();
        // with --checksum: every receiver's chunk sums, in the order they are sent
        let mut sums: BTreeMap<Rank, Vec<u32>> = BTreeMap::new();
        for s in &steps.sends {
            let len = s.bytes() as usize;
            let chunk = transport.chunking().chunk_bytes(len, chunk);
            let src = source(s);
            let mut peer_sums = options.checksum.then(|| sums.entry(s.to).or_default());
            for range in checksum::chunks(len, chunk) {
                let out = Outgoing {
                    from: rank,
                    to: s.to,
                    src,
                    src_box: s.src_box,
                    region: s.region,
                    elem_bytes: s.elem_bytes,
                    range,
                    cast: s.cast.clone(),
                    lands: s.lands,
                };
                match peer_sums.as_deref_mut() {
                    // summed by the transport as it reads the bytes, where it can
                    Some(peer_sums) => peer_sums.push(transport.send_summed(out)?),
                    None => transport.send(out)?,
                }
                sent.chunk_sent();
            }
            sent.transfer_sent(len as u64);
        }
        // the sums follow every chunk to their receiver
        for (peer, peer_sums) in sums {
            transport.send_sums(peer, peer_sums)?;
        }
        Ok(sent)
    };

    let receive_all = |stats: &mut RankStats,
                       progress: &mut Progress,
                       dst_bufs: &mut [&mut [u8]]|
     -> Result<()> {
        for s in &steps.locals {
            let (b, bytes) = s.dst_at.clone().expect("checked");
            let g = CopyGeometry::converting(
                s.region,
                Place::Within(s.src_box),
                Place::Within(s.dst_box),
                s.elem_bytes,
                s.cast.clone(),
            );
            g.copy(source(s), &mut dst_bufs[b][bytes], 0..g.len());
            stats.bytes_local += g.len() as u64;
        }
        let expected: Vec<Receive<'_>> = steps
            .recvs
            .iter()
            .map(|s| {
                let (buffer, bytes) = s.dst_at.clone().expect("checked");
                Receive {
                    from: s.from,
                    to: rank,
                    region: s.region,
                    src_box: s.src_box,
                    dst_box: s.dst_box,
                    elem_bytes: s.elem_bytes,
                    buffer,
                    bytes,
                    lands: s.lands,
                }
            })
            .collect();
        // a transport that reports a transfer twice, or one never asked for, fails the
        // rank once its receives return
        let mut refused = None;
        let landed = &mut |i: usize| {
            if let Err(e) = progress.transfer_landed(i) {
                refused.get_or_insert(e);
            }
        };
        transport.recv_all(&expected, dst_bufs, chunk, landed)?;
        if let Some(e) = refused {
            return Err(e);
        }
        if options.checksum {
            check_sums(steps, dst_bufs, transport, chunk, progress)?;
        }
        Ok(())
    };

    // A failure on either side breaks every link at once, so that the other side and the
    // peers stop now rather than at their timeouts.
    let give_up_on = |e: &Error| {
        tracing::warn!(rank, error = %e, "failed: breaking every link");
        transport.abort();
    };
    let mut progress = Progress::new(
        rank,
        steps
            .recvs
            .iter()
            .map(|s| {
                let bytes = s.bytes();
                let len = bytes as usize;
                Due {
                    from: s.from,
                    bytes,
                    chunks: len.div_ceil(transport.chunking().chunk_bytes(len, chunk)) as u64,
                }
            })
            .collect(),
    );
    let started = std::time::Instant::now();
    // the transport counts over its life; this run's share is the difference
    let direct_before = transport.direct_bytes();
    let (sent, received) = if !transport.sends_block() {
        // everything is posted first, then received, on this one thread
        let sent = send_all().inspect_err(give_up_on);
        let received = match &sent {
            Ok(_) => receive_all(&mut stats, &mut progress, dst_bufs).inspect_err(give_up_on),
            Err(_) => Err(Error::Internal {
                rank,
                detail: "nothing was received: sending failed first".into(),
            }),
        };
        (sent, received)
    } else {
        std::thread::scope(|scope| {
            let sender = std::thread::Builder::new()
                .spawn_scoped(scope, || send_all().inspect_err(give_up_on));
            if sender.is_err() {
                transport.abort();
            }
            let received = receive_all(&mut stats, &mut progress, dst_bufs).inspect_err(give_up_on);
            let sent = joined(sender, rank, RankThread::Sender);
            (sent, received)
        })
    };
    // Report everything that went wrong, and exactly what did not arrive.
    if let Err(e) = received {
        progress.failed(e);
    }
    let moved_counts = progress.outcome(sent)?;
    let moved = started.elapsed();
    transport.finish()?;
    tracing::debug!(
        rank,
        transport = transport.name(),
        moved_ms = moved.as_secs_f64() * 1e3,
        finished_ms = started.elapsed().as_secs_f64() * 1e3,
        bytes_received = moved_counts.bytes_received,
        bytes_sent = moved_counts.bytes_sent,
        "rank done"
    );
    stats.bytes_received = moved_counts.bytes_received;
    stats.chunks_received = moved_counts.chunks_received;
    stats.bytes_sent = moved_counts.bytes_sent;
    stats.chunks_sent = moved_counts.chunks_sent;
    stats.peak_staging_bytes = transport.peak_staging_bytes();
    stats.bytes_direct = transport.direct_bytes().saturating_sub(direct_before);
    Ok(stats)
}

/// With `--checksum`, once every transfer has landed: takes each sender's sums (sent after
/// its last chunk to this rank) and compares them with what landed. A transfer that differs
/// is marked as not arrived; the error names the first one.
fn check_sums<'buf, T: Transport<'buf> + ?Sized>(
    steps: &Steps<'_, '_>,
    dst_bufs: &[&mut [u8]],
    transport: &T,
    chunk: usize,
    progress: &mut Progress,
) -> Result<()> {
    // each sender's transfers, in their order
    let mut senders: BTreeMap<Rank, Vec<usize>> = BTreeMap::new();
    for (i, s) in steps.recvs.iter().enumerate() {
        senders.entry(s.from).or_default().push(i);
    }
    let mut first = None;
    for (peer, transfers) in senders {
        let sums = transport.recv_sums(peer)?;
        let mut rest = &sums[..];
        for i in transfers {
            let s = &steps.recvs[i];
            let (b, bytes) = s.dst_at.clone().expect("checked");
            let len = s.bytes() as usize;
            let landed = checksum::Landed {
                from: s.from,
                to: s.to,
                region: s.region,
                elem_bytes: s.elem_bytes,
                shard: &dst_bufs[b][bytes],
                dst_box: s.dst_box,
                chunk: transport.chunking().chunk_bytes(len, chunk),
            };
            let n = landed.chunk_count().min(rest.len());
            let (mine, later) = rest.split_at(n);
            rest = later;
            if let Err(e) = landed.check(mine) {
                progress.corrupt(i)?;
                first.get_or_insert(e);
            }
        }
        if !rest.is_empty() {
            return Err(Error::Protocol {
                rank: steps.rank,
                peer,
                detail: format!("sent {} checksums more than the chunks it sent", rest.len()),
            });
        }
    }
    first.map_or(Ok(()), Err)
}
