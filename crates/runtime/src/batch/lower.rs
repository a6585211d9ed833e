//! Lowering a rank's part of a batch ([`RankBatch`]) to its program: the partial amax
//! exchange of its quantized tensors, then every value and scale move in one schedule, the
//! small tensors packed into blobs before it and unpacked after it ([`lower_batch`]); and the
//! gather+broadcast baseline of a batch, tensor after tensor ([`lower_batch_baseline`]).
//! Pure: from the batch and the rank's part, no buffer and no I/O.
//!
//! The program's buffers: on the source side the rank's source buffers, then the staged
//! scales of each [`super::QuantSource`], then one blob per pack it roots; on the
//! destination side its destination buffers, then its scale buffers, then one blob per pack
//! it receives (the order of [`RankBatch`]'s moves).

use std::borrow::Cow;

use super::baseline::{BatchBaseline, RankBaseline};
use super::{Batch, MoveKind, PackRole, RankBatch};
use crate::exec::ExecOptions;
use crate::exec::lower::{BaselineParts, Slot, baseline_chunk, baseline_phases};
use crate::exec::program::{
    Buf, Convert, LocalCopy, Phase, PhaseKind, Piece, Program, Scaling, cut_chunk,
};
use reshard_core::copy::Cast;
use reshard_core::error::{Error, Result, Side};
use reshard_core::plan::QuantPlan;
use reshard_core::plan::quant::AMAX_BYTES;
use reshard_core::region::Region;
use reshard_transport::Lands;

fn quant_of(batch: &Batch, tensor: usize, rank: usize) -> Result<&QuantPlan> {
    batch
        .tensors
        .get(tensor)
        .and_then(|t| t.quant.as_ref())
        .ok_or_else(|| Error::Internal {
            rank,
            detail: format!("tensor {tensor} is planned as quantized but has no quantization"),
        })
}

/// The chunk size of a batch's transfers: when any tensor converts, chunks of whole elements
/// of every dtype for every transfer, so that the ends of a transfer cut it alike whether or
/// not their own other moves convert.
pub fn batch_chunk(batch: &Batch, options: &ExecOptions) -> usize {
    cut_chunk(options.chunk_bytes, batch.converts())
}

