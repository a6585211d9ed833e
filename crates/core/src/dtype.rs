//! Element types. Data moves as bytes; a dtype only fixes the element size.
//!
//! Below the errors, which name dtypes: parsing a name into an [`Error`](crate::Error) (the
//! `FromStr` impls) is written beside the errors, in `error::parse`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// An element type, named as PyTorch names it (short forms).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DType {
    /// `torch.bool`: one byte, 0 or 1.
    Bool,
    /// `torch.uint8`: unsigned 8-bit integer.
    U8,
    /// `torch.int8`: signed 8-bit integer.
    I8,
    /// `torch.float8_e4m3fn`: 8-bit float, 4 exponent and 3 mantissa bits, no infinities.
    Fp8E4M3,
    /// `torch.float8_e5m2`: 8-bit float, 5 exponent and 2 mantissa bits.
    Fp8E5M2,
    /// `torch.bfloat16`: 16-bit float, f32's 8 exponent bits and 7 mantissa bits.
    Bf16,
    /// `torch.float16`: IEEE half precision.
    F16,
    /// `torch.int16`: signed 16-bit integer.
    I16,
    /// `torch.uint16`: unsigned 16-bit integer.
    U16,
    /// `torch.float32`: IEEE single precision.
    F32,
    /// `torch.int32`: signed 32-bit integer.
    I32,
    /// `torch.uint32`: unsigned 32-bit integer.
    U32,
    /// `torch.float64`: IEEE double precision.
    F64,
    /// `torch.int64`: signed 64-bit integer.
    I64,
    /// `torch.uint64`: unsigned 64-bit integer.
    U64,
}

impl DType {
    /// Every dtype, in the order of the table in the design notes.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::Fp8E4M3,
        DType::Fp8E5M2,
        DType::Bf16,
        DType::F16,
        DType::I16,
        DType::U16,
        DType::F32,
        DType::I32,
        DType::U32,
        DType::F64,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::Fp8E4M3 | DType::Fp8E5M2 => 1,
            DType::Bf16 | DType::F16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The dtype named `name`: the short names and the common long ones (`bfloat16`,
    /// `float32`, `torch.float16`), in any case. `str::parse` wraps a miss into
    /// [`Error::UnknownDType`](crate::Error::UnknownDType).
    pub fn from_name(name: &str) -> Option<DType> {
        let key = name.trim().to_ascii_lowercase();
        let key = key.strip_prefix("torch.").unwrap_or(&key);
        Some(match key {
            "bool" => DType::Bool,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "fp8e4m3" | "f8e4m3" | "float8_e4m3fn" | "fp8_e4m3" | "e4m3" => DType::Fp8E4M3,
            "fp8e5m2" | "f8e5m2" | "float8_e5m2" | "fp8_e5m2" | "e5m2" => DType::Fp8E5M2,
            "bf16" | "bfloat16" => DType::Bf16,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "i16" | "int16" => DType::I16,
            "u16" | "uint16" => DType::U16,
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "i32" | "int32" => DType::I32,
            "u32" | "uint32" => DType::U32,
            "f64" | "fp64" | "float64" | "double" => DType::F64,
            "i64" | "int64" | "long" => DType::I64,
            "u64" | "uint64" => DType::U64,
            _ => return None,
        })
    }

    /// The canonical short name (`bf16`, `fp8e4m3`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::Fp8E4M3 => "fp8e4m3",
            DType::Fp8E5M2 => "fp8e5m2",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<DType> for String {
    fn from(d: DType) -> String {
        d.name().to_string()
    }
}

/// The element type of the scales (`--scale-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleDType {
    /// f32, little-endian: the scale itself.
    F32,
    /// e8m0: a u8 biased exponent, `2^(byte - 127)`; only for power-of-two scales.
    E8M0,
}

impl ScaleDType {
    /// Bytes per scale.
    pub const fn size(self) -> usize {
        match self {
            ScaleDType::F32 => 4,
            ScaleDType::E8M0 => 1,
        }
    }

    /// The scale dtype named `name` (`f32`, `e8m0` and their long names).
    pub fn from_name(name: &str) -> Option<ScaleDType> {
        match name {
            "f32" | "float32" => Some(ScaleDType::F32),
            "e8m0" | "ue8m0" => Some(ScaleDType::E8M0),
            _ => None,
        }
    }

    /// The dtype the scale buffer has (`f32` or `u8`).
    pub const fn dtype(self) -> DType {
        match self {
            ScaleDType::F32 => DType::F32,
            ScaleDType::E8M0 => DType::U8,
        }
    }
}

impl fmt::Display for ScaleDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScaleDType::F32 => "f32",
            ScaleDType::E8M0 => "e8m0",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(DType::Bf16.size(), 2);
        assert_eq!(DType::Fp8E4M3.size(), 1);
        assert_eq!(DType::F64.size(), 8);
        assert_eq!("torch.bfloat16".parse::<DType>().unwrap(), DType::Bf16);
    }

    #[test]
    fn unknown_dtype_names_the_value() {
        let err = "bf17".parse::<DType>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "dtype: unknown dtype `bf17` (expected one of bool, u8, i8, fp8e4m3, fp8e5m2, bf16, f16, i16, u16, f32, i32, u32, f64, i64, u64)"
        );
    }
}
