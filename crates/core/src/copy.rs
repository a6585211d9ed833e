//! Strided copies between a region's place in one buffer and its place in another.
//!
//! A region of a rank's local shard is a set of equally long contiguous runs. Trailing dims
//! that the region spans completely on both sides fold into one run, so a region that spans
//! whole inner dims is a single `memcpy`. The same walker packs (shard -> stream), unpacks
//! (stream -> shard) and copies directly (shard -> shard), for any byte range of the region's
//! row-major stream, which is how transfers are cut into bounded chunks.

use std::ops::Range;

use crate::region::Region;

/// Where a region's bytes sit on one side of a copy.
#[derive(Clone, Copy, Debug)]
pub enum Place<'a> {
    /// Inside a dense row-major buffer holding the box `.0` (a rank's local shard).
    Within(&'a Region),
    /// In a buffer that holds a slice of the region's own row-major stream (a message).
    Stream,
}

/// Byte offsets of a region on one side: a base and one stride per outer loop.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Strides {
    base: usize,
    outer: Vec<usize>,
    /// Whether the buffer holds only the copied slice of the stream (subtract its start).
    stream: bool,
}

/// A conversion applied while copying (`--dst-dtype`, `--quant`): the source's element size
/// and the kernel that casts a run of source elements into destination ones, or, when
/// quantizing, the sender's scales. The region's stream, and so every byte range and length
/// of a converting copy, counts destination bytes: what the wire carries.
#[derive(Clone, Debug)]
pub struct Cast {
    pub src: crate::DType,
    pub dst: crate::DType,
    pub src_elem: usize,
    pub kernel: crate::convert::CastFn,
    /// Quantizing into fp8: the scales of the sending rank's shard, whose multipliers the
    /// runs get block by block. `None` for a float cast, and on a rank that only receives
    /// fp8 (its casts only tell it how the senders cut their transfers: it never converts).
    pub quant: Option<std::sync::Arc<Quantizer>>,
}

/// A source rank's quantizing copy: its scales and the box of its shard, whose dense buffer
/// every quantized run is read from.
#[derive(Debug)]
pub struct Quantizer {
    pub scales: crate::convert::Scales,
    pub shard: Region,
}

