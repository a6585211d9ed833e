//! Which host each rank runs on: the input of topology-aware planning.
//!
//! Ranks of one host share memory; between hosts only their network links exist, and those
//! links, not memory copies, bound a reshard across hosts. A [`HostMap`] is pure data, like the
//! layouts: given by hand (`--hosts 0,0,1,1` or `--hosts 2x2`) or learned when a job meets.
//!
//! ```
//! use reshard::topology::HostMap;
//! let hosts = HostMap::parse("2x4").unwrap();
//! assert_eq!(hosts.len(), 8);
//! assert_eq!((hosts.host_of(3), hosts.host_of(4)), (0, 1));
//! assert_eq!(HostMap::parse("0,0,1,1").unwrap(), HostMap::uniform(2, 2));
//! assert!(HostMap::parse("2x0").is_err());
//! ```

use std::fmt;

use crate::error::{Error, Result};
use crate::rank::Rank;

/// The host of every global rank, indexed by rank; hosts are numbered from 0.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostMap {
    hosts: Vec<usize>,
    count: usize,
}

/// Most ranks a host map describes (the ranks of a job, see [`crate::limits`]).
const MAX_RANKS: usize = 1 << 24;

fn invalid(value: &str, reason: impl Into<String>) -> Error {
    Error::InvalidOption {
        field: "--hosts",
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl HostMap {
    /// `hosts` hosts of `per_host` consecutive ranks each.
    pub fn uniform(hosts: usize, per_host: usize) -> HostMap {
        let per_host = per_host.max(1);
        HostMap::from_hosts((0..hosts * per_host).map(|r| r / per_host).collect())
            .expect("consecutive hosts are valid")
    }

    /// The host of each global rank, in rank order. Every host number from 0 to the largest
    /// must have at least one rank.
    pub fn from_hosts(hosts: Vec<usize>) -> Result<HostMap> {
        let text = || {
            hosts
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        if hosts.is_empty() {
            return Err(invalid("", "no ranks"));
        }
        if hosts.len() > MAX_RANKS {
            return Err(invalid(
                &format!("{} ranks", hosts.len()),
                format!("at most {MAX_RANKS} ranks"),
            ));
        }
        let count = hosts.iter().max().map_or(0, |&h| h + 1);
        let mut seen = vec![false; count];
        hosts.iter().for_each(|&h| seen[h] = true);
        if let Some(h) = seen.iter().position(|s| !s) {
            return Err(invalid(&text(), format!("host {h} has no rank")));
        }
        Ok(HostMap { hosts, count })
    }

    /// Parses `0,0,1,1` (the host of each global rank) or `HxK` (H hosts of K consecutive
    /// ranks). Errors name `--hosts` and the value.
    pub fn parse(text: &str) -> Result<HostMap> {
        let t = text.trim();
        if let Some((h, k)) = t.split_once(['x', 'X']) {
            let num = |s: &str, what: &str| -> Result<usize> {
                match s.trim().parse::<usize>() {
                    Ok(0) => Err(invalid(text, format!("{what} must be at least 1"))),
                    Ok(n) => Ok(n),
                    Err(_) => Err(invalid(text, format!("{what} `{s}` is not a number"))),
                }
            };
            let (h, k) = (num(h, "the host count")?, num(k, "the ranks per host")?);
            if h.checked_mul(k).is_none_or(|n| n > MAX_RANKS) {
                return Err(invalid(text, format!("at most {MAX_RANKS} ranks")));
            }
            return Ok(HostMap::uniform(h, k));
        }
        let hosts = t
            .split(',')
            .map(|s| {
                s.trim().parse::<usize>().map_err(|_| {
                    invalid(
                        text,
                        format!("`{s}` is not a host number (expected 0,0,1,1 or HxK)"),
                    )
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        if hosts.iter().any(|&h| h >= MAX_RANKS) {
            return Err(invalid(text, "a host number is too large"));
        }
        HostMap::from_hosts(hosts).map_err(|e| match e {
            Error::InvalidOption { reason, .. } => invalid(text, reason),
            other => other,
        })
    }

    /// The host of `rank`. Ranks beyond the map count as hosts of their own, after the
    /// mapped ones (a rank the map does not name shares memory with no one).
    pub fn host_of(&self, rank: Rank) -> usize {
        self.hosts
            .get(rank)
            .copied()
            .unwrap_or_else(|| self.count + (rank - self.hosts.len()))
    }

    /// Number of hosts.
    pub fn num_hosts(&self) -> usize {
        self.count
    }

    /// Number of ranks the map names.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Checks that the map names every rank in `ranks` (those of a job's layouts).
    pub fn check_covers(&self, ranks: impl IntoIterator<Item = Rank>) -> Result<()> {
        match ranks.into_iter().find(|&r| r >= self.hosts.len()) {
            Some(rank) => Err(invalid(
                &self.to_string(),
                format!(
                    "names {} ranks, but the layouts use rank {rank}",
                    self.hosts.len()
                ),
            )),
            None => Ok(()),
        }
    }
}

impl fmt::Display for HostMap {
    /// The short form `HxK` when hosts are consecutive and even, the list otherwise.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per = self.hosts.len() / self.count.max(1);
        if self.count * per == self.hosts.len() && *self == HostMap::uniform(self.count, per) {
            return write!(f, "{}x{per}", self.count);
        }
        let parts: Vec<String> = self.hosts.iter().map(usize::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_parse_and_print() {
        let m = HostMap::parse("0,0,0,0,1,1,1,1").unwrap();
        assert_eq!(m, HostMap::parse("2x4").unwrap());
        assert_eq!(m.to_string(), "2x4");
        assert_eq!(m.num_hosts(), 2);
        let odd = HostMap::parse("1,0,1").unwrap();
        assert_eq!(odd.to_string(), "1,0,1");
        assert_eq!((odd.host_of(0), odd.host_of(1), odd.host_of(5)), (1, 0, 4));
    }

    #[test]
    fn bad_maps_name_the_value() {
        for bad in ["", "2x", "x2", "0x4", "4x0", "a,b", "0,2", "1"] {
            let e = HostMap::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("--hosts: "), "{bad}: {e}");
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn coverage_is_checked() {
        let m = HostMap::uniform(2, 2);
        assert!(m.check_covers(0..4).is_ok());
        assert!(
            m.check_covers([4])
                .unwrap_err()
                .to_string()
                .contains("rank 4")
        );
    }
}
