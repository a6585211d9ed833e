//! Lowering: a rank's part of a plan (plain or cast), of a quantizing plan, of a relay plan,
//! or of the gather+broadcast baseline, as its [`Program`]. Pure: from the plans and the
//! places of the rank's shards, no buffer and no I/O.

use std::borrow::Cow;
use std::ops::Range;

use super::options::ExecOptions;
use super::program::{
    Buf, Convert, LocalCopy, Phase, PhaseKind, Piece, Program, Scaling, Step, cut_chunk,
};
use super::quant::scale_steps;
use super::relay::{Rounds, slab_bytes};
use forward::forward_phase;
use reshard_core::copy::Cast;
use reshard_core::dtype::DType;
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::quant::AMAX_BYTES;
use reshard_core::plan::{GatherBroadcast, QuantPlan, QuantRankPlan, RankPlan, Transfer};
use reshard_core::region::Region;
use reshard_transport::Lands;

/// A buffer that is not there: lent as an empty one.
pub const NO_BUFFER: Buf = Buf::Src(usize::MAX);

/// Where a rank's shard of one side lies: its box, and the bytes of a buffer holding it.
#[derive(Clone, Debug)]
pub struct Slot<'p> {
    /// The shard's box, in tensor coordinates.
    pub region: Cow<'p, Region>,
    /// The buffer holding it.
    pub buf: Buf,
    /// The bytes of `buf` that hold the box, dense and row-major.
    pub bytes: Range<usize>,
}

/// A rank's part of a plan, as lowering takes it.
pub struct PlanJob<'p> {
    /// The rank's part of the plan.
    pub plan: &'p RankPlan,
    /// Where every sender's shard lies.
    pub src_layout: &'p Layout,
    /// The destination's dtype: the senders convert to it.
    pub dst_dtype: DType,
    /// Where the rank's source shard lies, if it is a source.
    pub src: Option<Slot<'p>>,
    /// Where the rank's destination shard lies, if it is a destination.
    pub dst: Option<Slot<'p>>,
    /// With a quantizing plan: the rank's part of the quantization.
    pub quant: Option<QuantParts<'p>>,
}

/// A rank's part of a quantizing plan beside its values.
pub struct QuantParts<'p> {
    /// The tensor's name, for errors.
    pub tensor: &'p str,
    /// The tensor's quantization over both layouts.
    pub plan: &'p QuantPlan,
    /// This rank's part of it.
    pub rank: &'p QuantRankPlan,
    /// The buffer its scale shard lands in, if it is given one.
    pub scales: Option<Buf>,
}

/// The chunk size of a plan's transfers on both ends.
pub fn plan_chunk(job: &PlanJob<'_>, options: &ExecOptions) -> usize {
    let converts = job.quant.is_some() || job.src_layout.dtype() != job.dst_dtype;
    cut_chunk(options.chunk_bytes, converts)
}

/// The program of a rank's part of a plan: its values in one phase, after the amax exchange
/// when it quantizes; round by round when it relays.
pub fn lower_plan<'p>(job: &PlanJob<'p>, options: &ExecOptions) -> Result<Program<'p>> {
    let mut program = Program::new(job.plan.rank, plan_chunk(job, options));
    plan_phases(&mut program, job, 0, options)?;
    Ok(program)
}

