//! The errors of precision in flight (`--dst-dtype`, `--quant`).

use thiserror::Error;

use super::{Dims, Field, Side};
use crate::dtype::{DType, ScaleDType};

/// A conversion that cannot be done. Carries no tensor name: [`Error::Convert`](super::Error::Convert)
/// adds it. Defined with the errors, which hold it, and named [`crate::convert::ConvertError`]
/// too.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConvertError {
    /// A cast between two dtypes that is not done in flight.
    #[error("{}: cannot convert {src} to {dst}: {reason}", Field::DstDType)]
    UnsupportedCast {
        /// The source dtype.
        src: DType,
        /// The destination dtype.
        dst: DType,
        /// Why the cast is not done, and what to do instead where there is a way.
        reason: &'static str,
    },

    /// A quantization whose destination dtype is not fp8.
    #[error(
        "{} {scheme}: the destination dtype is {dst}, but quantization writes fp8 (fp8e4m3 or fp8e5m2)",
        Field::Quant
    )]
    QuantDestination {
        /// The quantization scheme.
        scheme: String,
        /// The destination dtype.
        dst: DType,
    },

    /// A quantization of a source that is not f64, f32, bf16 or f16.
    #[error(
        "{} {scheme}: the source dtype is {src}, but only f64, f32, bf16 and f16 sources are quantized",
        Field::Quant
    )]
    QuantSource {
        /// The quantization scheme.
        scheme: String,
        /// The source dtype.
        src: DType,
    },

    /// e8m0 scales for a scheme whose scales are not powers of two.
    #[error(
        "{} {scale_dtype}: {} {scheme} has scales that are not powers of two (e8m0 needs `block:RxC:ue8m0` or `mx:32`)",
        Field::ScaleDType,
        Field::Quant
    )]
    ScaleDType {
        /// The quantization scheme.
        scheme: String,
        /// The scale dtype asked for.
        scale_dtype: ScaleDType,
    },

    /// A block scheme whose block has no row or no column.
    #[error(
        "{} {scheme}: a block needs at least one row and one column",
        Field::Quant
    )]
    EmptyBlock {
        /// The quantization scheme.
        scheme: String,
    },

    /// A scheme that needs more dimensions than the tensor has.
    #[error(
        "{} {scheme}: needs a tensor of at least {needs} dims, this one has {ndim}",
        Field::Quant
    )]
    SchemeNeedsDims {
        /// The quantization scheme.
        scheme: String,
        /// The fewest dimensions it needs.
        needs: usize,
        /// The tensor's number of dimensions.
        ndim: usize,
    },

    /// A shard boundary inside a quantization block, along a dimension where blocks must stay
    /// whole (the destination's, which loads whole blocks; a quantized source's).
    #[error(
        "{side}: a shard boundary at {boundary} along dim {dim} cuts a quantization block of {block} (boundaries must be multiples of the block size)"
    )]
    CutBlock {
        /// The side whose layout the boundary belongs to.
        side: Side,
        /// The dimension the boundary lies along.
        dim: usize,
        /// The boundary's index along that dimension.
        boundary: u64,
        /// The block's extent.
        block: Dims,
    },

    /// A NaN or an infinity in a block to quantize, which fp8 cannot carry.
    #[error(
        "block {block:?} holds a non-finite value ({value}) at element {element:?}, which fp8 cannot carry"
    )]
    NonFinite {
        /// Grid coordinates of the block.
        block: Vec<u64>,
        /// Global coordinates of the element.
        element: Vec<u64>,
        /// The value.
        value: f32,
    },

    /// A peer's partial amax message whose length is not 4 bytes per block it covers.
    #[error("a partial amax message of blocks {blocks} has {got} bytes, expected 4 per block")]
    AmaxPayload {
        /// The extent of the blocks it covers.
        blocks: Dims,
        /// Its length in bytes.
        got: u64,
    },

    /// Source and destination buffers of a cast that do not hold the same number of elements.
    #[error(
        "a cast from {src} to {dst} got {src_bytes} source bytes and {dst_bytes} destination bytes, which are not the same number of elements"
    )]
    Length {
        /// The source dtype.
        src: DType,
        /// The source buffer's length in bytes.
        src_bytes: u64,
        /// The destination dtype.
        dst: DType,
        /// The destination buffer's length in bytes.
        dst_bytes: u64,
    },
}
