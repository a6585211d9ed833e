//! Python bindings of `reshard`: layouts, plans and their errors, answered by the Rust core.
//!
//! This module holds no logic of its own: it converts Python values (sequences, strings,
//! torch's placement and dtype objects) into the core's types and back. The torch executor
//! that moves the data is Python (`reshard/torch.py`) on top of these answers, with the copies
//! of CPU tensors in Rust (`pack`).

mod checksum;
mod layout;
mod pack;
mod plan;
mod quant;
mod refit;
mod values;

use std::fmt::Display;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use reshard_core::PlanOptions;

create_exception!(
    reshard,
    ReshardError,
    PyValueError,
    "Bad input to reshard: the message names the argument and the value, as the command line's names its flag."
);

/// Plan options from an optional `min_split_bytes`; the default is the command line's, so
/// that Python plans equal `reshard plan`'s.
fn plan_options(min_split_bytes: Option<u64>) -> PlanOptions {
    let default = PlanOptions::default();
    PlanOptions {
        min_split_bytes: min_split_bytes.unwrap_or(default.min_split_bytes),
    }
}

fn error(e: impl Display) -> PyErr {
    ReshardError::new_err(e.to_string())
}

/// Layouts, plans and errors of `reshard`, from its Rust core.
#[pymodule]
mod _core {
    #[pymodule_export]
    use super::ReshardError;
    #[pymodule_export]
    use super::checksum::crc32c;
    #[pymodule_export]
    use super::layout::{PyLayout, PyReplicate, PyShard};
    #[pymodule_export]
    use super::pack::Packing;
    #[pymodule_export]
    use super::plan::{PyPlan, PyRankPlan, PyTransfer, plan, rank_plan};
    #[pymodule_export]
    use super::quant::{
        QuantAmax, QuantPacking, QuantScales, quant_scale_dtype, quant_scale_shape,
        quantized_scale_layouts,
    };
    #[pymodule_export]
    use super::refit::PyRefit;

    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        use pyo3::types::PyModuleMethods;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "DEFAULT_MIN_SPLIT_BYTES",
            super::PlanOptions::default().min_split_bytes,
        )
    }
}
