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

use crate::convert::format::{Format, decode};
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

/// f32 to a saturating fp8 format: the magnitude's bits are clamped to FMAX's first (an
/// integer minimum, which also takes infinities to FMAX), so the rounding below never leaves
/// the finite codes, and NaN is put back at the end. Fewer operations than the general
/// [`encode`], for the loop every quantization scheme spends its time in.
#[inline(always)]
fn encode_saturating(x: f32, fmt: Format, fmax: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    let a = abs.min(fmax.to_bits());
    let shift = 23 - fmt.m;
    let normal = (a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift;
    let normal = normal.wrapping_sub((127 - fmt.bias) << fmt.m);
    let magic = f32::from_bits((151 - fmt.bias - fmt.m) << 23);
    let sub = (f32::from_bits(a) + magic)
        .to_bits()
        .wrapping_sub(magic.to_bits());
    let code = if a < (128 - fmt.bias) << 23 {
        sub
    } else {
        normal
    };
    let code = if abs > 0x7f80_0000 {
        fmt.nan_code
    } else {
        code
    };
    (code | sign) as u8
}

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
        encode_saturating(x, self.format(), self.fmax())
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
    /// [`crate::convert::cast::read_f32`]). On x86-64 CPUs with AVX2 the same loop runs
    /// compiled for AVX2 (twice the lanes, and the unsigned min and compare it needs).
    pub fn encode_scaled(self, src_dtype: DType, src: &[u8], mult: f32, dst: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                // SAFETY: the CPU supports AVX-512 F, BW and VL (BW and VL imply F).
                return unsafe { encode_scaled_avx512(self, src_dtype, src, mult, dst) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, checked just above.
                return unsafe { encode_scaled_avx2(self, src_dtype, src, mult, dst) };
            }
        }
        encode_scaled_body(self, src_dtype, src, mult, dst)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn encode_scaled_avx512(fp8: Fp8, src_dtype: DType, src: &[u8], mult: f32, dst: &mut [u8]) {
    encode_scaled_body(fp8, src_dtype, src, mult, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn encode_scaled_avx2(fp8: Fp8, src_dtype: DType, src: &[u8], mult: f32, dst: &mut [u8]) {
    encode_scaled_body(fp8, src_dtype, src, mult, dst)
}

/// The loop of [`Fp8::encode_scaled`], one instance per format and common source dtype so
/// that the format's constants fold into it.
#[inline(always)]
fn encode_scaled_body(fp8: Fp8, src_dtype: DType, src: &[u8], mult: f32, dst: &mut [u8]) {
    #[inline(always)]
    fn run<const N: usize>(
        (fmt, fmax): (Format, f32),
        src: &[u8],
        dst: &mut [u8],
        read: impl Fn(&[u8]) -> f32,
        mult: f32,
    ) {
        for (s, d) in src.chunks_exact(N).zip(dst.iter_mut()) {
            *d = encode_saturating(read(s) * mult, fmt, fmax);
        }
    }
    let bf16 = |s: &[u8]| f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
    let f32 = |s: &[u8]| f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let f16 = |s: &[u8]| crate::convert::format::f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    let f64 = |s: &[u8]| f64::from_le_bytes(s.try_into().expect("8 bytes")) as f32;
    match (fp8, src_dtype) {
        (Fp8::E4M3, DType::Bf16) => run::<2>((E4M3, 448.0), src, dst, bf16, mult),
        (Fp8::E5M2, DType::Bf16) => run::<2>((E5M2, 57344.0), src, dst, bf16, mult),
        (Fp8::E4M3, DType::F32) => run::<4>((E4M3, 448.0), src, dst, f32, mult),
        (Fp8::E5M2, DType::F32) => run::<4>((E5M2, 57344.0), src, dst, f32, mult),
        (Fp8::E4M3, DType::F16) => run::<2>((E4M3, 448.0), src, dst, f16, mult),
        (Fp8::E5M2, DType::F16) => run::<2>((E5M2, 57344.0), src, dst, f16, mult),
        (Fp8::E4M3, DType::F64) => run::<8>((E4M3, 448.0), src, dst, f64, mult),
        (Fp8::E5M2, DType::F64) => run::<8>((E5M2, 57344.0), src, dst, f64, mult),
        _ => {
            // What is left of the float sources are the fp8 ones (the other dtypes read as
            // NaN, as the casts' `read_f32` reads them).
            let read = |s: &[u8]| match src_dtype {
                DType::Fp8E4M3 => Fp8::E4M3.decode(s[0]),
                DType::Fp8E5M2 => Fp8::E5M2.decode(s[0]),
                _ => f32::NAN,
            };
            let size = src_dtype.size();
            for (s, d) in src.chunks_exact(size).zip(dst.iter_mut()) {
                *d = fp8.encode(read(s) * mult);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of a code from its bit fields, in f64, written apart from the encoder's
    /// tables: `None` for NaN, and e5m2's infinities as such.
    pub fn field_value(fp8: Fp8, code: u8) -> Option<f64> {
        let (ebits, m, bias) = match fp8 {
            Fp8::E4M3 => (4, 3, 7),
            Fp8::E5M2 => (5, 2, 15),
        };
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((code & 0x7f) >> m) as i32;
        let man = (code & ((1 << m) - 1)) as f64;
        let top = (1 << ebits) - 1;
        match fp8 {
            Fp8::E4M3 if code & 0x7f == 0x7f => return None,
            Fp8::E5M2 if e == top && man != 0.0 => return None,
            Fp8::E5M2 if e == top => return Some(sign * f64::INFINITY),
            _ => {}
        }
        let scale = 2f64.powi(if e == 0 { 1 - bias } else { e - bias });
        let lead = if e == 0 { 0.0 } else { 1.0 };
        Some(sign * (lead + man / (1 << m) as f64) * scale)
    }

    /// The code nearest to `x` among the finite ones, ties to an even code; beyond FMAX, FMAX.
    fn nearest_code(fp8: Fp8, x: f32) -> u8 {
        // saturation first: beyond FMAX, f64 distances to the top codes lose their difference
        let x = (x as f64).clamp(-fp8.fmax() as f64, fp8.fmax() as f64);
        let mut best: Option<(f64, u8)> = None;
        for code in 0..=255u8 {
            let Some(v) = field_value(fp8, code).filter(|v| v.is_finite()) else {
                continue;
            };
            if v == 0.0 && (code & 0x80 != 0) != x.is_sign_negative() {
                continue; // keep the zero of x's sign
            }
            let d = (x - v).abs();
            best = match best {
                Some((bd, bc)) if bd < d || (bd == d && bc & 1 == 0) => Some((bd, bc)),
                _ => Some((d, code)),
            };
        }
        best.unwrap().1
    }

    #[test]
    fn the_tables_decode_every_code() {
        for fp8 in [Fp8::E4M3, Fp8::E5M2] {
            for code in 0..=255u8 {
                let got = fp8.decode(code);
                match field_value(fp8, code) {
                    None => assert!(got.is_nan(), "{fp8:?} {code:#x}"),
                    Some(v) => assert_eq!(got as f64, v, "{fp8:?} {code:#x}"),
                }
            }
        }
        assert_eq!(Fp8::E4M3.decode(0x7e), 448.0);
        assert_eq!(Fp8::E5M2.decode(0x7b), 57344.0);
        assert_eq!(Fp8::E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(Fp8::E5M2.decode(0x01), 2f32.powi(-16));
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        for fp8 in [Fp8::E4M3, Fp8::E5M2] {
            // every code, the midpoints to its neighbours and an f32 ulp around them
            let mut xs = Vec::new();
            for code in 0..0x7fu8 {
                let (Some(a), Some(b)) = (field_value(fp8, code), field_value(fp8, code + 1))
                else {
                    continue;
                };
                if !b.is_finite() {
                    continue;
                }
                let mid = ((a + b) / 2.0) as f32;
                for x in [
                    a as f32,
                    mid,
                    f32::from_bits(mid.to_bits() - 1),
                    f32::from_bits(mid.to_bits() + 1),
                ] {
                    xs.extend([x, -x]);
                }
            }
            xs.extend((0..=u32::MAX / 65521).map(|i| f32::from_bits(i * 65521)));
            xs.extend([
                fp8.fmax() * 1.1,
                f32::MAX,
                f32::INFINITY,
                f32::NEG_INFINITY,
                1e-30,
                -0.0,
            ]);
            for x in xs {
                if x.is_nan() {
                    continue;
                }
                assert_eq!(
                    fp8.encode(x),
                    nearest_code(fp8, x),
                    "{fp8:?} {x:e} ({:#x})",
                    x.to_bits()
                );
            }
            assert!(fp8.decode(fp8.encode(f32::NAN)).is_nan());
            assert_eq!(fp8.encode(-f32::NAN), 0xff);
            assert_eq!(fp8.decode(fp8.encode(f32::INFINITY)), fp8.fmax());
            assert_eq!(fp8.decode(fp8.encode(-1e30)), -fp8.fmax());
        }
    }

    /// The vector loops (with their tails: every length up to 100, at odd offsets) give what
    /// the scalar encoder gives.
    #[test]
    fn scaled_encoding_of_long_runs_equals_the_scalar_encoding() {
        let xs: Vec<f32> = (0..1000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9) & 0xc7ff_ffff))
            .chain([f32::NAN, f32::INFINITY, -f32::INFINITY, 1e-45, -0.0])
            .collect();
        for dtype in [DType::F32, DType::Bf16, DType::F16, DType::F64] {
            let e = dtype.size();
            let mut src = vec![0u8; 1 + xs.len() * e];
            for (i, &x) in xs.iter().enumerate() {
                crate::convert::cast::write_f32(dtype, x, &mut src[1 + i * e..]);
            }
            for fp8 in [Fp8::E4M3, Fp8::E5M2] {
                for mult in [1.0f32, 3.7, 1e-3] {
                    for len in (0..100).chain([xs.len()]) {
                        let mut dst = vec![0u8; len];
                        fp8.encode_scaled(dtype, &src[1..1 + len * e], mult, &mut dst);
                        for (i, &got) in dst.iter().enumerate() {
                            let x = crate::convert::cast::read_f32(dtype, &src[1 + i * e..]);
                            assert_eq!(got, fp8.encode(x * mult), "{dtype} {fp8:?} {x}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn scaled_encoding_reads_every_float_source() {
        let xs = [0.5f32, -3.0, 1e-3, 300.0, 0.0];
        for dtype in [DType::F64, DType::F32, DType::Bf16, DType::F16] {
            let mut src = vec![0u8; xs.len() * dtype.size()];
            for (i, &x) in xs.iter().enumerate() {
                crate::convert::cast::write_f32(dtype, x, &mut src[i * dtype.size()..]);
            }
            let mut dst = vec![0u8; xs.len()];
            Fp8::E4M3.encode_scaled(dtype, &src, 2.0, &mut dst);
            for (i, &x) in xs.iter().enumerate() {
                let read = crate::convert::cast::read_f32(dtype, &src[i * dtype.size()..]);
                assert_eq!(dst[i], Fp8::E4M3.encode(read * 2.0), "{dtype} {x}");
            }
        }
    }
}
