//! The bit arithmetic of small binary float formats (f16 and both fp8 formats): one encoder
//! and one decoder over f32 bits, with the constants of each format. Below both the casts and
//! the fp8 codecs, which share it; and the scalar bf16 and f16 conversions built on it.

/// A small binary float format: `m` mantissa bits and exponent bias `bias`, encoded from f32.
/// f16 and both fp8 formats share one encoder; only the constants differ.
#[derive(Clone, Copy, Debug)]
pub struct Format {
    /// Mantissa bits.
    pub m: u32,
    /// Exponent bias.
    pub bias: u32,
    /// Total bits (8 or 16): where the sign goes.
    pub bits: u32,
    /// Largest code a finite input may round to: the largest finite value for a saturating
    /// format, the infinity code for one with infinities.
    pub max_code: u32,
    /// The code of a NaN (without sign).
    pub nan_code: u32,
}

/// IEEE binary16.
pub const F16: Format = Format {
    m: 10,
    bias: 15,
    bits: 16,
    max_code: 0x7c00,
    nan_code: 0x7e00,
};

/// Encodes f32 bits into `fmt`, rounding to nearest even. Inputs beyond the largest finite
/// value (and ±inf) give `max_code`; NaN gives `nan_code` (for f16: with the top bits of the
/// payload kept, as the hardware conversion does).
#[inline(always)]
pub fn encode(bits: u32, fmt: Format) -> u32 {
    let sign = (bits >> 31) << (fmt.bits - 1);
    let abs = bits & 0x7fff_ffff;
    // Normal results: round the f32 mantissa to `m` bits; a carry rolls into the exponent,
    // which is what rounding up to the next binade must do.
    let shift = 23 - fmt.m;
    let rounded = abs.wrapping_add((1 << (shift - 1)) - 1 + ((abs >> shift) & 1));
    let normal = (rounded >> shift).wrapping_sub((127 - fmt.bias) << fmt.m);
    // Subnormal results: adding 2^k (k = 24 - bias - m), whose ulp is the format's subnormal spacing, makes the
    // f32 adder round to that spacing (nearest even); the difference of the bit patterns is
    // then the code (up to and including the smallest normal).
    let magic = f32::from_bits((151 - fmt.bias - fmt.m) << 23);
    let sub = (f32::from_bits(abs) + magic)
        .to_bits()
        .wrapping_sub(magic.to_bits());
    let min_normal = (128 - fmt.bias) << 23;
    let code = if abs < min_normal { sub } else { normal };
    let code = code.min(fmt.max_code);
    let nan = fmt.nan_code | ((abs >> shift) & ((1 << fmt.m) - 1));
    let code = if abs > 0x7f80_0000 { nan } else { code };
    sign | code
}

/// Decodes `fmt` bits into f32 (exactly: every value of these formats is an f32).
#[inline(always)]
pub fn decode(code: u32, fmt: Format) -> f32 {
    let sign = (code >> (fmt.bits - 1)) << 31;
    let abs = code & ((1 << (fmt.bits - 1)) - 1);
    let exp_mask = ((1 << (fmt.bits - 1 - fmt.m)) - 1) << fmt.m;
    let shift = 23 - fmt.m;
    let normal = (abs << shift) + ((127 - fmt.bias) << 23);
    let special = (abs << shift) | 0x7f80_0000;
    // subnormal: mantissa times the subnormal spacing, exact in f32
    let spacing = f32::from_bits((127 + 1 - fmt.bias - fmt.m) << 23);
    let sub = ((abs as f32) * spacing).to_bits();
    let exp = abs & exp_mask;
    let out = if exp == 0 {
        sub
    } else if exp == exp_mask {
        special
    } else {
        normal
    };
    f32::from_bits(sign | out)
}

/// f32 to bf16 bits, as torch: nearest even; NaN gives `0xffff`.
#[inline(always)]
pub fn bf16_from_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    if x.is_nan() { 0xffff } else { rounded }
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to f16 bits, as torch: nearest even, overflow to ±inf.
#[inline(always)]
pub fn f16_from_f32(x: f32) -> u16 {
    encode(x.to_bits(), F16) as u16
}

/// f16 bits to f32 (exact).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    decode(h as u32, F16)
}