/// Two casts are the same when they convert the same dtypes (the kernel follows from them)
/// with the same scales, if any.
impl PartialEq for Cast {
    fn eq(&self, other: &Cast) -> bool {
        (self.src, self.dst) == (other.src, other.dst)
            && match (&self.quant, &other.quant) {
                (None, None) => true,
                (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
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
        quantizer: Option<std::sync::Arc<Quantizer>>,
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

/// The folded loop nest that copies one region between two places.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyGeometry {
    /// Bytes per contiguous run (destination bytes when converting).
    run: usize,
    /// Trip counts of the outer loops, outermost first.
    counts: Vec<usize>,
    src: Strides,
    dst: Strides,
    len: usize,
    /// Destination element size, and the conversion from source elements, if any.
    elem: usize,
    cast: Option<Cast>,
}

/// Row-major byte strides of a buffer of `extent` elements of `elem` bytes.
fn dense_strides(extent: &[u64], elem: usize) -> Vec<usize> {
    let mut strides = vec![0; extent.len()];
    let mut s = elem;
    for d in (0..extent.len()).rev() {
        strides[d] = s;
        s *= extent[d] as usize;
    }
    strides
}

fn place_strides(region: &Region, place: Place<'_>, elem: usize) -> (usize, Vec<usize>) {
    match place {
        Place::Stream => (0, dense_strides(&region.extent, elem)),
        Place::Within(holder) => {
            let strides = dense_strides(&holder.extent, elem);
            let base = (0..region.ndim())
                .map(|d| (region.offset[d] - holder.offset[d]) as usize * strides[d])
                .sum();
            (base, strides)
        }
    }
}

impl CopyGeometry {
    /// The copy of `region` (of `elem`-byte elements) from `src` to `dst`. Boxes given in
    /// [`Place::Within`] must contain `region`.
    pub fn new(region: &Region, src: Place<'_>, dst: Place<'_>, elem: usize) -> CopyGeometry {
        CopyGeometry::converting(region, src, dst, elem, None)
    }

    /// The copy of `region` from `src` (elements of `cast.src_elem` bytes, or `elem` without
    /// a cast) to `dst` (elements of `elem` bytes), converting every run with the cast's
    /// kernel. Byte ranges count destination bytes; a range must start and end on whole
    /// elements (the executor cuts converted transfers at multiples of 8 bytes).
    pub fn converting(
        region: &Region,
        src: Place<'_>,
        dst: Place<'_>,
        elem: usize,
        cast: Option<Cast>,
    ) -> CopyGeometry {
        let src_elem = cast.as_ref().map_or(elem, |c| c.src_elem);
        let (src_base, src_strides) = place_strides(region, src, src_elem);
        let (dst_base, dst_strides) = place_strides(region, dst, elem);
        let len = region.volume() as usize * elem;
        // folded in elements: both sides fold the same dims whatever their element sizes
        let mut run_elems = 1usize;
        let mut run = elem;
        let mut counts = Vec::new();
        let mut src_outer = Vec::new();
        let mut dst_outer = Vec::new();
        let mut folding = true;
        for d in (0..region.ndim()).rev() {
            let e = region.extent[d] as usize;
            if e == 1 {
                continue;
            }
            if folding
                && src_strides[d] == run_elems * src_elem
                && dst_strides[d] == run_elems * elem
            {
                run_elems *= e;
                run *= e;
                continue;
            }
            folding = false;
            counts.push(e);
            src_outer.push(src_strides[d]);
            dst_outer.push(dst_strides[d]);
        }
        counts.reverse();
        src_outer.reverse();
        dst_outer.reverse();
        CopyGeometry {
            run,
            counts,
            src: Strides {
                base: src_base,
                outer: src_outer,
                stream: matches!(src, Place::Stream),
            },
            dst: Strides {
                base: dst_base,
                outer: dst_outer,
                stream: matches!(dst, Place::Stream),
            },
            len,
            elem,
            cast,
        }
    }

    /// Total bytes of the region.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes per contiguous run after folding.
    pub fn run_bytes(&self) -> usize {
        self.run
    }

    /// Number of contiguous runs.
    pub fn runs(&self) -> usize {
        self.counts.iter().product()
    }

    /// Copies bytes `range` of the region's stream from `src` to `dst`. A [`Place::Stream`]
    /// side's buffer holds exactly that range; a [`Place::Within`] side's buffer is the whole
    /// local shard. A destination of 8 MiB or more (the whole region in a shard, or this
    /// range in a message) is written around the caches, and the copy returns only once
    /// those writes are ordered before any later store. While one run is copied, the source
    /// of a run a little further on is prefetched: the hardware prefetchers stop at page
    /// boundaries, and a strided source starts a new page with nearly every run.
    ///
    /// Panics if a buffer is too small: the executor checks sizes before any copy.
    pub fn copy(&self, src: &[u8], dst: &mut [u8], range: Range<usize>) {
        self.copy_and_sum(src, dst, range, None);
    }

    /// [`CopyGeometry::copy`] that also appends the CRC-32C of the bytes it copies, in stream
    /// order, to `sum` (`--checksum`): each piece of at most [`SUMMED_PIECE`] bytes is summed
    /// right before it is copied, so the copy reads it from the nearest cache instead of a
    /// second pass reading it from memory.
    pub fn copy_summing(&self, src: &[u8], dst: &mut [u8], range: Range<usize>, sum: &mut u32) {
        self.copy_and_sum(src, dst, range, Some(sum));
    }

    fn copy_and_sum(
        &self,
        src: &[u8],
        dst: &mut [u8],
        range: Range<usize>,
        mut sum: Option<&mut u32>,
    ) {
        if let Some(cast) = &self.cast {
            // Converting: each run is cast straight from the source into its place, and
            // summed (`--checksum`) as the destination bytes it became, piece by piece
            // while they are cached (a piece holds whole elements: SUMMED_PIECE is a
            // multiple of every element size).
            let piece = if sum.is_some() {
                SUMMED_PIECE
            } else {
                usize::MAX
            };
            for (s, d, len) in self.runs_of(range) {
                let mut at = 0;
                while at < len {
                    let n = (len - at).min(piece);
                    let from = s + self.src_bytes(at);
                    let out = &mut dst[d + at..d + at + n];
                    let input = &src[from..from + self.src_bytes(n)];
                    match &cast.quant {
                        // the source side is the rank's shard (Place::Within): `from` counts
                        // its elements from the buffer's start
                        Some(q) => q.scales.quantize_run(
                            &q.shard,
                            cast.src,
                            (from / cast.src_elem) as u64,
                            input,
                            out,
                        ),
                        None => (cast.kernel)(input, out),
                    }
                    if let Some(sum) = sum.as_deref_mut() {
                        *sum = crate::checksum::append(*sum, out);
                    }
                    at += n;
                }
            }
            return;
        }
        // A shard is written region by region across many calls; a message, in this call.
        let written = if self.dst.stream {
            range.len()
        } else {
            self.len
        };
        let streaming = written >= STREAMING_BYTES;
        // a plain copy takes every run whole
        let most = if sum.is_some() {
            SUMMED_PIECE
        } else {
            usize::MAX
        };
        let mut add = |bytes: &[u8]| {
            if let Some(sum) = sum.as_deref_mut() {
                *sum = crate::checksum::append(*sum, bytes);
            }
        };
        if self.run < PREFETCH_MIN_RUN {
            for (s, d, len) in self.runs_of(range) {
                add(&src[s..s + len]);
                dst[d..d + len].copy_from_slice(&src[s..s + len]);
            }
        } else {
            let mut ahead = self.runs_of(range.clone());
            for _ in 0..PREFETCH_AHEAD.div_ceil(self.run) {
                ahead.next();
            }
            for (s, d, len) in self.runs_of(range) {
                let next = ahead.next().map_or(&[][..], |(s, _, len)| &src[s..s + len]);
                let mut at = 0;
                while at < len {
                    // a long run goes in pieces, so that a summed piece is still cached when
                    // it is copied; the next run is prefetched alongside the last piece
                    let n = (len - at).min(most);
                    let piece = &src[s + at..s + at + n];
                    add(piece);
                    let next = if at + n == len { next } else { &[][..] };
                    lines::copy(&mut dst[d + at..d + at + n], piece, next, streaming);
                    at += n;
                }
            }
        }
        if streaming {
            lines::fence();
        }
    }

    /// The source bytes of `bytes` of the stream: as many when copying, scaled by the ratio
    /// of the element sizes (on whole elements) when converting.
    fn src_bytes(&self, bytes: usize) -> usize {
        match &self.cast {
            None => bytes,
            Some(cast) => bytes / self.elem * cast.src_elem,
        }
    }

    /// Calls `f(src_offset, dst_offset, len)` for every contiguous piece of bytes `range` of
    /// the region's stream, in order, with offsets into the buffers [`CopyGeometry::copy`]
    /// takes.
    pub fn for_each_run(&self, range: Range<usize>, mut f: impl FnMut(usize, usize, usize)) {
        for (s, d, len) in self.runs_of(range) {
            f(s, d, len);
        }
    }

    /// The contiguous pieces of bytes `range` of the region's stream, in order, as
    /// `(src_offset, dst_offset, len)` (see [`CopyGeometry::for_each_run`]).
    fn runs_of(&self, range: Range<usize>) -> Runs<'_> {
        debug_assert!(range.end <= self.len);
        let to_src = |bytes: usize| self.src_bytes(bytes);
        let shift = |s: &Strides, bytes: usize| if s.stream { bytes } else { 0 };
        // an empty range walks nothing (an empty region may have runs, or trip counts, of 0)
        let run_index = range.start.checked_div(self.run).unwrap_or(0);
        // Odometer over the outer loops, positioned at `run_index`.
        let n = self.counts.len();
        let mut idx = vec![0usize; n];
        let mut rest = run_index;
        for k in (0..n).rev().filter(|_| !range.is_empty()) {
            idx[k] = rest % self.counts[k];
            rest /= self.counts[k];
        }
        Runs {
            g: self,
            s_off: self.src.base + dot(&idx, &self.src.outer),
            d_off: self.dst.base + dot(&idx, &self.dst.outer),
            idx,
            intra: range.start.checked_rem(self.run).unwrap_or(0),
            shifts: (
                shift(&self.src, to_src(range.start)),
                shift(&self.dst, range.start),
            ),
            pos: range.start,
            end: range.end,
        }
    }
}

/// Walks the runs of a byte range of a region's stream (see [`CopyGeometry::runs_of`]).
#[derive(Clone, Debug)]
struct Runs<'g> {
    g: &'g CopyGeometry,
    idx: Vec<usize>,
    s_off: usize,
    d_off: usize,
    /// Bytes of the current run before `pos` (only the first run starts inside).
    intra: usize,
    /// Subtracted from the offsets on a side whose buffer holds only the range.
    shifts: (usize, usize),
    pos: usize,
    end: usize,
}

impl Iterator for Runs<'_> {
    type Item = (usize, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.end {
            return None;
        }
        let g = self.g;
        let len = (g.run - self.intra).min(self.end - self.pos);
        let src_intra = g.src_bytes(self.intra);
        let item = (
            self.s_off + src_intra - self.shifts.0,
            self.d_off + self.intra - self.shifts.1,
            len,
        );
        self.pos += len;
        self.intra = 0;
        // advance the odometer by one run
        let mut k = g.counts.len();
        while k > 0 {
            k -= 1;
            self.idx[k] += 1;
            self.s_off += g.src.outer[k];
            self.d_off += g.dst.outer[k];
            if self.idx[k] < g.counts[k] {
                break;
            }
            self.s_off -= g.src.outer[k] * g.counts[k];
            self.d_off -= g.dst.outer[k] * g.counts[k];
            self.idx[k] = 0;
        }
        Some(item)
    }
}

