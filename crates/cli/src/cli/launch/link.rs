//! The emulated hosts' plan, as plain data: how many ranks each host runs, the hosts'
//! addresses and names, and the traffic-control lines that shape each link (`--link RATE`,
//! `--link-latency MS`). No I/O here: `netns` carries it out.

use std::net::Ipv4Addr;

use reshard::Error;
use reshard::error::Field;

/// Most emulated hosts: one address each in a /24, with room to spare.
pub const MAX_HOSTS: usize = 250;

/// The emulated network: 10.87.0.0/24, host `h` at 10.87.0.(h+1). It exists only inside the
/// job's own network namespaces, so it cannot collide with the machine's own networks.
pub const SUBNET: [u8; 3] = [10, 87, 0];
pub const PREFIX_LEN: u8 = 24;

/// Slowest and fastest link a job may ask for, in bits per second.
const MIN_RATE: u64 = 8_000;
const MAX_RATE: u64 = 1_000_000_000_000;

/// Longest one-way delay a link may be given, in milliseconds.
const MAX_LATENCY_MS: f64 = 10_000.0;

/// Packets the delay line holds: well above what a few TCP streams keep in flight on the
/// fastest link at the longest delay that is reasonable to ask for.
const NETEM_LIMIT: u32 = 100_000;

/// How the link of every host is shaped, each way.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Shape {
    /// Bits per second, if limited.
    pub rate_bits: Option<u64>,
    /// One-way delay in microseconds, if any.
    pub delay_us: Option<u64>,
}

/// Where the ranks go: `hosts` hosts of `per_host` consecutive ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hosts {
    pub hosts: usize,
    pub per_host: usize,
    pub shape: Shape,
}

impl Hosts {
    /// Checks `--hosts H --nproc N [--link RATE] [--link-latency MS]`.
    pub fn new(
        hosts: usize,
        nproc: usize,
        link: Option<&str>,
        latency: Option<&str>,
    ) -> Result<Hosts, Error> {
        if hosts == 0 || hosts > MAX_HOSTS {
            return Err(Error::InvalidOption {
                field: Field::Flag("--hosts"),
                value: hosts.to_string(),
                reason: format!("expected 1 to {MAX_HOSTS} emulated hosts"),
            });
        }
        if !nproc.is_multiple_of(hosts) {
            return Err(Error::InvalidOption {
                field: Field::Flag("--nproc"),
                value: nproc.to_string(),
                reason: format!(
                    "does not split evenly over --hosts {hosts}: every host runs the same number \
                     of consecutive ranks, so give a multiple of {hosts}"
                ),
            });
        }
        let shape = Shape {
            rate_bits: link.map(parse_rate).transpose()?,
            delay_us: latency.map(parse_latency).transpose()?.filter(|&us| us > 0),
        };
        Ok(Hosts {
            hosts,
            per_host: nproc / hosts,
            shape,
        })
    }

    /// The host of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        rank / self.per_host
    }
}

/// Host `h`'s address on the emulated network.
pub fn address(host: usize) -> Ipv4Addr {
    let [a, b, c] = SUBNET;
    // host < MAX_HOSTS < 255
    Ipv4Addr::new(a, b, c, host as u8 + 1)
}

/// Host `h`'s name (its UTS host name, and the `RESHARD_HOST` of its ranks).
pub fn host_name(host: usize) -> String {
    format!("host{host}")
}

/// The switch's end of host `h`'s link.
pub fn switch_port(host: usize) -> String {
    format!("rsh-h{host}")
}

/// The bridge that joins the hosts, inside the switch's namespace.
pub const BRIDGE: &str = "rsh-switch";

/// A host's end of its link, inside the host's namespace.
pub const HOST_DEVICE: &str = "eth0";

/// `2gbit`, `100mbit`, `2.5gbit`, `800kbit`, `1000000bit` (as tc writes rates: k, m, g, t are
/// powers of 1000, and units are bits): bits per second.
pub fn parse_rate(text: &str) -> Result<u64, Error> {
    let invalid = |reason: String| Error::InvalidOption {
        field: Field::Flag("--link"),
        value: text.into(),
        reason,
    };
    let lower = text.trim().to_ascii_lowercase();
    let split = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (number, unit) = lower.split_at(split);
    let scale = match unit.trim() {
        "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        "bps" | "kbps" | "mbps" | "gbps" | "tbps" | "b" | "k" | "m" | "g" | "t" | "" => {
            return Err(invalid(
                "give the unit in bits, as tc does: bit, kbit, mbit, gbit or tbit (e.g. 2gbit)"
                    .into(),
            ));
        }
        _ => return Err(invalid("expected a rate such as 2gbit or 100mbit".into())),
    };
    let value = number
        .parse::<f64>()
        .map_err(|_| invalid("expected a rate such as 2gbit or 100mbit".into()))?;
    let bits = (value * scale).round();
    if !(MIN_RATE as f64..=MAX_RATE as f64).contains(&bits) {
        return Err(invalid("expected a rate from 8kbit to 1tbit".into()));
    }
    Ok(bits as u64)
}