/// Appends the phases of `job` (as [`lower_plan`] lowers it) to `program`, as part `part`.
pub(crate) fn plan_phases<'p>(
    program: &mut Program<'p>,
    job: &PlanJob<'p>,
    part: usize,
    options: &ExecOptions,
) -> Result<()> {
    let rank = job.plan.rank;
    let cast = match &job.quant {
        Some(_) => None,
        None => Cast::between(job.src_layout.dtype(), job.dst_dtype).map_err(|source| {
            Error::Convert {
                tensor: "tensor".into(),
                source,
            }
        })?,
    };
    // a delta refit moves a relay plan's own transfers in one phase, then forwards
    // ([`forward_phase`]); without delta it runs round by round
    let forwarding = job.plan.relays() && options.delta.is_some();
    if job.plan.relays() && !forwarding {
        return relay_phases(program, job, part, cast, options);
    }
    let elem_bytes = job.dst_dtype.size();
    // every sender's box, for the receives
    let sender = |t: &Transfer| -> Result<Region> {
        job.src_layout
            .local_region(t.src)
            .ok_or_else(|| Error::Protocol {
                rank,
                peer: t.src,
                detail: "the plan receives from a rank that is not a source".into(),
            })
    };
    let own = |t: &&Transfer| t.via.is_none();
    let senders: Vec<Region> = job
        .plan
        .recvs
        .iter()
        .filter(own)
        .map(sender)
        .collect::<Result<_>>()?;
    let mut src = vec![job.src.as_ref().map_or(NO_BUFFER, |s| s.buf)];
    let mut dst = vec![job.dst.as_ref().map_or(NO_BUFFER, |d| d.buf)];
    // quantizing: the amax exchange first, then the values with the scales beside them
    let mut staged = None;
    if let Some(q) = &job.quant {
        let (amax, stage) = amax_phase(program, job, q, part)?;
        program.phases.push(amax);
        staged = stage;
        if let Some(b) = staged {
            src.push(b);
        }
        if let Some(b) = q.scales {
            dst.push(b);
        }
    }
    let convert = match (&job.quant, &job.src) {
        (Some(_), Some(s)) => Convert::Quantize {
            src: job.src_layout.dtype(),
            dst: job.dst_dtype,
            piece: piece_key(s),
        },
        _ => Convert::from(cast),
    };
    let src_at = job.src.as_ref().map(|s| (0, s.bytes.clone()));
    let dst_at = job.dst.as_ref().map(|d| (0, d.bytes.clone()));
    let step = |t: &'p Transfer, src_box: Cow<'p, Region>, dst_box: Cow<'p, Region>| Step {
        from: t.src,
        to: t.dst,
        region: Cow::Borrowed(&t.region),
        elem_bytes,
        src_box,
        dst_box,
        src_at: src_at.clone(),
        dst_at: dst_at.clone(),
        convert: convert.clone(),
        // the values: into the destination shard (the scales follow, aside)
        lands: Lands::Shard,
    };
    let mut phase = Phase::new(rank, PhaseKind::Values, part, src, dst);
    let (src_box, dst_box) = (
        job.src.as_ref().map(|s| &s.region),
        job.dst.as_ref().map(|d| &d.region),
    );
    if let Some(src_box) = src_box {
        phase.steps.sends = job
            .plan
            .sends
            .iter()
            .filter(own)
            .map(|t| step(t, src_box.clone(), Cow::Borrowed(&t.region)))
            .collect();
        if let Some(dst_box) = dst_box {
            phase.steps.locals = job
                .plan
                .locals
                .iter()
                .map(|t| step(t, src_box.clone(), dst_box.clone()))
                .collect();
        }
    }
    if let Some(dst_box) = dst_box {
        phase.steps.recvs = job
            .plan
            .recvs
            .iter()
            .filter(own)
            .zip(senders)
            .map(|(t, b)| Step {
                src_at: None,
                convert: Convert::Keep,
                ..step(t, Cow::Owned(b), dst_box.clone())
            })
            .collect();
    }
    if let Some(q) = &job.quant {
        // the scales ride after the values, in the same order on both ends of every pair
        let sender_blocks = job
            .plan
            .recvs
            .iter()
            .map(|t| Ok((t.src, q.plan.grid.blocks_touching(&sender(t)?))))
            .collect::<Result<_>>()?;
        let src_buf = staged.filter(|_| job.src.is_some()).map(|_| 1);
        let dst_buf = q.scales.map(|_| phase.dst.len() - 1);
        let extra = scale_steps(q.plan, q.rank, sender_blocks, src_buf, dst_buf);
        phase.steps.sends.extend(extra.sends);
        phase.steps.recvs.extend(extra.recvs);
        phase.steps.locals.extend(extra.locals);
    }
    program.phases.push(phase);
    if forwarding {
        forward_phase(program, job, part);
    }
    Ok(())
}

fn piece_key(slot: &Slot<'_>) -> (usize, usize) {
    (0, slot.bytes.start)
}

