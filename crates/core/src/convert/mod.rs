//! Precision in flight: the pure arithmetic of converting a tensor while it moves.
//!
//! A refit often changes the weights' type on the way: f32 master weights become bf16 for
//! inference, and fp8 engines load e4m3 values with scales in their own layout. Converting on
//! the sender while it packs halves (or quarters) the wire bytes and saves the engine a pass;
//! this module holds everything that conversion computes, free of I/O, so that the executor,
//! the reference tests and the Python package agree bit for bit:
//!
//! - [`cast`](mod@cast): float casts between f64, f32, bf16 and f16, exactly as torch's `.to()`, as
//!   slice kernels over little-endian bytes, and [`cast_supported`], the check that refuses
//!   integer, bool and unscaled fp8 conversions before any byte moves;
//! - [`format`](mod@format): the bit arithmetic shared by f16 and the fp8 formats;
//! - [`fp8`]: the e4m3fn and e5m2 formats, encoding (nearest even, saturating) and decoding;
//! - [`quant`]: the schemes (`block:RxC`, `block:RxC:ue8m0`, `mx:32`, `channel`, `tensor`),
//!   which engine loads each, their parsing and their scale arithmetic;
//! - [`grid`]: the block grid, the destination alignment rule, the partial amax exchange
//!   between source ranks that share a block, and the quantizing copy of a run.
//!
//! One rank quantizing its shard, when no block is cut by another shard (otherwise the
//! partial amax of [`amax_exchange`] are merged before the scales are taken):
//!
//! ```
//! use reshard_core::convert::{AmaxGrid, BlockGrid, Quant, QuantScheme, Scales};
//! use reshard_core::{DType, Region};
//! let scheme = QuantScheme::parse("block:2x2")?;
//! let quant = Quant::new(scheme, DType::F32, DType::Fp8E4M3, None)?;
//! let grid = BlockGrid::new(scheme, &[2, 4])?;
//! let shard = Region::full(&[2, 4]);
//! let values = [1.0f32, -2.0, 0.5, 0.25, 3.0, 4.0, 0.0, 0.125];
//! let buf: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
//! let amax = AmaxGrid::local(&grid, &shard, &buf, DType::F32)?;
//! assert_eq!(amax.amax, [4.0, 0.5]);
//! let scales = Scales::new(quant, &grid, &amax);
//! let mut q = [0u8; 8];
//! scales.quantize_run(&shard, DType::F32, 0, &buf, &mut q);
//! assert_eq!(q[5], 0x7e); // 4.0, its block's amax, becomes FMAX (448)
//! let mut scale = [0u8; 8];
//! scales.write(&grid.scale_region(&shard), &mut scale);
//! assert_eq!(f32::from_le_bytes(scale[..4].try_into()?), 4.0 / 448.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cast;
pub mod format;
pub mod fp8;
pub mod grid;
pub mod quant;
pub mod reference;
pub mod shard;

#[cfg(test)]
mod tests;

pub use crate::error::ConvertError;
pub use cast::{CastFn, cast, cast_fn, cast_supported};
pub use fp8::Fp8;
pub use grid::{AmaxGrid, BlockGrid, Scales, amax_exchange};
pub use quant::{Quant, QuantScheme, ScaleDType};
pub use shard::{check_whole_blocks, quantize_shard};
