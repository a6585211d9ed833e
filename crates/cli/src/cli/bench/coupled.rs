//! What a case of an already-quantized source (an fp8 `--dtype` with `--quant`) adds to its
//! [`super::suite::Case`]: the coupled move of the values and their scales, its batch, and
//! gather+broadcast of the scales; and every rank's boxes of both, which its source sends and
//! its destination is checked against.

use reshard::batch::Batch;
use reshard::convert::quantize_shard;
use reshard::fill::Fill;
use reshard::layout::Layout;
use reshard::plan::{GatherBroadcast, QuantizedMove};
use reshard::{DType, Error, Rank, Side};

/// A rank's boxes of the values and of the scales.
pub(super) type Boxes = (Vec<u8>, Vec<u8>);

/// What a case of an already-quantized source adds to its [`super::suite::Case`]: the coupled move (whose
/// values' plan is the case's `plan`), its batch, and gather+broadcast of the scale tensor
/// (the values' is the case's `baseline`).
pub(in crate::cli) struct Coupled {
    pub(in crate::cli) mv: QuantizedMove,
    pub(super) batch: Batch,
    pub(in crate::cli) scale_baseline: GatherBroadcast,
}

impl Coupled {
    pub(super) fn new(mv: QuantizedMove) -> Result<Coupled, Error> {
        let scale_baseline = GatherBroadcast::on_hosts(mv.scales.src(), mv.scales.dst(), None)?;
        let batch = Batch::quantized(&mv)?;
        Ok(Coupled {
            mv,
            batch,
            scale_baseline,
        })
    }

    /// The value layout and scale layout of `side`.
    fn layouts(&self, side: Side) -> (&Layout, &Layout) {
        match side {
            Side::Src => (self.mv.values.src(), self.mv.scales.src()),
            Side::Dst => (self.mv.values.dst(), self.mv.scales.dst()),
        }
    }

    /// `rank`'s boxes of the values and of the scales on `side`, if it holds a shard there:
    /// its box of the fill, made in f32 and quantized. Since the shard holds whole blocks,
    /// that is its slice of the whole tensor quantized block by block.
    pub(super) fn boxes(&self, fill: Fill, side: Side, rank: Rank) -> Result<Option<Boxes>, Error> {
        let (values, scales) = self.layouts(side);
        let Some(region) = values.local_region(rank) else {
            return Ok(None);
        };
        let mut v = vec![0u8; values.local_bytes(rank) as usize];
        let mut s = vec![0u8; scales.local_bytes(rank) as usize];
        if region.volume() == 0 {
            return Ok(Some((v, s)));
        }
        let f32_layout = Layout::new(
            values.shape().to_vec(),
            DType::F32,
            values.mesh().clone(),
            values.placements().to_vec(),
        )
        .map_err(|source| Error::Layout { side, source })?;
        let x = fill.shard(&f32_layout, rank)?.unwrap_or_default();
        let (quant, grid) = (self.mv.quant, &self.mv.grid);
        quantize_shard(quant, grid, &region, DType::F32, &x, &mut v, &mut s).map_err(|source| {
            Error::Convert {
                tensor: "tensor".into(),
                source,
            }
        })?;
        Ok(Some((v, s)))
    }

    /// Bytes of the scale shards of every destination rank.
    pub(super) fn dst_scale_bytes(&self) -> u64 {
        self.mv.scales.dst().shard_bytes()
    }
}
