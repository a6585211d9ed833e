//! Quantization schemes into fp8 with scales, and the per-block scale arithmetic.
//!
//! Every scheme cuts the tensor into blocks, takes each block's amax (largest magnitude), and
//! derives from it a scale (kept beside the fp8 values, in the layout the engine loads) and a
//! multiplier `m` such that `q = fp8(x * m)`, all in f32, the fp8 cast rounding to nearest even
//! and saturating at ±FMAX:
//!
//! | scheme | blocks | scale | who loads it |
//! |---|---|---|---|
//! | `block:RxC` | R x C over the last two dims (a grid per leading index: per expert of `[E, R, C]`) | `amax / FMAX` (f32), `m = FMAX / amax`, amax clamped below at 1e-4 | vLLM and SGLang fp8 block checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-FP8): `weight_scale_inv` |
//! | `block:RxC:ue8m0` | as above | `2^ceil(log2(amax / FMAX))` (f32, or e8m0: the biased exponent `k + 127` in a u8), `m = 1 / scale` | DeepGEMM's fp8 GEMMs on Blackwell (SGLang, vLLM's DeepGEMM path), which read power-of-two scales |
//! | `mx:32` | 32 consecutive elements of the last dim | `2^E`, `E = floor(log2(amax)) - emax` clamped to [-127, 127] (amax 0: -127), e8m0 by default, `m = 2^-E` | OCP MXFP8 (Blackwell's block-scaled tensor cores, TensorRT-LLM, vLLM's MXFP8) |
//! | `channel` | one row: the whole last dim | as `block`: `amax / FMAX`, f32 | vLLM's per-channel fp8 (`weight_scale` of shape `[N, 1]`) |
//! | `tensor` | the whole tensor | as `block`: `amax / FMAX`, f32 | vLLM's per-tensor fp8 (`weight_scale`), the oldest fp8 checkpoints |
//!
//! The scale tensor has as many dims as the tensor: `ceil(shape[d] / block[d])` along each,
//! so `[..., ceil(R/r), ceil(C/c)]` for `block`, `[..., ceil(C/32)]` for `mx`, `[..., 1]` for
//! `channel` and `[1, ..., 1]` for `tensor`.

use crate::error::Field;
use std::fmt;
use std::str::FromStr;

use crate::convert::ConvertError;
use crate::convert::fp8::Fp8;
use crate::dtype::DType;
pub use crate::dtype::ScaleDType;
use crate::error::Error;

/// Lower clamp of a block's amax for the `block`, `channel` and `tensor` schemes (DeepSeek's
/// and vLLM's recipes): an all-zero block gets a finite scale and quantizes to zeros.
pub const AMAX_FLOOR: f32 = 1e-4;

/// The OCP MX block length along the last dim.
pub const MX_BLOCK: u64 = 32;

/// How a tensor is quantized into fp8 (`--quant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// `block:RxC` or, with `ue8m0`, `block:RxC:ue8m0`: one scale per `rows x cols` block of
    /// the last two dims.
    Block {
        /// The block's extent along the second-to-last dim, in elements.
        rows: u64,
        /// The block's extent along the last dim, in elements.
        cols: u64,
        /// Whether the scales are rounded up to powers of two (DeepGEMM's `ue8m0`).
        ue8m0: bool,
    },
    /// `mx:32`: one power-of-two scale per 32 elements of the last dim.
    Mx,
    /// `channel`: one scale per row (the whole last dim).
    Channel,
    /// `tensor`: one scale for the whole tensor.
    Tensor,
}

impl fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantScheme::Block { rows, cols, ue8m0 } => {
                write!(f, "block:{rows}x{cols}")?;
                if *ue8m0 {
                    f.write_str(":ue8m0")?;
                }
                Ok(())
            }
            QuantScheme::Mx => write!(f, "mx:{MX_BLOCK}"),
            QuantScheme::Channel => f.write_str("channel"),
            QuantScheme::Tensor => f.write_str("tensor"),
        }
    }
}

