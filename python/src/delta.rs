//! The core's delta codec ([`reshard_core::delta`]) on torch tensors, for `reshard.torch`'s
//! delta refit: one definition of the encoding and one wire format, whatever drives it.
//!
//! [`delta_encode`] encodes a region of a CPU tensor (any view: a slice of a shard, strided)
//! against its base into a message buffer, and leaves the new values in the base;
//! [`delta_apply`] applies an encoding onto a region of a CPU tensor; [`delta_written`] lists
//! what an encoding writes (storage offsets and values), for a receiver whose tensor lives on
//! another device and writes them there with torch operations. Tensors are read by address
//! and strides at each call, as the packing kernels read them (`pack`), and the kernels run
//! with the GIL released. A view that is a box of a dense row-major array (a contiguous
//! tensor, a slice of one) is read and written in place through the core's strided walker;
//! another (a transposed one) is gathered into a stream first and scattered back after.

use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::delta::{self, BLOCK_ELEMS, DeltaEncoder, DeltaStats, HEADER_BYTES, Header};
use reshard_core::region::Region;

use crate::error;
use crate::pack::view::{View, each_index, read_view};

impl View {
    fn numel(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }

    /// Bytes of the tensor's row-major stream.
    fn len(&self) -> usize {
        self.numel() * self.elem
    }

    /// Whether the tensor's elements lie in row-major order with nothing between them.
    fn contiguous(&self) -> bool {
        let mut want = 1;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n > 1 && s != want {
                return false;
            }
            want *= n;
        }
        true
    }

    /// The copy of the tensor's elements into their row-major stream (the tensor must be a
    /// box of its holder).
    fn pack(&self, holder: &Region) -> CopyGeometry {
        let region = Region::full(&self.shape);
        CopyGeometry::new(&region, Place::Within(holder), Place::Stream, self.elem)
    }

    /// The copy of a row-major stream into the tensor's elements.
    fn unpack(&self, holder: &Region) -> CopyGeometry {
        let region = Region::full(&self.shape);
        CopyGeometry::new(&region, Place::Stream, Place::Within(holder), self.elem)
    }

    /// Calls `f(element offset, elements)` for every run of consecutive elements of the
    /// tensor, in row-major order (offsets from its first element).
    fn each_run(&self, mut f: impl FnMut(usize, usize)) {
        if self.shape.contains(&0) {
            return;
        }
        let n = self.shape.len();
        let (outer, run) = match n {
            0 => (0, 1),
            _ if self.strides[n - 1] == 1 => (n - 1, self.shape[n - 1] as usize),
            _ => (n, 1),
        };
        each_index(&self.shape[..outer], |idx| {
            let at: u64 = idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum();
            f(at as usize, run);
        });
    }

    /// The tensor's elements as their row-major stream, copied.
    ///
    /// # Safety
    /// As [`View::bytes`].
    unsafe fn gather(&self) -> Vec<u8> {
        let src = unsafe { self.bytes() };
        let mut out = Vec::with_capacity(self.len());
        self.each_run(|at, n| out.extend_from_slice(&src[at * self.elem..(at + n) * self.elem]));
        out
    }

    /// Writes a row-major stream into the tensor's elements.
    ///
    /// # Safety
    /// As [`View::bytes_mut`].
    unsafe fn scatter(&self, stream: &[u8]) {
        let dst = unsafe { self.bytes_mut() };
        let mut from = 0;
        self.each_run(|at, n| {
            let bytes = n * self.elem;
            dst[at * self.elem..at * self.elem + bytes]
                .copy_from_slice(&stream[from..from + bytes]);
            from += bytes;
        });
    }

    fn overlaps(&self, ptr: usize, len: usize) -> bool {
        self.span > 0 && len > 0 && self.ptr < ptr + len && ptr < self.ptr + self.span
    }

    /// Refuses a tensor to be written whose elements share memory (an expanded one: a
    /// stride of 0 along a dim of more than one element).
    fn writable(&self, what: &str) -> PyResult<()> {
        match (0..self.shape.len()).find(|&d| self.shape[d] > 1 && self.strides[d] == 0) {
            Some(d) => Err(error(format!(
                "{what}: dim {d} has stride 0: its elements share memory, so it cannot be written"
            ))),
            None => Ok(()),
        }
    }
}

