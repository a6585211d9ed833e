//! Byte sizes and rates, as people read and write them.

use reshard::Error;

/// `4194304`, `4MiB`, `4M`, `64KiB`, `1GiB` (binary units; `KB`/`MB`/`GB` are decimal).
pub fn parse_bytes(field: &'static str, text: &str) -> Result<u64, Error> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => u64::MAX,
    };
    num.parse::<u64>()
        .ok()
        .filter(|_| scale != u64::MAX)
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| Error::InvalidOption {
            field,
            value: text.to_string(),
            reason: "expected a byte count such as 4194304, 64KiB or 4MiB".into(),
        })
}

/// `128 B`, `4.0 KiB`, `128.0 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
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
        assert_eq!(parse_bytes("x", "64KiB").unwrap(), 65536);
        assert_eq!(parse_bytes("x", "4M").unwrap(), 4 << 20);
        assert_eq!(parse_bytes("x", "12").unwrap(), 12);
        assert!(
            parse_bytes("--chunk-bytes", "lots")
                .unwrap_err()
                .to_string()
                .starts_with("--chunk-bytes: lots")
        );
        assert_eq!(bytes(128), "128 B");
        assert_eq!(bytes(128 << 20), "128.0 MiB");
    }
}
