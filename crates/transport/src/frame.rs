//! Length-prefixed frames on a byte stream, with bounds checked before any allocation.
//!
//! Header: magic `RSHD` (4 bytes), kind (u32 LE), payload length (u64 LE). Control frames carry
//! JSON and are at most [`MAX_CONTROL_BYTES`]; data frames carry one chunk of a transfer and
//! must have exactly the length the receiver's own plan expects.

use std::io::{self, Read, Write};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use reshard_core::error::Error;
use reshard_core::layout::Rank;

const MAGIC: [u8; 4] = *b"RSHD";
/// Bytes of a frame header: magic, kind and payload length.
pub const HEADER_BYTES: usize = 16;
/// Largest control message: a rank table of a million ranks fits.
pub const MAX_CONTROL_BYTES: u64 = 64 << 20;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A JSON control message, at most [`MAX_CONTROL_BYTES`].
    Control = 1,
    /// One chunk of a transfer, as raw bytes.
    Data = 2,
}

/// Why a frame was rejected.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the stream, before or in the middle of a frame.
    #[error("connection closed")]
    Closed,
    /// A header that does not start with `RSHD` (the bytes found instead).
    #[error("bad magic {0:02x?}: not a reshard peer")]
    Magic([u8; 4]),
    /// A header whose kind is neither control (1) nor data (2).
    #[error("unknown frame kind {0}")]
    Kind(u32),
    /// A control frame where a data frame was due, or the other way round.
    #[error("unexpected {got:?} frame, expected {want:?}")]
    UnexpectedKind {
        /// The kind the header says.
        got: Kind,
        /// The kind the reader expected.
        want: Kind,
    },
    /// A data frame whose length is not the one the receiver's plan expects.
    #[error("frame of {got} bytes, expected {want}")]
    Length {
        /// The payload length the header says, in bytes.
        got: u64,
        /// The chunk's length in the receiver's plan, in bytes.
        want: u64,
    },
    /// A control frame longer than its limit (its length, in bytes).
    #[error("control frame of {0} bytes is over the limit")]
    TooLarge(u64),
    /// A control message that cannot be encoded as JSON, or a body that does not decode as
    /// one (why).
    #[error("malformed control message: {0}")]
    Json(String),
    /// A read or write that did not complete within the stream's timeout.
    #[error("timed out")]
    TimedOut,
    /// Any other I/O error of the stream.
    #[error("{0}")]
    Io(io::Error),
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> FrameError {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => FrameError::Closed,
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => FrameError::TimedOut,
            _ => FrameError::Io(e),
        }
    }
}

impl FrameError {
    /// The crate error for rank `rank` failing to exchange `what` with `peer`: a closed link
    /// is a gone peer, a read past `timeout` a stalled one, anything else a protocol error.
    pub fn into_error(self, rank: Rank, peer: Rank, what: &str, timeout: Duration) -> Error {
        match self {
            FrameError::Closed => Error::PeerGone {
                rank,
                peer,
                detail: format!("connection closed during {what}"),
            },
            FrameError::TimedOut => Error::Timeout {
                rank,
                peer,
                waited: timeout,
                detail: format!("{what} did not complete"),
            },
            e => Error::Protocol {
                rank,
                peer,
                detail: format!("{what}: {e}"),
            },
        }
    }
}

fn header(kind: Kind, len: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&(kind as u32).to_le_bytes());
    h[8..].copy_from_slice(&len.to_le_bytes());
    h
}

/// Reads and checks a header; returns the kind and payload length.
pub fn read_header(r: &mut impl Read) -> Result<(Kind, u64), FrameError> {
    let mut h = [0u8; HEADER_BYTES];
    r.read_exact(&mut h)?;
    let magic: [u8; 4] = h[..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(FrameError::Magic(magic));
    }
    let kind = match u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) {
        1 => Kind::Control,
        2 => Kind::Data,
        k => return Err(FrameError::Kind(k)),
    };
    Ok((
        kind,
        u64::from_le_bytes(h[8..].try_into().expect("8 bytes")),
    ))
}

/// A control message as one frame (header and JSON body), ready to be written to any number
/// of streams: rank 0 encodes the rank table once for all its members.
pub fn encode_control<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(msg).map_err(|e| FrameError::Json(e.to_string()))?;
    let mut buf = Vec::with_capacity(HEADER_BYTES + body.len());
    buf.extend_from_slice(&header(Kind::Control, body.len() as u64));
    buf.extend_from_slice(&body);
    Ok(buf)
}

/// Writes a frame made by [`encode_control`].
pub fn write_encoded(w: &mut impl Write, frame: &[u8]) -> Result<(), FrameError> {
    w.write_all(frame)?;
    w.flush()?;
    Ok(())
}

/// Writes a control message.
pub fn write_control<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    write_encoded(w, &encode_control(msg)?)
}

/// The payload length of a control frame whose header is `h`, if it is at most `max` bytes.
pub fn control_length(mut h: &[u8], max: u64) -> Result<u64, FrameError> {
    let (kind, len) = read_header(&mut h)?;
    if kind != Kind::Control {
        return Err(FrameError::UnexpectedKind {
            got: kind,
            want: Kind::Control,
        });
    }
    if len > max {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len)
}

/// Decodes the JSON body of a control frame.
pub fn decode_control<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Json(e.to_string()))
}

