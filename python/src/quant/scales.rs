//! What a quantized reshard's scales look like, asked of a scheme without packing anything:
//! the shape and dtype of a rank's scale shard, and the scale layouts of an already-quantized
//! move; and the checked scheme and scale dtype every quantizing call starts from.

use pyo3::prelude::*;
use reshard_core::convert::{BlockGrid, QuantScheme, ScaleDType};
use reshard_core::plan::{QuantRequest, QuantizedMove};

use crate::layout::PyLayout;
use crate::{error, plan_options};

/// The scheme and scale dtype a caller names, checked.
pub(super) fn request(quant: &str, scale_dtype: Option<&str>) -> PyResult<QuantRequest> {
    let scheme = QuantScheme::parse(quant).map_err(error)?;
    let scale_dtype = scale_dtype
        .map(|s| s.parse::<ScaleDType>())
        .transpose()
        .map_err(error)?;
    Ok(QuantRequest {
        scheme,
        scale_dtype,
    })
}

/// The shape of `rank`'s scale shard when `dst` is quantized as `quant` says, or None if the
/// rank holds no shard of `dst`: what to allocate for `reshard.torch.reshard_(..., scale=)`.
#[pyfunction]
pub(crate) fn quant_scale_shape(
    dst: &Bound<'_, PyLayout>,
    rank: usize,
    quant: &str,
) -> PyResult<Option<Vec<u64>>> {
    let dst = &dst.get().inner;
    let scheme = QuantScheme::parse(quant).map_err(error)?;
    let grid = BlockGrid::new(scheme, dst.shape()).map_err(|e| error(format!("tensor: {e}")))?;
    Ok(dst
        .local_region(rank)
        .map(|shard| grid.scale_region(&shard).extent))
}

/// The scale dtype of `quant` with `scale_dtype` (None: the scheme's default): `f32` or
/// `e8m0`.
#[pyfunction]
#[pyo3(signature = (quant, scale_dtype = None))]
pub(crate) fn quant_scale_dtype(quant: &str, scale_dtype: Option<&str>) -> PyResult<String> {
    let r = request(quant, scale_dtype)?;
    Ok(r.scale_dtype
        .unwrap_or(r.scheme.default_scale_dtype())
        .to_string())
}

/// The scale layouts of an already-quantized move of `src` to `dst` (fp8 values of one
/// format, quantized as `quant` says, with scales in `scale_dtype`): `(src_scales,
/// dst_scales)`, the scale tensor over each side's mesh and placements, whose shards are
/// exactly the scales of each rank's blocks. Refused, as the core plans it
/// ([`QuantizedMove`]), when the dtypes differ or are not fp8, the scheme does not fit the
/// tensor, or a shard boundary on either side cuts a block.
#[pyfunction]
#[pyo3(signature = (src, dst, quant, scale_dtype = None))]
pub(crate) fn quantized_scale_layouts(
    src: &Bound<'_, PyLayout>,
    dst: &Bound<'_, PyLayout>,
    quant: &str,
    scale_dtype: Option<&str>,
) -> PyResult<(PyLayout, PyLayout)> {
    let (src, dst) = (src.get().inner.clone(), dst.get().inner.clone());
    let req = request(quant, scale_dtype)?;
    let moved = QuantizedMove::new(src, dst, plan_options(None), req).map_err(error)?;
    Ok((
        PyLayout {
            inner: moved.scales.src().clone(),
        },
        PyLayout {
            inner: moved.scales.dst().clone(),
        },
    ))
}
