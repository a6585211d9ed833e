//! Moving a tensor that is already quantized on both sides (an fp8 source with its scales,
//! the same scheme at the destination): the fp8 values and the scale tensor reshard as two
//! coupled tensors over the same meshes and placements, the values byte for byte and each
//! scale with its block. Neither side may cut a block: a shard boundary inside a block would
//! leave a block's values on one rank and its scale meaningless for part of them, so it is an
//! error naming the tensor's side, the dim, the boundary and the block size, before any byte
//! moves. Every shard of either side then holds whole blocks, and its scale shard is exactly
//! the scales of those blocks ([`BlockGrid::scale_region`]).

use crate::convert::{BlockGrid, ConvertError, Quant, check_whole_blocks};
use crate::dtype::DType;
use crate::error::{Dims, Error, Result, Side};
use crate::layout::Layout;

use super::{Plan, PlanOptions, QuantRequest};

/// The two plans of an already-quantized move, and the scheme they follow.
#[derive(Clone, Debug)]
pub struct QuantizedMove {
    pub quant: Quant,
    pub grid: BlockGrid,
    /// The fp8 values: a plain reshard, byte for byte.
    pub values: Plan,
    /// The scale tensor (shape [`BlockGrid::grid_shape`], in the scale dtype), over the same
    /// meshes and placements as the values.
    pub scales: Plan,
}

impl QuantizedMove {
    /// Plans the move of `src` (fp8 values, quantized as `request` says) to `dst` (the same
    /// fp8 dtype and scheme). Refused before any byte moves: a dtype that is not fp8 or
    /// differs between the sides, a scheme that does not fit the tensor, and a shard
    /// boundary on either side that cuts a block.
    pub fn new(
        src: Layout,
        dst: Layout,
        options: PlanOptions,
        request: QuantRequest,
    ) -> Result<QuantizedMove> {
        let convert = |source| Error::Convert {
            tensor: "tensor".into(),
            source,
        };
        if src.dtype() != dst.dtype() {
            return Err(convert(ConvertError::UnsupportedCast {
                src: src.dtype(),
                dst: dst.dtype(),
                reason: "an already-quantized tensor keeps its fp8 format and scales",
            }));
        }
        // the scheme's checks, with the values' nominal f32 origin
        let quant = Quant::new(request.scheme, DType::F32, dst.dtype(), request.scale_dtype)
            .map_err(convert)?;
        let grid = BlockGrid::new(request.scheme, src.shape()).map_err(convert)?;
        for (side, layout) in [(Side::Src, &src), (Side::Dst, &dst)] {
            for &r in layout.mesh().ranks() {
                if let Some(shard) = layout.local_region(r) {
                    check_whole_blocks(&grid, &shard)
                        .map_err(|e| match e {
                            ConvertError::CutBlock {
                                dim,
                                boundary,
                                block,
                                ..
                            } => ConvertError::CutBlock {
                                side,
                                dim,
                                boundary,
                                block,
                            },
                            other => other,
                        })
                        .map_err(convert)?;
                }
            }
        }
        let scale_layout = |side: Side, values: &Layout| -> Result<Layout> {
            let layout = Layout::new(
                grid.grid_shape(),
                quant.scale_dtype.dtype(),
                values.mesh().clone(),
                values.placements().to_vec(),
            )
            .map_err(|source| Error::Layout { side, source })?;
            // DTensor's chunking of the scale grid must give each rank its blocks' scales
            for &r in values.mesh().ranks() {
                let want = values.local_region(r).map(|b| grid.scale_region(&b));
                let got = layout.local_region(r);
                let same = match (&want, &got) {
                    (Some(w), Some(g)) => w == g || (w.is_empty() && g.is_empty()),
                    (None, None) => true,
                    _ => false,
                };
                if !same {
                    return Err(Error::InvalidOption {
                        field: crate::error::Field::Quant,
                        value: quant.scheme.to_string(),
                        reason: format!(
                            "{side}: rank {r}'s scale shard by the layout's chunking ({}) is not the scales of its value shard's blocks ({})",
                            got.map_or("none".into(), |g| Dims(g.extent).to_string()),
                            want.map_or("none".into(), |w| Dims(w.extent).to_string()),
                        ),
                    });
                }
            }
            Ok(layout)
        };
        let scales = Plan::with_options(
            scale_layout(Side::Src, &src)?,
            scale_layout(Side::Dst, &dst)?,
            options,
        )?;
        let values = Plan::with_options(src, dst, options)?;
        Ok(QuantizedMove {
            quant,
            grid,
            values,
            scales,
        })
    }
}
