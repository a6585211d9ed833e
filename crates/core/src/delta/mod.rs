//! Delta encoding of a transfer: after a first refit, a sender sends only the elements of its
//! region that changed since the version its receiver holds, and the receiver writes them
//! over that version in place.
//!
//! A transfer's region is read as its row-major stream in the wire dtype (after any cast or
//! quantization), cut into blocks of [`BLOCK_ELEMS`] elements numbered from the start of the
//! region. Each block is encoded as the smallest of four ([`Encoding`]): unchanged (nothing
//! but its tag), a list of offsets with the changed values, a bitmask with the changed
//! values, or dense. Values are always the new values, never arithmetic differences, so
//! applying a delta is bit-exact and cannot drift however many versions go by.
//!
//! The encoded bytes describe themselves ([`Header`]: element size, block size, the first
//! block and how many follow), so a receiver needs nothing but its own region to apply them,
//! and checks every length, tag and offset before it writes a byte: a malformed delta is an
//! error, never a panic or a write outside the region.
//!
//! Both passes are fused with the copies they replace: the encoder packs one block at a time
//! from the source shard (converting on the way) into a block-sized scratch, compares it with
//! the base, and updates the base; the decoder writes values straight into the destination
//! shard through the same strided walker ([`CopyGeometry`]). Neither allocates anything the
//! size of the region.

mod block;
mod wire;

#[cfg(test)]
mod tests;

use std::ops::Range;

use thiserror::Error;

use crate::copy::CopyGeometry;

pub use block::{Encoding, choose, encoded_len};
pub use wire::{HEADER_BYTES, Header};

/// Elements per block: small enough that a block's mask (512 bytes) and values stay in the
/// nearest cache while it is encoded, large enough that the one-byte tag of an unchanged block
/// costs nothing (1 byte per 8 KiB of bf16).
pub const BLOCK_ELEMS: usize = 4096;

/// What can be wrong with a delta a receiver is asked to apply, or with a request to encode.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DeltaError {
    /// A parameter, a header field or a length that no encoder could have written, or a
    /// request to encode that does not fit the stream.
    #[error("delta: {field} is {value}: {reason}")]
    Invalid {
        /// What is wrong (`elem`, `block_elems`, `version`, `blocks`, `range`, ...).
        field: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        reason: &'static str,
    },
    /// The encoding ends inside a block.
    #[error("delta: truncated: block {block} needs {needed} more bytes, {left} are left")]
    Truncated {
        /// The block cut short, numbered from the start of the region's stream.
        block: u64,
        /// Bytes the block's next part needs.
        needed: usize,
        /// Bytes left in the encoding.
        left: usize,
    },
    /// A block whose tag or index is wrong.
    #[error("delta: block {block}: {reason}")]
    Malformed {
        /// The block, numbered from the start of the region's stream.
        block: u64,
        /// What is wrong with it.
        reason: String,
    },
}

/// What one encode or apply saw: how many blocks took each encoding, and how many elements
/// changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaStats {
    /// Blocks per [`Encoding`], indexed by its tag.
    pub blocks: [u64; 4],
    /// Elements covered by the blocks.
    pub elems: u64,
    /// Encoding: elements whose bytes differ from the base. Applying: elements written (a
    /// dense block writes every element, changed or not).
    pub changed: u64,
    /// Bytes of the encoding, header included.
    pub bytes: u64,
}

impl DeltaStats {
    /// Adds another encode's counts to these.
    pub fn add(&mut self, other: &DeltaStats) {
        for (a, b) in self.blocks.iter_mut().zip(other.blocks) {
            *a += b;
        }
        self.elems += other.elems;
        self.changed += other.changed;
        self.bytes += other.bytes;
    }
}

/// The blocks of a region's stream of `len` bytes: `len` must hold whole elements.
fn block_count(len: usize, elem: usize, block_elems: usize) -> usize {
    (len / elem).div_ceil(block_elems)
}

