//! Moving a tensor that is already quantized on both sides (an fp8 source with its scales,
//! the same scheme at the destination): the fp8 values and the scale tensor reshard as two
//! coupled tensors over the same meshes and placements, the values byte for byte and each
//! scale with its block. Neither side may cut a block: a shard boundary inside a block would
//! leave a block's values on one rank and its scale meaningless for part of them, so it is an
//! error naming the tensor's side, the dim, the boundary and the block size, before any byte
//! moves. Every shard of either side then holds whole blocks, and its scale shard is exactly
//! the scales of those blocks ([`BlockGrid::scale_region`]).
//!
//! The two tensors move in one exchange (the batch (`reshard_runtime::batch::Batch::quantized`)): one schedule over both,
//! each peer pair's scale bytes following its value bytes on the same link, rather than a
//! second reshard of a few kilobytes that would pay for its own links, start and end.

use crate::convert::{BlockGrid, ConvertError, Quant, check_whole_blocks};
use crate::dtype::DType;
use crate::error::{Dims, Error, Result, Side};
use crate::layout::Layout;

use super::quant::QuantTotals;
use super::report::{QuantJson, TransferJson};
use super::{Plan, PlanJson, PlanOptions, QuantRequest, Totals};

/// The two plans of an already-quantized move, and the scheme they follow.
#[derive(Clone, Debug)]
pub struct QuantizedMove {
    /// The scheme both sides are quantized with, and their fp8 format and scale dtype.
    pub quant: Quant,
    /// The blocks of the tensor under the scheme.
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

impl QuantizedMove {
    /// Where a rank's values lie among its buffers of the batch (`reshard_runtime::batch::Batch::quantized`).
    pub const VALUES: usize = 0;
    /// Where a rank's scales lie among its buffers of the batch (`reshard_runtime::batch::Batch::quantized`).
    pub const SCALES: usize = 1;

    /// The values' totals, with the scales' traffic beside them in `quant` (as a quantizing
    /// plan reports its scales): what the scale plan sends and copies, and what gather+broadcast
    /// of the scale tensor would move. No partial amax: nothing is quantized.
    pub fn totals(&self) -> Totals {
        let scales = self.scales.totals();
        Totals {
            quant: Some(QuantTotals {
                amax_bytes: 0,
                amax_messages: 0,
                scale_bytes: scales.bytes_remote,
                scale_bytes_local: scales.bytes_local,
                scale_messages: scales.messages,
                scale_gather_broadcast_bytes: Some(scales.gather_broadcast_bytes),
            }),
            ..self.values.totals()
        }
    }

    /// The plan JSON of the coupled move: the values' plan as for any reshard, with a `quant`
    /// object (`"source": "quantized"`) whose `scales` are the scale tensor's transfers, in
    /// scale grid coordinates, and totals that count the scales as [`QuantizedMove::totals`].
    pub fn json(&self) -> PlanJson {
        let scale_bytes = self.quant.scale_dtype.size();
        let mut json = PlanJson::of(&self.values);
        json.totals.totals = self.totals();
        json.quant = Some(QuantJson {
            source: Some("quantized"),
            scheme: self.quant.scheme.to_string(),
            scale_dtype: self.quant.scale_dtype.to_string(),
            scale_elem_bytes: scale_bytes,
            block: self.grid.block().to_vec(),
            scale_shape: self.grid.grid_shape(),
            amax: Vec::new(),
            scales: self
                .scales
                .transfers()
                .iter()
                .map(|t| TransferJson {
                    src: t.src,
                    dst: t.dst,
                    offset: t.region.offset.clone(),
                    extent: t.region.extent.clone(),
                    bytes: t.bytes(scale_bytes),
                    via: t.via,
                })
                .collect(),
        });
        json
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use proptest::prelude::*;

    use crate::testing::{arb_block_spec as spec, fp8_layout as layout, quant_request as request};

    /// TP4 S(0) -> TP2 S(1), 512x512 fp8 in 128x128 blocks, counted by hand: each of the
    /// two destinations (256 columns, 2 block columns) gets a 128x256 box from each of the
    /// four sources (32 KiB) and, with it, one block row of its two block columns (2 f32
    /// scales, 8 bytes). Gather+broadcast of the 4x4 f32 scales: 3 x 64 B gathered, 64 B to
    /// each of the 2 destinations.
    #[test]
    fn coupled_totals_by_hand() {
        let shape = [512, 512];
        let mv = QuantizedMove::new(
            layout("mesh=4 place=S(0)", &shape, 0),
            layout("mesh=2 place=S(1)", &shape, 4),
            PlanOptions::default(),
            request("block:128x128"),
        )
        .unwrap();
        let t = mv.totals();
        assert_eq!((t.bytes_remote, t.messages), (8 * 128 * 256, 8));
        assert_eq!(t.gather_broadcast_bytes, 3 * 512 * 512 + 2 * 512 * 512);
        let q = t.quant.unwrap();
        assert_eq!(
            (q.scale_bytes, q.scale_messages, q.scale_bytes_local),
            (64, 8, 0)
        );
        assert_eq!((q.amax_bytes, q.amax_messages), (0, 0));
        assert_eq!(q.scale_gather_broadcast_bytes, Some(3 * 64 + 2 * 64));
        let json = serde_json::to_value(mv.json()).unwrap();
        assert_eq!(json["quant"]["source"], "quantized");
        assert_eq!(json["quant"]["scale_shape"], serde_json::json!([4, 4]));
        assert_eq!(json["quant"]["scales"].as_array().unwrap().len(), 8);
        assert_eq!(json["totals"]["scale_bytes"], 64);
        assert_eq!(json["totals"]["scale_gather_broadcast_bytes"], 320);
        assert_eq!(json["totals"]["amax_messages"], 0);
    }

    proptest! {
        /// Whenever a coupled move is planned, the scale plan's transfers into each
        /// destination tile its scale shard (the scales of its value shard's blocks) exactly:
        /// inside it, no two overlapping, their volumes adding up to it.
        #[test]
        fn scale_transfers_tile_every_destination_scale_shard(
            rows in 1u64..=6, cols in 1u64..=6, br in 0u32..3, bc in 0u32..3,
            src in spec(), dst in spec(),
        ) {
            let (br, bc) = (1u64 << br, 2u64 << bc);
            let shape = [rows * br * 2, cols * bc * 2];
            let src = layout(&src, &shape, 0);
            let first = src.mesh().ranks().iter().max().map_or(0, |&r| r + 1);
            let dst = layout(&dst, &shape, first);
            let Ok(mv) = QuantizedMove::new(
                src, dst.clone(), PlanOptions::default(), request(&format!("block:{br}x{bc}")),
            ) else {
                return Ok(());
            };
            for &r in dst.mesh().ranks() {
                let want: Option<Region> = dst.local_region(r).map(|b| mv.grid.scale_region(&b));
                let Some(want) = want else { continue };
                let into: Vec<&Region> = mv
                    .scales
                    .transfers()
                    .iter()
                    .filter(|t| t.dst == r)
                    .map(|t| &t.region)
                    .collect();
                for (i, a) in into.iter().enumerate() {
                    prop_assert!(want.contains(a), "rank {r}: {a:?} outside {want:?}");
                    for b in &into[i + 1..] {
                        prop_assert!(a.intersect(b).is_none_or(|x| x.is_empty()), "rank {r}: {a:?} overlaps {b:?}");
                    }
                }
                let got: u64 = into.iter().map(|b| b.volume()).sum();
                prop_assert_eq!(got, want.volume(), "rank {}", r);
            }
        }
    }
}