fn dot(a: &[usize], b: &[usize]) -> usize {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Destinations of at least this many bytes are written with non-temporal stores where the
/// CPU has them. They would not stay in the caches anyway, and bypassing the caches saves
/// reading every destination line before writing it: a third of the memory traffic of a
/// copy. Large `memcpy`s do the same; below this size a message is still in the cache when
/// the transport reads it.
const STREAMING_BYTES: usize = 8 << 20;

/// The largest piece of a run that is summed and then copied at once by
/// [`CopyGeometry::copy_summing`]: well inside the first-level caches of a core.
pub const SUMMED_PIECE: usize = 16 << 10;

/// Runs shorter than this are copied without prefetching: the walk would cost more than the
/// misses it hides.
const PREFETCH_MIN_RUN: usize = 256;

/// How far ahead of the run being copied the prefetched run starts, in bytes of the stream
/// (rounded up to whole runs). One run ahead for runs of 2 KiB and more; measured here on
/// 4 threads: 4 KiB runs 6.0-6.6 GB/s without, 6.7-9.1 with; 1 KiB runs 4.0 -> 5.6-5.9.
const PREFETCH_AHEAD: usize = 2048;

/// Copies of one contiguous run, line by line, prefetching another run's source alongside.
#[cfg(target_arch = "x86_64")]
pub mod lines {
    use std::arch::x86_64::{
        __m128i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_storeu_si128,
        _mm_stream_si128,
    };

    /// Cache line size: streaming stores pay off when they fill whole lines.
    const LINE: usize = 64;

    /// Copies `src` into `dst` (equal lengths) and prefetches `ahead` (any length; its lines
    /// up to the copy's length), one line per line copied. With `streaming`, whole destination
    /// cache lines are written with non-temporal stores and the unaligned ends with ordinary
    /// ones; call [`fence`] before the bytes may be read by another thread.
    pub fn copy(dst: &mut [u8], src: &[u8], ahead: &[u8], streaming: bool) {
        assert_eq!(dst.len(), src.len(), "copy between unequal lengths");
        let len = dst.len();
        let head = dst.as_ptr().align_offset(LINE).min(len);
        let lines = (len - head) / LINE;
        if lines < 2 {
            dst.copy_from_slice(src);
            return;
        }
        let body_end = head + lines * LINE;
        dst[..head].copy_from_slice(&src[..head]);
        let prefetched = lines.min(ahead.len().div_ceil(LINE));
        // SAFETY: SSE2 is part of every x86_64 CPU. Bytes head..body_end lie inside both
        // slices (body_end <= len); the destination is 64-byte aligned at head, so every
        // 16-byte store is aligned as `_mm_stream_si128` requires; the loads are unaligned
        // ones, and the slices cannot overlap (one is borrowed mutably). Prefetches touch
        // lines of `ahead` only (line `i < prefetched` starts inside it), and never fault.
        unsafe {
            let mut s = src.as_ptr().add(head).cast::<__m128i>();
            let mut d = dst.as_mut_ptr().add(head).cast::<__m128i>();
            let p = ahead.as_ptr().cast::<i8>();
            for i in 0..lines {
                if i < prefetched {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(i * LINE));
                }
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                if streaming {
                    _mm_stream_si128(d, a);
                    _mm_stream_si128(d.add(1), b);
                    _mm_stream_si128(d.add(2), c);
                    _mm_stream_si128(d.add(3), e);
                } else {
                    _mm_storeu_si128(d, a);
                    _mm_storeu_si128(d.add(1), b);
                    _mm_storeu_si128(d.add(2), c);
                    _mm_storeu_si128(d.add(3), e);
                }
                s = s.add(4);
                d = d.add(4);
            }
        }
        dst[body_end..].copy_from_slice(&src[body_end..]);
    }

    /// Orders the streaming stores before every later store, so that a flag or a ring index
    /// written after a copy cannot be seen before the bytes.
    pub fn fence() {
        // SAFETY: SSE is part of every x86_64 CPU.
        unsafe { _mm_sfence() }
    }
}