impl FromStr for QuantScheme {
    type Err = Error;

    fn from_str(s: &str) -> Result<QuantScheme, Error> {
        QuantScheme::parse(s)
    }
}

impl QuantScheme {
    /// Parses `block:RxC`, `block:RxC:ue8m0`, `mx:32`, `channel` or `tensor`. Errors name
    /// `--quant` and the value.
    pub fn parse(s: &str) -> Result<QuantScheme, Error> {
        let bad = |reason: String| Error::InvalidOption {
            field: Field::Quant,
            value: s.to_string(),
            reason,
        };
        let usage = "expected `block:RxC`, `block:RxC:ue8m0`, `mx:32`, `channel` or `tensor`";
        let parts: Vec<&str> = s.trim().split(':').collect();
        match parts.as_slice() {
            ["channel"] => Ok(QuantScheme::Channel),
            ["tensor"] => Ok(QuantScheme::Tensor),
            ["mx", n] => match n.parse::<u64>() {
                Ok(MX_BLOCK) => Ok(QuantScheme::Mx),
                _ => Err(bad(format!(
                    "OCP MX blocks are {MX_BLOCK} elements long: expected `mx:{MX_BLOCK}`"
                ))),
            },
            ["block", dims, rest @ ..] => {
                let ue8m0 = match rest {
                    [] => false,
                    ["ue8m0"] => true,
                    _ => return Err(bad(usage.into())),
                };
                let (r, c) = dims
                    .split_once(['x', 'X'])
                    .ok_or_else(|| bad(format!("block size `{dims}` is not RxC")))?;
                let size = |t: &str| match t.parse::<u64>() {
                    Ok(n) if n >= 1 => Ok(n),
                    _ => Err(bad(format!(
                        "block size `{t}` is not a whole number of at least 1"
                    ))),
                };
                Ok(QuantScheme::Block {
                    rows: size(r)?,
                    cols: size(c)?,
                    ue8m0,
                })
            }
            _ => Err(bad(usage.into())),
        }
    }

    /// Whether the scales are powers of two (and so may be stored as e8m0).
    pub const fn power_of_two(self) -> bool {
        matches!(
            self,
            QuantScheme::Mx | QuantScheme::Block { ue8m0: true, .. }
        )
    }

    /// The scale dtype engines load for this scheme when `--scale-dtype` is not given: e8m0
    /// for `mx` (the OCP format), f32 otherwise.
    pub const fn default_scale_dtype(self) -> ScaleDType {
        match self {
            QuantScheme::Mx => ScaleDType::E8M0,
            _ => ScaleDType::F32,
        }
    }

    /// The extent of a block along every dim of a tensor of `shape` (a dim a block spans
    /// whole gets the dim's size, at least 1), or an error if the scheme needs more dims.
    pub fn block_shape(self, shape: &[u64]) -> Result<Vec<u64>, ConvertError> {
        let n = shape.len();
        let whole = |d: usize| shape[d].max(1);
        let need = |min: usize| {
            if n < min {
                Err(ConvertError::SchemeNeedsDims {
                    scheme: self.to_string(),
                    needs: min,
                    ndim: n,
                })
            } else {
                Ok(())
            }
        };
        Ok(match self {
            QuantScheme::Block { rows, cols, .. } => {
                need(2)?;
                if rows == 0 || cols == 0 {
                    return Err(ConvertError::EmptyBlock {
                        scheme: self.to_string(),
                    });
                }
                let mut b = vec![1; n];
                b[n - 2] = rows;
                b[n - 1] = cols;
                b
            }
            QuantScheme::Mx => {
                need(1)?;
                let mut b = vec![1; n];
                b[n - 1] = MX_BLOCK;
                b
            }
            QuantScheme::Channel => {
                need(1)?;
                let mut b = vec![1; n];
                b[n - 1] = whole(n - 1);
                b
            }
            QuantScheme::Tensor => (0..n).map(whole).collect(),
        })
    }