/// `1`, `0.5`, `20` milliseconds of one-way delay: microseconds.
pub fn parse_latency(text: &str) -> Result<u64, Error> {
    let ms = text
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|ms| ms.is_finite() && (0.0..=MAX_LATENCY_MS).contains(ms))
        .ok_or_else(|| Error::InvalidOption {
            field: Field::Flag("--link-latency"),
            value: text.into(),
            reason: "expected milliseconds of one-way delay, from 0 to 10000 (e.g. 1 or 0.5)"
                .into(),
        })?;
    Ok((ms * 1000.0).round() as u64)
}

impl Shape {
    /// The token bucket's depth in bytes: 4 ms of the rate, at least two full frames, so that
    /// the rate holds over any few milliseconds.
    fn burst_bytes(rate_bits: u64) -> u64 {
        (rate_bits / 8 / 250).max(3200)
    }

    /// The `tc -batch` lines that shape what leaves `device`: a token bucket at the rate,
    /// with the delay line (netem) inside it, or either alone.
    pub fn tc_lines(&self, device: &str) -> Vec<String> {
        let netem = |parent: &str, us: u64| {
            format!(
                "qdisc add dev {device} {parent} handle 10: netem delay {us}us limit {NETEM_LIMIT}"
            )
        };
        match (self.rate_bits, self.delay_us) {
            (None, None) => Vec::new(),
            (None, Some(us)) => vec![netem("root", us)],
            (Some(rate), delay) => {
                let mut lines = vec![format!(
                    "qdisc add dev {device} root handle 1: tbf rate {rate}bit burst {} latency 100ms",
                    Self::burst_bytes(rate)
                )];
                lines.extend(delay.map(|us| netem("parent 1:1", us)));
                lines
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_tc_reads_them() {
        assert_eq!(parse_rate("2gbit").unwrap(), 2_000_000_000);
        assert_eq!(parse_rate(" 2.5GBit ").unwrap(), 2_500_000_000);
        assert_eq!(parse_rate("100mbit").unwrap(), 100_000_000);
        assert_eq!(parse_rate("800kbit").unwrap(), 800_000);
        assert_eq!(parse_rate("8000bit").unwrap(), 8_000);
        for bad in [
            "2gbps",
            "2g",
            "100",
            "fast",
            "",
            "1bit",
            "2tbit",
            "-1gbit",
            "1.2.3gbit",
        ] {
            let err = parse_rate(bad).unwrap_err().to_string();
            assert!(err.starts_with(&format!("--link: {bad}")), "{bad}: {err}");
        }
        assert!(
            parse_rate("2gbps")
                .unwrap_err()
                .to_string()
                .contains("in bits")
        );
    }

    #[test]
    fn latencies_are_milliseconds() {
        assert_eq!(parse_latency("1").unwrap(), 1000);
        assert_eq!(parse_latency("0.25").unwrap(), 250);
        assert_eq!(parse_latency("0").unwrap(), 0);
        for bad in ["-1", "ms", "1ms", "NaN", "inf", "20000"] {
            let err = parse_latency(bad).unwrap_err().to_string();
            assert!(err.starts_with(&format!("--link-latency: {bad}")), "{err}");
        }
    }

    #[test]
    fn ranks_split_evenly_over_hosts() {
        let h = Hosts::new(2, 8, Some("2gbit"), Some("1")).unwrap();
        assert_eq!((h.per_host, h.host_of(3), h.host_of(4)), (4, 0, 1));
        let err = Hosts::new(3, 8, None, None).unwrap_err().to_string();
        assert!(
            err.contains("--nproc: 8") && err.contains("multiple of 3"),
            "{err}"
        );
        assert!(Hosts::new(0, 8, None, None).is_err());
        assert!(Hosts::new(MAX_HOSTS + 1, 251 * 4, None, None).is_err());
        // no delay asked, or a zero one: no delay line
        assert_eq!(
            Hosts::new(1, 1, None, Some("0")).unwrap().shape,
            Shape::default()
        );
    }

    #[test]
    fn addresses_and_names_are_per_host() {
        assert_eq!(address(0).to_string(), "10.87.0.1");
        assert_eq!(address(MAX_HOSTS - 1).to_string(), "10.87.0.250");
        assert_eq!(host_name(3), "host3");
        // interface names fit Linux's 15 bytes
        assert!(switch_port(MAX_HOSTS - 1).len() <= 15 && BRIDGE.len() <= 15);
    }

    #[test]
    fn the_shape_becomes_a_token_bucket_and_a_delay_line() {
        let both = Shape {
            rate_bits: Some(2_000_000_000),
            delay_us: Some(1500),
        };
        assert_eq!(
            both.tc_lines("eth0"),
            [
                "qdisc add dev eth0 root handle 1: tbf rate 2000000000bit burst 1000000 latency 100ms",
                "qdisc add dev eth0 parent 1:1 handle 10: netem delay 1500us limit 100000",
            ]
        );
        let slow = Shape {
            rate_bits: Some(8_000),
            delay_us: None,
        };
        assert_eq!(
            slow.tc_lines("x"),
            ["qdisc add dev x root handle 1: tbf rate 8000bit burst 3200 latency 100ms"]
        );
        let delay = Shape {
            rate_bits: None,
            delay_us: Some(7),
        };
        assert_eq!(
            delay.tc_lines("x"),
            ["qdisc add dev x root handle 10: netem delay 7us limit 100000"]
        );
        assert!(Shape::default().tc_lines("x").is_empty());
    }
}
