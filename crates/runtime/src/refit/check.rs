//! The checks of a refit's destination buffers: every piece of every tensor against its fill
//! ([`verify_values`]), and every fp8 value and scale of the quantized ones against the naive
//! quantizer ([`QuantCheck`], [`reshard_core::convert::reference`]): the rank's destination box
//! of the tensor materialized from the fill and quantized block by block on its own (the
//! inference shards hold whole blocks, which the plan checked and this checks again, so the
//! blocks of the box are the tensor's), then compared piece by piece with where the batch put
//! it. The one-tensor checks of a quantizing plan ([`reference()`], [`verify_quantized`],
//! [`compare`]) serve `reshard run` and `reshard bench`.
//!
//! Every check returns the bytes it covered, so that a report says "verified" only when every
//! destination byte was looked at ([`crate::harness::Checked`]).

use reshard_core::convert::BlockGrid;
use reshard_core::convert::reference::{QuantizedTensor, first_difference, quantize_tensor};
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::Error;
use reshard_core::fill::Fill;
use reshard_core::layout::{LayoutSpec, Rank};
use reshard_core::{Plan, Region};

use crate::batch::{Batch, RankBatch};

/// What one quantized tensor's destination box on this rank must hold.
struct Expected {
    /// Index of the tensor in the batch.
    tensor: usize,
    /// The rank's destination box, and its fp8 values (row-major, one byte each).
    shard: Region,
    values: Vec<u8>,
    /// The box's blocks, and their scales (row-major, in the scale dtype).
    blocks: Region,
    scales: Vec<u8>,
    scale_bytes: usize,
}

/// A rank's reference for every quantized tensor it is a destination of.
pub struct QuantCheck {
    rank: Rank,
    expected: Vec<Expected>,
}

/// The bytes of `piece` (a box inside `holder`) of a dense row-major buffer of `holder`.
fn cut(holder: &Region, bytes: &[u8], piece: &Region, elem: usize) -> Vec<u8> {
    let g = CopyGeometry::new(piece, Place::Within(holder), Place::Within(piece), elem);
    let mut out = vec![0u8; g.len()];
    g.copy(bytes, &mut out, 0..g.len());
    out
}

impl QuantCheck {
    /// The reference of `rank`'s destination boxes of `batch`'s quantized tensors, each
    /// filled as `fill_of` says (by the tensor's index in the batch).
    pub fn new(
        batch: &Batch,
        rank: Rank,
        fill_of: impl Fn(usize) -> Fill,
    ) -> Result<QuantCheck, Error> {
        let mut expected = Vec::new();
        for (i, t) in batch.tensors().iter().enumerate() {
            let (Some(q), Some(shard)) = (&t.quant, t.dst.local_region(rank)) else {
                continue;
            };
            let named = |source| Error::Convert {
                tensor: t.name.clone(),
                source,
            };
            let block = q.grid.block();
            let aligned = (0..shard.ndim()).all(|d| shard.offset[d].is_multiple_of(block[d]));
            if !aligned {
                return Err(Error::Internal {
                    rank,
                    detail: format!(
                        "{}: destination box {shard:?} is not on block boundaries of {block:?}",
                        t.name
                    ),
                });
            }
            let mut tensor =
                reshard_core::memory::zeroed(shard.volume() * t.src.dtype().size() as u64, || {
                    format!("rank {rank}'s reference of {}", t.name)
                })?;
            fill_of(i).fill_region(&t.src, &shard, &mut tensor);
            let grid = BlockGrid::new(q.quant.scheme, &shard.extent).map_err(named)?;
            let out = quantize_tensor(q.quant, &grid, t.src.dtype(), &tensor).map_err(named)?;
            expected.push(Expected {
                tensor: i,
                blocks: q.grid.scale_region(&shard),
                shard,
                values: out.values,
                scales: out.scales,
                scale_bytes: q.scale_bytes(),
            });
        }
        Ok(QuantCheck { rank, expected })
    }

    /// Zeroed scale buffers of `rb` ([`Batch::scale_buffers`]).
    pub fn scale_buffers(rb: &RankBatch) -> Result<Vec<Vec<u8>>, Error> {
        rb.scales
            .iter()
            .map(|b| {
                reshard_core::memory::zeroed(b.len as u64, || {
                    format!("rank {}'s scales of {}", rb.rank, b.name)
                })
            })
            .collect()
    }

