//! Packing and unpacking of CPU torch tensors for `reshard.torch`, in Rust.
//!
//! A whole-model refit moves thousands of tensors, each cut into a few regions per peer. Copying
//! them one torch call per region costs tens of microseconds of dispatch per region, more than
//! the copy itself for a tensor of a few MiB. A [`Packing`] is the copying part of one bucket
//! of a reshard on one rank, computed once per model and layouts: for every message, the regions
//! it holds (which tensor, where in it, where in the message), and the local copies. Each call
//! then reads the tensors' addresses and strides, checks them, and copies every region of every
//! message with the GIL released, with the core's strided copy kernels
//! ([`reshard_core::copy::CopyGeometry`]) wherever a tensor is a box of a dense row-major
//! array (contiguous tensors, and the slices of one, such as vLLM's fused buffers), and an
//! element-strided walk otherwise (a transposed tensor).

use pyo3::prelude::*;
use pyo3::types::PyList;
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::region::Region;

use crate::error;

/// One region of one message: tensor `slot`'s elements at local `offset`, `extent` long, in
/// the message from byte `at` on (row-major).
struct Piece {
    slot: usize,
    offset: Vec<u64>,
    extent: Vec<u64>,
    at: usize,
}

/// A copy from tensor `src`'s local `src_offset` to tensor `dst`'s local `dst_offset`.
struct LocalPiece {
    src: usize,
    src_offset: Vec<u64>,
    dst: usize,
    dst_offset: Vec<u64>,
    extent: Vec<u64>,
}

/// What a tensor slot must hold: its shape and element size.
struct Slot {
    shape: Vec<u64>,
    elem: usize,
}

/// A tensor as the copies see it: where its first element is, how many bytes from there its
/// elements reach, and its element strides. Read from the tensor at each call.
#[derive(Clone)]
struct View {
    ptr: usize,
    span: usize,
    /// Strides in elements.
    strides: Vec<u64>,
    elem: usize,
    /// The dense row-major array this tensor is a box of (starting at its first element), if
    /// it is one: then the core's kernels copy it.
    holder: Option<Region>,
}

impl View {
    /// The bytes of the tensor, from its first element to its last.
    ///
    /// # Safety
    /// `ptr` and `span` describe memory of a live tensor that nothing else writes during the
    /// borrow (the caller holds the tensors for the whole call).
    unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.span == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.span) }
    }

    /// As [`View::bytes`], writable.
    ///
    /// # Safety
    /// As [`View::bytes`], and no other slice of these bytes is alive during the borrow.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        if self.span == 0 {
            return &mut [];
        }
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.span) }
    }
}

/// The dense row-major array that a tensor of `shape` and element `strides` is a box of, at
/// the tensor's first element, or None if its strides are not those of any (transposed,
/// broadcast). Dims of size 1 take any stride; between two longer dims, the outer one's
/// stride must be a whole number of the inner one's rows.
fn dense_holder(shape: &[u64], strides: &[u64]) -> Option<Region> {
    let mut extent: Vec<u64> = shape.iter().map(|&n| n.min(1)).collect();
    if shape.contains(&0) {
        return Some(Region {
            offset: vec![0; shape.len()],
            extent: shape.to_vec(),
        });
    }
    let long: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] > 1).collect();
    let Some((&first, _)) = long.split_first() else {
        return Some(Region::full(&extent));
    };
    if strides[*long.last()?] != 1 {
        return None;
    }
    extent[first] = shape[first];
    for pair in long.windows(2) {
        let (outer, inner) = (pair[0], pair[1]);
        let (so, si) = (strides[outer], strides[inner]);
        if si == 0 || so % si != 0 || so / si < shape[inner] {
            return None;
        }
        extent[inner] = so / si;
    }
    Some(Region {
        offset: vec![0; shape.len()],
        extent,
    })
}