/// The program of `rb`, `rank`'s part of `batch`: phases [`PhaseKind::Amax`] and
/// [`PhaseKind::Values`].
pub fn lower_batch<'p>(
    batch: &'p Batch,
    rb: &'p RankBatch,
    options: &ExecOptions,
) -> Result<Program<'p>> {
    let rank = rb.rank;
    let mut program = Program::new(rank, batch_chunk(batch, options));
    let mut amax = Phase::new(rank, PhaseKind::Amax, 0, Vec::new(), Vec::new());
    amax.skip_empty = true;
    amax.counted = false;
    let mut staged = Vec::with_capacity(rb.quant.len());
    for s in &rb.quant {
        let t = &batch.tensors[s.tensor];
        let q = quant_of(batch, s.tensor, rank)?;
        let mut exchanges = Vec::with_capacity(s.exchanges.len());
        for blocks in &s.exchanges {
            let len = blocks.volume() as usize * AMAX_BYTES;
            let out = program.add_scratch(len, "partial amax");
            let inc = program.add_scratch(len, "partial amax");
            amax.src.push(Buf::Scratch(out));
            amax.dst.push(Buf::Scratch(inc));
            exchanges.push((Cow::Borrowed(blocks), out, inc));
        }
        let stage = program.add_scratch(
            s.blocks.volume() as usize * q.scale_bytes(),
            "staged scales",
        );
        staged.push(Buf::Scratch(stage));
        let mut pieces = Vec::new();
        for (b, buffer) in rb.src.iter().enumerate() {
            for piece in buffer.pieces.iter().filter(|p| p.tensor == s.tensor) {
                pieces.push(Piece {
                    buf: Buf::Src(b),
                    bytes: piece.bytes.clone(),
                    region: Cow::Borrowed(&piece.region),
                    key: (b, piece.bytes.start),
                });
            }
        }
        amax.scaling.push(Scaling {
            tensor: Cow::Borrowed(&t.name),
            plan: q,
            src_dtype: t.src.dtype(),
            dst_dtype: t.dst.dtype(),
            shard: Cow::Borrowed(&s.shard),
            blocks: Cow::Borrowed(&s.blocks),
            pieces,
            exchanges,
            staged: Some((stage, Cow::Borrowed(&s.blocks))),
        });
    }
    for m in rb.amax.iter().filter(|m| m.kind == MoveKind::Amax) {
        // partial amax land in the exchange's own staging
        let step = m.step(Convert::Keep, Lands::Aside);
        if m.from == rank {
            amax.steps.sends.push(step);
        } else {
            amax.steps.recvs.push(step);
        }
    }
    let roles = |role| rb.packs.iter().filter(move |(_, r)| *r == role);
    let blob =
        |program: &mut Program<'p>, len| Buf::Scratch(program.add_scratch(len, "packed tensors"));
    let root_blobs: Vec<Buf> = roles(PackRole::Root)
        .map(|(p, _)| blob(&mut program, p.len))
        .collect();
    let received: Vec<Buf> = roles(PackRole::Receiver)
        .map(|(p, _)| blob(&mut program, p.len))
        .collect();
    let src = (0..rb.src.len())
        .map(Buf::Src)
        .chain(staged)
        .chain(root_blobs.iter().copied());
    let dst = (0..rb.dst.len() + rb.scales.len())
        .map(Buf::Dst)
        .chain(received.iter().copied());
    let mut values = Phase::new(rank, PhaseKind::Values, 0, src.collect(), dst.collect());
    for m in &rb.moves {
        let convert = match m.kind {
            MoveKind::Copy | MoveKind::Scales | MoveKind::Amax => Convert::Keep,
            MoveKind::Cast(from, to) => {
                Convert::from(Cast::between(from, to).map_err(|source| Error::Convert {
                    tensor: format!("tensor {}", m.tensor),
                    source,
                })?)
            }
            // only the sender converts
            MoveKind::Quantize(..) if m.from != rank => Convert::Keep,
            MoveKind::Quantize(src, dst) => {
                let Some((b, bytes)) = &m.src_at else {
                    return Err(Error::Internal {
                        rank,
                        detail: format!(
                            "tensor {} is quantized, but this rank has no scales for its piece",
                            m.tensor
                        ),
                    });
                };
                Convert::Quantize {
                    src,
                    dst,
                    piece: (*b, bytes.start),
                }
            }
        };
        let step = m.step(convert, rb.lands(m));
        if m.from == m.to {
            values.steps.locals.push(step);
        } else if m.from == rank {
            values.steps.sends.push(step);
        } else {
            values.steps.recvs.push(step);
        }
    }
    // the blobs this rank roots, packed from its source buffers before anything moves
    for ((pack, _), &blob) in roles(PackRole::Root).zip(&root_blobs) {
        for (i, bytes) in &pack.tensors {
            let t = &batch.tensors[*i];
            let whole = Region::full(t.src.shape());
            for (b, buffer) in rb.src.iter().enumerate() {
                for piece in buffer.pieces.iter().filter(|p| p.tensor == *i) {
                    values.before.push(LocalCopy {
                        region: Cow::Borrowed(&piece.region),
                        from: (Buf::Src(b), piece.bytes.clone()),
                        from_box: Cow::Borrowed(&piece.region),
                        to: (blob, bytes.clone()),
                        to_box: Cow::Owned(whole.clone()),
                        elem_bytes: t.src.dtype().size(),
                        cast: None,
                        counted: false,
                    });
                }
            }
        }
    }
    // this rank's boxes of packed tensors, out of the blobs it received or roots
    let (mut roots, mut receives) = (root_blobs.iter(), received.iter());
    for (pack, role) in &rb.packs {
        let blob = match role {
            PackRole::Root => roots.next(),
            PackRole::Receiver => receives.next(),
        };
        let Some(&blob) = blob else { continue };
        for (i, bytes) in &pack.tensors {
            let t = &batch.tensors[*i];
            let whole = Region::full(t.src.shape());
            for (b, buffer) in rb.dst.iter().enumerate() {
                for piece in buffer.pieces.iter().filter(|p| p.tensor == *i) {
                    values.after.push(LocalCopy {
                        region: Cow::Borrowed(&piece.region),
                        from: (blob, bytes.clone()),
                        from_box: Cow::Owned(whole.clone()),
                        to: (Buf::Dst(b), piece.bytes.clone()),
                        to_box: Cow::Borrowed(&piece.region),
                        elem_bytes: t.src.dtype().size(),
                        cast: None,
                        counted: true,
                    });
                }
            }
        }
    }
    program.staging_bytes = program.scratch.iter().map(|s| s.len as u64).sum();
    program.phases = vec![amax, values];
    Ok(program)
}

