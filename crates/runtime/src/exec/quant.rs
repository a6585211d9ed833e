//! A rank's part of a quantizing reshard (`--quant`) before and beside its values: the local
//! amax of its shard, the exchange of partial amax with the source ranks that share a block
//! (an ordinary run of planned transfers on the same transport, in scale grid coordinates),
//! the scales, and the scale transfers that ride along with the values.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::options::ExecOptions;
use super::run::run_steps;
use super::steps::{Step, Steps};
use reshard_core::convert::{AmaxGrid, Scales};
use reshard_core::copy::{Cast, Quantizer};
use reshard_core::error::{Dims, Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::quant::AMAX_BYTES;
use reshard_core::plan::{QuantPlan, QuantRankPlan};
use reshard_core::region::Region;
use reshard_transport::{Lands, Transport};

/// One rank's quantization job, beside its [`super::RankJob`].
pub struct QuantJob<'buf, 'dst> {
    /// The tensor's name, for errors.
    pub tensor: &'buf str,
    pub plan: &'buf QuantPlan,
    pub rank: &'buf QuantRankPlan,
    /// Staging of [`QuantRankPlan::stage_bytes`]: the partial amax this rank sends, then its
    /// scales, which its scale transfers read until the run ends.
    pub stage: &'buf mut [u8],
    /// The rank's scale shard, if it is a destination: [`QuantRankPlan::dst_blocks`],
    /// row-major, in the scale dtype.
    pub scales: Option<&'dst mut [u8]>,
}

/// What the quantization prepared for the value transfers: the cast they carry and the
/// scales this rank stages for its scale transfers.
pub(super) struct Prepared<'buf> {
    pub cast: Cast,
    pub staged: &'buf [u8],
}

/// Checks the quantization job's buffers before any byte moves.
pub(super) fn check(job: &QuantJob<'_, '_>, rank: Rank, is_src: bool) -> Result<()> {
    let scale = job.plan.scale_bytes();
    let want = job.rank.stage_bytes(scale);
    let size = |side, extent: &Region, expected: u64, got: usize| {
        if expected == got as u64 {
            Ok(())
        } else {
            Err(Error::BufferSize {
                side,
                rank,
                extent: Dims(extent.extent.clone()),
                expected,
                got: got as u64,
            })
        }
    };
    if job.stage.len() != want {
        return Err(Error::Internal {
            rank,
            detail: format!(
                "the quantization's staging has {} bytes, {want} planned",
                job.stage.len()
            ),
        });
    }
    if !is_src && (!job.rank.amax.is_empty() || !job.rank.sends.is_empty()) {
        return Err(Error::MissingBuffer {
            side: Side::Src,
            rank,
        });
    }
    match (&job.rank.dst_blocks, &job.scales) {
        (Some(b), Some(s)) => size(Side::Dst, b, b.volume() * scale as u64, s.len()),
        (Some(b), None) if !b.is_empty() => Err(Error::MissingBuffer {
            side: Side::Dst,
            rank,
        }),
        (None, Some(_)) => Err(Error::UnexpectedBuffer {
            side: Side::Dst,
            rank,
        }),
        _ => Ok(()),
    }
}

/// On a source rank: the amax of its shard (a non-finite value is an error naming the
/// tensor and block), merged with the partial amax of the peers that share its blocks, then
/// its scales, staged for the scale transfers, and the quantizing cast of its values. On a
/// rank that only receives: the marker cast its receives carry. Breaks every link on
/// failure, so that the peers stop now.
pub(super) fn prepare<'buf, 'dst, T: Transport<'buf> + ?Sized>(
    job: QuantJob<'buf, 'dst>,
    rank: Rank,
    src_layout: &Layout,
    src: Option<(&'buf Region, &'buf [u8])>,
    transport: &T,
    options: &ExecOptions,
) -> Result<(Prepared<'buf>, Option<&'dst mut [u8]>)> {
    let QuantJob {
        tensor,
        plan,
        rank: part,
        stage,
        scales,
    } = job;
    let src_dtype = src_layout.dtype();
    let fp8 = match plan.quant.fp8 {
        reshard_core::convert::Fp8::E4M3 => reshard_core::DType::Fp8E4M3,
        reshard_core::convert::Fp8::E5M2 => reshard_core::DType::Fp8E5M2,
    };
    let Some((shard, buf)) = src else {
        return Ok((
            Prepared {
                cast: Cast::quantizing(src_dtype, fp8, None),
                staged: &[],
            },
            scales,
        ));
    };
    let named = |source| Error::Convert {
        tensor: tensor.to_string(),
        source,
    };
    let mut amax = AmaxGrid::local(&plan.grid, shard, buf, src_dtype)
        .map_err(named)
        .inspect_err(|_| transport.abort())?;
    let (outgoing, staged) = stage.split_at_mut(part.amax_bytes());
    if !part.amax.is_empty() {
        let mut at = 0;
        for (_, blocks) in &part.amax {
            let payload = amax.payload(blocks);
            outgoing[at..at + payload.len()].copy_from_slice(&payload);
            at += payload.len();
        }
        let outgoing: &'buf [u8] = outgoing;
        let mut incoming = vec![0u8; outgoing.len()];
        exchange(rank, part, outgoing, &mut incoming, transport, options)?;
        let mut at = 0;
        for (_, blocks) in &part.amax {
            let len = blocks.volume() as usize * AMAX_BYTES;
            amax.merge(blocks, &incoming[at..at + len])
                .map_err(named)
                .inspect_err(|_| transport.abort())?;
            at += len;
        }
    }
    let scales_of_shard = Scales::new(plan.quant, &plan.grid, &amax);
    if let Some(blocks) = &part.src_blocks {
        scales_of_shard.write(blocks, staged);
    }
    let quantizer = Quantizer {
        scales: scales_of_shard,
        shard: shard.clone(),
    };
    Ok((
        Prepared {
            cast: Cast::quantizing(src_dtype, fp8, Some(Arc::new(quantizer))),
            staged,
        },
        scales,
    ))
}