/// The amax phase of a quantizing plan: one transfer each way per peer, of the blocks they
/// share (4 bytes per block), and the scaling of this rank's shard; and the scratch its
/// scales are staged in, on a source rank.
fn amax_phase<'p>(
    program: &mut Program<'p>,
    job: &PlanJob<'p>,
    q: &QuantParts<'p>,
    part: usize,
) -> Result<(Phase<'p>, Option<Buf>)> {
    let rank = job.plan.rank;
    let mut phase = Phase::new(rank, PhaseKind::Amax, part, Vec::new(), Vec::new());
    phase.skip_empty = true;
    phase.counted = false;
    let Some(src) = &job.src else {
        return Ok((phase, None));
    };
    let mut exchanges = Vec::new();
    for (i, (peer, blocks)) in q.rank.amax.iter().enumerate() {
        let len = blocks.volume() as usize * AMAX_BYTES;
        let out = program.add_scratch(len, "partial amax");
        let inc = program.add_scratch(len, "partial amax");
        phase.src.push(Buf::Scratch(out));
        phase.dst.push(Buf::Scratch(inc));
        exchanges.push((Cow::Borrowed(blocks), out, inc));
        let step = Step {
            from: rank,
            to: *peer,
            region: Cow::Borrowed(blocks),
            elem_bytes: AMAX_BYTES,
            src_box: Cow::Borrowed(blocks),
            dst_box: Cow::Borrowed(blocks),
            src_at: Some((i, 0..len)),
            dst_at: None,
            convert: Convert::Keep,
            // into the receiver's staging of partial amax
            lands: Lands::Aside,
        };
        phase.steps.recvs.push(Step {
            from: *peer,
            to: rank,
            src_at: None,
            dst_at: Some((i, 0..len)),
            ..step.clone()
        });
        phase.steps.sends.push(step);
    }
    let staged_len = q
        .rank
        .src_blocks
        .as_ref()
        .map_or(0, |b| b.volume() as usize)
        * q.plan.scale_bytes();
    let k = program.add_scratch(staged_len, "staged scales");
    let staged = Buf::Scratch(k);
    let fp8 = match q.plan.quant.fp8 {
        reshard_core::convert::Fp8::E4M3 => DType::Fp8E4M3,
        reshard_core::convert::Fp8::E5M2 => DType::Fp8E5M2,
    };
    phase.scaling.push(Scaling {
        tensor: Cow::Borrowed(q.tensor),
        plan: q.plan,
        src_dtype: job.src_layout.dtype(),
        dst_dtype: fp8,
        shard: src.region.clone(),
        blocks: Cow::Owned(q.plan.grid.blocks_touching(&src.region)),
        pieces: vec![Piece {
            buf: src.buf,
            bytes: src.bytes.clone(),
            region: src.region.clone(),
            key: piece_key(src),
        }],
        exchanges,
        staged: q.rank.src_blocks.as_ref().map(|b| (k, Cow::Borrowed(b))),
    });
    Ok((phase, Some(staged)))
}

