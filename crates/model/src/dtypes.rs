//! A refit with a precision change: the training side's dtype and the inference side's dtype
//! chosen apart from the model config's (`torch_dtype`), as when fp32 master weights go to a
//! bf16 engine. Only float dtypes convert (f64, f32, bf16, f16: the casts torch's `.to()`
//! rounds to nearest even); fp8 comes only with a scheme ([`Refit::quantized`]), so a
//! side's dtype is one of those four.
//!
//! The plan then prices wire bytes (the sender converts while it packs, so a transfer carries
//! the inference dtype) and gather+broadcast the training dtype (it moves the tensor as held
//! and each receiver converts its box afterwards).

use reshard_core::dtype::DType;
use reshard_core::error::Field;

use crate::error::ModelError;
use reshard_core::layout::Layout;

use super::refit::Refit;

/// The dtypes a refit side may hold: those the float casts convert between.
pub const REFIT_DTYPES: [DType; 4] = [DType::F64, DType::F32, DType::Bf16, DType::F16];

/// Parses `text` as a refit side's dtype (`field` says which side, for the error):
/// `f32`, `float32`, `torch.bfloat16`, ... of [`REFIT_DTYPES`].
///
/// ```
/// use reshard_core::{DType, error::Field};
/// use reshard_model::refit_dtype;
/// assert_eq!(refit_dtype(Field::TrainDType, "float32").unwrap(), DType::F32);
/// let err = refit_dtype(Field::InferDType, "i8").unwrap_err().to_string();
/// assert!(err.starts_with("infer_dtype: `i8`: "), "{err}");
/// ```
pub fn refit_dtype(field: Field, text: &str) -> Result<DType, ModelError> {
    let invalid = |reason: String| ModelError::DType {
        field,
        value: text.to_string(),
        reason,
    };
    let names = || {
        REFIT_DTYPES
            .iter()
            .map(DType::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let dtype: DType = text.parse().map_err(|_| {
        invalid(format!(
            "not a dtype; a refit side holds one of {}",
            names()
        ))
    })?;
    if !REFIT_DTYPES.contains(&dtype) {
        return Err(invalid(format!(
            "a refit converts between float dtypes only ({}); fp8 inference weights come from {}",
            names(),
            Field::InferQuant
        )));
    }
    Ok(dtype)
}

impl Refit {
    /// The same refit with every tensor's training side held in `train` and its inference
    /// side in `infer` (`None` keeps the model's dtype on that side): `Some(F32), None`
    /// refits fp32 master weights into a bf16 engine. Either dtype must be one of
    /// [`REFIT_DTYPES`].
    ///
    /// A refit already [`Refit::quantized`] is quantized again from the new training dtype;
    /// the weights the engine keeps in fp8 stay fp8 and only the others (norms, embeddings,
    /// lm_head) take `infer`, so the two calls may come in either order.
    ///
    /// ```
    /// use reshard_core::DType;
    /// use reshard_model::{Inference, Model, Ranks, Refit, Rules, Training};
    /// let model = Model::load("qwen3-0.6b").unwrap();
    /// let refit = Refit::new(&model, &Training::parse("tp=2").unwrap(),
    ///     &Inference::parse("tp=2").unwrap(), &Rules::default(), Ranks::Disjoint).unwrap()
    ///     .with_dtypes(Some(DType::F32), None).unwrap();
    /// assert_eq!((refit.train_dtype(), refit.infer_dtype()), (Some(DType::F32), Some(DType::Bf16)));
    /// // the weights are counted as training holds them
    /// assert_eq!(refit.weight_bytes(), 2 * model.weight_bytes());
    /// ```
    pub fn with_dtypes(
        mut self,
        train: Option<DType>,
        infer: Option<DType>,
    ) -> Result<Refit, ModelError> {
        for (field, dtype) in [(Field::TrainDType, train), (Field::InferDType, infer)] {
            if let Some(d) = dtype.filter(|d| !REFIT_DTYPES.contains(d)) {
                return refit_dtype(field, &d.to_string()).map(|_| self);
            }
        }
        let quantized: Vec<bool> = (0..self.tensors.len())
            .map(|i| self.quant_plan(i).is_some())
            .collect();
        let quant = self.quant.take().map(|q| q.spec);
        for (t, quantized) in self.tensors.iter_mut().zip(quantized) {
            if let Some(d) = train {
                t.src = retyped(&t.src, d).map_err(|source| ModelError::Layout {
                    tensor: t.name.clone(),
                    side: Field::Train,
                    source,
                })?;
            }
            // the fp8 weights of a quantized refit get a float layout here, and their fp8
            // layout again when quantized below
            let to = match (infer, quantized) {
                (Some(d), _) => d,
                (None, true) => t.src.dtype(),
                (None, false) => t.dst.dtype(),
            };
            t.dst = retyped(&t.dst, to).map_err(|source| ModelError::Layout {
                tensor: t.name.clone(),
                side: Field::Infer,
                source,
            })?;
        }
        match quant {
            Some(q) => self.quantized(&q),
            None => Ok(self),
        }
    }

    /// The training side's dtype, if every tensor has the same (a checkpoint folder's
    /// tensors may differ).
    pub fn train_dtype(&self) -> Option<DType> {
        one(self.tensors.iter().map(|t| t.src.dtype()))
    }

    /// The inference side's dtype of the tensors the refit does not quantize, if they all
    /// have the same (the quantized ones are the fp8 of [`Refit::quant`]).
    pub fn infer_dtype(&self) -> Option<DType> {
        one(self
            .tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| self.quant_plan(*i).is_none())
            .map(|(_, t)| t.dst.dtype()))
    }
}

/// The one value of `dtypes`, or `None` if they differ or there are none.
fn one(mut dtypes: impl Iterator<Item = DType>) -> Option<DType> {
    let first = dtypes.next()?;
    dtypes.all(|d| d == first).then_some(first)
}

/// `layout` holding elements of `dtype`: a larger element may pass the byte limits.
fn retyped(layout: &Layout, dtype: DType) -> Result<Layout, reshard_core::error::LayoutError> {
    if layout.dtype() == dtype {
        return Ok(layout.clone());
    }
    Layout::new(
        layout.shape().to_vec(),
        dtype,
        layout.mesh().clone(),
        layout.placements().to_vec(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{InferQuant, Inference, Model, Ranks, Rules, Training};

    fn refit(train: &str, infer: &str) -> Refit {
        Refit::new(
            &Model::load("qwen3-0.6b").unwrap(),
            &Training::parse(train).unwrap(),
            &Inference::parse(infer).unwrap(),
            &Rules::default(),
            Ranks::Disjoint,
        )
        .unwrap()
    }

    #[test]
    fn only_float_dtypes_are_refit_sides() {
        for (text, want) in [
            ("f64", DType::F64),
            ("fp16", DType::F16),
            ("bf16", DType::Bf16),
        ] {
            assert_eq!(refit_dtype(Field::TrainDType, text).unwrap(), want);
        }
        for text in ["i32", "fp8e4m3", "bool", "u8"] {
            let err = refit_dtype(Field::TrainDType, text)
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with(&format!("train_dtype: `{text}`: ")),
                "{err}"
            );
            assert!(err.contains("float dtypes only"), "{err}");
        }
        let err = refit_dtype(Field::InferDType, "f33")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("infer_dtype: `f33`: not a dtype"), "{err}");
        // the library call refuses them too, naming the side
        let err = refit("tp=2", "tp=2")
            .with_dtypes(None, Some(DType::I8))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("infer_dtype: `i8`: "), "{err}");
    }

    /// f32 training weights into a bf16 engine: the plan moves half the bytes of an f32
    /// refit, gather+broadcast all of the f32.
    #[test]
    fn the_wire_carries_the_inference_dtype() {
        let options = Default::default();
        let bf16 = refit("tp=2", "tp=2").summary(&options).unwrap();
        let mixed = refit("tp=2", "tp=2")
            .with_dtypes(Some(DType::F32), None)
            .unwrap();
        let cast = mixed.summary(&options).unwrap();
        let f32 = refit("tp=2", "tp=2")
            .with_dtypes(Some(DType::F32), Some(DType::F32))
            .unwrap()
            .summary(&options)
            .unwrap();
        assert_eq!(cast.bytes_remote, bf16.bytes_remote);
        assert_eq!(f32.bytes_remote, 2 * bf16.bytes_remote);
        assert_eq!(cast.max_rank_recv_bytes, bf16.max_rank_recv_bytes);
        assert_eq!(cast.gather_broadcast_bytes, f32.gather_broadcast_bytes);
        assert_eq!(cast.weight_bytes, 2 * bf16.weight_bytes);
        assert_eq!(
            (mixed.train_dtype(), mixed.infer_dtype()),
            (Some(DType::F32), Some(DType::Bf16))
        );
    }

    /// With fp8 weights the engine's other tensors take the inference dtype, the quantized
    /// ones stay fp8 whichever call comes first, and quantize from the training dtype.
    #[test]
    fn quantized_refits_keep_their_fp8_weights() {
        let q = InferQuant::parse("fp8-block").unwrap().unwrap();
        let before = refit("tp=2", "tp=2")
            .quantized(&q)
            .unwrap()
            .with_dtypes(Some(DType::F32), Some(DType::F16))
            .unwrap();
        let after = refit("tp=2", "tp=2")
            .with_dtypes(Some(DType::F32), Some(DType::F16))
            .unwrap()
            .quantized(&q)
            .unwrap();
        for r in [&before, &after] {
            let quant = r.quant.as_ref().unwrap();
            assert!(quant.tensors() > 0);
            for (i, t) in r.tensors.iter().enumerate() {
                assert_eq!(t.src.dtype(), DType::F32, "{}", t.name);
                let want = match r.quant_plan(i) {
                    Some(_) => DType::Fp8E4M3,
                    None => DType::F16,
                };
                assert_eq!(t.dst.dtype(), want, "{}", t.name);
            }
            assert_eq!(r.infer_dtype(), Some(DType::F16));
        }
        assert_eq!(
            before.quant.unwrap().scales.len(),
            after.quant.unwrap().scales.len()
        );
    }
}
