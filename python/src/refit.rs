//! `Refit`: a whole model's parameters with their training and inference layouts.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use reshard_core::PlanOptions;

use crate::layout::*;
use crate::{error, plan_options};

/// A whole-model refit: every parameter of a model with its training (Megatron-LM) and
/// inference (vLLM) layouts, and the fused buffers of both sides, from the core's model rules.
#[pyclass(frozen, module = "reshard", name = "Refit")]
pub(crate) struct PyRefit {
    pub(crate) inner: reshard_model::Refit,
    /// Tensor index by name.
    pub(crate) index: std::collections::HashMap<String, usize>,
    pub(crate) options: PlanOptions,
}

impl PyRefit {
    fn tensor(&self, name: &str) -> PyResult<&reshard_model::RefitTensor> {
        self.index
            .get(name)
            .map(|&i| &self.inner.tensors[i])
            .ok_or_else(|| {
                error(format!(
                    "name: `{name}` is not a parameter of {} (see Refit.names)",
                    self.inner.model
                ))
            })
    }

    /// `fused`'s members on `rank` of one side: (member name, dim, offset, extent).
    fn members(
        &self,
        fused: &reshard_model::Fused,
        side: reshard_core::Side,
        rank: usize,
    ) -> Option<Vec<(String, usize, u64, u64)>> {
        let layouts = self.inner.member_layouts(fused, |t| match side {
            reshard_core::Side::Src => &t.src,
            reshard_core::Side::Dst => &t.dst,
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
    /// applied before the defaults. Raises `ArgumentError` with the command line's message.
    #[new]
    ///
    /// `infer_quant`: the inference side's fp8 weights as `refit --infer-quant` takes them
    /// (`"fp8-block"`, `"fp8-block:128x128"`, `"none"`); by default the model config's
    /// `quantization_config`, if any. Quantized weights get an fp8 inference layout and a
    /// scale tensor each (`Refit.scales`).
    ///
    /// `train_dtype`, `infer_dtype`: each side's dtype (`"f32"`, `torch.float32`; float dtypes
    /// only: f64, f32, bf16, f16), as `refit --train-dtype` / `--infer-dtype` take them; by
    /// default the model config's; a config that gives none (transformers 5 leaves it out of
    /// a fresh config) needs `train_dtype`, and both sides then hold it unless `infer_dtype`
    /// says otherwise. The weights move in `infer_dtype`, converted by their
    /// senders; with `infer_quant`, the fp8 weights are quantized from `train_dtype` and the
    /// others take `infer_dtype`.
    #[pyo3(signature = (model, train, infer, colocated = false, overrides = Vec::new(), min_split_bytes = None, infer_quant = None, train_dtype = None, infer_dtype = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: &Bound<'_, PyAny>,
        train: &str,
        infer: &str,
        colocated: bool,
        overrides: Vec<String>,
        min_split_bytes: Option<u64>,
        infer_quant: Option<&str>,
        train_dtype: Option<&Bound<'_, PyAny>>,
        infer_dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRefit> {
        use reshard_model::{InferQuant, Inference, Model, Ranks, Refit, Rules, Training};
        // a str or an os.PathLike
        let model = model.str()?.to_string();
        // a name or a torch.dtype (whose str is `torch.float32`)
        let dtype = |field, obj: Option<&Bound<'_, PyAny>>| -> PyResult<_> {
            obj.map(|o| {
                let text = o.str()?.to_string();
                reshard_model::refit_dtype(field, &text).map_err(error)
            })
            .transpose()
        };
        let train_dtype = dtype(reshard_core::error::Field::TrainDType, train_dtype)?;
        let infer_dtype = dtype(reshard_core::error::Field::InferDType, infer_dtype)?;
        let rules = overrides
            .iter()
            .try_fold(Rules::default(), |r, o| r.with_override_text(o))
            .map_err(error)?;
        let train = Training::parse(train).map_err(error)?;
        let infer = Inference::parse(infer).map_err(error)?;
        // a config without a dtype (transformers 5 leaves it out) is the training dtype's
        let loaded = Model::load_with_dtype(&model, train_dtype).map_err(error)?;
        let ranks = if colocated {
            Ranks::Colocated
        } else {
            Ranks::Disjoint
        };
        let mut inner = Refit::new(&loaded, &train, &infer, &rules, ranks)
            .and_then(|r| r.with_dtypes(train_dtype, infer_dtype))
            .map_err(error)?;
        let quant = match infer_quant {
            Some(text) => InferQuant::parse(text).map_err(error)?,
            None => loaded.quant.clone(),
        };
        if let Some(q) = &quant {
            inner = inner.quantized(q).map_err(error)?;
        }
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

    /// The inference replicas: for each, the inference ranks that together hold one copy of
    /// every parameter and serve as one (an engine's `tp x pp` ranks, joined where a
    /// parameter's copy spans engines, as experts split over `tp x dp` do), in rank order.
    #[getter]
    fn replicas(&self) -> Vec<Vec<usize>> {
        self.inner.replicas()
    }

    /// The commit groups of a staged refit's rolling commit in `rolling` groups (`refit
    /// --run --stage --rolling`): lists of ranks, each group whole replicas. Raises
    /// `ReshardError` naming the replica that `rolling` would cut and the groups it would
    /// fall into.
    fn rolling_groups(&self, rolling: usize) -> PyResult<Vec<Vec<usize>>> {
        self.inner.rolling_groups(rolling).map_err(error)
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
            "infer" => (reshard_core::Side::Dst, &self.inner.dst_fused),
            "train" => (reshard_core::Side::Src, &self.inner.src_fused),
            other => {
                return Err(error(format!(
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

    /// The quantization scheme of the fp8 weights (`"block:128x128"`), None without one.
    #[getter]
    fn quant(&self) -> Option<String> {
        self.inner
            .quant
            .as_ref()
            .map(|q| q.spec.scheme().to_string())
    }

    /// Every quantized weight's scale tensor: weight name -> `(scale name, scale shape)`,
    /// the scale under vLLM's name (`X.weight_scale_inv`, `...experts.w2_weight_scale_inv`).
    #[getter]
    fn scales<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        if let Some(q) = &self.inner.quant {
            for s in &q.scales {
                let weight = &self.inner.tensors[s.tensor].name;
                out.set_item(weight, (s.name.clone(), s.shape.clone()))?;
            }
        }
        Ok(out)
    }

    /// The fused scale buffers an inference `rank` holds (`qkv_proj.weight_scale_inv`,
    /// `w13_weight_scale_inv`): buffer name -> `[(member weight name, dim, offset, extent)]`,
    /// each member's scale shard at `offset` along `dim` of the rank's buffer, in blocks.
    fn scale_fused<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let Some(q) = &self.inner.quant else {
            return Ok(out);
        };
        let block = q.spec.block;
        for f in &self.inner.dst_fused {
            let name = reshard_model::scale_name(&f.name);
            if !q.fused.iter().any(|g| g.name == name) {
                continue;
            }
            let Some(members) = self.members(f, reshard_core::Side::Dst, rank) else {
                continue;
            };
            let ndim = self.inner.tensors[f.members[0]].dst.ndim();
            let b = match ndim - f.dim {
                2 => block[0],
                1 => block[1],
                _ => 1,
            };
            let members: Vec<_> = members
                .into_iter()
                .map(|(m, dim, offset, extent)| (m, dim, offset / b, extent.div_ceil(b)))
                .collect();
            out.set_item(name, members)?;
        }
        Ok(out)
    }

    /// Compares a trainer's or an engine's parameters with this refit, so that a misread
    /// config moves no bytes: `tensors` maps names to tensors (anything with `.shape` and
    /// `.dtype`: a `state_dict()`, `dict(named_parameters())`). Without `rank`, they are whole
    /// tensors (a DTensor's shape is its global one) and a fused buffer of `side`
    /// (`gate_up_proj`, `w13_weight`, `linear_fc1`) stands for its members; with `rank`,
    /// they are that rank's local shards, as `reshard_many_` takes them. Raises
    /// `ArgumentError` naming the first difference: a name the refit does not have, a
    /// parameter missing, a shape or a dtype.
    #[pyo3(signature = (tensors, side = "train", rank = None))]
    fn check(&self, tensors: &Bound<'_, PyDict>, side: &str, rank: Option<usize>) -> PyResult<()> {
        let (all, of): (_, fn(&reshard_model::RefitTensor) -> &reshard_core::Layout) = match side {
            "train" => (&self.inner.src_fused, |t| &t.src),
            "infer" => (&self.inner.dst_fused, |t| &t.dst),
            other => {
                return Err(error(format!(
                    "side: `{other}` is invalid: expected `train` or `infer`"
                )));
            }
        };
        let model = &self.inner.model;
        // the expected shape of a member on this side: global, or its shard on `rank`
        let expect = |layout: &reshard_core::Layout| -> Option<Vec<u64>> {
            match rank {
                None => Some(layout.shape().to_vec()),
                Some(r) => layout.local_region(r).map(|b| b.extent.to_vec()),
            }
        };
        let mut covered = vec![false; self.inner.tensors.len()];
        let mut names: Vec<(String, Bound<'_, PyAny>)> = tensors
            .iter()
            .map(|(k, v)| Ok((k.extract::<String>()?, v)))
            .collect::<PyResult<_>>()?;
        names.sort_by(|a, b| a.0.cmp(&b.0));
        let at = rank.map_or(String::new(), |r| format!(" on rank {r}"));
        for (name, tensor) in &names {
            let (members, want): (Vec<usize>, Option<Vec<u64>>) = if let Some(&i) =
                self.index.get(name)
            {
                (vec![i], expect(of(&self.inner.tensors[i])))
            } else if let Some(f) = all.iter().find(|f| &f.name == name) {
                let shapes: Vec<Option<Vec<u64>>> = f
                    .members
                    .iter()
                    .map(|&m| expect(of(&self.inner.tensors[m])))
                    .collect();
                let want = shapes.into_iter().try_fold(None::<Vec<u64>>, |acc, s| {
                    let s = s?;
                    Some(Some(match acc {
                        None => s,
                        Some(mut a) => {
                            a[f.dim] += s[f.dim];
                            a
                        }
                    }))
                });
                (f.members.clone(), want.flatten())
            } else {
                return Err(error(format!(
                    "tensors: {name} is neither a parameter of {model} nor a fused buffer of its {side} side (see Refit.names and Refit.fused): the config may not describe this model"
                )));
            };
            let Some(want) = want else {
                return Err(error(format!(
                    "tensors: {name}: rank {} holds no shard of it on the {side} side, yet a tensor was given",
                    rank.unwrap_or(0)
                )));
            };
            let shape: Vec<u64> = tensor.getattr("shape")?.extract()?;
            if shape != want {
                return Err(error(format!(
                    "tensors: {name}: shape {shape:?}, but the refit of {model} has {want:?} on the {side} side{at}: the config may not describe this model"
                )));
            }
            let dtype = crate::values::dtype_of(&tensor.getattr("dtype")?)?;
            let layout = of(&self.inner.tensors[members[0]]);
            if dtype != layout.dtype() {
                return Err(error(format!(
                    "tensors: {name}: dtype {dtype}, but the refit of {model} holds {} on the {side} side (give Refit(..., {side}_dtype=...))",
                    layout.dtype()
                )));
            }
            members.iter().for_each(|&m| covered[m] = true);
        }
        let missing = self
            .inner
            .tensors
            .iter()
            .zip(&covered)
            .find(|(t, c)| !**c && rank.is_none_or(|r| of(t).mesh().contains(r)));
        if let Some((t, _)) = missing {
            return Err(error(format!(
                "tensors: {} is a parameter of {model} on the {side} side{at}, but none was given: the config may not describe this model",
                t.name
            )));
        }
        Ok(())
    }

    /// The numbers of `reshard refit --json` (bytes, messages, both methods, planning time).
    fn totals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let totals = self.inner.summary(&self.options).map_err(error)?;
        let json = serde_json::to_string(&reshard_model::RefitJson::of(&self.inner, &totals))
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
