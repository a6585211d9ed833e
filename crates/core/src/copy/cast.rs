//! A conversion applied while copying: the kernel that casts a run, or the sender's scales
//! that quantize it.

use std::sync::Arc;

use crate::region::Region;

/// A conversion applied while copying (`--dst-dtype`, `--quant`): the source's element size
/// and the kernel that casts a run of source elements into destination ones, or, when
/// quantizing, the sender's scales. The region's stream, and so every byte range and length
/// of a converting copy, counts destination bytes: what the wire carries.
#[derive(Clone, Debug)]
pub struct Cast {
    /// The source's dtype.
    pub src: crate::DType,
    /// The destination's dtype, which the stream carries.
    pub dst: crate::DType,
    /// Bytes per source element.
    pub src_elem: usize,
    /// Casts a run of source elements into destination ones (unused when quantizing).
    pub kernel: crate::convert::CastFn,
    /// Quantizing into fp8: the scales of the sending rank's shard, whose multipliers the
    /// runs get block by block. `None` for a float cast, and on a rank that only receives
    /// fp8 (its casts only tell it how the senders cut their transfers: it never converts).
    pub quant: Option<Arc<Quantizer>>,
}

/// A source rank's quantizing copy: its scales and the box of its shard, whose dense buffer
/// every quantized run is read from.
#[derive(Debug)]
pub struct Quantizer {
    /// The scales of the blocks the rank quantizes.
    pub scales: crate::convert::Scales,
    /// The box of the rank's shard, in global coordinates.
    pub shard: Region,
}

/// Two casts are the same when they convert the same dtypes (the kernel follows from them)
/// with the same scales, if any.
impl PartialEq for Cast {
    fn eq(&self, other: &Cast) -> bool {
        (self.src, self.dst) == (other.src, other.dst)
            && match (&self.quant, &other.quant) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Eq for Cast {}

impl Cast {
    /// The conversion from `src` to `dst` elements, or `None` when they are the same dtype (a
    /// plain copy). Fails, naming both dtypes, for the pairs that cannot be converted.
    pub fn between(
        src: crate::DType,
        dst: crate::DType,
    ) -> std::result::Result<Option<Cast>, crate::convert::ConvertError> {
        let kernel = crate::convert::cast_fn(src, dst)?;
        Ok((src != dst).then_some(Cast {
            src,
            dst,
            src_elem: src.size(),
            kernel,
            quant: None,
        }))
    }

    /// The quantizing conversion of a source rank into `dst` (fp8) with `quantizer`'s
    /// scales; or, without one, the marker a receiving rank's steps carry so that it cuts its
    /// transfers as the senders do (it never converts anything itself).
    pub fn quantizing(
        src: crate::DType,
        dst: crate::DType,
        quantizer: Option<Arc<Quantizer>>,
    ) -> Cast {
        Cast {
            src,
            dst,
            src_elem: src.size(),
            kernel: unreachable_kernel,
            quant: quantizer,
        }
    }
}

/// The kernel of a receiver's quantizing marker ([`Cast::quantizing`] without scales):
/// receivers unpack wire bytes as they are and never call it.
fn unreachable_kernel(_: &[u8], _: &mut [u8]) {
    unreachable!("a rank without scales never quantizes")
}