/// Reads a control message, refusing data frames and oversized ones.
///
/// The body grows as its bytes arrive instead of being allocated at the length the header
/// claims: a peer that announces [`MAX_CONTROL_BYTES`] and sends ten costs ten bytes.
pub fn read_control<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    let mut h = [0u8; HEADER_BYTES];
    r.read_exact(&mut h)?;
    let len = control_length(&h, MAX_CONTROL_BYTES)?;
    let mut body = Vec::with_capacity(len.min(FIRST_BODY_BYTES) as usize);
    r.take(len).read_to_end(&mut body)?;
    if (body.len() as u64) < len {
        return Err(FrameError::Closed);
    }
    decode_control(&body)
}

/// The room first made for a control body: small messages need no more, larger ones grow.
const FIRST_BODY_BYTES: u64 = 64 << 10;

/// Writes the header of a data frame of `len` bytes; the payload follows.
pub fn write_data_header(w: &mut impl Write, len: u64) -> Result<(), FrameError> {
    w.write_all(&header(Kind::Data, len))?;
    Ok(())
}

/// Writes a data frame holding `payload`.
pub fn write_data(w: &mut impl Write, payload: &[u8]) -> Result<(), FrameError> {
    w.write_all(&header(Kind::Data, payload.len() as u64))?;
    w.write_all(payload)?;
    Ok(())
}

/// Reads the header of a data frame that must carry exactly `want` bytes.
pub fn read_data_header(r: &mut impl Read, want: u64) -> Result<(), FrameError> {
    let (kind, len) = read_header(r)?;
    if kind != Kind::Data {
        return Err(FrameError::UnexpectedKind {
            got: kind,
            want: Kind::Data,
        });
    }
    if len != want {
        return Err(FrameError::Length { got: len, want });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn round_trips() {
        let mut buf = Vec::new();
        write_control(&mut buf, &vec![1u32, 2, 3]).unwrap();
        write_data(&mut buf, b"abc").unwrap();
        let mut r = &buf[..];
        assert_eq!(read_control::<Vec<u32>>(&mut r).unwrap(), [1, 2, 3]);
        read_data_header(&mut r, 3).unwrap();
        assert_eq!(r, b"abc");
    }

    #[test]
    fn oversized_and_mismatched_frames_are_errors() {
        let mut r = &header(Kind::Control, u64::MAX)[..];
        assert!(matches!(
            read_control::<u32>(&mut r),
            Err(FrameError::TooLarge(_))
        ));
        let mut r = &header(Kind::Data, 1 << 40)[..];
        assert!(matches!(
            read_data_header(&mut r, 16),
            Err(FrameError::Length { .. })
        ));
        let mut r = &b"HTTP/1.1 200 OK\r\n"[..];
        assert!(matches!(read_header(&mut r), Err(FrameError::Magic(_))));
        let mut r = &b"RSHD"[..];
        assert!(matches!(read_header(&mut r), Err(FrameError::Closed)));
    }

    /// A reader that holds `prefix` and then ends, and remembers the largest buffer it was
    /// asked to fill.
    struct Watched<'a> {
        prefix: &'a [u8],
        largest: usize,
    }

    impl Read for Watched<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.largest = self.largest.max(buf.len());
            self.prefix.read(buf)
        }
    }

    #[test]
    fn a_claimed_length_is_not_allocated_before_its_bytes_arrive() {
        let mut input = header(Kind::Control, MAX_CONTROL_BYTES).to_vec();
        input.extend_from_slice(b"{\"a\":1}");
        let mut r = Watched {
            prefix: &input,
            largest: 0,
        };
        assert!(matches!(
            read_control::<serde_json::Value>(&mut r),
            Err(FrameError::Closed)
        ));
        assert!(
            r.largest <= 1 << 20,
            "asked for {} bytes at once",
            r.largest
        );
    }

    #[test]
    fn control_length_bounds_kind_and_size() {
        assert_eq!(control_length(&header(Kind::Control, 10), 10).unwrap(), 10);
        assert!(matches!(
            control_length(&header(Kind::Control, 11), 10),
            Err(FrameError::TooLarge(11))
        ));
        assert!(matches!(
            control_length(&header(Kind::Data, 1), 10),
            Err(FrameError::UnexpectedKind { .. })
        ));
        let frame = encode_control(&"hi").unwrap();
        let len = control_length(&frame[..HEADER_BYTES], 10).unwrap();
        assert_eq!(
            decode_control::<String>(&frame[HEADER_BYTES..][..len as usize]).unwrap(),
            "hi"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Arbitrary bytes, or a valid header followed by garbage: an error or a value, never
        /// a panic or a huge allocation.
        #[test]
        fn fuzzed_frames_never_panic(
            bytes in prop::collection::vec(any::<u8>(), 0..64),
            len in any::<u64>(),
            kind in 0u32..4,
            valid_header in any::<bool>(),
        ) {
            let mut input = Vec::new();
            if valid_header {
                input.extend_from_slice(&MAGIC);
                input.extend_from_slice(&kind.to_le_bytes());
                input.extend_from_slice(&len.to_le_bytes());
            }
            input.extend_from_slice(&bytes);
            let _ = read_control::<serde_json::Value>(&mut &input[..]);
            let _ = read_data_header(&mut &input[..], 16);
        }
    }
}