/// The program of `rank`'s part of the baseline of every tensor of `batch`, in batch order:
/// each tensor gathered and broadcast whole through the full-tensor buffer `full` (of
/// `full_len` bytes), then every piece of it this rank holds copied out (converted when the
/// destination has a float dtype of its own). A source shard that a fused buffer splits is
/// assembled into a copy first.
#[allow(clippy::too_many_arguments)]
pub fn lower_batch_baseline<'p>(
    batch: &'p Batch,
    baseline: &'p BatchBaseline,
    mine: &'p RankBaseline,
    rb: &'p RankBatch,
    full: Buf,
    full_len: usize,
    options: &ExecOptions,
) -> Result<Program<'p>> {
    let rank = rb.rank;
    let mut program = Program::new(rank, baseline_chunk(options));
    // one copy buffer for the shards fused buffers split, as large as the largest
    let split = |i: usize| {
        let t = &batch.tensors[i];
        let b = t.src.local_region(rank)?;
        let pieces: Vec<_> = rb
            .src
            .iter()
            .flat_map(|buf| buf.pieces.iter())
            .filter(|p| p.tensor == i)
            .collect();
        let whole = matches!(pieces.as_slice(), [p] if p.region == b);
        (!whole).then(|| t.src.local_bytes(rank) as usize)
    };
    let largest = (0..batch.tensors.len())
        .filter_map(|i| split(i).map(|n| (n, i)))
        .max();
    let copy = largest.map(|(n, i)| {
        let what = format!("copy of tensor {}'s source shard", batch.tensors[i].name);
        Buf::Scratch(program.add_scratch(n, what))
    });
    for (i, (gb, (gather, broadcast))) in baseline.tensors.iter().zip(&mine.parts).enumerate() {
        let t = &batch.tensors[i];
        let whole = Region::full(t.src.shape());
        let total = t.src.total_bytes() as usize;
        let src_box = t.src.local_region(rank);
        let gets = gb.gets_tensor(rank);
        if full_len < total && gets {
            return Err(Error::Batch {
                what: "tensor",
                name: t.name.clone(),
                reason: format!(
                    "rank {rank}'s full-tensor buffer holds {full_len} bytes, less than the tensor's {total}"
                ),
            });
        }
        let mut assemble = Vec::new();
        let shard: Option<Slot<'p>> = match (&src_box, split(i), copy) {
            (None, _, _) => None,
            (Some(b), Some(need), Some(copy)) => {
                for (k, buf) in rb.src.iter().enumerate() {
                    for p in buf.pieces.iter().filter(|p| p.tensor == i) {
                        assemble.push(LocalCopy {
                            region: Cow::Borrowed(&p.region),
                            from: (Buf::Src(k), p.bytes.clone()),
                            from_box: Cow::Borrowed(&p.region),
                            to: (copy, 0..need),
                            to_box: Cow::Owned(b.clone()),
                            elem_bytes: t.src.dtype().size(),
                            cast: None,
                            counted: true,
                        });
                    }
                }
                Some(Slot {
                    region: Cow::Owned(b.clone()),
                    buf: copy,
                    bytes: 0..need,
                })
            }
            (Some(b), _, _) => rb.src.iter().enumerate().find_map(|(k, buf)| {
                let p = buf.pieces.iter().find(|p| p.tensor == i)?;
                Some(Slot {
                    region: Cow::Owned(b.clone()),
                    buf: Buf::Src(k),
                    bytes: p.bytes.clone(),
                })
            }),
        };
        let first = program.phases.len();
        let parts = BaselineParts {
            rank,
            baseline: gb,
            gather: gather.as_ref(),
            broadcast: broadcast.as_ref(),
            src: shard.clone(),
            full: gets.then_some((full, 0..total)),
            dst: None,
            whole: Cow::Owned(whole.clone()),
        };
        baseline_phases(&mut program, parts, i, options)?;
        // keep: every piece of this tensor in this rank's destination buffers
        let tensor = match gets {
            true => Some((full, 0..total)),
            false => shard
                .filter(|_| gb.holders.contains(&rank))
                .map(|s| (s.buf, s.bytes)),
        };
        let mut keep = Phase::new(rank, PhaseKind::Keep, 3 * i + 2, Vec::new(), Vec::new());
        keep.skip_empty = true;
        for (k, buf) in rb.dst.iter().enumerate() {
            for p in buf.pieces.iter().filter(|p| p.tensor == i) {
                let Some(tensor) = &tensor else {
                    return Err(Error::MissingBuffer {
                        side: Side::Dst,
                        rank,
                    });
                };
                // converted as it is kept, when the destination has a float dtype of its own
                keep.after.push(LocalCopy {
                    region: Cow::Borrowed(&p.region),
                    from: tensor.clone(),
                    from_box: Cow::Owned(whole.clone()),
                    to: (Buf::Dst(k), p.bytes.clone()),
                    to_box: Cow::Borrowed(&p.region),
                    elem_bytes: t.dst.dtype().size(),
                    cast: gb.cast(),
                    counted: true,
                });
            }
        }
        if !keep.after.is_empty() || !assemble.is_empty() {
            program.phases.push(keep);
        }
        // the shard is assembled before the tensor's first phase
        if let Some(p) = program.phases.get_mut(first) {
            p.before.splice(0..0, assemble);
        }
    }
    Ok(program)
}
