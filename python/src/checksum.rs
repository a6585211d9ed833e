//! CRC-32C of a packed message's pieces, read in place.

use pyo3::prelude::*;

use crate::error;

/// The CRC-32C of each `(start, length)` piece of `tensor`, a contiguous 1-D `torch.uint8`
/// tensor in CPU memory (a packed message of the torch executor): the sums that travel with
/// a message under `checksum=True`, the same CRC-32C as the command line's `--checksum`.
/// The tensor is read in place (no copy), so everything about it is checked first, and a
/// piece outside it is refused.
#[pyfunction]
pub(crate) fn crc32c(tensor: &Bound<'_, PyAny>, pieces: Vec<(usize, usize)>) -> PyResult<Vec<u32>> {
    let attr = |name: &str| tensor.getattr(name);
    let dtype = attr("dtype")?.str()?.to_string();
    let device = attr("device")?.getattr("type")?.str()?.to_string();
    let dims: usize = attr("dim")?.call0()?.extract()?;
    let contiguous: bool = attr("is_contiguous")?.call0()?.extract()?;
    if dtype != "torch.uint8" || device != "cpu" || dims != 1 || !contiguous {
        return Err(error(format!(
            "crc32c: expected a contiguous 1-D torch.uint8 tensor on the cpu, got a {dims}-D {dtype} tensor on {device}{}",
            if contiguous { "" } else { " (not contiguous)" }
        )));
    }
    let len: usize = attr("numel")?.call0()?.extract()?;
    let ptr: usize = attr("data_ptr")?.call0()?.extract()?;
    if let Some(&(start, n)) = pieces
        .iter()
        .find(|(start, n)| start.checked_add(*n).is_none_or(|end| end > len))
    {
        return Err(error(format!(
            "crc32c: piece ({start}, {n}) lies outside the tensor's {len} bytes"
        )));
    }
    if len == 0 {
        return Ok(vec![0; pieces.len()]);
    }
    // SAFETY: `tensor` (borrowed for this whole call) is a contiguous 1-D uint8 tensor in CPU
    // memory of `len` elements starting at `ptr`, checked above; every piece lies inside it.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    Ok(pieces
        .iter()
        .map(|&(start, n)| reshard_core::checksum::bytes_sum(&bytes[start..start + n]))
        .collect())
}