    /// Per dim, whether a destination shard boundary may cut a block: only where the block
    /// spans the whole dim by definition (`channel`'s last dim, every dim of `tensor`), whose
    /// scales each destination then holds replicated, as vLLM keeps them on row-parallel
    /// layers. Elsewhere the engine needs whole blocks (vLLM refuses a partition that is not
    /// a multiple of the block).
    pub fn may_cut(self, ndim: usize) -> Vec<bool> {
        (0..ndim)
            .map(|d| match self {
                QuantScheme::Channel => d + 1 == ndim,
                QuantScheme::Tensor => true,
                _ => false,
            })
            .collect()
    }
}

/// A scheme applied to one destination: the scheme, the fp8 format and the scale dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quant {
    /// How the tensor is cut into blocks and each block's scale derived.
    pub scheme: QuantScheme,
    /// The fp8 format of the quantized values.
    pub fp8: Fp8,
    /// The dtype the scales are stored in.
    pub scale_dtype: ScaleDType,
}

/// The scale of one block: what the engine loads, and the multiplier the values get.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockScale {
    /// `q = fp8(x * mult)`.
    pub mult: f32,
    /// The scale as f32 (`x ≈ q * scale`).
    pub scale: f32,
    /// For power-of-two scales, the biased exponent (the e8m0 byte); 0 otherwise.
    pub e8m0: u8,
}

impl Quant {
    /// Checks the combination: `dst` must be an fp8 dtype, `src` a float dtype (f64, f32,
    /// bf16, f16), and e8m0 scales need a power-of-two scheme. `scale_dtype` `None` takes the
    /// scheme's default.
    pub fn new(
        scheme: QuantScheme,
        src: DType,
        dst: DType,
        scale_dtype: Option<ScaleDType>,
    ) -> Result<Quant, ConvertError> {
        let fp8 = Fp8::of(dst).ok_or(ConvertError::QuantDestination {
            scheme: scheme.to_string(),
            dst,
        })?;
        if !matches!(src, DType::F64 | DType::F32 | DType::Bf16 | DType::F16) {
            return Err(ConvertError::QuantSource {
                scheme: scheme.to_string(),
                src,
            });
        }
        let scale_dtype = scale_dtype.unwrap_or(scheme.default_scale_dtype());
        if scale_dtype == ScaleDType::E8M0 && !scheme.power_of_two() {
            return Err(ConvertError::ScaleDType {
                scheme: scheme.to_string(),
                scale_dtype,
            });
        }
        Ok(Quant {
            scheme,
            fp8,
            scale_dtype,
        })
    }

    /// The scale of a block whose largest magnitude is `amax` (finite, non-negative).
    pub fn scale(&self, amax: f32) -> BlockScale {
        let fmax = self.fp8.fmax();
        match self.scheme {
            QuantScheme::Block { ue8m0: false, .. }
            | QuantScheme::Channel
            | QuantScheme::Tensor => {
                let a = amax.max(AMAX_FLOOR);
                BlockScale {
                    mult: fmax / a,
                    scale: a / fmax,
                    e8m0: 0,
                }
            }
            QuantScheme::Block { ue8m0: true, .. } => {
                let a = amax.max(AMAX_FLOOR);
                pow2_scale(ceil_log2(a / fmax))
            }
            QuantScheme::Mx => {
                let e = if amax == 0.0 {
                    -127
                } else {
                    (floor_log2(amax) - self.fp8.emax()).clamp(-127, 127)
                };
                pow2_scale(e)
            }
        }
    }

    /// Writes `s` as this quantization's scale dtype into `out` (4 or 1 bytes).
    pub fn write_scale(&self, s: &BlockScale, out: &mut [u8]) {
        match self.scale_dtype {
            ScaleDType::F32 => out[..4].copy_from_slice(&s.scale.to_le_bytes()),
            ScaleDType::E8M0 => out[0] = s.e8m0,
        }
    }
}