/// Elsewhere, ordinary copies.
#[cfg(not(target_arch = "x86_64"))]
pub mod lines {
    pub fn copy(dst: &mut [u8], src: &[u8], _ahead: &[u8], _streaming: bool) {
        dst.copy_from_slice(src);
    }

    pub fn fence() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies element by element, the obvious way, to check the folded walker against.
    fn naive(
        region: &Region,
        src_box: &Region,
        dst_box: &Region,
        src: &[u8],
        elem: usize,
    ) -> Vec<u8> {
        let mut out = vec![0u8; dst_box.volume() as usize * elem];
        let n = region.ndim();
        for lin in 0..region.volume() {
            let mut rest = lin;
            let mut coord = vec![0u64; n];
            for d in (0..n).rev() {
                coord[d] = region.offset[d] + rest % region.extent[d];
                rest /= region.extent[d];
            }
            let at = |b: &Region| {
                (0..n).fold(0u64, |acc, d| acc * b.extent[d] + coord[d] - b.offset[d]) as usize
                    * elem
            };
            let (s, d) = (at(src_box), at(dst_box));
            out[d..d + elem].copy_from_slice(&src[s..s + elem]);
        }
        out
    }

    #[test]
    fn folds_whole_inner_dims_into_one_run() {
        let holder = Region::from_ranges(&[0..4, 0..8, 0..6]);
        let rows = Region::from_ranges(&[1..3, 0..8, 0..6]);
        let g = CopyGeometry::new(&rows, Place::Within(&holder), Place::Stream, 2);
        assert_eq!((g.runs(), g.run_bytes()), (1, 2 * 8 * 6 * 2));
        let cols = Region::from_ranges(&[0..4, 0..8, 2..4]);
        let g = CopyGeometry::new(&cols, Place::Within(&holder), Place::Stream, 2);
        assert_eq!((g.runs(), g.run_bytes()), (32, 4));
        // a dim of extent 1 does not break folding
        let one = Region::from_ranges(&[2..3, 3..4, 0..6]);
        let g = CopyGeometry::new(&one, Place::Within(&holder), Place::Stream, 4);
        assert_eq!((g.runs(), g.run_bytes()), (1, 24));
    }

