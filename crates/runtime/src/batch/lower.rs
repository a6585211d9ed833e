//! Lowering a rank's part of a batch ([`RankBatch`]) to its program: the partial amax
//! exchange of its quantized tensors, then every value and scale move in one schedule, the
//! small tensors packed into blobs before it and unpacked after it ([`lower_batch`]). (The
//! gather+broadcast baseline of a batch lowers in [`super::baseline`].)
//! Pure: from the batch and the rank's part, no buffer and no I/O.
//!
//! The program's buffers: on the source side the rank's source buffers, then the staged
//! scales of each [`super::QuantSource`], then one blob per pack it roots; on the
//! destination side its destination buffers, then its scale buffers, then one blob per pack
//! it receives (the order of [`RankBatch`]'s moves).

use std::borrow::Cow;

use super::{Batch, MoveKind, PackRole, RankBatch};
use crate::exec::ExecOptions;
use crate::exec::program::{
    Buf, Convert, LocalCopy, Phase, PhaseKind, Piece, Program, Scaling, cut_chunk,
};
use reshard_core::copy::Cast;
use reshard_core::error::{Error, Result};
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
