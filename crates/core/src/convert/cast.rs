//! Float casts between f64, f32, bf16 and f16 (and, unscaled, into the fp8 formats), as
//! slice-to-slice kernels over little-endian byte buffers.
//!
//! Every cast gives the bits torch's `.to()` gives on the CPU:
//! - rounding to nearest, ties to even, with subnormals rounded like any other value;
//! - overflow gives ±inf (bf16, f16, f32) or, for the fp8 formats, which the quantization
//!   schemes call only on scaled values, saturates at ±FMAX;
//! - NaN stays NaN: bf16 NaN is `0xffff` (torch's vectorized kernels write that whatever the
//!   sign; its scalar loop, which finishes a tensor's tail, writes `0x7fc0`), f16 NaN keeps its sign and the top bits of its payload, quieted, and f32 NaN from
//!   f64 likewise;
//! - from f64 to a type narrower than f32, torch rounds to f32 first and then to the target
//!   (its `Half` and `BFloat16` are built from a `float`). We do the same, so
//!   `1 + 2^-8 + 2^-40` becomes bf16 `1.0`, not `1 + 2^-7`, exactly as `.to(torch.bfloat16)`.
//!
//! The kernels decode each element to f32 (or f64), encode it with integer bit arithmetic and
//! a branch-free select, so that the compiler vectorizes the loop; they take byte slices, which
//! need no alignment, because the executor's buffers and messages are plain bytes.

use crate::convert::ConvertError;
pub use crate::convert::format::{
    F16, Format, bf16_from_f32, bf16_to_f32, decode, encode, f16_from_f32, f16_to_f32,
};
use crate::convert::fp8::Fp8;
use crate::dtype::DType;

/// A cast kernel: converts the elements of `src` (source dtype, little-endian) into `dst`
/// (destination dtype). It converts `min(src.len() / src_size, dst.len() / dst_size)`
/// elements; the caller gives slices of exactly `n` elements each.
pub type CastFn = fn(&[u8], &mut [u8]);

/// Whether a conversion from `src` to `dst` exists as a plain cast (no scales): equal dtypes
/// (a copy), or both among f64, f32, bf16 and f16. Integer and bool conversions are refused
/// (torch would wrap or truncate silently, which a weight refit never wants), and so is any
/// cast into fp8 without a quantization scheme (unscaled fp8 loses most weights to zero or to
/// saturation); see [`crate::convert::quant`] for those.
pub fn cast_supported(src: DType, dst: DType) -> Result<(), ConvertError> {
    let refuse = |reason: &'static str| Err(ConvertError::UnsupportedCast { src, dst, reason });
    if src == dst {
        return Ok(());
    }
    let float = |d: DType| matches!(d, DType::F64 | DType::F32 | DType::Bf16 | DType::F16);
    let fp8 = |d: DType| matches!(d, DType::Fp8E4M3 | DType::Fp8E5M2);
    if fp8(dst) {
        return refuse("an fp8 destination needs scales: give a quantization scheme (quant)");
    }
    if fp8(src) {
        return refuse("an fp8 source carries scales: its destination must be the same fp8 dtype");
    }
    if !float(src) || !float(dst) {
        return refuse("only float casts among f64, f32, bf16 and f16 are supported");
    }
    Ok(())
}

/// The kernel that casts `src` elements to `dst` ones, for the pairs [`cast_supported`]
/// accepts (equal dtypes give a plain copy). The executor looks it up once per tensor and
/// calls it on every contiguous run it packs.
pub fn cast_fn(src: DType, dst: DType) -> Result<CastFn, ConvertError> {
    cast_supported(src, dst)?;
    Ok(if src == dst {
        copy
    } else {
        match (src, dst) {
            (DType::F32, DType::Bf16) => f32_to_bf16,
            (DType::F32, DType::F16) => f32_to_f16,
            (DType::F32, DType::F64) => f32_to_f64,
            (DType::F64, DType::F32) => f64_to_f32,
            (DType::F64, DType::Bf16) => f64_to_bf16,
            (DType::F64, DType::F16) => f64_to_f16,
            (DType::Bf16, DType::F32) => bf16_to_f32s,
            (DType::Bf16, DType::F64) => bf16_to_f64,
            (DType::Bf16, DType::F16) => bf16_to_f16,
            (DType::F16, DType::F32) => f16_to_f32s,
            (DType::F16, DType::F64) => f16_to_f64,
            (DType::F16, DType::Bf16) => f16_to_bf16,
            _ => unreachable!("cast_supported admits float pairs only"),
        }
    })
}

