//! Byte sizes and rates, as people read and write them.

use reshard::Error;
use reshard::error::Field;

/// `4194304`, `4MiB`, `4M`, `64KiB`, `1GiB`, `2TiB`: a number and a unit, any case, with or
/// without a space between them. `K`/`M`/`G`/`T` and `KiB`/`MiB`/`GiB`/`TiB` are binary
/// (powers of 1024, as memory sizes are read); `KB`/`MB`/`GB`/`TB` are decimal (powers of
/// 1000, as disk and network vendors write them).
pub fn parse_bytes(field: Field, text: &str) -> Result<u64, Error> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let invalid = |reason: String| Error::InvalidOption {
        field,
        value: text.to_string(),
        reason,
    };
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(invalid(
                "expected a byte count such as 4194304, 64KiB, 4MiB or 1TiB (units B, K/KiB, M/MiB, G/GiB, T/TiB; KB, MB, GB, TB are decimal)"
                    .into(),
            ));
        }
    };
    let n = num.parse::<u64>().map_err(|_| {
        invalid("expected a byte count such as 4194304, 64KiB, 4MiB or 1TiB".into())
    })?;
    n.checked_mul(scale)
        .ok_or_else(|| invalid("more than 2^64-1 bytes".into()))
}

/// `128 B`, `4.0 KiB`, `128.0 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes(Field::Flag("x"), "64KiB").unwrap(), 65536);
        assert_eq!(parse_bytes(Field::Flag("x"), "4M").unwrap(), 4 << 20);
        assert_eq!(parse_bytes(Field::Flag("x"), "12").unwrap(), 12);
        assert!(
            parse_bytes(Field::Flag("--chunk-bytes"), "lots")
                .unwrap_err()
                .to_string()
                .starts_with("--chunk-bytes: lots")
        );
        assert_eq!(bytes(128), "128 B");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn terabytes() {
        assert_eq!(parse_bytes(Field::Flag("x"), "2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_bytes(Field::Flag("x"), "2 T").unwrap(), 2 << 40);
        assert_eq!(
            parse_bytes(Field::Flag("x"), "3tb").unwrap(),
            3_000_000_000_000
        );
        assert_eq!(
            parse_bytes(Field::Flag("x"), "1 GB").unwrap(),
            1_000_000_000
        );
        let err = parse_bytes(Field::Flag("--suite-bytes"), "16777216TiB").unwrap_err();
        assert_eq!(
            err.to_string(),
            "--suite-bytes: 16777216TiB is invalid: more than 2^64-1 bytes"
        );
        let err = parse_bytes(Field::Flag("--chunk-bytes"), "4PiB")
            .unwrap_err()
            .to_string();
        assert!(err.contains("units B, K/KiB"), "{err}");
        assert_eq!(bytes(128 << 20), "128.0 MiB");
    }
}
