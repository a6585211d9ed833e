//! Which host each rank runs on: the job's topology, as plain data.
//!
//! A [`HostMap`] gives every global rank of a job the index of its host. Hosts are numbered
//! from 0 with no gaps, so `num_hosts()` hosts each hold at least one rank. It is learned at
//! rendezvous (every rank names its host in its hello, rank 0 numbers the hosts in order of
//! their first rank and tells everyone) or written by hand:
//!
//! - `0,0,1,1`: the host of each global rank, in rank order;
//! - `4x2`: 4 hosts of 2 consecutive ranks each (ranks 0 and 1 on host 0, and so on).
//!
//! ```
//! use reshard_core::topology::HostMap;
//! let map = HostMap::parse("2x2").unwrap();
//! assert_eq!(map, HostMap::parse("0,0,1,1").unwrap());
//! assert_eq!((map.len(), map.num_hosts(), map.host_of(2)), (4, 2, 1));
//! ```

use std::fmt;

use crate::error::Field;
use crate::error::{Error, Result};
use crate::layout::Rank;
use crate::limits::MAX_HOST_MAP_RANKS;

/// The field errors name: the option the map is written in.
const FIELD: Field = Field::Hosts;

/// The host of every global rank of a job (`hosts()[rank]`), hosts numbered densely from 0.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostMap {
    hosts: Vec<u32>,
    count: usize,
}

impl HostMap {
    /// Reads `4x2` (4 hosts of 2 consecutive ranks) or `0,0,1,1` (the host of each rank).
    pub fn parse(text: &str) -> Result<HostMap> {
        let trimmed = text.trim();
        match trimmed.split_once(['x', 'X']) {
            Some((hosts, per_host)) => {
                let number = |part: &str, what: &str| -> Result<usize> {
                    part.trim().parse::<usize>().map_err(|_| invalid(
                        text,
                        format!("expected HOSTSxRANKS_PER_HOST (e.g. 4x2); {what} `{}` is not a number", part.trim()),
                    ))
                };
                let (hosts, per_host) =
                    (number(hosts, "hosts")?, number(per_host, "ranks per host")?);
                Self::uniform(hosts, per_host).map_err(|e| match e {
                    Error::InvalidOption { reason, .. } => invalid(text, reason),
                    other => other,
                })
            }
            None => Self::from_list(trimmed).map_err(|e| match e {
                Error::InvalidOption { reason, .. } => invalid(text, reason),
                other => other,
            }),
        }
    }

    /// `0,0,1,1`: the host of each global rank, in rank order.
    pub fn from_list(text: &str) -> Result<HostMap> {
        if text.trim().is_empty() {
            return Err(invalid(
                text,
                "no ranks: expected e.g. 0,0,1,1 or 2x2".into(),
            ));
        }
        let mut hosts = Vec::new();
        for (rank, item) in text.split(',').enumerate() {
            if rank >= MAX_HOST_MAP_RANKS {
                return Err(too_many(text, rank + 1));
            }
            let host = item.trim().parse::<u32>().map_err(|_| {
                invalid(
                    text,
                    format!(
                        "the host of rank {rank}, `{}`, is not a host number",
                        item.trim()
                    ),
                )
            })?;
            hosts.push(host);
        }
        Self::from_hosts(hosts).map_err(|reason| invalid(text, reason))
    }

    /// `hosts` hosts of `per_host` consecutive ranks each.
    pub fn uniform(hosts: usize, per_host: usize) -> Result<HostMap> {
        let value = || format!("{hosts}x{per_host}");
        if hosts == 0 || per_host == 0 {
            return Err(invalid(
                &value(),
                "needs at least one host of at least one rank".into(),
            ));
        }
        let ranks = hosts
            .checked_mul(per_host)
            .filter(|&n| n <= MAX_HOST_MAP_RANKS)
            .ok_or_else(|| too_many(&value(), hosts.saturating_mul(per_host)))?;
        let count = u32::try_from(hosts).map_err(|_| too_many(&value(), ranks))?;
        let map = (0..count)
            .flat_map(|h| std::iter::repeat_n(h, per_host))
            .collect();
        Ok(HostMap {
            hosts: map,
            count: hosts,
        })
    }

    /// Every rank on one host: a job of `ranks` processes on one machine.
    pub fn single(ranks: usize) -> Result<HostMap> {
        Self::uniform(1, ranks)
    }

