//! Python bindings of `reshard`: layouts, plans and their errors, answered by the Rust core.
//!
//! This module holds no logic of its own: it converts Python values (sequences, strings,
//! torch's placement and dtype objects) into the core's types and back. The torch executor
//! that moves the data is Python (`reshard/torch.py`) on top of these answers, with the copies
//! of CPU tensors in Rust (`pack.rs`).

mod pack;

use std::collections::hash_map::DefaultHasher;
use std::fmt::Display;
use std::hash::{Hash, Hasher};

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use reshard::layout::{LayoutSpec, PlacementSpec};
use reshard::plan::{PlanJson, rank_plan as core_rank_plan};
use reshard::{DType, Layout, Mesh, Placement, Plan, PlanOptions, RankPlan, Transfer};

create_exception!(
    reshard,
    ReshardError,
    PyValueError,
    "Bad input to reshard: the message is the command line's, naming the field and the value."
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

/// Non-negative integers from any iterable (list, tuple, `range`, `torch.Size`), with an
/// error naming the field and the item rather than a bare conversion failure.
fn ints<T: for<'a, 'py> FromPyObject<'a, 'py>>(
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
fn describe(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".to_string())
}

/// A placement given as text (`"S(0)"`, `"Shard(-1)"`, `"R"`), as this module's `Shard` /
/// `Replicate`, or as torch's own placement objects, which are recognized by their class name
/// so that torch need not be imported.
fn placement_spec(obj: &Bound<'_, PyAny>) -> PyResult<PlacementSpec> {
    if let Ok(text) = obj.cast::<PyString>() {
        return PlacementSpec::parse(&text.to_cow()?)
            .map_err(|reason| error(format!("placements: {reason}")));
    }
    if let Ok(shard) = obj.cast::<PyShard>() {
        return Ok(PlacementSpec::Shard(shard.get().dim));
    }
    if obj.is_instance_of::<PyReplicate>() {
        return Ok(PlacementSpec::Replicate);
    }
    let class = obj.get_type().name()?.to_string();
    match class.as_str() {
        "Replicate" => Ok(PlacementSpec::Replicate),
        "Shard" => {
            let dim: i64 = obj.getattr("dim").and_then(|d| d.extract()).map_err(|_| {
                error(format!(
                    "placements: {} has no integer `dim`",
                    describe(obj)
                ))
            })?;
            Ok(PlacementSpec::Shard(dim))
        }
        "_StridedShard" => Err(error(format!(
            "placements: {} is not supported: strided sharding (FSDP x TP) interleaves shards, \
             while reshard's Shard(d) holds one contiguous torch.chunk piece",
            describe(obj)
        ))),
        "Partial" | "_Partial" | "_NormPartial" | "MaskPartial" => Err(error(format!(
            "placements: {} is not supported: a pending reduction must be reduced \
             (DTensor.redistribute to Replicate or Shard) before it can be resharded",
            describe(obj)
        ))),
        _ => Err(error(format!(
            "placements: {} is not a placement (expected \"S(d)\", \"R\", Shard(d) or Replicate())",
            describe(obj)
        ))),
    }
}

/// A dtype given by name (`"bf16"`, `"bfloat16"`) or as a `torch.dtype`, whose `str` is
/// `torch.bfloat16`.
fn dtype_of(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    let text = obj.str()?.to_string();
    text.parse::<DType>().map_err(error)
}

/// DTensor may nest the shards of one tensor dim in an order other than mesh-axis order
/// (`DTensorSpec.shard_order`); reshard nests them in mesh-axis order only, so other orders
/// are refused rather than mislaid.
fn check_shard_order(dt: &Bound<'_, PyAny>) -> PyResult<()> {
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

/// `Shard(dim)`: split tensor dim `dim` across the ranks of one mesh axis with the
/// `torch.chunk` rule. Negative dims count from the end, as in torch.
#[pyclass(frozen, eq, hash, module = "reshard", name = "Shard")]
#[derive(Clone, PartialEq, Eq, Hash)]
struct PyShard {
    #[pyo3(get)]
    dim: i64,
}

#[pymethods]
impl PyShard {
    #[new]
    fn new(dim: i64) -> Self {
        PyShard { dim }
    }

    /// As torch's `Placement.is_shard`.
    #[pyo3(signature = (dim = None))]
    fn is_shard(&self, dim: Option<i64>) -> bool {
        dim.is_none_or(|d| d == self.dim)
    }

    fn is_replicate(&self) -> bool {
        false
    }

    fn __repr__(&self) -> String {
        format!("Shard({})", self.dim)
    }

    fn __str__(&self) -> String {
        format!("S({})", self.dim)
    }
}

/// `Replicate()`: every rank along one mesh axis holds the same data.
#[pyclass(frozen, eq, hash, module = "reshard", name = "Replicate")]
#[derive(Clone, PartialEq, Eq, Hash)]
struct PyReplicate {}

#[pymethods]
impl PyReplicate {
    #[new]
    fn new() -> Self {
        PyReplicate {}
    }

    #[pyo3(signature = (dim = None))]
    fn is_shard(&self, dim: Option<i64>) -> bool {
        let _ = dim; // torch's signature; a replica shards no dim
        false
    }

    fn is_replicate(&self) -> bool {
        true
    }

    fn __repr__(&self) -> String {
        "Replicate()".to_string()
    }

    fn __str__(&self) -> String {
        "R".to_string()
    }
}

/// A tensor laid out over a mesh of ranks: which box every rank holds.
#[pyclass(frozen, module = "reshard", name = "Layout")]
struct PyLayout {
    inner: Layout,
}

impl PyLayout {
    fn build(
        shape: Vec<u64>,
        dtype: DType,
        mesh: Vec<usize>,
        ranks: Option<Vec<usize>>,
        placements: &[PlacementSpec],
    ) -> PyResult<PyLayout> {
        let size = mesh
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| error(format!("mesh: {mesh:?} has more than 2^64 positions")))?;
        if ranks.is_none() && size > 1 << 24 {
            return Err(error(format!("mesh: {mesh:?} has more than 2^24 ranks")));
        }
        let ranks = ranks.unwrap_or_else(|| (0..size).collect());
        let mesh = Mesh::new(mesh, ranks).map_err(error)?;
        let placements = placements
            .iter()
            .map(|p| p.resolve(shape.len()))
            .collect::<Result<Vec<Placement>, _>>()
            .map_err(error)?;
        let inner = Layout::new(shape, dtype, mesh, placements).map_err(error)?;
        Ok(PyLayout { inner })
    }

    fn key(&self) -> (&[u64], DType, &[usize], &[usize], &[Placement]) {
        let l = &self.inner;
        (
            l.shape(),
            l.dtype(),
            l.mesh().dims(),
            l.mesh().ranks(),
            l.placements(),
        )
    }
}

fn tuple<'py, T: IntoPyObject<'py> + Copy>(
    py: Python<'py>,
    items: &[T],
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, items.iter().copied())
}

/// A sequence written as Python writes a tuple: `(4,)`, `(8, 8)`.
fn py_tuple<T: Display>(items: &[T]) -> String {
    let parts: Vec<String> = items.iter().map(T::to_string).collect();
    match parts.len() {
        1 => format!("({},)", parts[0]),
        _ => format!("({})", parts.join(", ")),
    }
}

/// Ranks as Python would rebuild them: `range(a, b)` when consecutive, a list otherwise.
fn py_ranks(ranks: &[usize]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(&a), Some(&b)) if ranks.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("range({a}, {})", b + 1)
        }
        _ => format!("{ranks:?}"),
    }
}

