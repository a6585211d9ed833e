//! The naive quantizer that `--verify` checks a quantizing reshard against: the whole tensor
//! materialized, every element's block found from its coordinates, every block's amax and
//! scale taken over the whole block, every element encoded on its own. No shards, no partial
//! amax, no runs: none of the executor's bookkeeping, so that a mistake there shows.

use crate::convert::ConvertError;
use crate::convert::cast::read_f32;
use crate::convert::grid::BlockGrid;
use crate::convert::quant::Quant;
use crate::dtype::DType;
use crate::region::Region;

/// A whole tensor quantized: fp8 values (row-major over the tensor) and scales (row-major
/// over the scale grid, in the scale dtype).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizedTensor {
    /// The tensor's shape, in elements.
    pub shape: Vec<u64>,
    /// The scale grid's shape: blocks along each dim.
    pub grid_shape: Vec<u64>,
    /// The fp8 values, one byte per element.
    pub values: Vec<u8>,
    /// The scales, `scale_bytes` each.
    pub scales: Vec<u8>,
    /// Bytes per scale (the scale dtype's size).
    pub scale_bytes: usize,
}

/// Row-major coordinates of element `i` of a tensor of `shape`.
fn coords(shape: &[u64], mut i: u64) -> Vec<u64> {
    let mut c = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        c[d] = i % shape[d].max(1);
        i /= shape[d].max(1);
    }
    c
}

/// Row-major index of `c` in a tensor of `shape`.
fn index(shape: &[u64], c: &[u64]) -> u64 {
    c.iter().zip(shape).fold(0, |acc, (&x, &n)| acc * n + x)
}

/// Quantizes `tensor` (the whole tensor of `grid.shape()`, elements of `dtype`) as `quant`
/// says. A non-finite element is an error naming its block and element.
pub fn quantize_tensor(
    quant: Quant,
    grid: &BlockGrid,
    dtype: DType,
    tensor: &[u8],
) -> Result<QuantizedTensor, ConvertError> {
    let shape = grid.shape().to_vec();
    let grid_shape = grid.grid_shape();
    let n: u64 = shape.iter().product();
    let elem = dtype.size();
    let block_of =
        |c: &[u64]| -> Vec<u64> { c.iter().zip(grid.block()).map(|(&x, &b)| x / b).collect() };
    let mut amax = vec![0f32; grid_shape.iter().product::<u64>() as usize];
    for i in 0..n {
        let x = read_f32(dtype, &tensor[i as usize * elem..][..elem]);
        let c = coords(&shape, i);
        let b = block_of(&c);
        if !x.is_finite() {
            return Err(ConvertError::NonFinite {
                block: b,
                element: c,
                value: x,
            });
        }
        let k = index(&grid_shape, &b) as usize;
        amax[k] = amax[k].max(x.abs());
    }
    let scales: Vec<_> = amax.iter().map(|&a| quant.scale(a)).collect();
    let mut values = vec![0u8; n as usize];
    for (i, v) in values.iter_mut().enumerate() {
        let x = read_f32(dtype, &tensor[i * elem..][..elem]);
        let k = index(&grid_shape, &block_of(&coords(&shape, i as u64))) as usize;
        *v = quant.fp8.encode(x * scales[k].mult);
    }
    let size = quant.scale_dtype.size();
    let mut out = vec![0u8; scales.len() * size];
    for (s, o) in scales.iter().zip(out.chunks_exact_mut(size)) {
        quant.write_scale(s, o);
    }
    Ok(QuantizedTensor {
        shape,
        grid_shape,
        values,
        scales: out,
        scale_bytes: size,
    })
}

/// The row-major bytes of `region` of a row-major tensor of `shape` (`elem` bytes each).
pub fn slice(whole: &[u8], shape: &[u64], elem: usize, region: &Region) -> Vec<u8> {
    let mut out = Vec::with_capacity(region.volume() as usize * elem);
    for i in 0..region.volume() {
        let local = coords(&region.extent, i);
        let global: Vec<u64> = local
            .iter()
            .zip(&region.offset)
            .map(|(a, b)| a + b)
            .collect();
        let at = index(shape, &global) as usize * elem;
        out.extend_from_slice(&whole[at..at + elem]);
    }
    out
}

impl QuantizedTensor {
    /// The fp8 values of a destination box.
    pub fn values_of(&self, region: &Region) -> Vec<u8> {
        slice(&self.values, &self.shape, 1, region)
    }

    /// The scales of a box of the scale grid.
    pub fn scales_of(&self, blocks: &Region) -> Vec<u8> {
        slice(&self.scales, &self.grid_shape, self.scale_bytes, blocks)
    }
}

/// The first byte where `got` differs from `want`, with both bytes, and how many differ.
pub fn first_difference(want: &[u8], got: &[u8]) -> Option<(u64, u8, u8, u64)> {
    let mut first = None;
    let mut count = 0u64;
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if w != g {
            count += 1;
            first.get_or_insert((i as u64, *w, *g));
        }
    }
    if want.len() != got.len() {
        count += want.len().abs_diff(got.len()) as u64;
        first.get_or_insert((want.len().min(got.len()) as u64, 0, 0));
    }
    first.map(|(o, w, g)| (o, w, g, count))
}