    /// Checks every fp8 value in `dst` (the rank's destination buffers) and every scale in
    /// `scales` (its scale buffers) against the reference, piece by piece: the first
    /// difference is an error naming the tensor, the rank and the byte of its buffer.
    /// Returns the bytes it compared, values and scales.
    pub fn verify(
        &self,
        batch: &Batch,
        rb: &RankBatch,
        dst: &[Vec<u8>],
        scales: &[Vec<u8>],
    ) -> Result<u64, Error> {
        let mut checked = 0u64;
        let rank = self.rank;
        let failed = |tensor: usize, e: Error| Error::Batch {
            what: "tensor",
            name: batch.tensors()[tensor].name.clone(),
            reason: e.to_string(),
        };
        for e in &self.expected {
            for (buffer, bytes) in rb.dst.iter().zip(dst) {
                for p in buffer.pieces.iter().filter(|p| p.tensor == e.tensor) {
                    let want = cut(&e.shard, &e.values, &p.region, 1);
                    let got = bytes.get(p.bytes.clone()).unwrap_or_default();
                    checked += got.len() as u64;
                    if let Some((at, expected, found, mismatches)) = first_difference(&want, got) {
                        return Err(failed(
                            e.tensor,
                            Error::VerifyFailed {
                                rank,
                                offset: p.bytes.start as u64 + at,
                                expected,
                                found,
                                mismatches,
                            },
                        ));
                    }
                }
            }
            for (buffer, bytes) in rb.scales.iter().zip(scales) {
                for p in buffer.pieces.iter().filter(|p| p.tensor == e.tensor) {
                    let want = cut(&e.blocks, &e.scales, &p.region, e.scale_bytes);
                    let got = bytes.get(p.bytes.clone()).unwrap_or_default();
                    checked += got.len() as u64;
                    if let Some((at, expected, found, mismatches)) = first_difference(&want, got) {
                        return Err(failed(
                            e.tensor,
                            Error::ScalesVerifyFailed {
                                rank,
                                offset: p.bytes.start as u64 + at,
                                expected,
                                found,
                                mismatches,
                            },
                        ));
                    }
                }
            }
        }
        Ok(checked)
    }
}

/// Checks every piece of this rank's destination buffers `dst` of `batch` that is not
/// quantized (those are [`QuantCheck`]'s) against its tensor's fill, `fill_of(i)` for the
/// batch's tensor `i`, cast from the source dtype as torch's `.to()` casts it. Returns the
/// bytes it checked.
pub fn verify_values(
    batch: &Batch,
    rb: &RankBatch,
    dst: &[Vec<u8>],
    fill_of: impl Fn(usize) -> Fill,
) -> Result<u64, Error> {
    let mut checked = 0u64;
    for (buffer, bytes) in rb.dst.iter().zip(dst) {
        for p in &buffer.pieces {
            let t = &batch.tensors()[p.tensor];
            if t.quant.is_some() {
                continue;
            }
            let piece = bytes.get(p.bytes.clone()).unwrap_or_default();
            fill_of(p.tensor).verify_converted(
                t.src.dtype(),
                &t.dst,
                &p.region,
                piece,
                (rb.rank, p.bytes.start as u64),
            )?;
            checked += piece.len() as u64;
        }
    }
    Ok(checked)
}

/// The reference of a quantizing plan's destination (the whole source materialized from the
/// fill and quantized block by block), or `None` for a plan that does not quantize.
pub fn reference(plan: &Plan, fill: Fill) -> Result<Option<QuantizedTensor>, Error> {
    let Some(q) = plan.quant() else {
        return Ok(None);
    };
    let whole = LayoutSpec::parse("mesh=1 place=R")
        .and_then(|s| s.resolve(plan.src().shape(), plan.src().dtype(), 0))
        .map_err(|source| Error::Layout {
            side: reshard_core::Side::Src,
            source,
        })?;
    let tensor = fill.shard(&whole, 0)?.unwrap_or_default();
    quantize_tensor(q.quant, &q.grid, plan.src().dtype(), &tensor)
        .map(Some)
        .map_err(|source| Error::Convert {
            tensor: "tensor".into(),
            source,
        })
}

/// Compares `rank`'s fp8 values and scales with their boxes of the reference; returns the
/// bytes compared (none where the rank holds no destination shard).
pub fn verify_quantized(
    plan: &Plan,
    reference: &QuantizedTensor,
    rank: Rank,
    values: &[u8],
    scales: &[u8],
) -> Result<u64, Error> {
    let (Some(q), Some(shard)) = (plan.quant(), plan.dst().local_region(rank)) else {
        return Ok(0);
    };
    let blocks = q.grid.scale_region(&shard);
    compare(
        rank,
        (&reference.values_of(&shard), values),
        Some((&reference.scales_of(&blocks), scales)),
    )
}

