//! The quantized tensors of a batch: a refit straight into an fp8 engine's weights and scales.
//!
//! A tensor with a [`Tensor::quant`](super::Tensor::quant) moves in the batch like any other,
//! with three additions, all planned from the layouts alone ([`Batch::rank_batch`]):
//!
//! 1. **Amax.** Every source rank of a quantized tensor computes the amax of the blocks its
//!    shard touches, reading its pieces in place (a fused Megatron buffer too). Where a block
//!    straddles source shards, the ranks that share it exchange partial amax
//!    ([`reshard_core::convert::amax_exchange`]): all of a rank's exchanges, of every quantized
//!    tensor, are one run of steps before any value moves ([`prepare`]).
//! 2. **Scales.** Each tensor's scales follow from its merged amax, with no communication; a
//!    source rank stages the scales of the blocks its shard touches, which its scale moves
//!    read.
//! 3. **Values and scales.** The value moves of a quantized tensor are in the batch's one
//!    schedule with every other move, and carry a quantizing [`Cast`] with the scales of their
//!    source piece: the sender quantizes while it packs, straight from the source piece to the
//!    wire (or, for a local copy, straight into the destination piece, a fused vLLM buffer
//!    included), so there is no extra pass over the values and no full-size temporary. Each
//!    value transfer carries the scales of the blocks it delivers
//!    ([`reshard_core::plan::QuantPlan::scales_of`]): a scale move from the sender's staged scales
//!    into the receiver's scale buffer, fused like its weights ([`Batch::scale_buffers`]), so
//!    that every destination receives each of its scales exactly once.
//!
//! **Why it cannot deadlock.** In each of the two runs (the amax exchange, then all moves)
//! every rank lists its messages in one global order on rank pairs, the shift schedule
//! ([`reshard_core::plan::Schedule`]: among the quantized tensors' source ranks for the amax, sources
//! against destinations for the moves), then by tensor, then values before scales, then
//! region; both ends of a pair compute the same list for it (a transfer, its cuts at the
//! pieces of both sides and the scales it carries follow from the layouts alone), so each
//! pair's messages form one stream in one order at both ends. Sends run on one thread and
//! receives on another, taking each sender's messages in order as they come (or all sends are
//! posted first where sends never block), so a rank never waits on a message that its peer
//! would send only after one the rank itself has yet to send or receive. Between the runs: a
//! rank leaves the amax run only once it has sent and received every one of its amax messages,
//! so a rank still in it depends only on peers' amax messages, which every peer sends before
//! any of its moves; value chunks that arrive early queue behind them on their pair's stream.
//! A rank without amax exchanges skips the first run. A failure (a non-finite value, a peer
//! that dies) breaks every link of the rank, so that its peers stop too rather than wait.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Batch, MoveKind, RankBatch};
use crate::exec::{ExecOptions, Steps, run_steps};
use reshard_core::convert::{AmaxGrid, Scales};
use reshard_core::copy::{Cast, Quantizer};
use reshard_core::error::{Error, Result};
use reshard_core::plan::QuantPlan;
use reshard_core::plan::quant::AMAX_BYTES;
use reshard_transport::Transport;

/// The quantizing casts of a rank's source pieces, by (source buffer, first byte of the
/// piece): each with the scales of the blocks its piece touches.
#[derive(Clone, Debug, Default)]
pub struct Casts {
    by_piece: BTreeMap<(usize, usize), Cast>,
}

impl Casts {
    /// The cast of the piece at `start` in source buffer `buffer`.
    pub fn of(&self, buffer: usize, start: usize) -> Option<&Cast> {
        self.by_piece.get(&(buffer, start))
    }
}

/// A rank's staging for its quantized tensors: its outgoing and incoming partial amax (one
/// buffer per exchange, as [`RankBatch::amax`] counts them) and the staged scales of each
/// [`super::QuantSource`]. Small: 4 bytes per block piece, one scale per block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantBuffers {
    pub outgoing: Vec<Vec<u8>>,
    pub incoming: Vec<Vec<u8>>,
    pub staged: Vec<Vec<u8>>,
}