#[pymethods]
impl PyLayout {
    /// `Layout(shape, dtype, mesh, ranks, placements)`.
    ///
    /// `mesh` is an int or a sequence of axis sizes; `ranks` the mesh's ranks in row-major
    /// order (`None`: `0..size`); `placements` one per mesh axis, as `"S(0)"`/`"R"`, as
    /// `Shard(0)`/`Replicate()`, or as torch's placement objects (or one string `"S(0),R"`).
    #[new]
    #[pyo3(signature = (shape, dtype, mesh, ranks, placements))]
    fn new(
        shape: &Bound<'_, PyAny>,
        dtype: &Bound<'_, PyAny>,
        mesh: &Bound<'_, PyAny>,
        ranks: &Bound<'_, PyAny>,
        placements: &Bound<'_, PyAny>,
    ) -> PyResult<PyLayout> {
        let shape: Vec<u64> = ints(shape, "shape")?;
        let dtype = dtype_of(dtype)?;
        let mesh: Vec<usize> = match mesh.extract::<usize>() {
            Ok(n) => vec![n],
            Err(_) => ints(mesh, "mesh")?,
        };
        let ranks: Option<Vec<usize>> = if ranks.is_none() {
            None
        } else {
            Some(ints(ranks, "ranks")?)
        };
        let placements: Vec<PlacementSpec> = if let Ok(text) = placements.cast::<PyString>() {
            text.to_cow()?
                .split(',')
                .map(|p| {
                    PlacementSpec::parse(p).map_err(|reason| error(format!("placements: {reason}")))
                })
                .collect::<PyResult<_>>()?
        } else {
            placements
                .try_iter()
                .map_err(|_| {
                    error(format!(
                        "placements: expected a sequence, got {}",
                        describe(placements)
                    ))
                })?
                .map(|p| placement_spec(&p?))
                .collect::<PyResult<_>>()?
        };
        PyLayout::build(shape, dtype, mesh, ranks, &placements)
    }