/// `rank`'s values against the expected ones, then its scales if given (`(expected, got)`
/// each): the first difference fails, as values or as scales. Returns the bytes compared.
pub fn compare(
    rank: Rank,
    values: (&[u8], &[u8]),
    scales: Option<(&[u8], &[u8])>,
) -> Result<u64, Error> {
    if let Some((offset, expected, found, mismatches)) = first_difference(values.0, values.1) {
        return Err(Error::VerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    if let Some((offset, expected, found, mismatches)) =
        scales.and_then(|(want, got)| first_difference(want, got))
    {
        return Err(Error::ScalesVerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    Ok((values.1.len() + scales.map_or(0, |(_, got)| got.len())) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{BatchOptions, Fusion, Tensor, run_local_batch};
    use crate::exec::ExecOptions;
    use reshard_core::layout::LayoutSpec;
    use reshard_core::plan::{QuantPlan, QuantRequest};
    use reshard_core::{DType, Side};
    use std::collections::BTreeMap;

    fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> reshard_core::Layout {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, dtype, first)
            .unwrap()
    }

    /// gate and up of 32x16 from TP2 into one fused gate_up buffer of fp8 on two other
    /// ranks, blocks of 8x8: the check passes on what the batch wrote, and names the tensor
    /// and the byte of a corrupted value and of a corrupted scale.
    #[test]
    fn verify_catches_a_corrupted_value_and_scale() {
        let tensor = |name: &str| {
            let src = layout("mesh=2 place=S(0)", &[32, 16], DType::Bf16, 0);
            let dst = layout("mesh=2 place=S(0)", &[32, 16], DType::Fp8E4M3, 2);
            let request = QuantRequest {
                scheme: "block:8x8".parse().unwrap(),
                scale_dtype: None,
            };
            let quant = QuantPlan::new(request, &src, &dst).unwrap();
            Tensor {
                quant: Some(quant),
                ..Tensor::new(name, src, dst)
            }
        };
        let fused = Fusion {
            name: "gate_up".into(),
            side: Side::Dst,
            dim: 0,
            members: vec![0, 1],
        };
        let batch = Batch::new(
            vec![tensor("gate"), tensor("up")],
            vec![fused],
            BatchOptions::default(),
        )
        .unwrap();
        let fill = |i: usize| Fill::Normal { seed: i as u64 };
        let (mut src, mut dst, mut scales) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        for r in 0..batch.world() {
            let rb = batch.rank_batch(r).unwrap();
            let mut bufs: Vec<Vec<u8>> = rb.src.iter().map(|b| vec![0u8; b.len]).collect();
            for (b, bytes) in rb.src.iter().zip(&mut bufs) {
                for p in &b.pieces {
                    let l = &batch.tensors()[p.tensor].src;
                    fill(p.tensor).fill_region(l, &p.region, &mut bytes[p.bytes.clone()]);
                }
            }
            src.insert(r, bufs);
            dst.insert(r, rb.dst.iter().map(|b| vec![0u8; b.len]).collect());
            scales.insert(r, QuantCheck::scale_buffers(&rb).unwrap());
        }
        run_local_batch(&batch, &src, &mut dst, &mut scales, &ExecOptions::default()).unwrap();
        let rank = 3;
        let rb = batch.rank_batch(rank).unwrap();
        let check = QuantCheck::new(&batch, rank, fill).unwrap();
        let checked = check
            .verify(&batch, &rb, &dst[&rank], &scales[&rank])
            .unwrap();
        // every value and scale of both tensors on rank 3: 16x16 fp8 and 2x2 f32 scales each
        assert_eq!(checked, 2 * (16 * 16 + 2 * 2 * 4));
        // up's first scale sits after gate's 2x2 blocks of f32 in the fused scale buffer
        let mut bad = scales[&rank].clone();
        bad[0][16] ^= 1;
        let err = check
            .verify(&batch, &rb, &dst[&rank], &bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("up") && err.contains("rank 3"), "{err}");
        assert!(err.contains("16"), "{err}");
        assert!(matches!(
            check.verify(&batch, &rb, &dst[&rank], &bad).unwrap_err(),
            Error::Batch { ref reason, .. } if reason.contains("scale")
        ));
        let mut bad = dst[&rank].clone();
        bad[0][5] ^= 0x40;
        let err = check
            .verify(&batch, &rb, &bad, &scales[&rank])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gate") && err.contains("rank 3"), "{err}");
    }
}
