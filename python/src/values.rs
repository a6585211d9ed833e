//! Python values into the core's types and back: integers, placements, dtypes, tuples.

use std::fmt::Display;

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use reshard_core::DType;

use crate::error;

/// Non-negative integers from any iterable (list, tuple, `range`, `torch.Size`), with an
/// error naming the field and the item rather than a bare conversion failure.
pub(crate) fn ints<T: for<'a, 'py> FromPyObject<'a, 'py>>(
    obj: &Bound<'_, PyAny>,
    field: &str,
) -> PyResult<Vec<T>> {
    let items = obj.try_iter().map_err(|_| {
        error(format!(
            "{field}: expected a sequence of integers, got {}",
            describe(obj)
        ))
    })?;
    items
        .map(|item| {
            let item = item?;
            item.extract::<T>().map_err(|_| {
                error(format!(
                    "{field}: `{}` is not a non-negative integer",
                    describe(&item)
                ))
            })
        })
        .collect()
}

/// `repr(obj)`, or a placeholder when even that fails.
pub(crate) fn describe(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".to_string())
}

/// A dtype given by name (`"bf16"`, `"bfloat16"`) or as a `torch.dtype`, whose `str` is
/// `torch.bfloat16`.
pub(crate) fn dtype_of(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    let text = obj.str()?.to_string();
    text.parse::<DType>().map_err(error)
}

/// DTensor may nest the shards of one tensor dim in an order other than mesh-axis order
/// (`DTensorSpec.shard_order`); reshard nests them in mesh-axis order only, so other orders
/// are refused rather than mislaid.
pub(crate) fn check_shard_order(dt: &Bound<'_, PyAny>) -> PyResult<()> {
    let Ok(order) = dt.getattr("_spec").and_then(|s| s.getattr("shard_order")) else {
        return Ok(());
    };
    if order.is_none() {
        return Ok(());
    }
    for entry in order.try_iter()? {
        let entry = entry?;
        let dim: i64 = entry.getattr("tensor_dim")?.extract()?;
        let axes: Vec<usize> = ints(&entry.getattr("mesh_dims")?, "shard_order")?;
        if axes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(error(format!(
                "placements: the DTensor shards tensor dim {dim} over mesh axes {axes:?} in that \
                 order; reshard nests the shards of one dim in mesh-axis order only"
            )));
        }
    }
    Ok(())
}

pub(crate) fn tuple<'py, T: IntoPyObject<'py> + Copy>(
    py: Python<'py>,
    items: &[T],
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, items.iter().copied())
}

/// A sequence written as Python writes a tuple: `(4,)`, `(8, 8)`.
pub(crate) fn py_tuple<T: Display>(items: &[T]) -> String {
    let parts: Vec<String> = items.iter().map(T::to_string).collect();
    match parts.len() {
        1 => format!("({},)", parts[0]),
        _ => format!("({})", parts.join(", ")),
    }
}

/// Ranks as Python would rebuild them: `range(a, b)` when consecutive, a list otherwise.
pub(crate) fn py_ranks(ranks: &[usize]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(&a), Some(&b)) if ranks.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("range({a}, {})", b + 1)
        }
        _ => format!("{ranks:?}"),
    }
}