    /// A layout from the command line's spec (`"mesh=2x4 ranks=8..16 place=R,S(0)"`);
    /// without `ranks=`, the mesh starts at `first_rank`.
    #[staticmethod]
    #[pyo3(signature = (spec, shape, dtype, first_rank = 0))]
    fn from_spec(
        spec: &str,
        shape: &Bound<'_, PyAny>,
        dtype: &Bound<'_, PyAny>,
        first_rank: usize,
    ) -> PyResult<PyLayout> {
        let shape: Vec<u64> = ints(shape, "shape")?;
        let dtype = dtype_of(dtype)?;
        let inner = LayoutSpec::parse(spec)
            .and_then(|s| s.resolve(&shape, dtype, first_rank))
            .map_err(error)?;
        Ok(PyLayout { inner })
    }

    /// The layout of a DTensor: its global shape and dtype, its device mesh's shape and
    /// global ranks, its placements.
    #[staticmethod]
    fn from_dtensor(dt: &Bound<'_, PyAny>) -> PyResult<PyLayout> {
        let shape: Vec<u64> = ints(&dt.getattr("shape")?, "shape")?;
        let dtype = dtype_of(&dt.getattr("dtype")?)?;
        let device_mesh = dt.getattr("device_mesh")?;
        let mesh: Vec<usize> = ints(&device_mesh.getattr("shape")?, "mesh")?;
        let ranks = device_mesh
            .getattr("mesh")?
            .call_method0("flatten")?
            .call_method0("tolist")?;
        let ranks: Vec<usize> = ints(&ranks, "ranks")?;
        check_shard_order(dt)?;
        let placements = dt
            .getattr("placements")?
            .try_iter()?
            .map(|p| placement_spec(&p?))
            .collect::<PyResult<Vec<_>>>()?;
        PyLayout::build(shape, dtype, mesh, Some(ranks), &placements)
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple(py, self.inner.shape())
    }

    /// The canonical short name: `bf16`, `f32`, `fp8e4m3`, ...
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }

    #[getter]
    fn elem_bytes(&self) -> usize {
        self.inner.dtype().size()
    }

    #[getter]
    fn ndim(&self) -> usize {
        self.inner.ndim()
    }

    #[getter]
    fn mesh<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple(py, self.inner.mesh().dims())
    }

    /// The mesh's ranks in row-major order.
    #[getter]
    fn ranks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple(py, self.inner.mesh().ranks())
    }

    /// One `Shard(d)` (d resolved to be non-negative) or `Replicate()` per mesh axis.
    #[getter]
    fn placements<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items = self
            .inner
            .placements()
            .iter()
            .map(|p| match *p {
                Placement::Shard(d) => {
                    Bound::new(py, PyShard { dim: d as i64 }).map(Bound::into_any)
                }
                Placement::Replicate => Bound::new(py, PyReplicate {}).map(Bound::into_any),
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)
    }

    /// `(offset, extent)` of the box `rank` holds, in global coordinates, or `None` if
    /// `rank` is not in the mesh. An extent with a 0 is an empty (legal) shard.
    fn local_region<'py>(
        &self,
        py: Python<'py>,
        rank: usize,
    ) -> PyResult<Option<(Bound<'py, PyTuple>, Bound<'py, PyTuple>)>> {
        self.inner
            .local_region(rank)
            .map(|r| Ok((tuple(py, &r.offset)?, tuple(py, &r.extent)?)))
            .transpose()
    }

    /// The shape of `rank`'s local tensor, or `None` if `rank` is not in the mesh.
    fn local_shape<'py>(
        &self,
        py: Python<'py>,
        rank: usize,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        self.inner
            .local_region(rank)
            .map(|r| tuple(py, &r.extent))
            .transpose()
    }

    /// The command line's spec of this layout (`mesh=4 ranks=0..4 place=S(0)`).
    #[getter]
    fn spec(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        let placements: Vec<String> = l
            .placements()
            .iter()
            .map(|p| match p {
                Placement::Shard(d) => format!("Shard({d})"),
                Placement::Replicate => "Replicate()".to_string(),
            })
            .collect();
        format!(
            "Layout(shape={}, dtype='{}', mesh={}, ranks={}, placements=[{}])",
            py_tuple(l.shape()),
            l.dtype(),
            py_tuple(l.mesh().dims()),
            py_ranks(l.mesh().ranks()),
            placements.join(", ")
        )
    }

    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyLayout>()
            .is_ok_and(|o| self.key() == o.get().key())
    }

    fn __hash__(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.key().hash(&mut h);
        h.finish()
    }
}