fn attr_str(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    Ok(obj.getattr(name)?.str()?.to_string())
}

/// Reads a CPU tensor of any shape and non-negative strides.
fn view_of(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
    if tensor.is_none() {
        return Err(error(format!("{what}: expected a tensor, got None")));
    }
    read_view(tensor, what, "the delta kernels read")
}

/// Reads a message buffer: a contiguous 1-D `torch.uint8` CPU tensor, as `(address, bytes)`.
fn buffer_of(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<(usize, usize)> {
    let dtype = attr_str(tensor, "dtype")?;
    let device = attr_str(&tensor.getattr("device")?, "type")?;
    let dims: usize = tensor.call_method0("dim")?.extract()?;
    let contiguous: bool = tensor.call_method0("is_contiguous")?.extract()?;
    if dtype != "torch.uint8" || device != "cpu" || dims != 1 || !contiguous {
        return Err(error(format!(
            "{what}: expected a contiguous 1-D torch.uint8 tensor on the cpu, got a {dims}-D \
             {dtype} tensor on {device}{}",
            if contiguous { "" } else { " (not contiguous)" }
        )));
    }
    let len: usize = tensor.call_method0("numel")?.extract()?;
    let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
    Ok((ptr, len))
}

/// Bytes `at..at + nbytes` of a buffer of `len` bytes (to its end without `nbytes`), checked.
fn slice_of(what: &str, len: usize, at: usize, nbytes: Option<usize>) -> PyResult<(usize, usize)> {
    let nbytes = nbytes.unwrap_or(len.saturating_sub(at));
    match at.checked_add(nbytes) {
        Some(end) if end <= len => Ok((at, nbytes)),
        _ => Err(error(format!(
            "{what}: bytes {at}..{} lie outside its {len} bytes",
            at.saturating_add(nbytes)
        ))),
    }
}

/// # Safety
/// `ptr..ptr + len` is a live buffer that nothing else reads or writes during the borrow.
unsafe fn raw<'a>(ptr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}

/// Statistics of an encode or apply as Python takes them: bytes of the encoding, blocks per
/// tag, changed (encoding) or written (applying) elements.
type Stats = (usize, [u64; 4], u64);

fn stats(s: &DeltaStats) -> Stats {
    (s.bytes as usize, s.blocks, s.changed)
}

/// `delta_encode(new, base, out, at=0, *, update_base=True, smaller_only=False,
/// block_elems=4096)`: encodes `new` (a CPU tensor: the region as its row-major stream of
/// elements) against `base` (as many elements of the same size, any shape: what the receiver
/// holds) in the core's wire format, into `out` (a contiguous 1-D `torch.uint8` CPU tensor)
/// from byte `at`; returns `(bytes, blocks per tag, changed elements)`. `out` must have room
/// for the largest encoding from `at` on: a header, a tag per block and the region's bytes,
/// or with `smaller_only` the region's bytes, as an encoding not smaller than the region is
/// then not written (the caller sends the region dense; the statistics still say what
/// changed). With `update_base` the base takes the new values. The GIL is released while it
/// encodes.
#[pyfunction]
#[pyo3(signature = (new, base, out, at=0, *, update_base=true, smaller_only=false, block_elems=BLOCK_ELEMS))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_encode(
    py: Python<'_>,
    new: &Bound<'_, PyAny>,
    base: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    at: usize,
    update_base: bool,
    smaller_only: bool,
    block_elems: usize,
) -> PyResult<Stats> {
    let new = view_of(new, "new")?;
    let base = view_of(base, "base")?;
    let (out_ptr, out_len) = buffer_of(out, "out")?;
    let mut encoder = DeltaEncoder::new(new.elem, block_elems).map_err(error)?;
    if base.numel() != new.numel() || base.elem != new.elem {
        return Err(error(format!(
            "base: expected {} elements of {} bytes (as new), got {} of {} bytes",
            new.numel(),
            new.elem,
            base.numel(),
            base.elem
        )));
    }
    let len = new.len();
    let room = if smaller_only {
        len
    } else {
        HEADER_BYTES + new.numel().div_ceil(block_elems) + len
    };
    let (at, room) = slice_of("out", out_len, at, Some(room))?;
    if new.overlaps(out_ptr + at, room) || base.overlaps(out_ptr + at, room) {
        return Err(error("out: the message shares memory with new or base"));
    }
    if update_base {
        base.writable("base")?;
    }
    if update_base && base.overlaps(new.ptr, new.span) {
        return Err(error(
            "base: it shares memory with new, and would take its values",
        ));
    }
    py.detach(|| {
        // SAFETY: `new`, `base` and `out` are live CPU tensors the caller holds for this
        // call, of the spans read above; `base` is written only where it does not overlap
        // `new` or the part of `out` written (checked above).
        let gathered;
        let whole = Region::full(&new.shape);
        let (src, pack) = match &new.holder {
            Some(holder) => (unsafe { new.bytes() }, new.pack(holder)),
            None => {
                gathered = unsafe { new.gather() };
                let stream =
                    CopyGeometry::new(&whole, Place::Within(&whole), Place::Stream, new.elem);
                (&gathered[..], stream)
            }
        };
        let in_place = update_base && base.contiguous();
        let mut copied;
        let base_stream: &mut [u8] = if in_place {
            unsafe { &mut base.bytes_mut()[..len] }
        } else {
            copied = unsafe { base.gather() };
            &mut copied
        };
        let mut wire = Vec::new();
        let got = encoder
            .encode(&pack, src, base_stream, 0..len, &mut wire)
            .map_err(error)?;
        if update_base && !in_place {
            unsafe { base.scatter(base_stream) };
        }
        if !smaller_only || wire.len() < len {
            unsafe { raw(out_ptr + at, wire.len()) }.copy_from_slice(&wire);
        }
        Ok(stats(&got))
    })
}

