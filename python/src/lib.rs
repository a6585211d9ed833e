//! Python bindings of `reshard`: layouts, plans and their errors, answered by the Rust core.
//!
//! This module holds no logic of its own: it converts Python values (sequences, strings,
//! torch's placement and dtype objects) into the core's types and back. The torch executor
//! that moves the data is Python (`reshard/torch.py`) on top of these answers, with the copies
//! of CPU tensors in Rust (`pack`).

mod checksum;
mod control;
mod delta;
mod layout;
mod pack;
mod plan;
mod program;
mod quant;
mod refit;
mod values;

use std::any::Any;
use std::fmt::Display;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use reshard_core::{Error, PlanOptions};

create_exception!(
    reshard,
    ReshardError,
    PyValueError,
    "Every error of reshard; its subclasses say which kind. The message names the argument and the value, as the command line's names its flag."
);
create_exception!(
    reshard,
    ArgumentError,
    ReshardError,
    "A bad argument, tensor or layout: the message names the argument and the value."
);
create_exception!(
    reshard,
    AgreementError,
    ReshardError,
    "The ranks disagree on the job, or another rank refused its part: nothing was moved."
);
create_exception!(
    reshard,
    ChecksumError,
    ReshardError,
    "A transfer arrived changed: what landed differs from what its sender sent."
);
create_exception!(
    reshard,
    PeerLostError,
    ReshardError,
    "A peer died, closed its link or timed out: the message names the rank."
);
create_exception!(
    reshard,
    InDoubtError,
    ReshardError,
    "A rank voted prepared, then lost the coordinator before the decision came."
);
create_exception!(
    reshard,
    VersionError,
    ReshardError,
    "A version reused or lower than the last, nothing staged, a stale staging, or another version asked for."
);
create_exception!(
    reshard,
    AbortedError,
    ReshardError,
    "The job decided to abort a staged version: some rank voted not to commit it."
);

/// Plan options from an optional `min_split_bytes`; the default is the command line's, so
/// that Python plans equal `reshard plan`'s.
fn plan_options(min_split_bytes: Option<u64>) -> PlanOptions {
    let default = PlanOptions::default();
    PlanOptions {
        min_split_bytes: min_split_bytes.unwrap_or(default.min_split_bytes),
    }
}

/// The Python exception of an error, its message unchanged: a core [`Error`] raises the
/// subclass of `ReshardError` of its kind ([`class_of`]); a message written here (a `String`:
/// the bindings' own checks of their arguments), a layout or a model's refusal raises
/// `ArgumentError`, as does a conversion's (a scheme that does not fit, a value fp8 cannot
/// carry); anything else (an encoding that failed) `ReshardError` itself.
fn error<E: Display + 'static>(e: E) -> PyErr {
    let any: &dyn Any = &e;
    let class = if let Some(core) = any.downcast_ref::<Error>() {
        class_of(core)
    } else if any.is::<String>()
        || any.is::<&'static str>()
        || any.is::<reshard_core::error::LayoutError>()
        || any.is::<reshard_core::error::ConvertError>()
        || any.is::<reshard_model::ModelError>()
    {
        Class::Argument
    } else {
        Class::Other
    };
    class.err(e.to_string())
}

/// The kinds of error Python tells apart, one exception class each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Argument,
    Agreement,
    Checksum,
    PeerLost,
    InDoubt,
    Version,
    Other,
}

impl Class {
    fn err(self, message: String) -> PyErr {
        match self {
            Class::Argument => ArgumentError::new_err(message),
            Class::Agreement => AgreementError::new_err(message),
            Class::Checksum => ChecksumError::new_err(message),
            Class::PeerLost => PeerLostError::new_err(message),
            Class::InDoubt => InDoubtError::new_err(message),
            Class::Version => VersionError::new_err(message),
            Class::Other => ReshardError::new_err(message),
        }
    }
}

/// The kind of a core error: bad input (a layout, a spec, an option, a buffer, a model) is an
/// argument; ranks that disagree or refuse (or fail, told by the control plane), an agreement; a transfer or delta that landed
/// changed, a checksum; a peer gone or silent, a lost peer; the two-phase decision's doubt and
/// its versions, their own kinds. An incomplete reshard is of the kind its failures share.
/// Anything else (internal, I/O, memory, a malformed transfer) is a plain `ReshardError`.
fn class_of(e: &Error) -> Class {
    match e {
        Error::UnknownDType { .. }
        | Error::Layout { .. }
        | Error::MalformedShape { .. }
        | Error::ShapeMismatch { .. }
        | Error::MissingBuffer { .. }
        | Error::UnexpectedBuffer { .. }
        | Error::BufferSize { .. }
        | Error::InvalidOption { .. }
        | Error::CutReplica { .. }
        | Error::Batch { .. }
        | Error::Env { .. }
        | Error::Convert { .. }
        | Error::Model(_) => Class::Argument,
        // another rank's failure, told to this one by the job's control plane
        Error::Disagreement { .. } | Error::RankRefused { .. } | Error::JobFailed { .. } => {
            Class::Agreement
        }
        Error::ChecksumMismatch { .. } | Error::DeltaMismatch { .. } => Class::Checksum,
        Error::PeerGone { .. } | Error::Timeout { .. } => Class::PeerLost,
        Error::InDoubt { .. } => Class::InDoubt,
        Error::NotStaged { .. } | Error::ServesOther { .. } | Error::StillStaged { .. } => {
            Class::Version
        }
        Error::Incomplete { failures } => {
            let mut classes = failures.iter().map(class_of);
            match classes.next() {
                Some(first) if classes.all(|c| c == first) => first,
                _ => Class::Other,
            }
        }
        _ => Class::Other,
    }
}

/// Layouts, plans and errors of `reshard`, from its Rust core.
#[pymodule]
mod _core {
    #[pymodule_export]
    use super::checksum::crc32c;
    #[pymodule_export]
    use super::control::{PyControl, PyControlListener};
    #[pymodule_export]
    use super::delta::{delta_apply, delta_encode, delta_written};
    #[pymodule_export]
    use super::layout::{PyLayout, PyReplicate, PyShard};
    #[pymodule_export]
    use super::pack::Packing;
    #[pymodule_export]
    use super::plan::{PyPlan, PyRankPlan, PyTransfer, plan, rank_plan};
    #[pymodule_export]
    use super::program::rank_program;
    #[pymodule_export]
    use super::quant::{
        QuantAmax, QuantPacking, QuantScales, quant_scale_dtype, quant_scale_shape,
        quantized_scale_layouts,
    };
    #[pymodule_export]
    use super::refit::PyRefit;
    #[pymodule_export]
    use super::{
        AbortedError, AgreementError, ArgumentError, ChecksumError, InDoubtError, PeerLostError,
        ReshardError, VersionError,
    };

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
