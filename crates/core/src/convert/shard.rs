//! Quantizing a shard that holds whole blocks, in one go: what a receiver does when it got
//! the source dtype and quantizes after the fact. `bench --quant` measures the quantizing
//! reshard against exactly this, on the executor's own kernels, so that the comparison is of
//! where the work happens and what the wire carries, not of two different encoders.

use super::ConvertError;
use super::grid::{AmaxGrid, BlockGrid, Scales};
use super::quant::Quant;
use crate::dtype::DType;
use crate::error::{Dims, Side};
use crate::region::Region;

/// Checks that every block `shard` touches lies wholly inside it (a block cut short by the
/// tensor's end counts as whole): otherwise the shard alone cannot give its blocks' amax.
/// The error names the first dim and boundary that cut a block.
pub fn check_whole_blocks(grid: &BlockGrid, shard: &Region) -> Result<(), ConvertError> {
    if shard.is_empty() {
        return Ok(());
    }
    for d in 0..shard.ndim() {
        let (b, r, n) = (grid.block()[d], shard.range(d), grid.shape()[d]);
        for boundary in [r.start, r.end] {
            if !boundary.is_multiple_of(b) && boundary != n {
                return Err(ConvertError::CutBlock {
                    side: Side::Dst,
                    dim: d,
                    boundary,
                    block: Dims(grid.block().to_vec()),
                });
            }
        }
    }
    Ok(())
}

/// Quantizes `src`, the dense row-major buffer of `shard` (elements of `dtype`), into
/// `values` (one fp8 byte per element) and `scales` (the scales of
/// [`BlockGrid::scale_region`] of `shard`, row-major, in the scale dtype). Every block the
/// shard touches must lie inside it ([`check_whole_blocks`]); a non-finite value is an error
/// naming its block and element.
///
/// Panics if a buffer's length does not match `shard`: callers size them from the layout.
pub fn quantize_shard(
    quant: Quant,
    grid: &BlockGrid,
    shard: &Region,
    dtype: DType,
    src: &[u8],
    values: &mut [u8],
    scales: &mut [u8],
) -> Result<(), ConvertError> {
    check_whole_blocks(grid, shard)?;
    let n = shard.volume() as usize;
    assert_eq!(src.len(), n * dtype.size(), "source buffer of the shard");
    assert_eq!(values.len(), n, "value buffer of the shard");
    let amax = AmaxGrid::local(grid, shard, src, dtype)?;
    let s = Scales::new(quant, grid, &amax);
    s.quantize_run(shard, dtype, 0, src, values);
    s.write(&grid.scale_region(shard), scales);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::QuantScheme;
    use crate::convert::reference::quantize_tensor;

    /// Every shard of a block-aligned split, quantized on its own, is the reference's box.
    #[test]
    fn shards_quantized_alone_match_the_reference() {
        let shape = [6u64, 10];
        let scheme = QuantScheme::parse("block:2x4").expect("scheme");
        let quant = Quant::new(scheme, DType::F32, DType::Fp8E4M3, None).expect("quant");
        let grid = BlockGrid::new(scheme, &shape).expect("grid");
        let whole: Vec<u8> = (0..60)
            .flat_map(|i| ((i as f32 - 23.0) * 0.37 * (1 + i % 7) as f32).to_le_bytes())
            .collect();
        let reference = quantize_tensor(quant, &grid, DType::F32, &whole).expect("reference");
        for shard in [
            Region::from_ranges(&[0..2, 0..10]),
            Region::from_ranges(&[2..6, 4..10]),
            Region::from_ranges(&[4..6, 8..10]),
        ] {
            let src = crate::convert::reference::slice(&whole, &shape, 4, &shard);
            let mut values = vec![0u8; shard.volume() as usize];
            let blocks = grid.scale_region(&shard);
            let mut scales = vec![0u8; blocks.volume() as usize * 4];
            quantize_shard(
                quant,
                &grid,
                &shard,
                DType::F32,
                &src,
                &mut values,
                &mut scales,
            )
            .expect("quantize");
            assert_eq!(values, reference.values_of(&shard), "values of {shard:?}");
            assert_eq!(scales, reference.scales_of(&blocks), "scales of {shard:?}");
        }
    }

    #[test]
    fn a_shard_that_cuts_a_block_is_refused() {
        let scheme = QuantScheme::parse("block:2x4").expect("scheme");
        let grid = BlockGrid::new(scheme, &[6, 10]).expect("grid");
        let err = check_whole_blocks(&grid, &Region::from_ranges(&[0..3, 0..10]));
        assert!(
            matches!(
                err,
                Err(ConvertError::CutBlock {
                    dim: 0,
                    boundary: 3,
                    ..
                })
            ),
            "{err:?}"
        );
    }
}
