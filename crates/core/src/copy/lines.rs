//! Copies of one contiguous run, line by line, prefetching another run's source alongside:
//! with SSE2 streaming stores on x86_64, ordinary copies elsewhere.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m128i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_storeu_si128,
    _mm_stream_si128,
};

/// Cache line size: streaming stores pay off when they fill whole lines.
#[cfg(target_arch = "x86_64")]
const LINE: usize = 64;

/// Copies `src` into `dst` (equal lengths) and prefetches `ahead` (any length; its lines
/// up to the copy's length), one line per line copied. With `streaming`, whole destination
/// cache lines are written with non-temporal stores and the unaligned ends with ordinary
/// ones; call [`fence`] before the bytes may be read by another thread.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
pub fn fence() {
    // SAFETY: SSE is part of every x86_64 CPU.
    unsafe { _mm_sfence() }
}
/// Elsewhere, an ordinary copy.
#[cfg(not(target_arch = "x86_64"))]
pub fn copy(dst: &mut [u8], src: &[u8], _ahead: &[u8], _streaming: bool) {
    dst.copy_from_slice(src);
}

/// Elsewhere, nothing to order.
#[cfg(not(target_arch = "x86_64"))]
pub fn fence() {}
