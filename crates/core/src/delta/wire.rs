//! The bytes of an encoded delta: a fixed header, then one tagged block after another, and
//! their checks on the receiving side.
//!
//! ```text
//! header  u8 version | u8 elem | u32 block_elems | u64 first_block | u32 blocks   (18 bytes)
//! block   u8 tag, then by tag:
//!         0 unchanged  nothing
//!         1 bitmask    ceil(n/8) mask bytes (bit i of byte i/8: element i changed), values
//!         2 offsets    u16 count, count u16 offsets (strictly increasing), values
//!         3 dense      n values
//! ```
//! All little-endian; `n` is the block's element count ([`super::BLOCK_ELEMS`] but for a
//! short last block); values are the changed elements' new bytes, in stream order.

use super::DeltaError;
use super::block::{Block, Encoding};

/// The version this build writes and reads.
const VERSION: u8 = 1;

/// Bytes of the [`Header`].
pub const HEADER_BYTES: usize = 18;

/// What an encoding says about itself: enough for a receiver to apply it to its region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Bytes per element (1, 2, 4 or 8).
    pub elem: u8,
    /// Elements per block (1 to 65536); the region's last block may be shorter.
    pub block_elems: u32,
    /// The block of the region's stream the first encoded block is.
    pub first_block: u64,
    /// How many blocks follow the header.
    pub blocks: u32,
}

pub(super) fn invalid(
    field: &'static str,
    value: impl ToString,
    reason: &'static str,
) -> DeltaError {
    DeltaError::Invalid {
        field,
        value: value.to_string(),
        reason,
    }
}

pub(super) fn check_params(elem: usize, block_elems: usize) -> Result<(), DeltaError> {
    if !matches!(elem, 1 | 2 | 4 | 8) {
        return Err(invalid("elem", elem, "must be 1, 2, 4 or 8 bytes"));
    }
    if !(1..=1 << 16).contains(&block_elems) {
        return Err(invalid(
            "block_elems",
            block_elems,
            "must be 1..=65536, so that an offset fits in 16 bits",
        ));
    }
    Ok(())
}

impl Header {
    /// Appends the header's [`HEADER_BYTES`] bytes to `out`.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        out.push(self.elem);
        out.extend_from_slice(&self.block_elems.to_le_bytes());
        out.extend_from_slice(&self.first_block.to_le_bytes());
        out.extend_from_slice(&self.blocks.to_le_bytes());
    }

    /// Reads and checks a header: a known version and parameters an encoder could have used.
    pub fn read(bytes: &[u8]) -> Result<Header, DeltaError> {
        if bytes.len() < HEADER_BYTES {
            return Err(invalid("header", bytes.len(), "needs 18 bytes"));
        }
        if bytes[0] != VERSION {
            return Err(invalid("version", bytes[0], "this build reads version 1"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap_or([0; 4]));
        let header = Header {
            elem: bytes[1],
            block_elems: u32_at(2),
            first_block: u64::from_le_bytes(bytes[6..14].try_into().unwrap_or([0; 8])),
            blocks: u32_at(14),
        };
        check_params(header.elem as usize, header.block_elems as usize)?;
        Ok(header)
    }
}

/// Splits `bytes` off the front of `rest`, or says which block it cut short.
fn take<'a>(rest: &mut &'a [u8], bytes: usize, block: u64) -> Result<&'a [u8], DeltaError> {
    if rest.len() < bytes {
        return Err(DeltaError::Truncated {
            block,
            needed: bytes,
            left: rest.len(),
        });
    }
    let (head, tail) = rest.split_at(bytes);
    *rest = tail;
    Ok(head)
}

/// Parses and checks a whole encoding against a region's stream of `len` bytes: every block
/// inside the stream, every tag known, every offset below its block's size and increasing,
/// every length exact, nothing left over.
pub(super) fn parse(encoded: &[u8], len: usize) -> Result<Vec<Block<'_>>, DeltaError> {
    let header = Header::read(encoded)?;
    let elem = header.elem as usize;
    let block_bytes = elem * header.block_elems as usize;
    if !len.is_multiple_of(elem) {
        return Err(invalid("elem", elem, "does not divide the region's bytes"));
    }
    let total = (len / elem).div_ceil(header.block_elems as usize) as u64;
    let end = header.first_block.checked_add(header.blocks as u64);
    if end.is_none_or(|end| end > total) {
        return Err(invalid(
            "blocks",
            format!(
                "{}..{}",
                header.first_block,
                header.first_block.saturating_add(header.blocks as u64)
            ),
            "reach past the region's blocks",
        ));
    }
    let mut rest = &encoded[HEADER_BYTES..];
    let mut blocks = Vec::with_capacity(header.blocks as usize);
    for k in 0..header.blocks as u64 {
        let index = header.first_block + k;
        let start = index as usize * block_bytes;
        let bytes = start..(start + block_bytes).min(len);
        let n = bytes.len() / elem;
        let tag = take(&mut rest, 1, index)?[0];
        let encoding = Encoding::from_tag(tag).ok_or_else(|| DeltaError::Malformed {
            block: index,
            reason: format!("unknown tag {tag}"),
        })?;
        let (index_bytes, changed) = match encoding {
            Encoding::Unchanged => (&[][..], 0),
            Encoding::Dense => (&[][..], n),
            Encoding::Bitmask => {
                let mask = take(&mut rest, n.div_ceil(8), index)?;
                if !n.is_multiple_of(8) && mask[n / 8] >> (n % 8) != 0 {
                    return Err(DeltaError::Malformed {
                        block: index,
                        reason: format!("mask bits set past its {n} elements"),
                    });
                }
                (mask, mask.iter().map(|b| b.count_ones() as usize).sum())
            }
            Encoding::Offsets => {
                let count = take(&mut rest, 2, index)?;
                let count = u16::from_le_bytes([count[0], count[1]]) as usize;
                let offsets = take(&mut rest, 2 * count, index)?;
                let mut last = None;
                for o in offsets.chunks_exact(2) {
                    let o = u16::from_le_bytes([o[0], o[1]]) as usize;
                    if o >= n || last.is_some_and(|l| o <= l) {
                        return Err(DeltaError::Malformed {
                            block: index,
                            reason: format!(
                                "offset {o} is not increasing or not below its {n} elements"
                            ),
                        });
                    }
                    last = Some(o);
                }
                (offsets, count)
            }
        };
        let values = take(&mut rest, changed * elem, index)?;
        blocks.push(Block {
            encoding,
            elem,
            bytes,
            elems: n,
            changed,
            index: index_bytes,
            values,
        });
    }
    if !rest.is_empty() {
        return Err(invalid(
            "length",
            encoded.len(),
            "has bytes after the last block",
        ));
    }
    Ok(blocks)
}