/// `2^e` as a block scale, for `e` in [-127, 127].
fn pow2_scale(e: i32) -> BlockScale {
    BlockScale {
        mult: pow2(-e),
        scale: pow2(e),
        e8m0: (e + 127) as u8,
    }
}

/// `2^e` in f32, exactly, for `e` in [-149, 127] (subnormal below -126).
pub fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// `floor(log2(x))`, exactly, for a positive finite f32 (subnormals included).
pub fn floor_log2(x: f32) -> i32 {
    let bits = x.to_bits() & 0x7fff_ffff;
    let exp = (bits >> 23) as i32;
    if exp == 0 {
        // x = m * 2^-149 with m < 2^23
        31 - bits.leading_zeros() as i32 - 149
    } else {
        exp - 127
    }
}

/// `ceil(log2(x))`, exactly, for a positive finite f32.
pub fn ceil_log2(x: f32) -> i32 {
    let bits = x.to_bits() & 0x7fff_ffff;
    let exact = if bits >> 23 == 0 {
        bits.is_power_of_two()
    } else {
        bits & 0x7f_ffff == 0
    };
    floor_log2(x) + i32::from(!exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_parse_and_print_back() {
        for text in [
            "block:128x128",
            "block:1x32:ue8m0",
            "mx:32",
            "channel",
            "tensor",
        ] {
            let s = QuantScheme::parse(text).unwrap();
            assert_eq!(s.to_string(), text);
        }
        assert_eq!(
            "block:128x64".parse::<QuantScheme>().unwrap(),
            QuantScheme::Block {
                rows: 128,
                cols: 64,
                ue8m0: false
            }
        );
        for bad in [
            "block:0x128",
            "block:128",
            "block:axb",
            "block:1x1:e8m0",
            "mx:16",
            "row",
            "",
        ] {
            let err = QuantScheme::parse(bad).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("quant: {bad} is invalid")),
                "{err}"
            );
        }
        assert!(
            QuantScheme::parse("mx:64")
                .unwrap_err()
                .to_string()
                .contains("mx:32")
        );
        assert_eq!("e8m0".parse::<ScaleDType>().unwrap(), ScaleDType::E8M0);
        let err = "f16".parse::<ScaleDType>().unwrap_err().to_string();
        assert_eq!(err, "scale_dtype: f16 is invalid: expected `f32` or `e8m0`");
    }

    #[test]
    fn combinations_are_checked() {
        let block = QuantScheme::parse("block:128x128").unwrap();
        let mx = QuantScheme::Mx;
        let q = Quant::new(block, DType::Bf16, DType::Fp8E4M3, None).unwrap();
        assert_eq!((q.fp8, q.scale_dtype), (Fp8::E4M3, ScaleDType::F32));
        let q = Quant::new(mx, DType::F32, DType::Fp8E5M2, None).unwrap();
        assert_eq!(q.scale_dtype, ScaleDType::E8M0);
        let err = Quant::new(block, DType::Bf16, DType::Bf16, None).unwrap_err();
        assert!(
            err.to_string().contains("the destination dtype is bf16"),
            "{err}"
        );
        let err = Quant::new(block, DType::I32, DType::Fp8E4M3, None).unwrap_err();
        assert!(err.to_string().contains("the source dtype is i32"), "{err}");
        let err =
            Quant::new(block, DType::F32, DType::Fp8E4M3, Some(ScaleDType::E8M0)).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("scale_dtype e8m0: quant block:128x128"),
            "{err}"
        );
        let ue = QuantScheme::parse("block:128x128:ue8m0").unwrap();
        assert!(Quant::new(ue, DType::F32, DType::Fp8E4M3, Some(ScaleDType::E8M0)).is_ok());
    }

    #[test]
    fn block_shapes_and_the_dims_they_need() {
        let block = QuantScheme::parse("block:128x64").unwrap();
        assert_eq!(block.block_shape(&[8, 300, 200]).unwrap(), [1, 128, 64]);
        assert!(matches!(
            block.block_shape(&[300]),
            Err(ConvertError::SchemeNeedsDims {
                needs: 2,
                ndim: 1,
                ..
            })
        ));
        let empty = QuantScheme::Block {
            rows: 0,
            cols: 4,
            ue8m0: false,
        };
        assert_eq!(
            empty.block_shape(&[4, 4]).unwrap_err().to_string(),
            "quant block:0x4: a block needs at least one row and one column"
        );
        assert_eq!(QuantScheme::Mx.block_shape(&[4, 100]).unwrap(), [1, 32]);
        assert_eq!(
            QuantScheme::Channel.block_shape(&[4, 100]).unwrap(),
            [1, 100]
        );
        assert_eq!(QuantScheme::Tensor.block_shape(&[4, 0]).unwrap(), [4, 1]);
        assert!(QuantScheme::Tensor.block_shape(&[]).unwrap().is_empty());
        assert_eq!(QuantScheme::Channel.may_cut(3), [false, false, true]);
        assert_eq!(block.may_cut(2), [false, false]);
    }

    #[test]
    fn exact_logarithms() {
        for e in -149..=127 {
            let x = pow2(e);
            assert_eq!(floor_log2(x), e);
            assert_eq!(ceil_log2(x), e);
            let above = f32::from_bits(x.to_bits() + 1);
            // (above 2^-149 comes 2^-148 itself)
            if e > -149 && e < 127 {
                assert_eq!(floor_log2(above), e, "{e}");
                assert_eq!(ceil_log2(above), e + 1, "{e}");
            }
        }
        assert_eq!(floor_log2(f32::MAX), 127);
        assert_eq!(floor_log2(3.0 * pow2(-149)), -148);
    }

    #[test]
    fn scales_follow_the_formulas() {
        let q = |s: &str, fp8| {
            Quant::new(QuantScheme::parse(s).unwrap(), DType::F32, fp8, None).unwrap()
        };
        let e4 = DType::Fp8E4M3;
        // block: amax / FMAX, clamped below at 1e-4
        let s = q("block:128x128", e4).scale(2.0);
        assert_eq!((s.scale, s.mult), (2.0 / 448.0, 448.0 / 2.0));
        let s = q("block:128x128", e4).scale(0.0);
        assert_eq!((s.scale, s.mult), (1e-4 / 448.0, 448.0 / 1e-4));
        // ue8m0: 2^ceil(log2(amax / FMAX)): 448 / 448 = 1 -> 2^0; 449 / 448 -> 2^1
        let s = q("block:128x128:ue8m0", e4).scale(448.0);
        assert_eq!((s.scale, s.mult, s.e8m0), (1.0, 1.0, 127));
        let s = q("block:128x128:ue8m0", e4).scale(449.0);
        assert_eq!((s.scale, s.mult, s.e8m0), (2.0, 0.5, 128));
        let s = q("block:128x128:ue8m0", e4).scale(0.0);
        assert_eq!(s.scale, pow2(ceil_log2(1e-4 / 448.0)));
        // mx: E = floor(log2(amax)) - emax, clamped; amax 0 gives -127
        let s = q("mx:32", e4).scale(448.0);
        assert_eq!((s.scale, s.e8m0), (1.0, 127));
        let s = q("mx:32", DType::Fp8E5M2).scale(1.0);
        assert_eq!((s.scale, s.e8m0), (pow2(-15), 112));
        let s = q("mx:32", e4).scale(0.0);
        assert_eq!((s.scale, s.mult, s.e8m0), (pow2(-127), pow2(127), 0));
        let s = q("mx:32", e4).scale(f32::MAX);
        assert_eq!(s.e8m0, 127 + 119);
        let s = q("mx:32", e4).scale(pow2(-149));
        assert_eq!(s.e8m0, 0);
        let mut out = [0u8; 4];
        q("tensor", e4).write_scale(&q("tensor", e4).scale(4.48), &mut out);
        assert_eq!(f32::from_le_bytes(out), 4.48 / 448.0);
    }
}