/// One box moved from rank `src` to rank `dst` (`src == dst`: a local copy), in global
/// coordinates.
#[pyclass(frozen, eq, ord, hash, module = "reshard", name = "Transfer")]
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct PyTransfer {
    inner: Transfer,
    bytes: u64,
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
struct PyRankPlan {
    inner: RankPlan,
    elem_bytes: usize,
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
struct PyPlan {
    inner: Plan,
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
fn plan(
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
fn rank_plan(
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

/// A whole-model refit: every parameter of a model with its training (Megatron-LM) and
/// inference (vLLM) layouts, and the fused buffers of both sides, from the core's model rules.
#[pyclass(frozen, module = "reshard", name = "Refit")]
struct PyRefit {
    inner: reshard::model::Refit,
    /// Tensor index by name.
    index: std::collections::HashMap<String, usize>,
    options: PlanOptions,
}

impl PyRefit {
    fn tensor(&self, name: &str) -> PyResult<&reshard::model::RefitTensor> {
        self.index
            .get(name)
            .map(|&i| &self.inner.tensors[i])
            .ok_or_else(|| {
                ReshardError::new_err(format!(
                    "name: `{name}` is not a parameter of {} (see Refit.names)",
                    self.inner.model
                ))
            })
    }

    /// `fused`'s members on `rank` of one side: (member name, dim, offset, extent).
    fn members(
        &self,
        fused: &reshard::model::Fused,
        side: reshard::Side,
        rank: usize,
    ) -> Option<Vec<(String, usize, u64, u64)>> {
        let layouts = self.inner.member_layouts(fused, |t| match side {
            reshard::Side::Src => &t.src,
            reshard::Side::Dst => &t.dst,
        });
        let offsets = fused.local_offsets(&layouts, rank)?;
        Some(
            fused
                .members
                .iter()
                .zip(layouts.iter().zip(offsets))
                .map(|(&m, (l, offset))| {
                    let extent = l.local_region(rank).map_or(0, |r| r.extent[fused.dim]);
                    (
                        self.inner.tensors[m].name.clone(),
                        fused.dim,
                        offset,
                        extent,
                    )
                })
                .collect(),
        )
    }
}

#[pymethods]
impl PyRefit {
    /// `model`: a shipped model's name (`qwen3-0.6b`, `deepseek-v3`, ...), an HF
    /// `config.json` or a checkpoint folder; `train` and `infer`: the parallelism as on the
    /// command line (`"tp=2,pp=2"`, `"tp=4"`); `overrides`: `[train:|infer:]GLOB=KIND` rules
    /// applied before the defaults. Raises `ReshardError` with the command line's message.
    #[new]
    #[pyo3(signature = (model, train, infer, colocated = false, overrides = Vec::new(), min_split_bytes = None))]
    fn new(
        model: &Bound<'_, PyAny>,
        train: &str,
        infer: &str,
        colocated: bool,
        overrides: Vec<String>,
        min_split_bytes: Option<u64>,
    ) -> PyResult<PyRefit> {
        use reshard::model::{Inference, Model, Ranks, Refit, Rules, Training};
        // a str or an os.PathLike
        let model = model.str()?.to_string();
        let rules = overrides
            .iter()
            .try_fold(Rules::default(), |r, o| r.with_override_text(o))
            .map_err(error)?;
        let train = Training::parse(train).map_err(error)?;
        let infer = Inference::parse(infer).map_err(error)?;
        let loaded = Model::load(&model).map_err(error)?;
        let ranks = if colocated {
            Ranks::Colocated
        } else {
            Ranks::Disjoint
        };
        let inner = Refit::new(&loaded, &train, &infer, &rules, ranks).map_err(error)?;
        let index = inner
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(PyRefit {
            inner,
            index,
            options: plan_options(min_split_bytes),
        })
    }

    /// The model's name.
    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }

    /// Every parameter's name (HF names; routed experts stacked per projection).
    #[getter]
    fn names(&self) -> Vec<String> {
        self.inner.tensors.iter().map(|t| t.name.clone()).collect()
    }

    /// The number of training ranks and of inference ranks, and the first inference rank.
    #[getter]
    fn train_ranks(&self) -> usize {
        self.inner.train_ranks
    }

    #[getter]
    fn infer_ranks(&self) -> usize {
        self.inner.infer_ranks
    }

    #[getter]
    fn infer_base(&self) -> usize {
        self.inner.infer_base
    }

    /// Every rank of either side, counted once.
    #[getter]
    fn world(&self) -> usize {
        self.inner.world()
    }

    /// `(src, dst)`: the parameter's training and inference layouts.
    fn layouts(&self, name: &str) -> PyResult<(PyLayout, PyLayout)> {
        let t = self.tensor(name)?;
        Ok((
            PyLayout {
                inner: t.src.clone(),
            },
            PyLayout {
                inner: t.dst.clone(),
            },
        ))
    }

    /// The parameters `rank` takes part in: those it holds a training or an inference shard
    /// of (what it sends, receives or copies), in model order.
    fn rank_names(&self, rank: usize) -> Vec<String> {
        self.inner
            .tensors
            .iter()
            .filter(|t| t.src.mesh().contains(rank) || t.dst.mesh().contains(rank))
            .map(|t| t.name.clone())
            .collect()
    }

    /// vLLM's fused buffers that `rank` holds (`qkv_proj`, `gate_up_proj`, the experts'
    /// `w13`): buffer name -> `[(member name, dim, offset, extent)]`, each member's local
    /// shard lying at `offset` along `dim` of the rank's buffer, `extent` long.
    #[pyo3(signature = (rank, side = "infer"))]
    fn fused<'py>(&self, py: Python<'py>, rank: usize, side: &str) -> PyResult<Bound<'py, PyDict>> {
        let (side, all) = match side {
            "infer" => (reshard::Side::Dst, &self.inner.dst_fused),
            "train" => (reshard::Side::Src, &self.inner.src_fused),
            other => {
                return Err(ReshardError::new_err(format!(
                    "side: `{other}` is invalid: expected `train` or `infer`"
                )));
            }
        };
        let out = PyDict::new(py);
        for f in all {
            if let Some(members) = self.members(f, side, rank) {
                out.set_item(&f.name, members)?;
            }
        }
        Ok(out)
    }

    /// The numbers of `reshard refit --json` (bytes, messages, both methods, planning time).
    fn totals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let totals = self.inner.summary(&self.options).map_err(error)?;
        let json = serde_json::to_string(&reshard::model::RefitJson::of(&self.inner, &totals))
            .map_err(error)?;
        py.import("json")?.call_method1("loads", (json,))
    }

    fn __len__(&self) -> usize {
        self.inner.tensors.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Refit(model={:?}, tensors={}, train_ranks={}, infer_ranks={}, infer_base={})",
            self.inner.model,
            self.inner.tensors.len(),
            self.inner.train_ranks,
            self.inner.infer_ranks,
            self.inner.infer_base
        )
    }
}

/// The CRC-32C of each `(start, length)` piece of `tensor`, a contiguous 1-D `torch.uint8`
/// tensor in CPU memory (a packed message of the torch executor): the sums that travel with
/// a message under `checksum=True`, the same CRC-32C as the command line's `--checksum`.
/// The tensor is read in place (no copy), so everything about it is checked first, and a
/// piece outside it is refused.
#[pyfunction]
fn crc32c(tensor: &Bound<'_, PyAny>, pieces: Vec<(usize, usize)>) -> PyResult<Vec<u32>> {
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
        .map(|&(start, n)| reshard::checksum::bytes_sum(&bytes[start..start + n]))
        .collect())
}

/// Layouts, plans and errors of `reshard`, from its Rust core.
#[pymodule]
mod _core {
    #[pymodule_export]
    use super::pack::Packing;
    #[pymodule_export]
    use super::{
        PyLayout, PyPlan, PyRankPlan, PyRefit, PyReplicate, PyShard, PyTransfer, ReshardError,
        crc32c, plan, rank_plan,
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
