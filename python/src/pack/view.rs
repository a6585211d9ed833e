//! A CPU tensor as the copies see it ([`View`]): its address, span and strides, read and
//! checked at each call, the dense array it is a box of when it is one, and the
//! element-strided walk that copies it when it is not.

use pyo3::prelude::*;
use reshard_core::region::Region;

use super::Slot;
use crate::error;

/// A tensor as the copies see it: where its first element is, how many bytes from there its
/// elements reach, and its element strides. Read from the tensor at each call.
#[derive(Clone)]
pub(crate) struct View {
    pub(crate) ptr: usize,
    /// Bytes from the first element to the end of the last.
    pub(crate) span: usize,
    pub(crate) shape: Vec<u64>,
    /// Strides in elements.
    pub(crate) strides: Vec<u64>,
    pub(crate) elem: usize,
    /// The dense row-major array this tensor is a box of (starting at its first element), if
    /// it is one: then the core's kernels copy it.
    pub(crate) holder: Option<Region>,
}

impl View {
    /// The bytes of the tensor, from its first element to its last.
    ///
    /// # Safety
    /// `ptr` and `span` describe memory of a live tensor that nothing else writes during the
    /// borrow (the caller holds the tensors for the whole call).
    pub(crate) unsafe fn bytes<'a>(&self) -> &'a [u8] {
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
    pub(crate) unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
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
pub(crate) fn dense_holder(shape: &[u64], strides: &[u64]) -> Option<Region> {
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
pub(super) fn view_of(tensor: &Bound<'_, PyAny>, slot: &Slot, what: &str) -> PyResult<View> {
    if tensor.is_none() {
        return Err(error(format!(
            "{what}: expected a tensor of shape {:?}, got None",
            slot.shape
        )));
    }
    let view = read_view(tensor, what, "the packing kernels copy")?;
    if view.shape != slot.shape || view.elem != slot.elem {
        return Err(error(format!(
            "{what}: expected a tensor of shape {:?} with {}-byte elements, got shape {:?} \
             with {}-byte elements",
            slot.shape, slot.elem, view.shape, view.elem
        )));
    }
    Ok(view)
}

/// Reads a CPU tensor of any shape and non-negative strides: its address, shape, strides,
/// element size and the dense array it is a box of; `kernels` says who refuses another
/// device (`the packing kernels copy`).
pub(crate) fn read_view(tensor: &Bound<'_, PyAny>, what: &str, kernels: &str) -> PyResult<View> {
    let device = tensor
        .getattr("device")?
        .getattr("type")?
        .str()?
        .to_string();
    if device != "cpu" {
        return Err(error(format!(
            "{what}: the tensor is on {device}; {kernels} CPU tensors only"
        )));
    }
    let elem: usize = tensor.call_method0("element_size")?.extract()?;
    let shape: Vec<u64> = tensor.getattr("shape")?.extract()?;
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
        shape,
        strides,
        elem,
        holder,
    })
}

/// Row-major element strides of a dense array of `extent`.
pub(super) fn dense(extent: &[u64]) -> Vec<u64> {
    let mut out = vec![1u64; extent.len()];
    for d in (0..extent.len().saturating_sub(1)).rev() {
        out[d] = out[d + 1] * extent[d + 1];
    }
    out
}

/// Copies a box of `extent` elements of `elem` bytes from `src` (at element `src_base`, with
/// element strides `src_strides`) to `dst` likewise, one element or one contiguous innermost
/// row at a time: the walk for tensors that are no box of a dense array.
pub(super) fn strided_copy(
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
    each_index(&extent[..outer], |idx| {
        let at = |base: u64, strides: &[u64]| {
            (base + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<u64>()) as usize * elem
        };
        let (s, d) = (at(src_base, src_strides), at(dst_base, dst_strides));
        dst[d..d + bytes].copy_from_slice(&src[s..s + bytes]);
    });
}

/// Calls `f(index)` for every index of a box of `extent`, in row-major order (once, with no
/// index, for no dims; never for an empty box).
pub(crate) fn each_index(extent: &[u64], mut f: impl FnMut(&[u64])) {
    if extent.contains(&0) {
        return;
    }
    let mut idx = vec![0u64; extent.len()];
    loop {
        f(&idx);
        let mut k = extent.len();
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
pub(super) fn base_of(offset: &[u64], strides: &[u64]) -> u64 {
    offset.iter().zip(strides).map(|(o, s)| o * s).sum()
}

/// Whether two tensors' byte spans overlap.
pub(super) fn overlap(a: &View, b: &View) -> bool {
    a.span > 0 && b.span > 0 && a.ptr < b.ptr + b.span && b.ptr < a.ptr + a.span
}