/// The encoding at bytes `at..at + nbytes` of a message buffer (to its end without
/// `nbytes`), checked to hold a header of `elem`-byte elements.
fn encoding_of(
    encoded: &Bound<'_, PyAny>,
    at: usize,
    nbytes: Option<usize>,
    elem: usize,
) -> PyResult<(usize, usize)> {
    let (ptr, len) = buffer_of(encoded, "encoded")?;
    let (at, nbytes) = slice_of("encoded", len, at, nbytes)?;
    // SAFETY: the buffer is a live tensor of `len` bytes the caller holds for this call.
    let bytes = unsafe { raw(ptr + at, nbytes) };
    let header = Header::read(bytes).map_err(error)?;
    if header.elem as usize != elem {
        return Err(error(format!(
            "encoded: its elements are of {} bytes, the region's of {elem}",
            header.elem
        )));
    }
    Ok((ptr + at, nbytes))
}

/// `delta_apply(encoded, dst, at=0, nbytes=None)`: applies the encoding at bytes
/// `at..at + nbytes` of `encoded` (a contiguous 1-D `torch.uint8` CPU tensor; to its end
/// without `nbytes`) onto `dst` (a CPU tensor holding the base: the region as its row-major
/// stream of elements), in place; returns `(bytes, blocks per tag, written elements)`. The
/// whole encoding is checked before a byte of `dst` is written: a malformed one raises and
/// leaves `dst` as it was. The GIL is released while it applies.
#[pyfunction]
#[pyo3(signature = (encoded, dst, at=0, nbytes=None))]
pub(crate) fn delta_apply(
    py: Python<'_>,
    encoded: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    at: usize,
    nbytes: Option<usize>,
) -> PyResult<Stats> {
    let dst = view_of(dst, "dst")?;
    dst.writable("dst")?;
    let (ptr, nbytes) = encoding_of(encoded, at, nbytes, dst.elem)?;
    if dst.overlaps(ptr, nbytes) {
        return Err(error("dst: it shares memory with the encoding"));
    }
    py.detach(|| {
        // SAFETY: the encoding and `dst` are live CPU tensors the caller holds for this call,
        // and they do not overlap (checked above).
        let wire = unsafe { raw(ptr, nbytes) };
        let got = match &dst.holder {
            Some(holder) => delta::apply(&dst.unpack(holder), wire, unsafe { dst.bytes_mut() }),
            None => {
                let mut stream = unsafe { dst.gather() };
                let whole = Region::full(&dst.shape);
                let unpack =
                    CopyGeometry::new(&whole, Place::Stream, Place::Within(&whole), dst.elem);
                let got = delta::apply(&unpack, wire, &mut stream);
                if got.is_ok() {
                    unsafe { dst.scatter(&stream) };
                }
                got
            }
        };
        got.map(|s| stats(&s)).map_err(error)
    })
}

