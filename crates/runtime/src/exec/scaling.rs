//! The executor's arithmetic of a quantizing program, around its amax exchange: the amax of
//! each quantized tensor's source pieces (a non-finite value is an error naming the tensor,
//! the block and the element), staged for the exchange ([`amax`]); then, once the partial
//! amax of the peers have landed, the merged amax, the scales staged for the scale transfers
//! and the quantizing cast of every source piece ([`settle`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::buffers::Buffers;
use super::program::{Buf, Convert, Scaling};
use reshard_core::convert::{AmaxGrid, Scales};
use reshard_core::copy::{Cast, Quantizer};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::plan::quant::AMAX_BYTES;

/// The quantizing casts of a rank's source pieces, by the key of their piece
/// ([`super::program::Piece::key`]): each with the scales of the blocks its piece touches.
#[derive(Clone, Debug, Default)]
pub struct Casts {
    by_piece: BTreeMap<(usize, usize), Cast>,
}

impl Casts {
    /// The cast of the piece keyed `(buffer, start)`.
    pub fn of(&self, buffer: usize, start: usize) -> Option<&Cast> {
        self.by_piece.get(&(buffer, start))
    }

    /// The cast a step converts with.
    pub fn resolve(&self, convert: &Convert, rank: Rank) -> Result<Option<Cast>> {
        match convert {
            Convert::Keep => Ok(None),
            Convert::Cast(c) => Ok(Some(c.clone())),
            Convert::Quantize { piece, .. } => match self.by_piece.get(piece) {
                Some(c) => Ok(Some(c.clone())),
                None => Err(Error::Internal {
                    rank,
                    detail: format!(
                        "the piece at byte {} of source buffer {} is quantized, but this rank has no scales for it",
                        piece.1, piece.0
                    ),
                }),
            },
        }
    }
}

fn named(tensor: &str) -> impl Fn(reshard_core::convert::ConvertError) -> Error + '_ {
    move |source| Error::Convert {
        tensor: tensor.to_string(),
        source,
    }
}

fn internal(rank: Rank, detail: String) -> Error {
    Error::Internal { rank, detail }
}

/// The amax of every tensor's source shard, piece by piece where it lies in a fused buffer,
/// and the partial amax each exchange sends, written to its scratch.
pub(crate) fn amax(
    rank: Rank,
    scalings: &[Scaling<'_>],
    bufs: &mut Buffers<'_>,
) -> Result<Vec<AmaxGrid>> {
    let mut grids = Vec::with_capacity(scalings.len());
    for s in scalings {
        let grid_of = &s.plan.grid;
        let bytes_of = |p: &super::program::Piece<'_>| -> Result<&[u8]> {
            let Buf::Src(b) = p.buf else {
                return Err(internal(
                    rank,
                    format!("{}: a source piece outside the source buffers", s.tensor),
                ));
            };
            bufs.src
                .get(b)
                .and_then(|buf| buf.get(p.bytes.clone()))
                .ok_or_else(|| {
                    internal(
                        rank,
                        format!("source buffer {b} does not hold its piece of {}", s.tensor),
                    )
                })
        };
        let grid = match s.pieces.as_slice() {
            // the whole shard in one piece: its amax as it is
            [p] if *p.region == *s.shard => {
                AmaxGrid::local(grid_of, &s.shard, bytes_of(p)?, s.src_dtype)
                    .map_err(named(&s.tensor))?
            }
            pieces => {
                let mut grid = AmaxGrid {
                    blocks: s.blocks.clone().into_owned(),
                    amax: vec![0.0; s.blocks.volume() as usize],
                };
                for p in pieces {
                    let local = AmaxGrid::local(grid_of, &p.region, bytes_of(p)?, s.src_dtype)
                        .map_err(named(&s.tensor))?;
                    grid.merge(&local.blocks, &local.payload(&local.blocks))
                        .map_err(named(&s.tensor))?;
                }
                grid
            }
        };
        for (blocks, out, _) in &s.exchanges {
            let payload = grid.payload(blocks);
            match bufs.scratch.get_mut(*out) {
                Some(o) if o.len() == payload.len() => o.copy_from_slice(&payload),
                _ => {
                    return Err(internal(
                        rank,
                        format!("{}: no staging for its partial amax", s.tensor),
                    ));
                }
            }
        }
        grids.push(grid);
    }
    Ok(grids)
}

/// Merges the partial amax that landed into `grids`, stages each tensor's scales and records
/// the quantizing cast of each of its source pieces in `casts`.
pub(crate) fn settle(
    rank: Rank,
    scalings: &[Scaling<'_>],
    mut grids: Vec<AmaxGrid>,
    bufs: &mut Buffers<'_>,
    casts: &mut Casts,
) -> Result<()> {
    if grids.len() != scalings.len() {
        return Err(internal(
            rank,
            "the amax phase settled before it began".into(),
        ));
    }
    for (s, grid) in scalings.iter().zip(&mut grids) {
        for (blocks, _, incoming) in &s.exchanges {
            let payload = bufs.scratch.get(*incoming).ok_or_else(|| {
                internal(
                    rank,
                    format!("{}: no staging for its partial amax", s.tensor),
                )
            })?;
            grid.merge(blocks, payload).map_err(named(&s.tensor))?;
        }
        let q = s.plan;
        let scales = Scales::new(q.quant, &q.grid, grid);
        if let Some((k, blocks)) = &s.staged {
            let stage = bufs.scratch.get_mut(*k).ok_or_else(|| {
                internal(rank, format!("{}: no staging for its scales", s.tensor))
            })?;
            scales.write(blocks, stage);
        }
        for piece in &s.pieces {
            let scales = match *piece.region == *s.shard {
                true => scales.clone(),
                // a piece of a fused buffer: the scales of the blocks it touches
                false => {
                    let blocks = q.grid.blocks_touching(&piece.region);
                    let amax = grid
                        .payload(&blocks)
                        .chunks_exact(AMAX_BYTES)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    Scales::new(q.quant, &q.grid, &AmaxGrid { blocks, amax })
                }
            };
            let quantizer = Quantizer {
                scales,
                shard: piece.region.clone().into_owned(),
            };
            let cast = Cast::quantizing(s.src_dtype, s.dst_dtype, Some(Arc::new(quantizer)));
            casts.by_piece.insert(piece.key, cast);
        }
    }
    Ok(())
}
