//! Buffers whose size the user chose (a shard of `--shape`, a full tensor, a staging area):
//! allocated fallibly, so that a tensor too large for this machine, or for the address space a
//! `ulimit -v` leaves, is an error that names the size instead of an abort of the process.
//! Small bookkeeping allocations stay infallible, as everywhere in Rust.

use std::alloc::Layout;

use crate::error::{Error, Result};

/// A zero-filled buffer of `bytes` bytes for `what` (e.g. "rank 3's --dst shard"), or
/// [`Error::OutOfMemory`] when the allocator cannot provide it.
///
/// Zeroed memory comes from the allocator's zeroing path (fresh pages from the kernel for large
/// sizes), so a big buffer costs nothing until it is written, as with `vec![0u8; n]`.
pub fn zeroed(bytes: u64, what: impl FnOnce() -> String) -> Result<Vec<u8>> {
    let out_of_memory = |what: String| Error::OutOfMemory { what, bytes };
    if bytes == 0 {
        return Ok(Vec::new());
    }
    let Ok(len) = usize::try_from(bytes) else {
        return Err(out_of_memory(what()));
    };
    let Ok(layout) = Layout::array::<u8>(len) else {
        return Err(out_of_memory(what()));
    };
    // SAFETY: `layout` has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(out_of_memory(what()));
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[u8; len]`,
    // which is exactly what a `Vec<u8>` of capacity `len` frees; all `len` bytes are
    // initialized (zeroed).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Makes room for `additional` more bytes in `buf`, or [`Error::OutOfMemory`] naming `what`.
pub fn reserve(buf: &mut Vec<u8>, additional: usize, what: impl FnOnce() -> String) -> Result<()> {
    buf.try_reserve_exact(additional)
        .map_err(|_| Error::OutOfMemory {
            what: what(),
            bytes: additional as u64,
        })
}

/// Sets every byte of `buf` to `value` with stores that bypass the caches where the CPU has
/// them, so that the buffer ends up in memory and not in the caches: benchmarks poison
/// destinations this way between repetitions, leaving them as a destination that was last
/// written long ago is (a poison left dirty in the caches would be written back during the
/// next, timed, repetition).
pub fn fill_around_caches(buf: &mut [u8], value: u8) {
    const PIECE: usize = 64 << 10;
    let pattern = [value; PIECE];
    for piece in buf.chunks_mut(PIECE) {
        let len = piece.len();
        crate::copy::lines::copy(piece, &pattern[..len], &[], true);
    }
    crate::copy::lines::fence();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_buffers_have_their_size_and_only_zeros() {
        assert!(zeroed(0, String::new).unwrap().is_empty());
        let buf = zeroed(100_000, String::new).unwrap();
        assert_eq!(buf.len(), 100_000);
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_size_no_allocator_can_give_is_an_error_naming_it() {
        // more than the address space: refused by the layout or by the allocator, never an abort
        let e = zeroed(u64::MAX / 2, || "rank 3's --dst shard".into()).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory { bytes, .. } if bytes == u64::MAX / 2));
        let text = e.to_string();
        assert!(text.contains("rank 3's --dst shard"), "{text}");
        assert!(text.contains("memory"), "{text}");

        let mut buf = vec![1u8];
        let e = reserve(&mut buf, usize::MAX / 2, || "a staging area".into()).unwrap_err();
        assert!(e.to_string().contains("a staging area"));
        assert_eq!(buf, [1]);
    }

    #[test]
    fn fills_around_the_caches_set_every_byte() {
        let mut buf = vec![1u8; (200 << 10) + 77];
        fill_around_caches(&mut buf[3..], 0xA5);
        assert_eq!(buf[..3], [1, 1, 1]);
        assert!(buf[3..].iter().all(|&b| b == 0xA5));
    }
}
