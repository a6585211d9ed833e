//! `Layout`, `Shard` and `Replicate`: a tensor's placement over a mesh of ranks.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use reshard_core::layout::{LayoutSpec, PlacementSpec};
use reshard_core::{DType, Layout, Mesh, Placement};

use crate::error;
use crate::values::*;

/// `Shard(dim)`: split tensor dim `dim` across the ranks of one mesh axis with the
/// `torch.chunk` rule. Negative dims count from the end, as in torch.
#[pyclass(frozen, eq, hash, module = "reshard", name = "Shard")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct PyShard {
    #[pyo3(get)]
    pub(crate) dim: i64,
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
pub(crate) struct PyReplicate {}

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
pub(crate) struct PyLayout {
    pub(crate) inner: Layout,
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
    /// global ranks, its placements. FSDP2 x TP's `_StridedShard` (shards taken right to
    /// left) is the layout of plain shards over the mesh with its axes swapped, the ranks
    /// permuted with them (`reshard.torch.dtensor_layout`, which checks every rank's box).
    #[staticmethod]
    fn from_dtensor(dt: &Bound<'_, PyAny>) -> PyResult<PyLayout> {
        let strided = dt.getattr("placements")?.try_iter()?.any(|p| {
            p.ok()
                .and_then(|p| p.get_type().name().ok().map(|n| n.to_string()))
                .is_some_and(|n| n == "_StridedShard")
        });
        if strided {
            let layout = dt
                .py()
                .import("reshard.dtensor")?
                .call_method1("layout_of", (dt,))?;
            let layout = layout.cast::<PyLayout>()?.get();
            return Ok(PyLayout {
                inner: layout.inner.clone(),
            });
        }
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

    /// The replicas of the whole tensor: for each, the ranks that together hold one copy
    /// of it (ranks that differ only along `Replicate()` axes hold different replicas), in
    /// mesh order.
    #[getter]
    fn replicas(&self) -> Vec<Vec<usize>> {
        self.inner.replicas()
    }

    /// As a destination, the commit groups of a staged refit's rolling commit in `rolling`
    /// groups (`run --stage --rolling`): lists of ranks, each group whole replicas, the
    /// replicas in order of their lowest rank. Raises `ReshardError` naming the replica that
    /// `rolling` would cut and the groups it would fall into.
    fn rolling_groups(&self, rolling: usize) -> PyResult<Vec<Vec<usize>>> {
        reshard_core::rolling::rolling_groups(&self.inner.replicas(), rolling).map_err(error)
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

/// A placement given as text (`"S(0)"`, `"Shard(-1)"`, `"R"`), as this module's `Shard` /
/// `Replicate`, or as torch's own placement objects, which are recognized by their class name
/// so that torch need not be imported.
pub(crate) fn placement_spec(obj: &Bound<'_, PyAny>) -> PyResult<PlacementSpec> {
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
            "placements: {} is a DTensor's own: give the DTensor (Layout.from_dtensor), whose \
             mesh says how its shards are ordered",
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