    /// The hosts of ranks named by an identity each (a host name, say), in rank order: hosts
    /// are numbered in the order of their first rank.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<HostMap> {
        if names.len() > MAX_HOST_MAP_RANKS {
            return Err(too_many("(host names)", names.len()));
        }
        let mut seen: rustc_hash::FxHashMap<&str, u32> = Default::default();
        let hosts = names
            .iter()
            .map(|name| {
                let next = seen.len() as u32; // at most MAX_HOST_MAP_RANKS < 2^32 names
                *seen.entry(name.as_ref()).or_insert(next)
            })
            .collect();
        Self::from_hosts(hosts).map_err(|reason| invalid("(host names)", reason))
    }

    /// The host of each rank, in rank order, as numbers (dense from 0).
    pub fn from_indices(hosts: &[usize]) -> Result<HostMap> {
        let shown = || {
            let list: Vec<String> = hosts.iter().take(16).map(usize::to_string).collect();
            list.join(",")
        };
        if hosts.len() > MAX_HOST_MAP_RANKS {
            return Err(too_many(&shown(), hosts.len()));
        }
        let hosts = hosts
            .iter()
            .map(|&h| {
                u32::try_from(h).map_err(|_| invalid(&shown(), format!("host {h} is too large")))
            })
            .collect::<Result<Vec<u32>>>()?;
        Self::from_hosts(hosts).map_err(|reason| invalid(&shown(), reason))
    }

    /// Checks that the host numbers are dense (every host from 0 to the highest has a rank).
    fn from_hosts(hosts: Vec<u32>) -> std::result::Result<HostMap, String> {
        if hosts.is_empty() {
            return Err("no ranks".into());
        }
        let highest = *hosts.iter().max().unwrap_or(&0) as usize;
        let mut used = vec![false; highest + 1];
        for &h in &hosts {
            used[h as usize] = true;
        }
        if let Some(gap) = used.iter().position(|&u| !u) {
            return Err(format!(
                "host {gap} has no rank; hosts are numbered from 0 without gaps (the highest here is {highest})"
            ));
        }
        Ok(HostMap {
            hosts,
            count: highest + 1,
        })
    }

    /// The host of each rank, in rank order.
    pub fn hosts(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.hosts.iter().map(|&h| h as usize)
    }

    /// The host of `rank`. Ranks beyond the map count as hosts of their own, after the
    /// mapped ones (a rank the map does not name shares memory with no one); check the ranks
    /// a plan uses with [`HostMap::check_ranks`] or [`HostMap::check_covers`] first.
    pub fn host_of(&self, rank: Rank) -> usize {
        self.get(rank)
            .unwrap_or_else(|| self.count + (rank - self.hosts.len()))
    }

    /// The host of `rank`, if the map covers it.
    pub fn get(&self, rank: Rank) -> Option<usize> {
        self.hosts.get(rank).map(|&h| h as usize)
    }

    /// Whether ranks `a` and `b` are on one host (false if the map does not cover both).
    pub fn same_host(&self, a: Rank, b: Rank) -> bool {
        matches!((self.get(a), self.get(b)), (Some(x), Some(y)) if x == y)
    }

    /// The ranks of `host`, in order.
    pub fn ranks_of(&self, host: usize) -> impl Iterator<Item = Rank> + '_ {
        self.hosts()
            .enumerate()
            .filter(move |&(_, h)| h == host)
            .map(|(r, _)| r)
    }

    /// How many hosts there are.
    pub fn num_hosts(&self) -> usize {
        self.count
    }

    /// How many ranks the map covers.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Always false: a map covers at least one rank.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Checks that the map covers every rank up to `highest` (the highest rank a plan uses).
    pub fn check_ranks(&self, highest: Rank) -> Result<()> {
        if highest >= self.len() {
            return Err(invalid(
                &self.to_string(),
                format!(
                    "gives the hosts of ranks 0..{}, but the layouts use rank {highest}",
                    self.len()
                ),
            ));
        }
        Ok(())
    }
}

impl HostMap {
    /// Checks that the map names every rank in `ranks` (those of a job's layouts).
    pub fn check_covers(&self, ranks: impl IntoIterator<Item = Rank>) -> Result<()> {
        match ranks.into_iter().max() {
            Some(highest) => self.check_ranks(highest),
            None => Ok(()),
        }
    }
}