/// Casts `src` (dtype `from`) into `dst` (dtype `to`), checking the pair and the lengths:
/// the convenient form of [`cast_fn`] for whole buffers.
pub fn cast(from: DType, to: DType, src: &[u8], dst: &mut [u8]) -> Result<(), ConvertError> {
    let kernel = cast_fn(from, to)?;
    let n = src.len() / from.size();
    if !src.len().is_multiple_of(from.size()) || dst.len() != n * to.size() {
        return Err(ConvertError::Length {
            src: from,
            src_bytes: src.len() as u64,
            dst: to,
            dst_bytes: dst.len() as u64,
        });
    }
    kernel(src, dst);
    Ok(())
}

/// Reads element `I` little-endian bytes.
macro_rules! le {
    ($t:ty, $s:expr) => {
        <$t>::from_le_bytes($s.try_into().expect("chunks_exact gives whole elements"))
    };
}

/// A kernel from `$st` elements to `$dt` ones through `$f`: one loop, compiled twice on
/// x86-64 (for the baseline and for AVX2, chosen at run time) so that it runs as wide as the
/// CPU allows without asking the build for a target CPU.
macro_rules! kernel {
    ($name:ident, $st:ty, $dt:ty, $f:expr) => {
        fn $name(src: &[u8], dst: &mut [u8]) {
            #[inline(always)]
            fn body(src: &[u8], dst: &mut [u8]) {
                const S: usize = std::mem::size_of::<$st>();
                const D: usize = std::mem::size_of::<$dt>();
                let f = $f;
                for (s, d) in src.chunks_exact(S).zip(dst.chunks_exact_mut(D)) {
                    let v: $dt = f(le!($st, s));
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn wide(src: &[u8], dst: &mut [u8]) {
                body(src, dst)
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, checked just above.
                return unsafe { wide(src, dst) };
            }
            body(src, dst)
        }
    };
}

fn copy(src: &[u8], dst: &mut [u8]) {
    let n = src.len().min(dst.len());
    dst[..n].copy_from_slice(&src[..n]);
}

kernel!(f32_to_bf16, u32, u16, |b| bf16_from_f32(f32::from_bits(b)));
kernel!(f32_to_f16, u32, u16, |b| encode(b, F16) as u16);
kernel!(f32_to_f64, u32, u64, |b| (f32::from_bits(b) as f64)
    .to_bits());
kernel!(f64_to_f32, u64, u32, |b| (f64::from_bits(b) as f32)
    .to_bits());
kernel!(f64_to_bf16, u64, u16, |b| bf16_from_f32(
    f64::from_bits(b) as f32
));
kernel!(
    f64_to_f16,
    u64,
    u16,
    |b| encode((f64::from_bits(b) as f32).to_bits(), F16) as u16
);
kernel!(bf16_to_f32s, u16, u32, |h| (h as u32) << 16);
kernel!(bf16_to_f64, u16, u64, |h| (bf16_to_f32(h) as f64).to_bits());
kernel!(bf16_to_f16, u16, u16, |h| f16_from_f32(bf16_to_f32(h)));
kernel!(f16_to_f32s, u16, u32, |h| f16_to_f32(h).to_bits());
kernel!(f16_to_f64, u16, u64, |h| (f16_to_f32(h) as f64).to_bits());
kernel!(f16_to_bf16, u16, u16, |h| bf16_from_f32(f16_to_f32(h)));

/// Reads element `i` of a float buffer of dtype `dtype` as f32 (f64 rounded to nearest even;
/// fp8 decoded). The quantizer's (and the reference's) view of a source element.
#[inline(always)]
pub fn read_f32(dtype: DType, bytes: &[u8]) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
        DType::F64 => f64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as f32,
        DType::Bf16 => bf16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
        DType::F16 => f16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
        DType::Fp8E4M3 => Fp8::E4M3.decode(bytes[0]),
        DType::Fp8E5M2 => Fp8::E5M2.decode(bytes[0]),
        _ => f32::NAN,
    }
}

