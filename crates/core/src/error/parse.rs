//! Parsing the names of the value types below the errors (dtypes, scale dtypes): written here,
//! beside the errors, because a bad name is an [`Error`] and the errors name those types
//! themselves; the names are looked up by the types' own `from_name`.

use std::str::FromStr;

use super::{Error, Field};
use crate::dtype::{DType, ScaleDType};

impl FromStr for DType {
    type Err = Error;

    /// Accepts the short names and the common long ones (`bfloat16`, `float32`, `torch.float16`).
    fn from_str(s: &str) -> Result<Self, Error> {
        DType::from_name(s).ok_or_else(|| Error::UnknownDType {
            value: s.to_string(),
        })
    }
}

impl TryFrom<String> for DType {
    type Error = Error;
    fn try_from(s: String) -> Result<Self, Error> {
        s.parse()
    }
}

impl FromStr for ScaleDType {
    type Err = Error;

    /// `f32` or `e8m0`.
    fn from_str(s: &str) -> Result<ScaleDType, Error> {
        ScaleDType::from_name(s).ok_or_else(|| Error::InvalidOption {
            field: Field::ScaleDType,
            value: s.to_string(),
            reason: "expected `f32` or `e8m0`".into(),
        })
    }
}
