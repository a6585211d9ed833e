//! Checksums of transfers (`--checksum`): the sender sums every chunk of a transfer as it
//! hands it to the transport, the receiver sums what landed in its shard, and a difference
//! fails the job naming the transfer and the chunk.
//!
//! A sum is the CRC-32C of bytes `range` of a region's row-major stream, whatever buffer holds
//! the region: both ends read the same stream from differently shaped shards, and cut it into
//! the same chunks (`reshard_transport::Chunking`, fixed when a transport is built, cuts alike on both ends).
//! CRC-32C is computed by `crc-fast` with carry-less multiplications (AVX-512 VPCLMULQDQ,
//! PCLMULQDQ, ARMv8 PMULL): measured here (`cargo bench --bench kernels`, `sum_2d`) it sums a
//! strided region faster than the copy kernels copy it, 1.2x (4 KiB runs) to 2.9x (1 KiB)
//! the `crc32c` crate's speed; and the sum of a whole transfer is the chunks' sums appended
//! in order, so per-chunk sums lose nothing against one sum per transfer while naming the
//! chunk that went wrong.

use std::ops::Range;

use crate::copy::{CopyGeometry, Place};
pub use crate::crc::{append, bytes_sum};
use crate::error::{Dims, Error, Result};
use crate::layout::Rank;
use crate::region::Region;

/// The CRC-32C of bytes `range` of `region`'s row-major stream, read from `shard`, a dense
/// row-major buffer holding the box `holder` (which must contain `region`).
pub fn region_sum(
    shard: &[u8],
    holder: &Region,
    region: &Region,
    elem_bytes: usize,
    range: Range<usize>,
) -> u32 {
    let g = CopyGeometry::new(region, Place::Within(holder), Place::Stream, elem_bytes);
    let mut sum = 0;
    if !(PREFETCH_MIN_RUN..=PREFETCH_MAX_RUN).contains(&g.run_bytes()) {
        g.for_each_run(range, |at, _, len| sum = append(sum, &shard[at..at + len]));
        return sum;
    }
    // A strided region of short runs starts a new page with nearly every run, where the
    // hardware prefetchers stop: the run after next is prefetched while this one is summed,
    // as the copy kernels do.
    let mut runs = Vec::with_capacity(range.len().div_ceil(g.run_bytes()) + 1);
    g.for_each_run(range, |at, _, len| runs.push(at..at + len));
    for (i, run) in runs.iter().enumerate() {
        if let Some(ahead) = runs.get(i + PREFETCH_RUNS_AHEAD) {
            prefetch(&shard[ahead.clone()]);
        }
        sum = append(sum, &shard[run.clone()]);
    }
    sum
}

/// Runs shorter than this are summed without prefetching: the walk would cost more than the
/// misses it hides.
const PREFETCH_MIN_RUN: usize = 1024;
/// Runs longer than this are summed without prefetching: the hardware prefetchers follow a
/// run within its pages, and asking for a whole long run at once would only crowd them.
const PREFETCH_MAX_RUN: usize = 64 << 10;
/// How many runs ahead of the one being summed are prefetched.
const PREFETCH_RUNS_AHEAD: usize = 2;

/// Asks for every cache line of `bytes` (a hint: it never faults, and does nothing where the
/// CPU has no such instruction).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for at in (0..bytes.len()).step_by(64) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: `at` lies inside `bytes`; a prefetch only hints the caches.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(at).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// The byte ranges a transfer of `len` bytes is cut into, at `chunk` bytes each.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    (0..len)
        .step_by(chunk)
        .map(move |start| start..start.saturating_add(chunk).min(len))
}

/// One transfer as its receiver checks it.
#[derive(Clone, Copy, Debug)]
pub struct Landed<'a> {
    /// The sender.
    pub from: Rank,
    /// The receiver, which checks.
    pub to: Rank,
    /// The region moved, in global coordinates.
    pub region: &'a Region,
    /// Bytes per element.
    pub elem_bytes: usize,
    /// The receiver's shard (only the bytes of `dst_box`).
    pub shard: &'a [u8],
    /// The box `shard` holds, in global coordinates (it contains `region`).
    pub dst_box: &'a Region,
    /// The chunk size both ends cut this transfer into.
    pub chunk: usize,
}

