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

#[cfg(test)]
mod tests;
pub(crate) mod view;

use view::{View, base_of, dense, overlap, strided_copy, view_of};

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
