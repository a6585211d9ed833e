//! `Plan`, `RankPlan` and `Transfer`: who sends which box to whom, from the core's planner.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use reshard_core::plan::{PlanJson, rank_plan as core_rank_plan};
use reshard_core::{Plan, RankPlan, Transfer};

use crate::layout::*;
use crate::values::*;
use crate::{error, plan_options};

/// One box moved from rank `src` to rank `dst` (`src == dst`: a local copy), in global
/// coordinates.
#[pyclass(frozen, eq, ord, hash, module = "reshard", name = "Transfer")]
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PyTransfer {
    pub(crate) inner: Transfer,
    pub(crate) bytes: u64,
}

impl PyTransfer {
    fn new(t: &Transfer, elem_bytes: usize) -> PyTransfer {
        PyTransfer {
            inner: t.clone(),
            bytes: t.bytes(elem_bytes),
        }
    }

    fn list(ts: &[Transfer], elem_bytes: usize) -> Vec<PyTransfer> {
        ts.iter().map(|t| PyTransfer::new(t, elem_bytes)).collect()
    }
}

#[pymethods]
impl PyTransfer {
    #[getter]
    fn src(&self) -> usize {
        self.inner.src
    }

    #[getter]
    fn dst(&self) -> usize {
        self.inner.dst
    }

    #[getter]
    fn offset<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple(py, &self.inner.region.offset)
    }

    #[getter]
    fn extent<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple(py, &self.inner.region.extent)
    }

    #[getter]
    fn bytes(&self) -> u64 {
        self.bytes
    }

    #[getter]
    fn is_local(&self) -> bool {
        self.inner.is_local()
    }

    /// The transfer as in the plan JSON: `{"src", "dst", "offset", "extent", "bytes"}`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("src", self.inner.src)?;
        d.set_item("dst", self.inner.dst)?;
        d.set_item("offset", self.inner.region.offset.clone())?;
        d.set_item("extent", self.inner.region.extent.clone())?;
        d.set_item("bytes", self.bytes)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Transfer(src={}, dst={}, offset={:?}, extent={:?}, bytes={})",
            self.inner.src,
            self.inner.dst,
            self.inner.region.offset,
            self.inner.region.extent,
            self.bytes
        )
    }
}

/// One rank's part of a plan: what it sends, receives and copies locally, in schedule order.
#[pyclass(frozen, module = "reshard", name = "RankPlan")]
pub(crate) struct PyRankPlan {
    pub(crate) inner: RankPlan,
    pub(crate) elem_bytes: usize,
}

#[pymethods]
impl PyRankPlan {
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Remote transfers this rank sends.
    #[getter]
    fn sends(&self) -> Vec<PyTransfer> {
        PyTransfer::list(&self.inner.sends, self.elem_bytes)
    }

    /// Remote transfers this rank receives.
    #[getter]
    fn recvs(&self) -> Vec<PyTransfer> {
        PyTransfer::list(&self.inner.recvs, self.elem_bytes)
    }

    /// Copies from this rank's source shard into its own destination shard.
    #[getter]
    fn locals(&self) -> Vec<PyTransfer> {
        PyTransfer::list(&self.inner.locals, self.elem_bytes)
    }

    /// Every rank this rank exchanges data with, sorted.
    #[getter]
    fn peers(&self) -> Vec<usize> {
        self.inner.peers().into_iter().collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "RankPlan(rank={}, sends={}, recvs={}, locals={})",
            self.inner.rank,
            self.inner.sends.len(),
            self.inner.recvs.len(),
            self.inner.locals.len()
        )
    }
}

/// A complete plan: every transfer between two layouts, computed without communication.
#[pyclass(frozen, module = "reshard", name = "Plan")]
pub(crate) struct PyPlan {
    pub(crate) inner: Plan,
}

#[pymethods]
impl PyPlan {
    #[getter]
    fn src(&self) -> PyLayout {
        PyLayout {
            inner: self.inner.src().clone(),
        }
    }

    #[getter]
    fn dst(&self) -> PyLayout {
        PyLayout {
            inner: self.inner.dst().clone(),
        }
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple(py, self.inner.src().shape())
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.src().dtype().name()
    }

    #[getter]
    fn elem_bytes(&self) -> usize {
        self.inner.elem_bytes()
    }

    /// Every transfer, sorted by (src, dst, region): the `transfers` of the plan JSON.
    #[getter]
    fn transfers(&self) -> Vec<PyTransfer> {
        PyTransfer::list(self.inner.transfers(), self.inner.elem_bytes())
    }

    /// The `totals` of the plan JSON: remote and local bytes, messages, the busiest rank's
    /// send and receive bytes, and what gather+broadcast would move. A total past 2^64 - 1 is
    /// `None`, and `overflow` (present only then) lists the names of those totals.
    #[getter]
    fn totals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let value = serde_json::to_value(self.inner.totals()).map_err(error)?;
        let d = PyDict::new(py);
        if let serde_json::Value::Object(fields) = value {
            for (k, v) in fields {
                match v {
                    serde_json::Value::Array(names) => {
                        let names: Vec<&str> = names.iter().filter_map(|n| n.as_str()).collect();
                        d.set_item(k, names)?
                    }
                    v => d.set_item(k, v.as_u64())?,
                }
            }
        }
        Ok(d)
    }

    /// Every rank of either side, sorted.
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.inner.ranks()
    }

    /// The plan as `reshard plan --json` prints it.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string_pretty(&PlanJson::of(&self.inner)).map_err(error)
    }

    /// `rank`'s sends, receives and local copies.
    fn for_rank(&self, rank: usize) -> PyRankPlan {
        PyRankPlan {
            inner: self.inner.for_rank(rank),
            elem_bytes: self.inner.elem_bytes(),
        }
    }

    fn __len__(&self) -> usize {
        self.inner.transfers().len()
    }

    fn __repr__(&self) -> String {
        let t = self.inner.totals();
        format!(
            "Plan({} -> {}: {} transfers, {} bytes remote, {} bytes local)",
            self.inner.src(),
            self.inner.dst(),
            self.inner.transfers().len(),
            t.bytes_remote,
            t.bytes_local
        )
    }
}

/// The plan from `src` to `dst`. Raises `ReshardError` if the layouts disagree on the
/// tensor (shape, dtype).
#[pyfunction]
#[pyo3(signature = (src, dst, min_split_bytes = None))]
pub(crate) fn plan(
    src: &Bound<'_, PyLayout>,
    dst: &Bound<'_, PyLayout>,
    min_split_bytes: Option<u64>,
) -> PyResult<PyPlan> {
    let options = plan_options(min_split_bytes);
    let inner = Plan::with_options(src.get().inner.clone(), dst.get().inner.clone(), options)
        .map_err(error)?;
    Ok(PyPlan { inner })
}

/// `rank`'s part of the plan from `src` to `dst`, computed from the layouts alone (the same
/// as `plan(src, dst).for_rank(rank)`, at a cost that follows this rank's pieces only).
#[pyfunction]
#[pyo3(signature = (src, dst, rank, min_split_bytes = None))]
pub(crate) fn rank_plan(
    src: &Bound<'_, PyLayout>,
    dst: &Bound<'_, PyLayout>,
    rank: usize,
    min_split_bytes: Option<u64>,
) -> PyResult<PyRankPlan> {
    let (src, dst) = (&src.get().inner, &dst.get().inner);
    let options = plan_options(min_split_bytes);
    let inner = core_rank_plan(src, dst, rank, &options).map_err(error)?;
    Ok(PyRankPlan {
        inner,
        elem_bytes: dst.dtype().size(),
    })
}
