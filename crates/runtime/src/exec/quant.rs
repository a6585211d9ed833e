//! A rank's part of a quantizing reshard (`--quant`) beside its values, as the job gives it
//! ([`QuantJob`]) and as lowering turns it into steps: the scale transfers that ride along
//! with the values ([`scale_steps`]). The amax exchange before them is a phase of the
//! program ([`super::lower`]), its arithmetic the executor's ([`super::scaling`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::program::{Convert, Step};
use reshard_core::error::{Dims, Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::plan::{QuantPlan, QuantRankPlan};
use reshard_core::region::Region;
use reshard_transport::Lands;

/// One rank's quantization job, beside its [`super::RankJob`].
pub struct QuantJob<'buf, 'dst> {
    /// The tensor's name, for errors.
    pub tensor: &'buf str,
    /// The tensor's quantization over both layouts.
    pub plan: &'buf QuantPlan,
    /// This rank's part of it.
    pub rank: &'buf QuantRankPlan,
    /// Staging of [`QuantRankPlan::stage_bytes`]: the partial amax this rank sends, then its
    /// scales, which its scale transfers read until the run ends.
    pub stage: &'buf mut [u8],
    /// The rank's scale shard, if it is a destination: [`QuantRankPlan::dst_blocks`],
    /// row-major, in the scale dtype.
    pub scales: Option<&'dst mut [u8]>,
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

/// The scale steps of a rank: its scale transfers as steps over its scale buffers (the
/// staged scales at source buffer `src_buf`, the scale shard at destination buffer
/// `dst_buf`), appended after the value steps in the same order on both ends of each pair.
pub(super) struct ScaleSteps<'p> {
    pub sends: Vec<Step<'p>>,
    pub recvs: Vec<Step<'p>>,
    pub locals: Vec<Step<'p>>,
}

/// Builds [`ScaleSteps`]; `sender_blocks` holds every sender's staged blocks (for receives).
pub(super) fn scale_steps<'p>(
    plan: &QuantPlan,
    part: &'p QuantRankPlan,
    sender_blocks: BTreeMap<Rank, Region>,
    src_buf: Option<usize>,
    dst_buf: Option<usize>,
) -> ScaleSteps<'p> {
    let elem = plan.scale_bytes();
    let bytes = |b: &Option<Region>| b.as_ref().map_or(0, |b| b.volume() as usize * elem);
    let (src_len, dst_len) = (bytes(&part.src_blocks), bytes(&part.dst_blocks));
    let empty: &'static Region = &EMPTY;
    let src_blocks: &'p Region = part.src_blocks.as_ref().unwrap_or(empty);
    let dst_blocks: &'p Region = part.dst_blocks.as_ref().unwrap_or(empty);
    let src_at = src_buf.map(|b| (b, 0..src_len));
    let dst_at = dst_buf.map(|b| (b, 0..dst_len));
    let step = |t: &'p reshard_core::plan::Transfer| Step {
        from: t.src,
        to: t.dst,
        region: Cow::Borrowed(&t.region),
        elem_bytes: elem,
        src_box: Cow::Borrowed(src_blocks),
        dst_box: Cow::Borrowed(&t.region),
        src_at: src_at.clone(),
        dst_at: None,
        convert: Convert::Keep,
        // into the receiver's scale shard
        lands: Lands::Aside,
    };
    ScaleSteps {
        sends: part.sends.iter().map(step).collect(),
        recvs: part
            .recvs
            .iter()
            .map(|t| Step {
                src_box: Cow::Owned(sender_blocks.get(&t.src).unwrap_or(empty).clone()),
                dst_box: Cow::Borrowed(dst_blocks),
                src_at: None,
                dst_at: dst_at.clone(),
                ..step(t)
            })
            .collect(),
        locals: part
            .locals
            .iter()
            .map(|t| Step {
                dst_box: Cow::Borrowed(dst_blocks),
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