/// The rounds of a relay plan ([`super::relay`]), one phase each: its legs out of the shard
/// and out of the staging half the round before filled, into the shard and the other half;
/// then the slabs it staged, copied into its shard.
fn relay_phases<'p>(
    program: &mut Program<'p>,
    job: &PlanJob<'p>,
    part: usize,
    cast: Option<Cast>,
    options: &ExecOptions,
) -> Result<()> {
    let rank = job.plan.rank;
    let elem_bytes = job.dst_dtype.size();
    let rounds = Rounds::of(job.plan, elem_bytes, slab_bytes(options))?;
    let staging = rounds.staging_bytes();
    let [a, b] = match program.relay_staging {
        // a part relayed before: its halves, as large as the larger of the two
        Some([a, b]) => {
            let before = program.scratch[a].len;
            if staging > before {
                program.scratch[a].len = staging;
                program.scratch[b].len = staging;
                program.staging_bytes += 2 * (staging - before) as u64;
            }
            [a, b]
        }
        None => {
            program.staging_bytes += 2 * staging as u64;
            [
                program.add_scratch(staging, "relay staging"),
                program.add_scratch(staging, "relay staging"),
            ]
        }
    };
    program.relay_staging = Some([a, b]);
    let halves = [Buf::Scratch(a), Buf::Scratch(b)];
    let missing = |side| Error::MissingBuffer { side, rank };
    let src = job.src.as_ref();
    let dst = job.dst.as_ref();
    let bytes_of = |r: &Region| r.volume() as usize * elem_bytes;
    for (j, round) in rounds.rounds.into_iter().enumerate() {
        let (recv_into, send_from) = (halves[j % 2], halves[(j + 1) % 2]);
        let mut phase = Phase::new(
            rank,
            PhaseKind::Round(j),
            part,
            vec![src.map_or(NO_BUFFER, |s| s.buf), send_from],
            vec![dst.map_or(NO_BUFFER, |d| d.buf), recv_into],
        );
        phase.skip_empty = true;
        let src_at = src.map(|s| (0, s.bytes.clone()));
        let dst_at = dst.map(|d| (0, d.bytes.clone()));
        for l in &round.sends {
            let region: Cow<'p, Region> = Cow::Owned(l.region.clone());
            let step = match l.staged {
                Some(offset) => Step {
                    from: l.from,
                    to: l.to,
                    region: region.clone(),
                    elem_bytes,
                    src_box: region.clone(),
                    dst_box: region,
                    src_at: Some((1, offset..offset + bytes_of(&l.region))),
                    dst_at: None,
                    convert: Convert::Keep,
                    lands: l.lands,
                },
                None => Step {
                    from: l.from,
                    to: l.to,
                    region: region.clone(),
                    elem_bytes,
                    src_box: src.ok_or_else(|| missing(Side::Src))?.region.clone(),
                    dst_box: region,
                    src_at: src_at.clone(),
                    dst_at: None,
                    convert: Convert::from(cast.clone()),
                    lands: l.lands,
                },
            };
            phase.steps.sends.push(step);
        }
        for l in &round.recvs {
            let region: Cow<'p, Region> = Cow::Owned(l.region.clone());
            let (dst_box, at) = match l.staged {
                Some(offset) => (region.clone(), (1, offset..offset + bytes_of(&l.region))),
                None => {
                    let d = dst.ok_or_else(|| missing(Side::Dst))?;
                    (d.region.clone(), (0, d.bytes.clone()))
                }
            };
            let src_box = match l.forwarded {
                true => region.clone(),
                false => Cow::Owned(job.src_layout.local_region(l.from).ok_or_else(|| {
                    Error::Protocol {
                        rank,
                        peer: l.from,
                        detail: "the plan receives from a rank that is not a source".into(),
                    }
                })?),
            };
            phase.steps.recvs.push(Step {
                from: l.from,
                to: rank,
                region,
                elem_bytes,
                src_box,
                dst_box,
                src_at: None,
                dst_at: Some(at),
                convert: Convert::Keep,
                lands: l.lands,
            });
        }
        for t in &round.locals {
            phase.steps.locals.push(Step {
                from: rank,
                to: rank,
                region: Cow::Owned(t.region.clone()),
                elem_bytes,
                src_box: src.ok_or_else(|| missing(Side::Src))?.region.clone(),
                dst_box: dst.ok_or_else(|| missing(Side::Dst))?.region.clone(),
                src_at: src_at.clone(),
                dst_at: dst_at.clone(),
                convert: Convert::from(cast.clone()),
                lands: Lands::Shard,
            });
        }
        // the slabs staged here belong in this rank's shard too; not counted as local
        // copies: the plan's totals count the hop, received in the round
        for l in round.recvs.iter().filter(|l| l.staged.is_some()) {
            let offset = l.staged.unwrap_or_default();
            let d = dst.ok_or_else(|| missing(Side::Dst))?;
            phase.after.push(LocalCopy {
                region: Cow::Owned(l.region.clone()),
                from: (recv_into, offset..offset + bytes_of(&l.region)),
                from_box: Cow::Owned(l.region.clone()),
                to: (d.buf, d.bytes.clone()),
                to_box: d.region.clone(),
                elem_bytes,
                cast: None,
                counted: false,
            });
        }
        program.phases.push(phase);
    }
    Ok(())
}