/// `HxK` when the map is that, else the list of hosts.
impl fmt::Display for HostMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_host = self.len() / self.count;
        if per_host * self.count == self.len()
            && self.hosts().enumerate().all(|(r, h)| h == r / per_host)
        {
            return write!(f, "{}x{per_host}", self.count);
        }
        for (i, h) in self.hosts().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{h}")?;
        }
        Ok(())
    }
}

fn invalid(value: &str, reason: String) -> Error {
    Error::InvalidOption {
        field: FIELD,
        value: value.into(),
        reason,
    }
}

fn too_many(value: &str, ranks: usize) -> Error {
    let shown: String = value.chars().take(64).collect();
    invalid(
        &shown,
        format!("covers {ranks} ranks or more; at most {MAX_HOST_MAP_RANKS} are allowed"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn both_forms_read_alike() {
        let map = HostMap::parse("4x2").unwrap();
        assert_eq!(map, HostMap::parse("0,0,1,1,2,2,3,3").unwrap());
        assert_eq!(map, HostMap::uniform(4, 2).unwrap());
        assert_eq!((map.len(), map.num_hosts()), (8, 4));
        assert_eq!(map.hosts().collect::<Vec<_>>(), [0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(map.ranks_of(2).collect::<Vec<_>>(), [4, 5]);
        assert!(map.same_host(6, 7) && !map.same_host(1, 2) && !map.same_host(7, 8));
        assert_eq!((map.get(7), map.get(8)), (Some(3), None));
        assert_eq!(map.to_string(), "4x2");
    }

    #[test]
    fn a_list_may_interleave_hosts() {
        let map = HostMap::parse(" 1, 0,1 ,0 ").unwrap();
        assert_eq!((map.host_of(0), map.host_of(1), map.num_hosts()), (1, 0, 2));
        assert_eq!(map.to_string(), "1,0,1,0");
        assert!(map.check_ranks(3).is_ok());
        let err = map.check_ranks(4).unwrap_err().to_string();
        assert!(err.contains("hosts") && err.contains("rank 4"), "{err}");
    }

    #[test]
    fn names_number_hosts_by_first_rank() {
        let map = HostMap::from_names(&["b", "b", "a", "b", "c"]).unwrap();
        assert_eq!(map.hosts().collect::<Vec<_>>(), [0, 0, 1, 0, 2]);
        assert_eq!(HostMap::single(3).unwrap().num_hosts(), 1);
    }

    #[test]
    fn bad_maps_name_the_value() {
        for (text, needle) in [
            ("", "no ranks"),
            ("0,,1", "rank 1"),
            ("0,2", "host 1 has no rank"),
            ("0,-1", "rank 1"),
            ("0x4", "at least one host"),
            ("4x0", "at least one host"),
            ("axb", "not a number"),
            ("2x", "not a number"),
            ("99999999x99999999", "at most"),
        ] {
            let err = HostMap::parse(text).unwrap_err();
            let shown = err.to_string();
            assert!(
                matches!(&err, Error::InvalidOption { field: Field::Hosts, value, .. } if value == text
                    || text.len() > 10),
                "{text}: {shown}"
            );
            assert!(shown.contains(needle), "{text}: {shown}");
        }
    }

    proptest! {
        #[test]
        fn uniform_is_consecutive_ranks(hosts in 1usize..20, per_host in 1usize..20) {
            let map = HostMap::uniform(hosts, per_host).unwrap();
            prop_assert_eq!(map.len(), hosts * per_host);
            prop_assert_eq!(map.num_hosts(), hosts);
            for r in 0..map.len() {
                prop_assert_eq!(map.host_of(r), r / per_host);
            }
            // printed and read back, it is the same map
            prop_assert_eq!(HostMap::parse(&map.to_string()).unwrap(), map);
        }

        #[test]
        fn a_list_reads_back(list in proptest::collection::vec(0u32..5, 1..40)) {
            // renumber densely, as a map requires
            let names: Vec<String> = list.iter().map(u32::to_string).collect();
            let map = HostMap::from_names(&names).unwrap();
            let again = HostMap::parse(&map.to_string()).unwrap();
            prop_assert_eq!(&again, &map);
            for (a, b) in (0..list.len()).zip(1..list.len()) {
                prop_assert_eq!(map.same_host(a, b), list[a] == list[b]);
            }
        }
    }
}