/// The partial amax exchange: one transfer each way per peer, of the blocks they share, as an
/// ordinary run of steps (4 bytes per block) on the transport the values then take.
fn exchange<'buf, T: Transport<'buf> + ?Sized>(
    rank: Rank,
    part: &'buf QuantRankPlan,
    outgoing: &'buf [u8],
    incoming: &mut [u8],
    transport: &T,
    options: &ExecOptions,
) -> Result<()> {
    let mut src_bufs: Vec<&'buf [u8]> = Vec::new();
    let mut dst_bufs: Vec<&mut [u8]> = Vec::new();
    let mut steps = Steps {
        rank,
        ..Steps::default()
    };
    let (mut out, mut inc) = (outgoing, incoming);
    for (i, (peer, blocks)) in part.amax.iter().enumerate() {
        let len = blocks.volume() as usize * AMAX_BYTES;
        let (o, rest) = out.split_at(len);
        out = rest;
        let (d, rest) = std::mem::take(&mut inc).split_at_mut(len);
        inc = rest;
        src_bufs.push(o);
        dst_bufs.push(d);
        let step = Step {
            from: rank,
            to: *peer,
            region: blocks,
            elem_bytes: AMAX_BYTES,
            src_box: blocks,
            dst_box: blocks,
            src_at: Some((i, 0..len)),
            dst_at: None,
            cast: None,
            // into the receiver's staging of partial amax
            lands: Lands::Aside,
        };
        steps.recvs.push(Step {
            from: *peer,
            to: rank,
            src_at: None,
            dst_at: Some((i, 0..len)),
            ..step.clone()
        });
        steps.sends.push(step);
    }
    run_steps(&steps, &src_bufs, &mut dst_bufs, transport, options).map(|_| ())
}

/// The scale steps of a rank: its scale transfers as steps over its scale buffers (the
/// staged scales at source buffer `src_buf`, the scale shard at destination buffer
/// `dst_buf`), appended after the value steps in the same order on both ends of each pair.
pub(super) struct ScaleSteps<'s, 'r> {
    pub sends: Vec<Step<'s>>,
    pub recvs: Vec<Step<'r>>,
    pub locals: Vec<Step<'r>>,
}

/// Builds [`ScaleSteps`]; `sender_blocks` holds every sender's staged blocks (for receives).
pub(super) fn scale_steps<'s: 'r, 'r>(
    plan: &QuantPlan,
    part: &'s QuantRankPlan,
    sender_blocks: &'r BTreeMap<Rank, Region>,
    src_buf: Option<usize>,
    dst_buf: Option<usize>,
) -> ScaleSteps<'s, 'r> {
    let elem = plan.scale_bytes();
    let bytes = |b: &Option<Region>| b.as_ref().map_or(0, |b| b.volume() as usize * elem);
    let (src_len, dst_len) = (bytes(&part.src_blocks), bytes(&part.dst_blocks));
    let empty: &'static Region = &EMPTY;
    let src_blocks: &'s Region = part.src_blocks.as_ref().unwrap_or(empty);
    let dst_blocks: &'s Region = part.dst_blocks.as_ref().unwrap_or(empty);
    let src_at = src_buf.map(|b| (b, 0..src_len));
    let dst_at = dst_buf.map(|b| (b, 0..dst_len));
    let step = |t: &'s reshard_core::plan::Transfer| Step {
        from: t.src,
        to: t.dst,
        region: &t.region,
        elem_bytes: elem,
        src_box: src_blocks,
        dst_box: &t.region,
        src_at: src_at.clone(),
        dst_at: None,
        cast: None,
        // into the receiver's scale shard
        lands: Lands::Aside,
    };
    ScaleSteps {
        sends: part.sends.iter().map(step).collect(),
        recvs: part
            .recvs
            .iter()
            .map(|t| Step {
                src_box: sender_blocks.get(&t.src).unwrap_or(empty),
                dst_box: dst_blocks,
                src_at: None,
                dst_at: dst_at.clone(),
                ..step(t)
            })
            .collect(),
        locals: part
            .locals
            .iter()
            .map(|t| Step {
                dst_box: dst_blocks,
                dst_at: dst_at.clone(),
                ..step(t)
            })
            .collect(),
    }
}

static EMPTY: Region = Region {
    offset: Vec::new(),
    extent: Vec::new(),
};
