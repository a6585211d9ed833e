//! The quantized tensors of a batch: a refit straight into an fp8 engine's weights and scales.
//!
//! A tensor with a [`Tensor::quant`](super::Tensor::quant) moves in the batch like any other,
//! with three additions, all planned from the layouts alone ([`super::Batch::rank_batch`]):
//!
//! 1. **Amax.** Every source rank of a quantized tensor computes the amax of the blocks its
//!    shard touches, reading its pieces in place (a fused Megatron buffer too). Where a block
//!    straddles source shards, the ranks that share it exchange partial amax
//!    ([`reshard_core::convert::amax_exchange`]): all of a rank's exchanges, of every quantized
//!    tensor, are one phase of its program before any value moves ([`super::lower`]).
//! 2. **Scales.** Each tensor's scales follow from its merged amax, with no communication; a
//!    source rank stages the scales of the blocks its shard touches, which its scale moves
//!    read.
//! 3. **Values and scales.** The value moves of a quantized tensor are in the batch's one
//!    schedule with every other move, and carry a quantizing [`Cast`](reshard_core::copy::Cast) with the scales of their
//!    source piece: the sender quantizes while it packs, straight from the source piece to the
//!    wire (or, for a local copy, straight into the destination piece, a fused vLLM buffer
//!    included), so there is no extra pass over the values and no full-size temporary. Each
//!    value transfer carries the scales of the blocks it delivers
//!    ([`reshard_core::plan::QuantPlan::scales_of`]): a scale move from the sender's staged scales
//!    into the receiver's scale buffer, fused like its weights ([`super::Batch::scale_buffers`]), so
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

pub use crate::exec::Casts;
