//! The two small messages of a delta phase, before its values move: the version a receiver
//! holds ([`Fence`], to each of its senders), and what each transfer will carry ([`Header`],
//! from each sender, one per transfer in schedule order).
//!
//! ```text
//! fence   u8 holds | 7 bytes zero | u64 version                                  (16 bytes)
//! header  u8 kind | u8 why | u8 summed | u8 zero | u32 crc | u64 base | u64 len   (24 bytes)
//! ```
//! All little-endian. A `kind` of 0 is dense (the transfer moves as it would without delta,
//! `why` says why), 1 a delta of `len` bytes against version `base`. With `--checksum`,
//! `summed` is 1 and `crc` is the CRC-32C of the whole new region as the receiver will hold
//! it, in the wire dtype, so that a delta applied to the wrong base cannot pass.

use serde::Serialize;

/// Bytes of a [`Fence`].
pub const FENCE_BYTES: usize = 16;

/// Bytes of a [`Header`].
pub const HEADER_BYTES: usize = 24;

/// A receiver's word to a sender: the version its shards hold, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The version its shards hold; `None` when they hold none known.
    pub held: Option<u64>,
}

impl Fence {
    /// The fence as it goes on the wire ([`FENCE_BYTES`] bytes).
    pub fn write(&self) -> [u8; FENCE_BYTES] {
        let mut out = [0u8; FENCE_BYTES];
        if let Some(v) = self.held {
            out[0] = 1;
            out[8..].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// The fence in `bytes`, or why they are not one.
    pub fn read(bytes: &[u8]) -> Result<Fence, String> {
        let bytes: &[u8; FENCE_BYTES] = bytes
            .try_into()
            .map_err(|_| format!("a fence of {} bytes, not {FENCE_BYTES}", bytes.len()))?;
        let version = u64::from_le_bytes(bytes[8..].try_into().unwrap_or_default());
        match bytes[0] {
            0 if version == 0 => Ok(Fence { held: None }),
            1 => Ok(Fence {
                held: Some(version),
            }),
            _ => Err(format!(
                "a fence that says neither a version nor none: {bytes:?}"
            )),
        }
    }
}

/// Why a transfer moves dense in a delta refit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Dense {
    /// The sender has no base for it: the first refit of this transfer, or the sender's own
    /// state was lost.
    NoBase,
    /// The receiver holds another version than the sender's base (it missed a refit,
    /// restarted, or joins late).
    Stale,
    /// An anchor version: everything dense.
    Anchor,
    /// The encoding would not be smaller than the values.
    NotSmaller,
}

impl std::fmt::Display for Dense {
    /// As reports print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dense::NoBase => "no base",
            Dense::Stale => "holds another version",
            Dense::Anchor => "anchor",
            Dense::NotSmaller => "not smaller",
        })
    }
}

impl Dense {
    fn tag(self) -> u8 {
        match self {
            Dense::NoBase => 0,
            Dense::Stale => 1,
            Dense::Anchor => 2,
            Dense::NotSmaller => 3,
        }
    }

    fn from_tag(tag: u8) -> Option<Dense> {
        Some(match tag {
            0 => Dense::NoBase,
            1 => Dense::Stale,
            2 => Dense::Anchor,
            3 => Dense::NotSmaller,
            _ => return None,
        })
    }
}

/// What a transfer carries in a delta phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carries {
    /// The values as they would move without delta, and why.
    Dense(Dense),
    /// An encoding of `len` bytes against version `base`.
    Delta {
        /// The version the encoding is against: the one the receiver holds.
        base: u64,
        /// Bytes of the encoding.
        len: u64,
    },
}

/// A sender's word about one transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Whether the transfer's values come dense or as a delta.
    pub carries: Carries,
    /// The CRC-32C of the new region, with `--checksum`.
    pub crc: Option<u32>,
}

impl Header {
    /// Appends the header as it goes on the wire ([`HEADER_BYTES`] bytes) to `out`.
    pub fn write(&self, out: &mut Vec<u8>) {
        let mut h = [0u8; HEADER_BYTES];
        match self.carries {
            Carries::Dense(why) => h[1] = why.tag(),
            Carries::Delta { base, len } => {
                h[0] = 1;
                h[8..16].copy_from_slice(&base.to_le_bytes());
                h[16..24].copy_from_slice(&len.to_le_bytes());
            }
        }
        if let Some(crc) = self.crc {
            h[2] = 1;
            h[4..8].copy_from_slice(&crc.to_le_bytes());
        }
        out.extend_from_slice(&h);
    }

    /// The header in `h`, or why it is not one.
    pub fn read(h: &[u8]) -> Result<Header, String> {
        if h.len() != HEADER_BYTES {
            return Err(format!("a header of {} bytes, not {HEADER_BYTES}", h.len()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or_default());
        let carries = match h[0] {
            0 => Carries::Dense(
                Dense::from_tag(h[1]).ok_or_else(|| format!("an unknown dense reason {}", h[1]))?,
            ),
            1 => Carries::Delta {
                base: u64_at(8),
                len: u64_at(16),
            },
            k => return Err(format!("an unknown transfer kind {k}")),
        };
        let crc = match h[2] {
            0 => None,
            1 => Some(u32::from_le_bytes(h[4..8].try_into().unwrap_or_default())),
            s => return Err(format!("an unknown checksum flag {s}")),
        };
        Ok(Header { carries, crc })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_and_headers_read_back_what_was_written() {
        for held in [None, Some(0), Some(7), Some(u64::MAX)] {
            let f = Fence { held };
            assert_eq!(Fence::read(&f.write()), Ok(f));
        }
        let headers = [
            Header {
                carries: Carries::Dense(Dense::Stale),
                crc: None,
            },
            Header {
                carries: Carries::Delta { base: 3, len: 99 },
                crc: Some(0xdead_beef),
            },
        ];
        let mut out = Vec::new();
        for h in &headers {
            h.write(&mut out);
        }
        assert_eq!(out.len(), 2 * HEADER_BYTES);
        for (h, bytes) in headers.iter().zip(out.chunks(HEADER_BYTES)) {
            assert_eq!(Header::read(bytes).as_ref(), Ok(h));
        }
    }

    #[test]
    fn malformed_words_are_refused() {
        assert!(Fence::read(&[2; FENCE_BYTES]).is_err());
        assert!(Fence::read(&[0; 3]).is_err());
        let mut h = vec![0u8; HEADER_BYTES];
        h[0] = 5;
        assert!(Header::read(&h).unwrap_err().contains("kind 5"));
        h[0] = 0;
        h[1] = 9;
        assert!(Header::read(&h).unwrap_err().contains("reason 9"));
    }
}