/// Writes f32 `x` into `out` as `dtype` (rounding as the casts do; fp8 unscaled, saturating).
/// Integer dtypes are not float destinations: they get the f32 bits truncated, which no
/// caller asks for ([`cast_supported`] refuses them first).
pub fn write_f32(dtype: DType, x: f32, out: &mut [u8]) {
    match dtype {
        DType::F32 => out[..4].copy_from_slice(&x.to_le_bytes()),
        DType::F64 => out[..8].copy_from_slice(&(x as f64).to_le_bytes()),
        DType::Bf16 => out[..2].copy_from_slice(&bf16_from_f32(x).to_le_bytes()),
        DType::F16 => out[..2].copy_from_slice(&f16_from_f32(x).to_le_bytes()),
        DType::Fp8E4M3 => out[0] = Fp8::E4M3.encode(x),
        DType::Fp8E5M2 => out[0] = Fp8::E5M2.encode(x),
        d => {
            let n = d.size().min(4);
            out[..n].copy_from_slice(&x.to_bits().to_le_bytes()[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 bit patterns to test: a stride over all 2^32 and, for every value of a 16-bit
    /// format, the midpoints to its neighbour and one f32 ulp either side (ties and near-ties).
    fn patterns(stride: u32) -> impl Iterator<Item = u32> {
        let strided = (0..=u32::MAX / stride).map(move |i| i * stride);
        let ties = (0..=0xffffu32).flat_map(|h| {
            // bf16 midpoints (16 dropped bits) and f16 midpoints in the normal range
            let bf = (h << 16) | 0x8000;
            let f16mid = f32::from_bits(0x3800_0000 + (h << 13)).to_bits() | 0x1000;
            [bf - 1, bf, bf + 1, f16mid - 1, f16mid, f16mid + 1]
        });
        strided.chain(ties)
    }

    /// The nearer of two candidate codes for `x` by exact f64 distance, ties to the even one.
    fn nearest(x: f64, lo: (u32, f64), hi: (u32, f64)) -> u32 {
        let (dl, dh) = ((x - lo.1).abs(), (hi.1 - x).abs());
        if dl < dh || (dl == dh && lo.0 & 1 == 0) {
            lo.0
        } else {
            hi.0
        }
    }

    #[test]
    fn bf16_from_f32_rounds_to_nearest_even() {
        for bits in patterns(4099) {
            let x = f32::from_bits(bits);
            let got = bf16_from_f32(x);
            if x.is_nan() {
                assert_eq!(got, 0xffff, "{bits:#x}");
                continue;
            }
            // the two bf16 values around x, by truncation of the magnitude
            let t = (bits >> 16) as u16;
            let lo = (t as u32, bf16_to_f32(t) as f64);
            let up = bf16_to_f32(t.wrapping_add(1)) as f64;
            let up = if up.is_nan() { f64::INFINITY } else { up };
            let want = if bits & 0xffff == 0 {
                t
            } else {
                let hi = (t as u32 + 1, up);
                // bf16 max rounds up to inf when it is at least halfway to 2^128
                let x = x as f64;
                if hi.1.is_infinite() {
                    let half = (bf16_to_f32(t) as f64).abs() + 2f64.powi(119);
                    if x.abs() >= half { t + 1 } else { t }
                } else {
                    nearest(x, lo, hi) as u16
                }
            };
            assert_eq!(got, want, "{bits:#x}");
        }
    }

    #[test]
    fn every_bf16_and_f16_decodes_exactly_and_encodes_back() {
        for h in 0..=0xffffu16 {
            // bf16: an f32 with the low half zero
            let x = bf16_to_f32(h);
            assert_eq!(x.to_bits(), (h as u32) << 16);
            if !x.is_nan() {
                assert_eq!(bf16_from_f32(x), h);
            }
            // f16 against the fields, in f64
            let (s, e, m) = ((h >> 15) as i32, ((h >> 10) & 31) as i32, (h & 1023) as f64);
            let sign = if s == 1 { -1.0 } else { 1.0 };
            let want = match e {
                0 => sign * m * 2f64.powi(-24),
                31 if m == 0.0 => sign * f64::INFINITY,
                31 => f64::NAN,
                _ => sign * (1.0 + m / 1024.0) * 2f64.powi(e - 15),
            };
            let got = f16_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan() && got.is_sign_negative() == (s == 1), "{h:#x}");
                // a NaN keeps its payload's top bits, quieted
                assert_eq!(f16_from_f32(got), h | 0x200, "{h:#x}");
            } else {
                assert_eq!(got as f64, want, "{h:#x}");
                assert_eq!(f16_from_f32(got), h, "{h:#x}");
            }
            let other = half::f16::from_bits(h).to_f32();
            assert!(got.to_bits() == other.to_bits() || (got.is_nan() && other.is_nan()));
        }
    }

    #[test]
    fn f16_from_f32_agrees_with_the_half_crate() {
        for bits in patterns(4099) {
            let x = f32::from_bits(bits);
            let got = f16_from_f32(x);
            let want = half::f16::from_f32(x).to_bits();
            if x.is_nan() {
                assert!(f16_to_f32(got).is_nan(), "{bits:#x}");
                assert_eq!(got & 0x8000, want & 0x8000, "{bits:#x}");
            } else {
                assert_eq!(got, want, "{bits:#x} ({x})");
            }
        }
    }

    fn golden(text: &str) -> Vec<Vec<u64>> {
        text.lines()
            .map(|l| {
                l.split_whitespace()
                    .map(|w| u64::from_str_radix(w, 16).unwrap())
                    .collect()
            })
            .collect()
    }

    /// Bits torch 2.15 (CPU) gives for `.to()`, generated by `golden/gen.py`.
    #[test]
    fn f32_casts_match_torch() {
        let rows = golden(include_str!("golden/f32.txt"));
        assert!(rows.len() > 1000);
        for r in rows {
            let x = f32::from_bits(r[0] as u32);
            assert_eq!(bf16_from_f32(x) as u64, r[1], "bf16 of {:#x}", r[0]);
            assert_eq!(f16_from_f32(x) as u64, r[2], "f16 of {:#x}", r[0]);
            assert_eq!(Fp8::E4M3.encode(x) as u64, r[3], "e4m3 of {:#x}", r[0]);
            // torch's e5m2 overflows to inf, where the schemes saturate at FMAX
            let e5 = Fp8::E5M2.encode(x) as u64;
            if r[4] & 0x7f == 0x7c {
                assert_eq!(e5, r[4] - 1, "e5m2 of {:#x}", r[0]);
            } else {
                assert_eq!(e5, r[4], "e5m2 of {:#x}", r[0]);
            }
        }
    }

    #[test]
    fn f64_casts_match_torch() {
        let rows = golden(include_str!("golden/f64.txt"));
        assert!(rows.len() > 300);
        for r in rows {
            let src = r[0].to_le_bytes();
            for (dst, want, width) in [
                (DType::F32, r[1], 4),
                (DType::Bf16, r[2], 2),
                (DType::F16, r[3], 2),
            ] {
                let mut out = vec![0u8; width];
                cast(DType::F64, dst, &src, &mut out).unwrap();
                let mut got = [0u8; 8];
                got[..width].copy_from_slice(&out);
                let got = u64::from_le_bytes(got);
                if dst == DType::Bf16 && want & 0x7fff > 0x7f80 {
                    // torch writes bf16 NaN as 0xffff in its vector loop and 0x7fc0 in the
                    // scalar tail after it; either way a NaN
                    assert!(got & 0x7fff > 0x7f80, "{dst} of {:#x}", r[0]);
                } else {
                    assert_eq!(got, want, "{dst} of {:#x}", r[0]);
                }
            }
        }
    }

    /// Every kernel, over a byte buffer at an odd offset, equals its element function.
    #[test]
    fn kernels_equal_the_element_casts() {
        let floats = [DType::F64, DType::F32, DType::Bf16, DType::F16];
        let values: Vec<f32> = patterns(1 << 20).take(5000).map(f32::from_bits).collect();
        for from in floats {
            let mut src = vec![0u8; 1 + values.len() * from.size()];
            for (i, &v) in values.iter().enumerate() {
                write_f32(from, v, &mut src[1 + i * from.size()..]);
            }
            for to in floats {
                let mut dst = vec![0u8; values.len() * to.size()];
                cast(from, to, &src[1..], &mut dst).unwrap();
                for i in 0..values.len() {
                    let x = read_f32(from, &src[1 + i * from.size()..]);
                    let got = &dst[i * to.size()..(i + 1) * to.size()];
                    let mut want = vec![0u8; to.size()];
                    if from == DType::F64 && to == DType::F64 {
                        want.copy_from_slice(&src[1 + i * 8..9 + i * 8]);
                    } else if to == DType::F64 && !x.is_nan() {
                        want.copy_from_slice(&(x as f64).to_le_bytes());
                    } else {
                        write_f32(to, x, &mut want);
                    }
                    if x.is_nan() {
                        assert!(read_f32(to, got).is_nan(), "{from}->{to} {i}");
                    } else {
                        assert_eq!(got, &want[..], "{from}->{to} of {x}");
                    }
                }
            }
        }
    }

    #[test]
    fn only_float_casts_are_supported() {
        let float = [DType::F64, DType::F32, DType::Bf16, DType::F16];
        for a in DType::ALL {
            for b in DType::ALL {
                let ok = a == b || (float.contains(&a) && float.contains(&b));
                assert_eq!(cast_supported(a, b).is_ok(), ok, "{a} -> {b}");
                assert_eq!(cast_fn(a, b).is_ok(), ok, "{a} -> {b}");
            }
        }
        let err = cast_supported(DType::Bf16, DType::Fp8E4M3).unwrap_err();
        assert!(err.to_string().contains("quant"), "{err}");
        let err = cast_supported(DType::F32, DType::I32).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dst_dtype: cannot convert f32 to i32: only float casts among f64, f32, bf16 and f16 are supported"
        );
    }

    #[test]
    fn lengths_that_disagree_are_an_error() {
        let err = cast(DType::F32, DType::Bf16, &[0; 8], &mut [0; 2]).unwrap_err();
        assert!(
            matches!(
                err,
                ConvertError::Length {
                    src_bytes: 8,
                    dst_bytes: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(cast(DType::F32, DType::Bf16, &[0; 7], &mut [0; 2]).is_err());
        let mut out = [0u8; 4];
        cast(
            DType::F32,
            DType::Bf16,
            &1.5f32.to_le_bytes().repeat(2),
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0xc0, 0x3f, 0xc0, 0x3f]);
    }
}
