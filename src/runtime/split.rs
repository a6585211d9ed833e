//! Two links under one schedule: the transfers into one buffer of each receiver over links
//! that may write into it directly, the rest over links of their own.
//!
//! Same-host senders write straight into a receiver's destination when it lives in shared
//! memory (one copy per byte instead of a ring's two), but a shm link knows one destination
//! box per receiver. An already-quantized move lands in two buffers, values and scales: its
//! value chunks may be written directly, its scale chunks (other coordinates, another buffer)
//! may not. [`SplitTransport`] keeps the move one schedule, each peer pair's scales right
//! behind its values, and hands every chunk to the link of its buffer: the executor runs one
//! exchange, as over one link.

use std::ops::Range;

use super::AnyTransport;
use crate::error::Result;
use crate::layout::Rank;
use crate::transport::{Chunking, Incoming, Outgoing, Transport};

/// The addresses a buffer spans: a chunk lies in it when its bytes lie in them.
fn span(buffer: Option<&[u8]>) -> Range<usize> {
    buffer.map_or(0..0, |b| {
        let start = b.as_ptr() as usize;
        start..start + b.len()
    })
}

/// Whether `part` (a slice the executor cut out of one of its buffers) lies in `within`.
fn lies_in(part: &[u8], within: &Range<usize>) -> bool {
    let start = part.as_ptr() as usize;
    !part.is_empty() && within.start <= start && start + part.len() <= within.end
}

/// A transport that sends the chunks of one source buffer and receives those of one
/// destination buffer over `direct` (opened with that destination, so same-host senders may
/// write into it), and every other chunk over `rest`. Both ends of a transfer route it alike:
/// the sender by its source buffer, the receiver by its destination buffer, which hold the
/// same tensor. Checksums travel over `direct`, after every chunk of both links.
pub struct SplitTransport<'a> {
    direct: AnyTransport<'a>,
    rest: AnyTransport<'a>,
    direct_src: Range<usize>,
    direct_dst: Range<usize>,
}

impl<'a> SplitTransport<'a> {
    /// `direct_src` is this rank's source buffer whose chunks go over `direct` (if it sends
    /// any), `direct_dst` its destination buffer that `direct` lets same-host senders write
    /// into (if it receives any). The buffers must stay where they are while the transport
    /// runs (they are told by their addresses).
    pub fn new(
        direct: AnyTransport<'a>,
        rest: AnyTransport<'a>,
        direct_src: Option<&[u8]>,
        direct_dst: Option<&[u8]>,
    ) -> SplitTransport<'a> {
        SplitTransport {
            direct,
            rest,
            direct_src: span(direct_src),
            direct_dst: span(direct_dst),
        }
    }

    fn sending(&self, chunk: &Outgoing<'_>) -> &AnyTransport<'a> {
        match lies_in(chunk.src, &self.direct_src) {
            true => &self.direct,
            false => &self.rest,
        }
    }

    fn receiving(&self, chunk: &Incoming<'_>) -> &AnyTransport<'a> {
        match lies_in(chunk.dst, &self.direct_dst) {
            true => &self.direct,
            false => &self.rest,
        }
    }
}

impl<'buf> Transport<'buf> for SplitTransport<'_> {
    fn name(&self) -> &'static str {
        self.direct.name()
    }

    /// Both links are opened alike, so they cut alike.
    fn chunking(&self) -> Chunking {
        self.direct.chunking()
    }

    fn sends_block(&self) -> bool {
        self.direct.sends_block() || self.rest.sends_block()
    }

    fn send(&self, chunk: Outgoing<'buf>) -> Result<()> {
        self.sending(&chunk).send(chunk)
    }

    fn send_summed(&self, chunk: Outgoing<'buf>) -> Result<u32> {
        self.sending(&chunk).send_summed(chunk)
    }

    fn recv(&self, chunk: Incoming<'_>) -> Result<()> {
        self.receiving(&chunk).recv(chunk)
    }

    fn send_sums(&self, to: Rank, sums: Vec<u32>) -> Result<()> {
        self.direct.send_sums(to, sums)
    }

    fn recv_sums(&self, from: Rank) -> Result<Vec<u32>> {
        self.direct.recv_sums(from)
    }

    fn abort(&self) {
        self.direct.abort();
        self.rest.abort();
    }

    fn finish(&self) -> Result<()> {
        let direct = self.direct.finish();
        let rest = self.rest.finish();
        direct.and(rest)
    }

    fn peak_staging_bytes(&self) -> u64 {
        self.direct.peak_staging_bytes() + self.rest.peak_staging_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_lies_in_its_buffer_and_nowhere_else() {
        let (a, b) = (vec![0u8; 16], vec![0u8; 16]);
        let within = span(Some(&a));
        assert!(lies_in(&a, &within));
        assert!(lies_in(&a[4..9], &within));
        assert!(!lies_in(&b[..], &within));
        assert!(!lies_in(&b[0..1], &within));
        // an empty part lies nowhere, and nothing lies in no buffer
        assert!(!lies_in(&a[3..3], &within));
        assert!(!lies_in(&a, &span(None)));
    }
}
