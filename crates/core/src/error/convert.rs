//! The errors of precision in flight (`--dst-dtype`, `--quant`).

use thiserror::Error;

use super::{Dims, Field, Side};
use crate::dtype::{DType, ScaleDType};

/// A conversion that cannot be done. Carries no tensor name: [`Error::Convert`](super::Error::Convert)
/// adds it. Defined with the errors, which hold it, and named [`crate::convert::ConvertError`]
/// too.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConvertError {
    #[error("{}: cannot convert {src} to {dst}: {reason}", Field::DstDType)]
    UnsupportedCast {
        src: DType,
        dst: DType,
        reason: &'static str,
    },

    #[error(
        "{} {scheme}: the destination dtype is {dst}, but quantization writes fp8 (fp8e4m3 or fp8e5m2)",
        Field::Quant
    )]
    QuantDestination { scheme: String, dst: DType },

    #[error(
        "{} {scheme}: the source dtype is {src}, but only f64, f32, bf16 and f16 sources are quantized",
        Field::Quant
    )]
    QuantSource { scheme: String, src: DType },

    #[error(
        "{} {scale_dtype}: {} {scheme} has scales that are not powers of two (e8m0 needs `block:RxC:ue8m0` or `mx:32`)",
        Field::ScaleDType,
        Field::Quant
    )]
    ScaleDType {
        scheme: String,
        scale_dtype: ScaleDType,
    },

    #[error(
        "{} {scheme}: a block needs at least one row and one column",
        Field::Quant
    )]
    EmptyBlock { scheme: String },

    #[error(
        "{} {scheme}: needs a tensor of at least {needs} dims, this one has {ndim}",
        Field::Quant
    )]
    SchemeNeedsDims {
        scheme: String,
        needs: usize,
        ndim: usize,
    },

    #[error(
        "{side}: a shard boundary at {boundary} along dim {dim} cuts a quantization block of {block} (boundaries must be multiples of the block size)"
    )]
    CutBlock {
        side: Side,
        dim: usize,
        boundary: u64,
        block: Dims,
    },

    #[error(
        "block {block:?} holds a non-finite value ({value}) at element {element:?}, which fp8 cannot carry"
    )]
    NonFinite {
        /// Grid coordinates of the block.
        block: Vec<u64>,
        /// Global coordinates of the element.
        element: Vec<u64>,
        value: f32,
    },

    #[error("a partial amax message of blocks {blocks} has {got} bytes, expected 4 per block")]
    AmaxPayload { blocks: Dims, got: u64 },

    #[error(
        "a cast from {src} to {dst} got {src_bytes} source bytes and {dst_bytes} destination bytes, which are not the same number of elements"
    )]
    Length {
        src: DType,
        src_bytes: u64,
        dst: DType,
        dst_bytes: u64,
    },
}
