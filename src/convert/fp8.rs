//! The two OCP fp8 formats, as torch names them:
//! - `float8_e4m3fn` (`fp8e4m3`): 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
//!   NaN is `0x7f`/`0xff`; largest finite value FMAX = 448, smallest subnormal 2^-9.
//! - `float8_e5m2` (`fp8e5m2`): 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like with
//!   infinities (`0x7c`) and NaNs (`0x7d..=0x7f`); FMAX = 57344, smallest subnormal 2^-16.
//!
//! Encoding from f32 rounds to nearest even and saturates: a finite value beyond FMAX, or an
//! infinity, becomes ±FMAX (OCP's saturating mode, the one every quantization recipe uses, and
//! what torch's `.to(torch.float8_e4m3fn)` gives too). NaN stays NaN. Decoding is exact, by a
//! 256-entry table.

use std::sync::LazyLock;

use crate::convert::cast::{Format, decode, encode};
use crate::dtype::DType;

/// An fp8 format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    /// `float8_e4m3fn`: FMAX 448, no infinities.
    E4M3,
    /// `float8_e5m2`: FMAX 57344.
    E5M2,
}

const E4M3: Format = Format {
    m: 3,
    bias: 7,
    bits: 8,
    max_code: 0x7e,
    nan_code: 0x7f,
};

const E5M2: Format = Format {
    m: 2,
    bias: 15,
    bits: 8,
    max_code: 0x7b,
    nan_code: 0x7f,
};

static E4M3_TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| table(Fp8::E4M3));
static E5M2_TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| table(Fp8::E5M2));

fn table(fp8: Fp8) -> [f32; 256] {
    let mut t = [0f32; 256];
    for (code, v) in t.iter_mut().enumerate() {
        *v = fp8.decode_slow(code as u8);
    }
    t
}

impl Fp8 {
    /// The format of an fp8 dtype, `None` for any other dtype.
    pub fn of(dtype: DType) -> Option<Fp8> {
        match dtype {
            DType::Fp8E4M3 => Some(Fp8::E4M3),
            DType::Fp8E5M2 => Some(Fp8::E5M2),
            _ => None,
        }
    }

    /// The dtype of this format.
    pub fn dtype(self) -> DType {
        match self {
            Fp8::E4M3 => DType::Fp8E4M3,
            Fp8::E5M2 => DType::Fp8E5M2,
        }
    }

    /// The largest finite value.
    pub const fn fmax(self) -> f32 {
        match self {
            Fp8::E4M3 => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }

    /// `floor(log2(FMAX))`: the exponent of the largest power of two the format holds, which
    /// OCP MX calls `emax` (8 for e4m3, 15 for e5m2).
    pub const fn emax(self) -> i32 {
        match self {
            Fp8::E4M3 => 8,
            Fp8::E5M2 => 15,
        }
    }

    const fn format(self) -> Format {
        match self {
            Fp8::E4M3 => E4M3,
            Fp8::E5M2 => E5M2,
        }
    }

    /// f32 to fp8: nearest even, saturating at ±FMAX, NaN to NaN (`0x7f`, with the sign).
    #[inline(always)]
    pub fn encode(self, x: f32) -> u8 {
        // NaN keeps its sign; its payload fits in the 0x7f code whatever it is
        encode(x.to_bits(), self.format()) as u8
    }

    /// fp8 to f32 (exact), by table.
    #[inline(always)]
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Fp8::E4M3 => E4M3_TABLE[code as usize],
            Fp8::E5M2 => E5M2_TABLE[code as usize],
        }
    }

    /// fp8 to f32 from the bit fields, the table's source.
    fn decode_slow(self, code: u8) -> f32 {
        match self {
            // e4m3fn has no infinities: exponent 15 is an ordinary binade but for its NaN
            Fp8::E4M3 if code & 0x7f == 0x7f => {
                f32::NAN.copysign(if code & 0x80 != 0 { -1.0 } else { 1.0 })
            }
            Fp8::E4M3 if code & 0x78 == 0x78 => {
                let m = (code & 7) as f32;
                let v = (1.0 + m / 8.0) * 256.0;
                if code & 0x80 != 0 { -v } else { v }
            }
            _ => decode(code as u32, self.format()),
        }
    }

    /// Encodes `n` f32 values, `dst[i] = encode(src[i] * mult)`: the inner loop of every
    /// quantization scheme, over one run of elements that share a block (and so a
    /// multiplier). Source elements are read as f32 from `src_dtype` (see
    /// [`crate::convert::cast::read_f32`]).
    pub fn encode_scaled(self, src_dtype: DType, src: &[u8], mult: f32, dst: &mut [u8]) {
        match src_dtype {
            DType::F32 => {
                for (s, d) in src.chunks_exact(4).zip(dst.iter_mut()) {
                    let x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    *d = self.encode(x * mult);
                }
            }
            DType::Bf16 => {
                for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
                    let x = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
                    *d = self.encode(x * mult);
                }
            }
            _ => {
                let size = src_dtype.size();
                for (s, d) in src.chunks_exact(size).zip(dst.iter_mut()) {
                    *d = self.encode(crate::convert::cast::read_f32(src_dtype, s) * mult);
                }
            }
        }
    }
}