impl QuantBuffers {
    /// Bytes held.
    pub fn len(&self) -> usize {
        [&self.outgoing, &self.incoming, &self.staged]
            .iter()
            .flat_map(|v| v.iter())
            .map(Vec::len)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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

impl RankBatch {
    /// Zeroed [`QuantBuffers`] for this rank's part ([`Error::OutOfMemory`] when they do not
    /// fit).
    pub fn quant_buffers(&self, batch: &Batch) -> Result<QuantBuffers> {
        let rank = self.rank;
        let zeroed = |len: usize, what: &str| {
            reshard_core::memory::zeroed(len as u64, || format!("rank {rank}'s {what}"))
        };
        let mut out = QuantBuffers::default();
        for s in &self.quant {
            for blocks in &s.exchanges {
                let len = blocks.volume() as usize * AMAX_BYTES;
                out.outgoing.push(zeroed(len, "partial amax")?);
                out.incoming.push(zeroed(len, "partial amax")?);
            }
            let q = quant_of(batch, s.tensor, rank)?;
            let len = s.blocks.volume() as usize * q.scale_bytes();
            out.staged.push(zeroed(len, "staged scales")?);
        }
        Ok(out)
    }
}

/// Runs the first two phases of `rb`'s quantized tensors (see the module docs): the amax of
/// its source pieces (`src`, its source buffers), the exchange of partial amax over
/// `transport` (`quant`'s amax buffers), and the scales, staged in `quant`. Returns the
/// quantizing casts of its source pieces for [`RankBatch::steps`], and the staged scales,
/// which its scale moves read. A non-finite source value is an error naming the tensor, the
/// block and the element; on any failure every link is broken, so that the peers stop now.
pub fn prepare<'buf, T: Transport<'buf> + ?Sized>(
    batch: &Batch,
    rb: &'buf RankBatch,
    src: &[&[u8]],
    quant: &'buf mut QuantBuffers,
    transport: &T,
    options: &ExecOptions,
) -> Result<(Casts, &'buf [Vec<u8>])> {
    let QuantBuffers {
        outgoing,
        incoming,
        staged,
    } = quant;
    let casts = prepared(
        batch, rb, src, outgoing, incoming, staged, transport, options,
    )
    .inspect_err(|_| transport.abort())?;
    Ok((casts, staged))
}

#[allow(clippy::too_many_arguments)]
fn prepared<'buf, T: Transport<'buf> + ?Sized>(
    batch: &Batch,
    rb: &'buf RankBatch,
    src: &[&[u8]],
    outgoing: &'buf mut [Vec<u8>],
    incoming: &mut [Vec<u8>],
    staged: &mut [Vec<u8>],
    transport: &T,
    options: &ExecOptions,
) -> Result<Casts> {
    let rank = rb.rank;
    let named = |tensor: usize| {
        let name = batch.tensors[tensor].name.clone();
        move |source| Error::Convert {
            tensor: name,
            source,
        }
    };
    let exchanges: usize = rb.quant.iter().map(|s| s.exchanges.len()).sum();
    if outgoing.len() != exchanges || incoming.len() != exchanges || staged.len() != rb.quant.len()
    {
        return Err(Error::Internal {
            rank,
            detail: format!(
                "{exchanges} amax exchanges and {} staged scales planned, buffers for {}, {} and {}",
                rb.quant.len(),
                outgoing.len(),
                incoming.len(),
                staged.len()
            ),
        });
    }
    // the amax of each tensor's shard, piece by piece where it lies in a fused buffer
    let mut grids = Vec::with_capacity(rb.quant.len());
    for s in &rb.quant {
        let t = &batch.tensors[s.tensor];
        let q = quant_of(batch, s.tensor, rank)?;
        let mut grid = AmaxGrid {
            blocks: s.blocks.clone(),
            amax: vec![0.0; s.blocks.volume() as usize],
        };
        for (b, buffer) in rb.src.iter().enumerate() {
            for piece in buffer.pieces.iter().filter(|p| p.tensor == s.tensor) {
                let bytes = src
                    .get(b)
                    .and_then(|buf| buf.get(piece.bytes.clone()))
                    .ok_or_else(|| Error::Internal {
                        rank,
                        detail: format!("source buffer {b} does not hold its piece of {}", t.name),
                    })?;
                let local = AmaxGrid::local(&q.grid, &piece.region, bytes, t.src.dtype())
                    .map_err(named(s.tensor))?;
                grid.merge(&local.blocks, &local.payload(&local.blocks))
                    .map_err(named(s.tensor))?;
            }
        }
        grids.push(grid);
    }
    // the partial amax of the blocks shared with other source ranks, all in one run
    if !rb.amax.is_empty() {
        let mut k = 0;
        for (s, grid) in rb.quant.iter().zip(&grids) {
            for blocks in &s.exchanges {
                outgoing[k].copy_from_slice(&grid.payload(blocks));
                k += 1;
            }
        }
        let outgoing: &'buf [Vec<u8>] = outgoing;
        exchange(rb, outgoing, incoming, transport, options)?;
        let mut k = 0;
        for (s, grid) in rb.quant.iter().zip(&mut grids) {
            for blocks in &s.exchanges {
                grid.merge(blocks, &incoming[k]).map_err(named(s.tensor))?;
                k += 1;
            }
        }
    }
    // the scales: staged for the scale moves, and each source piece's quantizing cast
    let mut casts = Casts::default();
    for ((s, grid), stage) in rb.quant.iter().zip(&grids).zip(staged.iter_mut()) {
        let t = &batch.tensors[s.tensor];
        let q = quant_of(batch, s.tensor, rank)?;
        let scales = Scales::new(q.quant, &q.grid, grid);
        scales.write(&s.blocks, stage);
        for (b, buffer) in rb.src.iter().enumerate() {
            for piece in buffer.pieces.iter().filter(|p| p.tensor == s.tensor) {
                let scales = match piece.region == s.shard {
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
                    shard: piece.region.clone(),
                };
                let cast =
                    Cast::quantizing(t.src.dtype(), t.dst.dtype(), Some(Arc::new(quantizer)));
                casts.by_piece.insert((b, piece.bytes.start), cast);
            }
        }
    }
    Ok(casts)
}

/// The partial amax exchange: every amax move of the rank as one run of steps, in the amax
/// schedule's order, on the transport the moves then take.
fn exchange<'buf, T: Transport<'buf> + ?Sized>(
    rb: &'buf RankBatch,
    outgoing: &'buf [Vec<u8>],
    incoming: &mut [Vec<u8>],
    transport: &T,
    options: &ExecOptions,
) -> Result<()> {
    let mut steps = Steps {
        rank: rb.rank,
        ..Steps::default()
    };
    for m in rb.amax.iter().filter(|m| m.kind == MoveKind::Amax) {
        // partial amax land in the exchange's own staging
        let step = m.step(None, reshard_transport::Lands::Aside);
        if m.from == rb.rank {
            steps.sends.push(step);
        } else {
            steps.recvs.push(step);
        }
    }
    let src: Vec<&'buf [u8]> = outgoing.iter().map(Vec::as_slice).collect();
    let mut dst: Vec<&mut [u8]> = incoming.iter_mut().map(Vec::as_mut_slice).collect();
    run_steps(&steps, &src, &mut dst, transport, options).map(drop)
}