/// Encodes a transfer's stream against its base, block by block.
///
/// ```
/// use reshard_core::copy::{CopyGeometry, Place};
/// use reshard_core::delta::{DeltaEncoder, apply};
/// use reshard_core::region::Region;
/// // a 4x8 shard of u16; the transfer is its 4x2 column block at columns 2..4
/// let shard = Region::from_ranges(&[0..4, 0..8]);
/// let region = Region::from_ranges(&[0..4, 2..4]);
/// let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, 2);
/// let old: Vec<u8> = (0..64).collect();
/// let mut base = vec![0u8; pack.len()];
/// pack.copy(&old, &mut base, 0..pack.len());
/// // one element changes
/// let mut new = old.clone();
/// new[2 * (8 + 3)] ^= 1;
/// let mut encoder = DeltaEncoder::new(2, 4096).unwrap();
/// let mut wire = Vec::new();
/// let stats = encoder.encode(&pack, &new, &mut base, 0..pack.len(), &mut wire).unwrap();
/// assert_eq!(stats.changed, 1);
/// // the receiver holds the old values and patches them in place
/// let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&shard), 2);
/// let mut dst = old.clone();
/// apply(&unpack, &wire, &mut dst).unwrap();
/// assert_eq!(dst, new);
/// ```
#[derive(Debug)]
pub struct DeltaEncoder {
    elem: usize,
    block_elems: usize,
    /// One block of new values in the wire dtype.
    scratch: Vec<u8>,
    /// The changed elements of the current block, one bit each.
    mask: Vec<u64>,
}

impl DeltaEncoder {
    /// An encoder of `elem`-byte elements (1, 2, 4 or 8) in blocks of `block_elems`
    /// (1..=65536, so an offset fits in 16 bits).
    pub fn new(elem: usize, block_elems: usize) -> Result<DeltaEncoder, DeltaError> {
        wire::check_params(elem, block_elems)?;
        Ok(DeltaEncoder {
            elem,
            block_elems,
            scratch: vec![0; elem * block_elems],
            mask: vec![0; block_elems.div_ceil(64)],
        })
    }

    /// Encodes bytes `range` of the region's stream, read from `src` through `pack` (a copy
    /// from the source shard to [`Place::Stream`](crate::copy::Place::Stream), converting if
    /// it has a cast), against `base` (the whole stream as last sent, in the wire dtype),
    /// appending the encoding to `out` and leaving the new values in `base`. `range` must
    /// start on a block and end on a block or at the end of the stream.
    pub fn encode(
        &mut self,
        pack: &CopyGeometry,
        src: &[u8],
        base: &mut [u8],
        range: Range<usize>,
        out: &mut Vec<u8>,
    ) -> Result<DeltaStats, DeltaError> {
        let whole = self.encode_unless(pack, src, base, range, out, |_, _| false)?;
        Ok(whole.unwrap_or_default())
    }