/// Reads a CPU tensor's address, shape, strides and element size, checked against what its
/// slot must hold.
fn view_of(tensor: &Bound<'_, PyAny>, slot: &Slot, what: &str) -> PyResult<View> {
    if tensor.is_none() {
        return Err(error(format!(
            "{what}: expected a tensor of shape {:?}, got None",
            slot.shape
        )));
    }
    let device = tensor
        .getattr("device")?
        .getattr("type")?
        .str()?
        .to_string();
    if device != "cpu" {
        return Err(error(format!(
            "{what}: the tensor is on {device}; the packing kernels copy CPU tensors only"
        )));
    }
    let elem: usize = tensor.call_method0("element_size")?.extract()?;
    let shape: Vec<u64> = tensor.getattr("shape")?.extract()?;
    if shape != slot.shape || elem != slot.elem {
        return Err(error(format!(
            "{what}: expected a tensor of shape {:?} with {}-byte elements, got shape {shape:?} \
             with {elem}-byte elements",
            slot.shape, slot.elem
        )));
    }
    let strides: Vec<i64> = tensor.call_method0("stride")?.extract()?;
    let strides = strides
        .iter()
        .map(|&s| u64::try_from(s))
        .collect::<Result<Vec<u64>, _>>()
        .map_err(|_| error(format!("{what}: strides {strides:?} are negative")))?;
    let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
    let span = if shape.contains(&0) {
        0
    } else {
        let last: u64 = shape.iter().zip(&strides).map(|(&n, &s)| (n - 1) * s).sum();
        (last as usize + 1) * elem
    };
    let holder = dense_holder(&shape, &strides);
    Ok(View {
        ptr,
        span,
        strides,
        elem,
        holder,
    })
}

/// Row-major element strides of a dense array of `extent`.
fn dense(extent: &[u64]) -> Vec<u64> {
    let mut out = vec![1u64; extent.len()];
    for d in (0..extent.len().saturating_sub(1)).rev() {
        out[d] = out[d + 1] * extent[d + 1];
    }
    out
}