impl Landed<'_> {
    /// Number of chunks, and so of sums, the sender sent for this transfer.
    pub fn chunk_count(&self) -> usize {
        let len = self.region.volume() as usize * self.elem_bytes;
        len.div_ceil(self.chunk.max(1))
    }

    /// Compares what landed with the sender's `sums` (one per chunk, in order): the first
    /// chunk that differs, as an error naming the transfer.
    pub fn check(&self, sums: &[u32]) -> Result<()> {
        let len = self.region.volume() as usize * self.elem_bytes;
        if sums.len() != self.chunk_count() {
            return Err(Error::Protocol {
                rank: self.to,
                peer: self.from,
                detail: format!(
                    "sent {} checksums for the {} chunks of {}",
                    sums.len(),
                    self.chunk_count(),
                    self.region
                ),
            });
        }
        for (index, (range, &sent)) in chunks(len, self.chunk).zip(sums).enumerate() {
            let landed = region_sum(
                self.shard,
                self.dst_box,
                self.region,
                self.elem_bytes,
                range.clone(),
            );
            if landed != sent {
                return Err(Error::ChecksumMismatch {
                    src: self.from,
                    dst: self.to,
                    offset: self.region.offset.clone(),
                    extent: Dims(self.region.extent.clone()),
                    chunk: index,
                    bytes: range,
                    sent,
                    landed,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `rows` x `cols` shard of bytes whose value is their position.
    fn shard(rows: u64, cols: u64) -> (Region, Vec<u8>) {
        let b = Region::from_ranges(&[0..rows, 0..cols]);
        let bytes = (0..rows * cols).map(|i| (i * 7 + 3) as u8).collect();
        (b, bytes)
    }

    #[test]
    fn the_sum_of_a_region_is_that_of_its_packed_stream_in_any_chunking() {
        let (holder, bytes) = shard(6, 10);
        let region = Region::from_ranges(&[1..5, 3..8]);
        let g = CopyGeometry::new(&region, Place::Within(&holder), Place::Stream, 1);
        let mut packed = vec![0u8; g.len()];
        g.copy(&bytes, &mut packed, 0..g.len());
        let whole = region_sum(&bytes, &holder, &region, 1, 0..g.len());
        assert_eq!(whole, bytes_sum(&packed));
        for chunk in [1, 3, 7, 20] {
            let mut appended = 0;
            for r in chunks(g.len(), chunk) {
                assert_eq!(
                    region_sum(&bytes, &holder, &region, 1, r.clone()),
                    bytes_sum(&packed[r.clone()])
                );
                appended = append(appended, &packed[r]);
            }
            assert_eq!(appended, whole);
        }
    }

    #[test]
    fn the_same_region_in_differently_shaped_shards_sums_alike() {
        // the sender holds rows 0..4 of all 8 columns, the receiver all 8 rows of columns 2..4
        let src_box = Region::from_ranges(&[0..4, 0..8]);
        let dst_box = Region::from_ranges(&[0..8, 2..4]);
        let region = Region::from_ranges(&[0..4, 2..4]);
        let src: Vec<u8> = (0..32u8).collect();
        let mut dst = vec![0u8; 16];
        let g = CopyGeometry::new(&region, Place::Within(&src_box), Place::Within(&dst_box), 1);
        g.copy(&src, &mut dst, 0..g.len());
        let sent: Vec<u32> = chunks(8, 3)
            .map(|r| region_sum(&src, &src_box, &region, 1, r))
            .collect();
        let landed = Landed {
            from: 0,
            to: 2,
            region: &region,
            elem_bytes: 1,
            shard: &dst,
            dst_box: &dst_box,
            chunk: 3,
        };
        assert!(landed.check(&sent).is_ok());
        // one flipped byte in the second chunk (bytes 3..6 of the stream: rows 1 and 2)
        let mut dst = dst.clone();
        dst[2 * 2 + 1] ^= 0x10;
        let landed = Landed {
            shard: &dst,
            ..landed
        };
        let err = landed.check(&sent).unwrap_err();
        let Error::ChecksumMismatch { chunk, bytes, .. } = &err else {
            panic!("{err}");
        };
        assert_eq!((*chunk, bytes.clone()), (1, 3..6));
        let msg = err.to_string();
        assert!(
            msg.contains("rank 0 to rank 2") && msg.contains("offset [0, 2] extent 4x2"),
            "{msg}"
        );
        // a sender that sent the wrong number of sums
        assert!(matches!(
            landed.check(&sent[..2]),
            Err(Error::Protocol { .. })
        ));
    }

    /// The sender's sum taken while copying equals the sum of the region in place and of the
    /// bytes copied: short runs, prefetched runs, and runs longer than a summed piece, over
    /// ranges that start and end inside a run.
    #[test]
    fn summing_copies_agree_with_sums_in_place() {
        for cols in [3u64, 2048, 40 << 10] {
            let rows = 5;
            let holder = Region::from_ranges(&[0..rows, 0..2 * cols]);
            let bytes: Vec<u8> = (0..rows * 2 * cols).map(|i| (i * 13 + 1) as u8).collect();
            let region = Region::from_ranges(&[1..rows, cols / 2..cols / 2 + cols]);
            let g = CopyGeometry::new(&region, Place::Within(&holder), Place::Stream, 1);
            let len = g.len();
            for r in [0..len, 1..len - 1, len / 3..len / 2] {
                let mut out = vec![0; r.len()];
                let mut sum = 0;
                g.copy_summing(&bytes, &mut out, r.clone(), &mut sum);
                assert_eq!(sum, region_sum(&bytes, &holder, &region, 1, r.clone()));
                assert_eq!(sum, bytes_sum(&out), "{cols} {r:?}");
            }
        }
    }

    /// CRC-32C's check value, in one piece and in two.
    #[test]
    fn sums_are_crc32c() {
        assert_eq!(bytes_sum(b"123456789"), 0xE306_9283);
        assert_eq!(append(bytes_sum(b"1234"), b"56789"), 0xE306_9283);
        assert_eq!(bytes_sum(b""), 0);
    }

    #[test]
    fn empty_transfers_have_no_chunks() {
        let holder = Region::from_ranges(&[0..0, 0..4]);
        let landed = Landed {
            from: 0,
            to: 1,
            region: &holder,
            elem_bytes: 2,
            shard: &[],
            dst_box: &holder,
            chunk: 8,
        };
        assert_eq!(landed.chunk_count(), 0);
        assert!(landed.check(&[]).is_ok());
    }
}