/// What [`delta_written`] returns: the storage offsets (little-endian int64) and the values
/// of the elements an encoding writes, and its statistics.
type Written = (Py<PyByteArray>, Py<PyByteArray>, Stats);

/// `delta_written(encoded, shape, strides, elem, at=0, nbytes=None)`: what applying the
/// encoding at bytes `at..at + nbytes` of `encoded` (as [`delta_apply`] reads it) onto a
/// region of `shape`, element `strides` and `elem`-byte elements writes, for a receiver that
/// writes it itself (a tensor on another device): `(offsets, values, (bytes, blocks per tag,
/// written elements))`, `offsets` the written elements' offsets in elements from the
/// region's first one (little-endian int64, in stream order), `values` their new bytes one
/// after the other. Checked whole as [`delta_apply`] checks it.
#[pyfunction]
#[pyo3(signature = (encoded, shape, strides, elem, at=0, nbytes=None))]
pub(crate) fn delta_written(
    py: Python<'_>,
    encoded: &Bound<'_, PyAny>,
    shape: Vec<u64>,
    strides: Vec<u64>,
    elem: usize,
    at: usize,
    nbytes: Option<usize>,
) -> PyResult<Written> {
    if strides.len() != shape.len() {
        return Err(error(format!(
            "strides: {} of them for a shape of {} dims",
            strides.len(),
            shape.len()
        )));
    }
    let (ptr, nbytes) = encoding_of(encoded, at, nbytes, elem)?;
    let len = shape.iter().product::<u64>() as usize * elem;
    let (offsets, values, got) = py.detach(|| {
        // SAFETY: the encoding is a live CPU tensor the caller holds for this call.
        let wire = unsafe { raw(ptr, nbytes) };
        // the stream index of an element to its offset in the region, dim by dim
        let dims: Vec<(u64, u64)> = shape
            .iter()
            .copied()
            .zip(strides.iter().copied())
            .rev()
            .collect();
        let (mut offsets, mut values) = (Vec::new(), Vec::new());
        let got = delta::for_each_written(wire, len, |i, value| {
            let (mut rest, mut at) = (i as u64, 0u64);
            for &(n, s) in &dims {
                at += rest % n * s;
                rest /= n;
            }
            offsets.extend_from_slice(&(at as i64).to_le_bytes());
            values.extend_from_slice(value);
        });
        (offsets, values, got)
    });
    let got = got.map_err(error)?;
    Ok((
        PyByteArray::new(py, &offsets).unbind(),
        PyByteArray::new(py, &values).unbind(),
        stats(&got),
    ))
}