    /// [`DeltaEncoder::encode`], giving up as soon as `give_up(encoded, covered)` says so
    /// after a block (`encoded` bytes of encoding so far for `covered` bytes of the stream):
    /// the rest of `base` then takes the new values by a plain copy, `out` is left as it
    /// was, and `None` says that the range is better sent dense. A sender asks this when it
    /// would send a transfer dense anyway if its encoding is not smaller.
    pub fn encode_unless(
        &mut self,
        pack: &CopyGeometry,
        src: &[u8],
        base: &mut [u8],
        range: Range<usize>,
        out: &mut Vec<u8>,
        give_up: impl Fn(usize, usize) -> bool,
    ) -> Result<Option<DeltaStats>, DeltaError> {
        let (elem, block_bytes) = (self.elem, self.elem * self.block_elems);
        let len = pack.len();
        if base.len() != len {
            return Err(wire::invalid(
                "base",
                base.len(),
                "must hold the whole stream",
            ));
        }
        if range.start > range.end
            || range.end > len
            || !range.start.is_multiple_of(block_bytes)
            || (!range.end.is_multiple_of(block_bytes) && range.end != len)
            || !len.is_multiple_of(elem)
        {
            return Err(wire::invalid(
                "range",
                format!("{range:?} of {len}"),
                "must start on a block and end on one or at the end of the stream",
            ));
        }
        let first = range.start / block_bytes;
        let count = block_count(range.end, elem, self.block_elems) - first;
        let start = out.len();
        Header {
            elem: elem as u8,
            block_elems: self.block_elems as u32,
            first_block: first as u64,
            blocks: count as u32,
        }
        .write(out);
        let mut stats = DeltaStats::default();
        // a region that lies in the shard as it travels (a shard sent whole, unconverted) is
        // compared where it lies, without asking block by block
        let whole = in_one_run(pack, range.clone());
        for k in 0..count {
            let at = range.start + k * block_bytes;
            let bytes = at..(at + block_bytes).min(range.end);
            let n = bytes.len() / elem;
            let lies = match whole {
                Some(first) => Some(first + (at - range.start)),
                None => in_one_run(pack, bytes.clone()),
            };
            let new: &[u8] = match lies {
                // unconverted and contiguous in the shard: compared where it lies
                Some(at) => &src[at..at + bytes.len()],
                None => {
                    let scratch = &mut self.scratch[..bytes.len()];
                    pack.copy(src, scratch, bytes.clone());
                    scratch
                }
            };
            let old = &mut base[bytes];
            let changed = block::diff(elem, new, old, &mut self.mask);
            let encoding = choose(n, changed, elem);
            block::write(encoding, elem, n, new, &self.mask, changed, out);
            block::update(encoding, elem, n, new, &self.mask, old);
            stats.blocks[encoding as usize] += 1;
            stats.elems += n as u64;
            stats.changed += changed as u64;
            let covered = at + n * elem - range.start;
            if give_up(out.len() - start, covered) {
                let rest = range.start + covered..range.end;
                pack.copy(src, &mut base[rest.clone()], rest);
                out.truncate(start);
                return Ok(None);
            }
        }
        stats.bytes = (out.len() - start) as u64;
        Ok(Some(stats))
    }
}

/// Where bytes `range` of the stream start in the source buffer, when they lie there as they
/// travel: one contiguous run, not converted.
fn in_one_run(pack: &CopyGeometry, range: Range<usize>) -> Option<usize> {
    if pack.converts() {
        return None;
    }
    let (mut first, mut runs) = (None, 0);
    pack.for_each_run(range.clone(), |s, _, len| {
        runs += 1;
        if len == range.len() {
            first = Some(s);
        }
    });
    first.filter(|_| runs == 1)
}

/// Applies an encoding made by [`DeltaEncoder::encode`] onto a destination shard holding
/// the base: `unpack` copies the region's stream into the shard (from
/// [`Place::Stream`](crate::copy::Place::Stream) to the shard's box). Checks the whole
/// encoding before it writes a byte, so a malformed one leaves `dst` as it was.
pub fn apply(
    unpack: &CopyGeometry,
    encoded: &[u8],
    dst: &mut [u8],
) -> Result<DeltaStats, DeltaError> {
    let blocks = wire::parse(encoded, unpack.len())?;
    let mut stats = DeltaStats {
        bytes: encoded.len() as u64,
        ..DeltaStats::default()
    };
    for b in &blocks {
        block::apply(unpack, b, dst);
        stats.blocks[b.encoding as usize] += 1;
        stats.elems += b.elems as u64;
        stats.changed += b.changed as u64;
    }
    Ok(stats)
}

/// Calls `f(element, value)` for every element that applying `encoded` onto a region's stream
/// of `len` bytes writes, in stream order: `element` its index in the stream, `value` its new
/// bytes (every element of a dense block, the changed ones of the others). Checks the whole
/// encoding first, as [`apply`] does, so `f` sees nothing of a malformed one. For a receiver
/// that writes the values itself (a shard in another device's memory).
pub fn for_each_written(
    encoded: &[u8],
    len: usize,
    mut f: impl FnMut(usize, &[u8]),
) -> Result<DeltaStats, DeltaError> {
    let blocks = wire::parse(encoded, len)?;
    let mut stats = DeltaStats {
        bytes: encoded.len() as u64,
        ..DeltaStats::default()
    };
    for b in &blocks {
        block::each_written(b, &mut f);
        stats.blocks[b.encoding as usize] += 1;
        stats.elems += b.elems as u64;
        stats.changed += b.changed as u64;
    }
    Ok(stats)
}