/// Copies a box of `extent` elements of `elem` bytes from `src` (at element `src_base`, with
/// element strides `src_strides`) to `dst` likewise, one element or one contiguous innermost
/// row at a time: the walk for tensors that are no box of a dense array.
fn strided_copy(
    (src, src_base, src_strides): (&[u8], u64, &[u64]),
    (dst, dst_base, dst_strides): (&mut [u8], u64, &[u64]),
    extent: &[u64],
    elem: usize,
) {
    if extent.contains(&0) {
        return;
    }
    let n = extent.len();
    // the innermost dim goes as one run when it is contiguous on both sides
    let (outer, run) = match n {
        0 => (0, 1),
        _ if src_strides[n - 1] == 1 && dst_strides[n - 1] == 1 => (n - 1, extent[n - 1]),
        _ => (n, 1),
    };
    let bytes = run as usize * elem;
    let mut idx = vec![0u64; outer];
    loop {
        let at = |base: u64, strides: &[u64]| {
            (base + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<u64>()) as usize * elem
        };
        let (s, d) = (at(src_base, src_strides), at(dst_base, dst_strides));
        dst[d..d + bytes].copy_from_slice(&src[s..s + bytes]);
        let mut k = outer;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < extent[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// The element offset of local `offset` in a tensor of element `strides`.
fn base_of(offset: &[u64], strides: &[u64]) -> u64 {
    offset.iter().zip(strides).map(|(o, s)| o * s).sum()
}

/// Which way a message's bytes go.
#[derive(Clone, Copy)]
enum Way {
    Pack,
    Unpack,
}

/// Copies one region between a tensor and its place in a message.
///
/// # Safety
/// `view` describes a live tensor; no other slice of its bytes is alive (when unpacking).
unsafe fn copy_piece(piece: &Piece, view: &View, message: &mut [u8], way: Way) {
    let region = Region {
        offset: piece.offset.clone(),
        extent: piece.extent.clone(),
    };
    let len = region.volume() as usize * view.elem;
    if len == 0 {
        return;
    }
    let slot = &mut message[piece.at..piece.at + len];
    if let Some(holder) = &view.holder {
        match way {
            Way::Pack => {
                let g = CopyGeometry::new(&region, Place::Within(holder), Place::Stream, view.elem);
                g.copy(unsafe { view.bytes() }, slot, 0..len);
            }
            Way::Unpack => {
                let g = CopyGeometry::new(&region, Place::Stream, Place::Within(holder), view.elem);
                g.copy(slot, unsafe { view.bytes_mut() }, 0..len);
            }
        }
        return;
    }
    let stream = dense(&piece.extent);
    let at = base_of(&piece.offset, &view.strides);
    match way {
        Way::Pack => strided_copy(
            (unsafe { view.bytes() }, at, &view.strides),
            (slot, 0, &stream),
            &piece.extent,
            view.elem,
        ),
        Way::Unpack => {
            let slot: &[u8] = slot;
            strided_copy(
                (slot, 0, &stream),
                (unsafe { view.bytes_mut() }, at, &view.strides),
                &piece.extent,
                view.elem,
            )
        }
    }
}

/// A message's buffer of `size` bytes at `ptr` (an empty tensor's address may be null).
///
/// # Safety
/// `ptr` is the address of `size` bytes of a live buffer that nothing else reads or writes
/// during the borrow.
unsafe fn message<'a>(ptr: usize, size: usize) -> &'a mut [u8] {
    if size == 0 {
        return &mut [];
    }
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, size) }
}

/// Whether two tensors' byte spans overlap.
fn overlap(a: &View, b: &View) -> bool {
    a.span > 0 && b.span > 0 && a.ptr < b.ptr + b.span && b.ptr < a.ptr + a.span
}

/// The copying part of one bucket of a reshard on one rank: every message's regions and the
/// local copies, over a list of tensor slots (`None` where a slot holds no tensor). Built
/// once per model and layouts; see the module's documentation.
#[pyclass(frozen, module = "reshard", name = "Packing")]
pub struct Packing {
    slots: Vec<Option<Slot>>,
    sends: Vec<(usize, Vec<Piece>)>,
    recvs: Vec<(usize, Vec<Piece>)>,
    locals: Vec<LocalPiece>,
}

type PieceArg = (usize, Vec<u64>, Vec<u64>, usize);
type LocalArg = (usize, Vec<u64>, usize, Vec<u64>, Vec<u64>);

impl Packing {
    /// Copies every message of `messages` between its buffer (None skips the message) and
    /// the slots' tensors, `way` saying which way, with the GIL released.
    fn copy_messages(
        &self,
        py: Python<'_>,
        messages: &[(usize, Vec<Piece>)],
        buffers: &Bound<'_, PyList>,
        tensors: &Bound<'_, PyList>,
        way: Way,
    ) -> PyResult<()> {
        let views = self.views(tensors)?;
        let buffers = Self::buffers(buffers, messages.iter().map(|(size, _)| *size), "buffers")?;
        py.detach(|| {
            for ((_, pieces), buffer) in messages.iter().zip(&buffers) {
                let Some((ptr, size)) = *buffer else { continue };
                // SAFETY: the buffer is a live contiguous tensor of at least `size` bytes
                // (checked above), held by the caller for this call, and no tensor of a slot
                // shares it (the executor allocates it).
                let message = unsafe { message(ptr, size) };
                for piece in pieces {
                    let view = views[piece.slot]
                        .as_ref()
                        .expect("a piece's slot holds a tensor");
                    // SAFETY: the view is of a live tensor of the slot's shape (checked), the
                    // piece lies inside that shape (checked at construction), and one tensor
                    // slice is alive at a time.
                    unsafe { copy_piece(piece, view, message, way) };
                }
            }
        });
        Ok(())
    }

    /// Pieces and message sizes checked against the slots, so that no call can copy outside a
    /// message or a tensor whose shape matches its slot.
    fn messages(
        &self,
        messages: Vec<(usize, Vec<PieceArg>)>,
        what: &str,
    ) -> PyResult<Vec<(usize, Vec<Piece>)>> {
        messages
            .into_iter()
            .enumerate()
            .map(|(m, (size, pieces))| {
                let pieces = pieces
                    .into_iter()
                    .map(|(slot, offset, extent, at)| {
                        let piece = Piece {
                            slot,
                            offset,
                            extent,
                            at,
                        };
                        let elem = self.check_box(slot, &piece.offset, &piece.extent, what)?;
                        let len = piece.extent.iter().product::<u64>() as usize * elem;
                        if at.checked_add(len).is_none_or(|end| end > size) {
                            return Err(error(format!(
                                "{what}[{m}]: a region of {len} bytes at {at} lies outside the \
                                 message's {size} bytes"
                            )));
                        }
                        Ok(piece)
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok((size, pieces))
            })
            .collect()
    }

    /// Checks that a box lies inside slot `slot`'s tensor; returns its element size.
    fn check_box(
        &self,
        slot: usize,
        offset: &[u64],
        extent: &[u64],
        what: &str,
    ) -> PyResult<usize> {
        let Some(Some(s)) = self.slots.get(slot) else {
            return Err(error(format!("{what}: slot {slot} holds no tensor")));
        };
        let inside = offset.len() == s.shape.len()
            && extent.len() == s.shape.len()
            && (0..s.shape.len()).all(|d| {
                offset[d]
                    .checked_add(extent[d])
                    .is_some_and(|end| end <= s.shape[d])
            });
        if !inside {
            return Err(error(format!(
                "{what}: the box at {offset:?} of extent {extent:?} lies outside slot {slot}'s \
                 shape {:?}",
                s.shape
            )));
        }
        Ok(s.elem)
    }

    /// Every slot's tensor read and checked (`None` where the slot holds none).
    fn views(&self, tensors: &Bound<'_, PyList>) -> PyResult<Vec<Option<View>>> {
        if tensors.len() != self.slots.len() {
            return Err(error(format!(
                "tensors: expected {} slots, got {}",
                self.slots.len(),
                tensors.len()
            )));
        }
        self.slots
            .iter()
            .zip(tensors.iter())
            .enumerate()
            .map(|(i, (slot, tensor))| match slot {
                None => Ok(None),
                Some(slot) => view_of(&tensor, slot, &format!("tensors[{i}]")).map(Some),
            })
            .collect()
    }

    /// The messages' buffers, each a contiguous 1-D CPU `torch.uint8` tensor of at least its
    /// message's size, as `(address, size)`, or None for a message that needs no staging
    /// (sent or received in place).
    fn buffers(
        buffers: &Bound<'_, PyList>,
        sizes: impl ExactSizeIterator<Item = usize>,
        what: &str,
    ) -> PyResult<Vec<Option<(usize, usize)>>> {
        if buffers.len() != sizes.len() {
            return Err(error(format!(
                "{what}: expected {} buffers, got {}",
                sizes.len(),
                buffers.len()
            )));
        }
        buffers
            .iter()
            .zip(sizes)
            .enumerate()
            .map(|(i, (b, size))| {
                if b.is_none() {
                    return Ok(None);
                }
                let dtype = b.getattr("dtype")?.str()?.to_string();
                let device = b.getattr("device")?.getattr("type")?.str()?.to_string();
                let dims: usize = b.call_method0("dim")?.extract()?;
                let contiguous: bool = b.call_method0("is_contiguous")?.extract()?;
                let len: usize = b.call_method0("numel")?.extract()?;
                if dtype != "torch.uint8" || device != "cpu" || dims != 1 || !contiguous || len < size {
                    return Err(error(format!(
                        "{what}[{i}]: expected a contiguous 1-D torch.uint8 tensor on the cpu of at \
                         least {size} bytes, got a {dims}-D {dtype} tensor of {len} elements on \
                         {device}{}",
                        if contiguous { "" } else { " (not contiguous)" }
                    )));
                }
                let ptr: usize = b.call_method0("data_ptr")?.extract()?;
                Ok(Some((ptr, size)))
            })
            .collect()
    }
}

#[pymethods]
impl Packing {
    /// `Packing(slots, sends, recvs, locals)`: `slots` one `(shape, elem_bytes)` or `None`
    /// per tensor slot; `sends` and `recvs` one `(size, [(slot, offset, extent, at)])` per
    /// message; `locals` one `(src_slot, src_offset, dst_slot, dst_offset, extent)` per local
    /// copy (offsets local to each tensor). Every box must lie inside its slot's shape and
    /// every region inside its message.
    #[new]
    fn new(
        slots: Vec<Option<(Vec<u64>, usize)>>,
        sends: Vec<(usize, Vec<PieceArg>)>,
        recvs: Vec<(usize, Vec<PieceArg>)>,
        locals: Vec<LocalArg>,
    ) -> PyResult<Packing> {
        let mut packing = Packing {
            slots: slots
                .into_iter()
                .map(|s| s.map(|(shape, elem)| Slot { shape, elem }))
                .collect(),
            sends: Vec::new(),
            recvs: Vec::new(),
            locals: Vec::new(),
        };
        packing.sends = packing.messages(sends, "sends")?;
        packing.recvs = packing.messages(recvs, "recvs")?;
        for (src, src_offset, dst, dst_offset, extent) in locals {
            packing.check_box(src, &src_offset, &extent, "locals")?;
            packing.check_box(dst, &dst_offset, &extent, "locals")?;
            packing.locals.push(LocalPiece {
                src,
                src_offset,
                dst,
                dst_offset,
                extent,
            });
        }
        Ok(packing)
    }

    /// Packs every send message into its buffer (one per message, in order; None skips the
    /// message) from the slots' tensors, with the GIL released.
    fn pack(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyList>,
        buffers: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        self.copy_messages(py, &self.sends, buffers, tensors, Way::Pack)
    }

    /// Unpacks every receive message from its buffer (None skips the message) into the slots'
    /// tensors, with the GIL released.
    fn unpack(
        &self,
        py: Python<'_>,
        buffers: &Bound<'_, PyList>,
        tensors: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        self.copy_messages(py, &self.recvs, buffers, tensors, Way::Unpack)
    }

    /// Runs the local copies between the slots' tensors, with the GIL released. A copy whose
    /// source and destination tensors share memory is refused, before anything is copied.
    fn copy_locals(&self, py: Python<'_>, tensors: &Bound<'_, PyList>) -> PyResult<()> {
        if self.locals.is_empty() {
            return Ok(());
        }
        let views = self.views(tensors)?;
        let view = |slot: usize| {
            views[slot]
                .as_ref()
                .expect("a local copy's slot holds a tensor")
        };
        for l in &self.locals {
            if overlap(view(l.src), view(l.dst)) {
                return Err(error(format!(
                    "tensors[{}] and tensors[{}]: the source and the destination of a local copy \
                     share memory",
                    l.src, l.dst
                )));
            }
        }
        py.detach(|| {
            for l in &self.locals {
                let (s, d) = (view(l.src), view(l.dst));
                // SAFETY: both views are of live tensors of their slots' shapes, the boxes lie
                // inside them (checked at construction), and their bytes do not overlap
                // (checked above).
                let (src, dst) = unsafe { (s.bytes(), d.bytes_mut()) };
                match (&s.holder, &d.holder) {
                    (Some(sh), Some(dh)) => {
                        // The core's kernel takes one region and the two boxes holding it in
                        // one coordinate system. Element q of the copy is at source local
                        // src_offset + q and destination local dst_offset + q; with
                        // coordinates q + src_offset + dst_offset (never negative), the
                        // source holder starts at dst_offset and the destination's at
                        // src_offset.
                        let region = Region {
                            offset: l
                                .src_offset
                                .iter()
                                .zip(&l.dst_offset)
                                .map(|(a, b)| a + b)
                                .collect(),
                            extent: l.extent.clone(),
                        };
                        let src_box = Region {
                            offset: l.dst_offset.clone(),
                            extent: sh.extent.clone(),
                        };
                        let dst_box = Region {
                            offset: l.src_offset.clone(),
                            extent: dh.extent.clone(),
                        };
                        let g = CopyGeometry::new(
                            &region,
                            Place::Within(&src_box),
                            Place::Within(&dst_box),
                            s.elem,
                        );
                        g.copy(src, dst, 0..g.len());
                    }
                    _ => strided_copy(
                        (src, base_of(&l.src_offset, &s.strides), &s.strides),
                        (dst, base_of(&l.dst_offset, &d.strides), &d.strides),
                        &l.extent,
                        s.elem,
                    ),
                }
            }
        });
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Packing(slots={}, sends={}, recvs={}, locals={})",
            self.slots.len(),
            self.sends.len(),
            self.recvs.len(),
            self.locals.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_holders_of_views() {
        // contiguous
        let h = dense_holder(&[4, 6], &[6, 1]).unwrap();
        assert_eq!(h.extent, vec![4, 6]);
        // a slice of columns of a 4x10 array
        let h = dense_holder(&[4, 3], &[10, 1]).unwrap();
        assert_eq!(h.extent, vec![4, 10]);
        // a middle dim of size 1 takes any stride
        let h = dense_holder(&[2, 1, 5], &[20, 999, 1]).unwrap();
        assert_eq!(h.extent, vec![2, 1, 20]);
        // transposed, broadcast, innermost not contiguous
        assert!(dense_holder(&[3, 4], &[1, 3]).is_none());
        assert!(dense_holder(&[3, 4], &[0, 1]).is_none());
        assert!(dense_holder(&[3, 4], &[8, 2]).is_none());
        // rows overlapping their outer stride
        assert!(dense_holder(&[3, 4], &[2, 1]).is_none());
        // empty and scalar
        assert_eq!(dense_holder(&[0, 4], &[4, 1]).unwrap().extent, vec![0, 4]);
        assert_eq!(dense_holder(&[], &[]).unwrap().extent, Vec::<u64>::new());
    }

    #[test]
    fn strided_walk_copies_a_transposed_box() {
        // a 3x4 array of u16 stored transposed (strides 1, 3); copy its box [1..3, 1..4]
        let elem = 2;
        let value = |r: u64, c: u64| (r * 10 + c) as u16;
        let mut stored = vec![0u8; 12 * elem];
        for r in 0..3 {
            for c in 0..4 {
                let at = (r + c * 3) as usize * elem;
                stored[at..at + elem].copy_from_slice(&value(r, c).to_le_bytes());
            }
        }
        let strides = [1, 3];
        let extent = [2, 3];
        let mut out = vec![0u8; 6 * elem];
        strided_copy(
            (&stored, base_of(&[1, 1], &strides), &strides),
            (&mut out, 0, &dense(&extent)),
            &extent,
            elem,
        );
        let got: Vec<u16> = out
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(got, vec![11, 12, 13, 21, 22, 23]);
    }
}