/// A rank's part of the gather+broadcast baseline, as lowering takes it: its plans for both
/// phases, and where its shards and its full-tensor buffer lie.
pub struct BaselineParts<'p> {
    /// The rank whose part it is.
    pub rank: Rank,
    /// The tensor's gather+broadcast.
    pub baseline: &'p GatherBroadcast,
    /// This rank's part of the gather, if it gathers.
    pub gather: Option<&'p RankPlan>,
    /// This rank's part of the broadcast, if it sends or receives in it.
    pub broadcast: Option<&'p RankPlan>,
    /// Where its source shard lies, if it is a source.
    pub src: Option<Slot<'p>>,
    /// The rank's full-tensor buffer, if it has one (bytes of the tensor in its source dtype).
    pub full: Option<(Buf, Range<usize>)>,
    /// Where its destination shard lies, if it is a destination.
    pub dst: Option<Slot<'p>>,
    /// The box of the whole tensor.
    pub whole: Cow<'p, Region>,
}

/// The program of a rank's part of the baseline: gather, broadcast, keep.
pub fn lower_gather_broadcast<'p>(
    parts: BaselineParts<'p>,
    options: &ExecOptions,
) -> Result<Program<'p>> {
    let mut program = Program::new(parts.rank, baseline_chunk(options));
    baseline_phases(&mut program, parts, 0, options)?;
    Ok(program)
}

/// The baseline moves every byte in the source dtype, so it never cuts for conversions.
pub fn baseline_chunk(options: &ExecOptions) -> usize {
    cut_chunk(options.chunk_bytes, false)
}

/// Appends the phases of a rank's part of the baseline to `program`, as parts `3 * tensor`
/// (gather), `3 * tensor + 1` (broadcast) and `3 * tensor + 2` (keep).
pub(crate) fn baseline_phases<'p>(
    program: &mut Program<'p>,
    parts: BaselineParts<'p>,
    tensor: usize,
    options: &ExecOptions,
) -> Result<()> {
    let BaselineParts {
        rank,
        baseline,
        gather,
        broadcast,
        src,
        full,
        dst,
        whole,
    } = parts;
    // A rank that keeps the whole tensor gathers or receives it straight into its shard.
    let (full, dst) = match (full, dst) {
        (None, Some(d)) if baseline.gets_tensor(rank) => (Some((d.buf, d.bytes)), None),
        (full, dst) => (full, dst),
    };
    let full_slot = full.as_ref().map(|(buf, bytes)| Slot {
        region: whole.clone(),
        buf: *buf,
        bytes: bytes.clone(),
    });
    if let (Some(plan), Some(g)) = (gather, &baseline.gather) {
        let job = PlanJob {
            plan,
            src_layout: g.src(),
            dst_dtype: g.dst().dtype(),
            src: src.clone(),
            dst: full_slot.clone(),
            quant: None,
        };
        plan_phases(program, &job, 3 * tensor, options)?;
    }
    // The tensor a holder broadcasts and keeps from: its gathered copy, or its source shard
    // when the source is fully replicated.
    let holds_all = baseline.holders.binary_search(&rank).is_ok();
    let tensor_slot = full_slot.clone().or_else(|| {
        src.as_ref().filter(|_| holds_all).map(|s| Slot {
            region: whole.clone(),
            ..s.clone()
        })
    });
    if let (Some(plan), Some(b)) = (broadcast, &baseline.broadcast) {
        let (send_from, receive_into) = match holds_all {
            true => (tensor_slot.clone(), None),
            false => (None, full_slot.clone()),
        };
        let job = PlanJob {
            plan,
            src_layout: b.src(),
            dst_dtype: b.dst().dtype(),
            src: send_from,
            dst: receive_into,
            quant: None,
        };
        plan_phases(program, &job, 3 * tensor + 1, options)?;
    }
    if let Some(d) = dst {
        let Some(t) = tensor_slot else {
            return Err(Error::MissingBuffer {
                side: Side::Dst,
                rank,
            });
        };
        let mut keep = Phase::new(
            rank,
            PhaseKind::Keep,
            3 * tensor + 2,
            Vec::new(),
            Vec::new(),
        );
        keep.skip_empty = true;
        keep.after.push(LocalCopy {
            region: d.region.clone(),
            from: (t.buf, t.bytes),
            from_box: whole,
            to: (d.buf, d.bytes),
            to_box: d.region,
            elem_bytes: baseline.dst().dtype().size(),
            cast: baseline.cast(),
            counted: true,
        });
        program.phases.push(keep);
    }
    Ok(())
}

mod forward;
#[cfg(test)]
mod tests;
