//! `--verify` and `--dump` of a quantizing run: the naive reference (the whole source
//! materialized from the fill and quantized block by block) and each destination's values
//! and scales compared with their boxes of it.

use reshard::convert::reference::{QuantizedTensor, first_difference, quantize_tensor};
use reshard::fill::Fill;
use reshard::layout::LayoutSpec;
use reshard::{Error, Plan, Rank};

/// The reference of a quantizing plan's destination, or `None` for a plan that does not
/// quantize.
pub fn reference(plan: &Plan, fill: Fill) -> Result<Option<QuantizedTensor>, Error> {
    let Some(q) = plan.quant() else {
        return Ok(None);
    };
    let whole = LayoutSpec::parse("mesh=1 place=R")
        .and_then(|s| s.resolve(plan.src().shape(), plan.src().dtype(), 0))
        .map_err(|source| Error::Layout {
            side: reshard::Side::Src,
            source,
        })?;
    let tensor = fill.shard(&whole, 0)?.unwrap_or_default();
    quantize_tensor(q.quant, &q.grid, plan.src().dtype(), &tensor)
        .map(Some)
        .map_err(|source| Error::Convert {
            tensor: "tensor".into(),
            source,
        })
}

/// Compares `rank`'s fp8 values and scales with their boxes of the reference.
pub fn verify(
    plan: &Plan,
    reference: &QuantizedTensor,
    rank: Rank,
    values: &[u8],
    scales: &[u8],
) -> Result<(), Error> {
    let (Some(q), Some(shard)) = (plan.quant(), plan.dst().local_region(rank)) else {
        return Ok(());
    };
    let blocks = q.grid.scale_region(&shard);
    compare(
        rank,
        (&reference.values_of(&shard), values),
        Some((&reference.scales_of(&blocks), scales)),
    )
}

/// `rank`'s values against the expected ones, then its scales if given (`(expected, got)`
/// each): the first difference fails, as values or as scales.
pub fn compare(
    rank: Rank,
    values: (&[u8], &[u8]),
    scales: Option<(&[u8], &[u8])>,
) -> Result<(), Error> {
    if let Some((offset, expected, found, mismatches)) = first_difference(values.0, values.1) {
        return Err(Error::VerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    if let Some((offset, expected, found, mismatches)) =
        scales.and_then(|(want, got)| first_difference(want, got))
    {
        return Err(Error::ScalesVerifyFailed {
            rank,
            offset,
            expected,
            found,
            mismatches,
        });
    }
    Ok(())
}
