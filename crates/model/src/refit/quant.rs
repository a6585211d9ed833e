//! A refit into an fp8 engine ([`Refit::quantized`]): which weights become fp8, their scale
//! tensors and fused scale buffers, checked against the engine's blocks before anything is
//! planned.

use reshard_core::DType;
use reshard_core::convert::ConvertError;
use reshard_core::error::Side;
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::QuantPlan;
use reshard_core::region::Region;

use super::Refit;
use crate::error::ModelError;
use crate::fused::Fused;
use crate::quant::{InferQuant, scale_name};

/// The scale tensor of one quantized weight.
#[derive(Clone, Debug)]
pub struct RefitScale {
    /// The engine's name ([`scale_name`]).
    pub name: String,
    /// The weight (an index into the refit's tensors).
    pub tensor: usize,
    /// The block grid: `[..., ceil(rows/R), ceil(cols/C)]`.
    pub shape: Vec<u64>,
}

/// The quantization of a refit ([`Refit::quantized`]).
#[derive(Clone, Debug)]
pub struct RefitQuant {
    /// The engine's quantization: fp8 dtype, block size and the modules it leaves alone.
    pub spec: InferQuant,
    /// For every tensor of the refit, its quantization if the engine keeps it in fp8.
    pub plans: Vec<Option<QuantPlan>>,
    /// One per quantized weight, in tensor order.
    pub scales: Vec<RefitScale>,
    /// The fused scale buffers of the inference side (members index `scales`), named after
    /// their weights' fused buffers.
    pub fused: Vec<Fused>,
}

impl RefitQuant {
    /// How many weights are quantized.
    pub fn tensors(&self) -> usize {
        self.scales.len()
    }

    /// The box of the scale grid inference rank `rank` holds of scale tensor `scale`, if it
    /// holds the weight: its shard's blocks, row-major in its `weight_scale_inv` shard.
    pub fn scale_region(&self, refit: &Refit, scale: usize, rank: Rank) -> Option<Region> {
        let s = &self.scales[scale];
        let plan = self.plans[s.tensor].as_ref()?;
        plan.dst_scale_box(&refit.tensors[s.tensor].dst, rank)
    }
}

impl Refit {
    /// The same refit into an fp8 engine: the weights `quant` converts ([`InferQuant::quantizes`])
    /// get an fp8 inference layout and a scale tensor each; checked before anything is
    /// planned: every inference shard boundary of a quantized weight on a block boundary, and
    /// inside a fused buffer every member but the last a whole number of blocks along the
    /// fused dim on every rank (else the engine's blocks of the fused buffer would straddle
    /// two members).
    pub fn quantized(mut self, quant: &InferQuant) -> Result<Refit, ModelError> {
        let mut plans = Vec::with_capacity(self.tensors.len());
        let mut scales = Vec::new();
        let mut scale_of = vec![None; self.tensors.len()];
        for (i, t) in self.tensors.iter_mut().enumerate() {
            if !quant.quantizes(&t.name, t.dst.ndim()) {
                plans.push(None);
                continue;
            }
            let dst = retyped(&t.dst, quant.fp8);
            let plan = QuantPlan::new(quant.request(), &t.src, &dst).map_err(|e| match e {
                reshard_core::Error::Convert {
                    source:
                        ConvertError::CutBlock {
                            dim,
                            boundary,
                            block,
                            side: Side::Dst,
                        },
                    ..
                } => ModelError::QuantCut {
                    tensor: t.name.clone(),
                    dim,
                    boundary,
                    block,
                },
                reshard_core::Error::Convert { source, .. } => ModelError::Quant {
                    tensor: t.name.clone(),
                    source,
                },
                other => ModelError::Plan {
                    tensor: t.name.clone(),
                    source: other,
                },
            })?;
            t.dst = dst;
            scale_of[i] = Some(scales.len());
            scales.push(RefitScale {
                name: scale_name(&t.name),
                tensor: i,
                shape: plan.grid.grid_shape(),
            });
            plans.push(Some(plan));
        }
        let mut fused = Vec::new();
        for f in &self.dst_fused {
            let members: Vec<Option<usize>> = f.members.iter().map(|&m| scale_of[m]).collect();
            if members.iter().all(Option::is_none) {
                continue;
            }
            let Some(members) = members.into_iter().collect::<Option<Vec<usize>>>() else {
                return Err(ModelError::Fused {
                    name: f.name.clone(),
                    reason: "some members are quantized and some are not: one buffer holds one dtype (check modules_to_not_convert)".into(),
                });
            };
            self.check_fused_blocks(f, quant)?;
            fused.push(Fused {
                name: scale_name(&f.name),
                dim: f.dim,
                members,
            });
        }
        self.validate_fused()?;
        self.quant = Some(RefitQuant {
            spec: quant.clone(),
            plans,
            scales,
            fused,
        });
        Ok(self)
    }

    /// Every member of `f` but the last holds whole blocks along the fused dim on every rank.
    fn check_fused_blocks(&self, f: &Fused, quant: &InferQuant) -> Result<(), ModelError> {
        let Some((_, leading)) = f.members.split_last() else {
            return Ok(());
        };
        for &m in leading {
            let t = &self.tensors[m];
            let ndim = t.dst.ndim();
            let block = match ndim - f.dim {
                2 => quant.block[0],
                1 => quant.block[1],
                _ => 1,
            };
            if let Some(piece) = t
                .dst
                .dim_pieces(f.dim)
                .iter()
                .find(|p| !(p.end - p.start).is_multiple_of(block))
            {
                return Err(ModelError::Fused {
                    name: f.name.clone(),
                    reason: format!(
                        "member {} holds {} elements along dim {} on some inference rank, not a multiple of the fp8 block's {block}: the buffer's blocks would straddle two members",
                        t.name,
                        piece.end - piece.start,
                        f.dim
                    ),
                });
            }
        }
        Ok(())
    }
}

/// `layout` holding elements of `dtype` instead (fp8 elements are never larger, so the
/// layout stays valid).
fn retyped(layout: &Layout, dtype: DType) -> Layout {
    Layout::new(
        layout.shape().to_vec(),
        dtype,
        layout.mesh().clone(),
        layout.placements().to_vec(),
    )
    .expect("a valid layout with smaller elements is valid")
}