    #[test]
    fn pack_then_unpack_in_chunks_equals_direct_copy() {
        let src_box = Region::from_ranges(&[2..9, 0..5, 1..8]);
        let dst_box = Region::from_ranges(&[0..6, 1..5, 0..8]);
        let region = src_box.intersect(&dst_box).unwrap();
        let elem = 2;
        let src: Vec<u8> = (0..src_box.volume() as usize * elem)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let want = naive(&region, &src_box, &dst_box, &src, elem);

        let direct = CopyGeometry::new(
            &region,
            Place::Within(&src_box),
            Place::Within(&dst_box),
            elem,
        );
        let mut got = vec![0u8; want.len()];
        direct.copy(&src, &mut got, 0..direct.len());
        assert_eq!(got, want);

        for chunk in [1, 3, 7, 16, 1000] {
            let pack = CopyGeometry::new(&region, Place::Within(&src_box), Place::Stream, elem);
            let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&dst_box), elem);
            let mut got = vec![0u8; want.len()];
            let mut start = 0;
            while start < pack.len() {
                let end = (start + chunk).min(pack.len());
                let mut msg = vec![0u8; end - start];
                pack.copy(&src, &mut msg, start..end);
                unpack.copy(&msg, &mut got, start..end);
                start = end;
            }
            assert_eq!(got, want, "chunk {chunk}");
        }
    }

    /// A converting copy (f32 -> bf16, bf16 -> f64) packed in chunks of whole destination
    /// elements and unpacked, or written directly, equals the naive copy of the cast source,
    /// and its checksum is that of the destination bytes.
    #[test]
    fn converting_copies_equal_the_cast_of_the_naive_copy() {
        use crate::DType;
        let src_box = Region::from_ranges(&[2..9, 0..5, 1..8]);
        let dst_box = Region::from_ranges(&[0..6, 1..5, 0..8]);
        let region = src_box.intersect(&dst_box).unwrap();
        // whole tensors of the source box, cast as a block: the reference
        for (from, to) in [(DType::F32, DType::Bf16), (DType::Bf16, DType::F64)] {
            let (se, de) = (from.size(), to.size());
            let src: Vec<u8> = (0..src_box.volume() as usize * se)
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            let mut cast_box = vec![0u8; src_box.volume() as usize * de];
            crate::convert::cast(from, to, &src, &mut cast_box).unwrap();
            let want = naive(&region, &src_box, &dst_box, &cast_box, de);
            let cast = Cast::between(from, to).unwrap();
            assert!(cast.is_some());
            let direct = CopyGeometry::converting(
                &region,
                Place::Within(&src_box),
                Place::Within(&dst_box),
                de,
                cast.clone(),
            );
            assert_eq!(direct.len(), region.volume() as usize * de);
            let mut got = vec![0u8; want.len()];
            direct.copy(&src, &mut got, 0..direct.len());
            assert!(got == want, "{from} -> {to} direct");
            for chunk in [de, 3 * de, 8, 48, 1000 * de] {
                let pack = CopyGeometry::converting(
                    &region,
                    Place::Within(&src_box),
                    Place::Stream,
                    de,
                    cast.clone(),
                );
                let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&dst_box), de);
                let mut got = vec![0u8; want.len()];
                let mut start = 0;
                while start < pack.len() {
                    let end = (start + chunk).min(pack.len());
                    let mut msg = vec![0u8; end - start];
                    let mut sum = 0;
                    pack.copy_summing(&src, &mut msg, start..end, &mut sum);
                    assert_eq!(sum, crate::checksum::append(0, &msg));
                    unpack.copy(&msg, &mut got, start..end);
                    start = end;
                }
                assert!(got == want, "{from} -> {to}, chunk {chunk}");
            }
        }
        assert_eq!(Cast::between(DType::F32, DType::F32).unwrap(), None);
        assert!(Cast::between(DType::F32, DType::I32).is_err());
    }

    /// A converted run longer than [`SUMMED_PIECE`] is cast and summed piece by piece: the
    /// same bytes and the same sum as one cast of the whole run.
    #[test]
    fn long_converted_runs_are_summed_piece_by_piece() {
        use crate::DType;
        let holder = Region::from_ranges(&[0..3, 0..7001]);
        let src: Vec<u8> = (0..holder.volume() as usize * 4)
            .map(|i| (i * 13 % 251) as u8)
            .collect();
        let mut want = vec![0u8; holder.volume() as usize * 2];
        crate::convert::cast(DType::F32, DType::Bf16, &src, &mut want).unwrap();
        let cast = Cast::between(DType::F32, DType::Bf16).unwrap();
        let g = CopyGeometry::converting(&holder, Place::Within(&holder), Place::Stream, 2, cast);
        assert_eq!(g.runs(), 1);
        assert!(g.run_bytes() > 2 * SUMMED_PIECE);
        for range in [0..g.len(), 6..g.len() - 4] {
            let mut got = vec![0u8; range.len()];
            let mut sum = 0;
            g.copy_summing(&src, &mut got, range.clone(), &mut sum);
            assert!(got == want[range.clone()], "{range:?}");
            assert_eq!(sum, crate::checksum::append(0, &want[range]));
        }
    }

    #[test]
    fn line_copies_match_plain_copies_at_every_alignment() {
        let src: Vec<u8> = (0..5000).map(|i| (i * 13 % 251) as u8).collect();
        for streaming in [false, true] {
            for len in [0, 1, 63, 64, 127, 128, 129, 191, 200, 1000, 4097] {
                for (s_at, d_at) in [(0, 0), (1, 0), (0, 1), (5, 17), (63, 62), (64, 33)] {
                    // prefetching nothing, less than the copy, and more than it
                    for ahead in [&src[..0], &src[4000..4100], &src[100..]] {
                        let mut got = vec![0u8; 4200];
                        let mut want = got.clone();
                        let (from, to) = (&src[s_at..s_at + len], &mut got[d_at..d_at + len]);
                        lines::copy(to, from, ahead, streaming);
                        lines::fence();
                        want[d_at..d_at + len].copy_from_slice(&src[s_at..s_at + len]);
                        assert_eq!(got, want, "len {len}, {s_at} -> {d_at}, {streaming}");
                    }
                }
            }
        }
    }

    #[test]
    fn large_regions_copy_the_same_bytes_through_the_streaming_path() {
        // 130 rows of 65557 bytes; the region is 128 rows of 65536 bytes: 8 MiB, enough
        // for the streaming stores, and its rows start at odd offsets.
        let (rows, cols) = (130u64, 65557u64);
        let src_box = Region::from_ranges(&[0..rows, 0..cols]);
        let dst_box = Region::from_ranges(&[1..rows + 3, 7..cols + 7]);
        let region = Region::from_ranges(&[1..129, 11..65547]);
        let width = region.extent[1] as usize;
        assert!(region.volume() as usize >= STREAMING_BYTES);
        let src: Vec<u8> = (0..(rows * cols) as usize)
            .map(|i| (i % 241) as u8)
            .collect();
        // the region's rows, one after another
        let stream: Vec<u8> = (1..129usize)
            .flat_map(|r| {
                let at = r * cols as usize + 11;
                src[at..at + width].iter().copied()
            })
            .collect();

        let pack = CopyGeometry::new(&region, Place::Within(&src_box), Place::Stream, 1);
        let mut packed = vec![0u8; pack.len()];
        pack.copy(&src, &mut packed, 0..pack.len());
        assert!(packed == stream, "packed stream differs");

        let dst_len = dst_box.volume() as usize;
        let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&dst_box), 1);
        let mut unpacked = vec![0u8; dst_len];
        let chunk = 1_000_003;
        for start in (0..unpack.len()).step_by(chunk) {
            let end = (start + chunk).min(unpack.len());
            unpack.copy(&stream[start..end], &mut unpacked, start..end);
        }
        let direct =
            CopyGeometry::new(&region, Place::Within(&src_box), Place::Within(&dst_box), 1);
        let mut copied = vec![0u8; dst_len];
        direct.copy(&src, &mut copied, 0..direct.len());
        let mut want = vec![0u8; dst_len];
        let dst_cols = dst_box.extent[1] as usize;
        for (k, row) in stream.chunks(width).enumerate() {
            // region row 1 + k sits at dst row k, column 11 - 7
            let at = k * dst_cols + 4;
            want[at..at + width].copy_from_slice(row);
        }
        assert!(unpacked == want, "unpacked shard differs");
        assert!(copied == want, "directly copied shard differs");
    }
}
