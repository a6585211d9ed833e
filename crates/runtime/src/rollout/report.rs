//! What a stream of refits while serving reports: each destination rank's view of each
//! version ([`RankServed`]), a version by a method ([`VersionServed`]), where a rank stands
//! when the stream stops ([`Standing`]), and each method summed up ([`MethodSummary`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use reshard_core::layout::Rank;

/// What one destination rank saw of one version.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankServed {
    /// The destination rank.
    pub rank: Rank,
    /// The version its shards serve afterwards.
    pub serving: Option<u64>,
    /// How long its commit held the shards (0 in place: the whole refit held them).
    pub commit_s: f64,
    /// The serving stand-in's longest gap between passes, in seconds.
    pub pause_s: f64,
    /// Passes the serving stand-in served in all.
    pub passes: u64,
    /// Passes it served while the version was moved (prepared, or written in place).
    pub passes_during_refit: u64,
    /// Whether a pass saw anything but the version before or the version after, whole.
    pub mixed: bool,
    /// Bytes of its shadows (staged; 0 in place).
    pub staging_bytes: u64,
    /// Bytes of the patches its commit applied.
    pub patch_bytes: u64,
    /// Bytes its commit copied from the shadows.
    pub copied_bytes: u64,
    /// Which commit group it is in (rolling commit), from 0.
    pub group: usize,
}

/// One version by one method, on the ranks of this process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VersionServed {
    /// The version moved.
    pub version: u64,
    /// The method's name (`staged`, `in-place-delta`, ...).
    pub method: String,
    /// Seconds to move the version: prepared (staged) or written (in place).
    pub refit_s: f64,
    /// Seconds of the two-phase decision.
    pub decide_s: f64,
    /// Seconds of the commit, from the decision to the last group's end.
    pub commit_s: f64,
    /// `commit`, `in place`, or `abort (why)`.
    pub outcome: String,
    /// Each destination rank's view of it.
    pub ranks: Vec<RankServed>,
}

impl VersionServed {
    /// The longest pause any destination rank saw.
    pub fn pause_s(&self) -> f64 {
        self.ranks.iter().map(|r| r.pause_s).fold(0.0, f64::max)
    }

    /// Whether any pass on any rank saw a mix of versions.
    pub fn mixed(&self) -> bool {
        self.ranks.iter().any(|r| r.mixed)
    }

    /// Every rank's part of one version as one: the slowest rank's times, every rank's
    /// entries.
    pub fn combine(parts: &[VersionServed]) -> VersionServed {
        let mut all = parts.first().cloned().unwrap_or_default();
        all.ranks.clear();
        for p in parts {
            all.refit_s = all.refit_s.max(p.refit_s);
            all.decide_s = all.decide_s.max(p.decide_s);
            all.commit_s = all.commit_s.max(p.commit_s);
            if p.outcome != all.outcome && p.outcome.starts_with("abort") {
                all.outcome = p.outcome.clone();
            }
            all.ranks.extend(p.ranks.iter().cloned());
        }
        all.ranks.sort_by_key(|r| r.rank);
        all.ranks.dedup_by_key(|r| r.rank);
        all
    }

    /// The job's versions from every rank's report (each a JSON object whose `versions` are
    /// that rank's, in the same order on every rank), combined version by version.
    pub fn of_job(ranks: &[serde_json::Value]) -> Vec<VersionServed> {
        let per_rank: Vec<Vec<VersionServed>> = ranks
            .iter()
            .map(|r| serde_json::from_value(r["versions"].clone()).unwrap_or_default())
            .collect();
        let n = per_rank.iter().map(Vec::len).max().unwrap_or(0);
        (0..n)
            .map(|i| {
                let parts: Vec<VersionServed> =
                    per_rank.iter().filter_map(|p| p.get(i).cloned()).collect();
                VersionServed::combine(&parts)
            })
            .collect()
    }

    /// Each commit group's pause (the longest of its ranks') and its ranks, in commit order.
    pub fn groups(&self) -> Vec<(Vec<Rank>, f64)> {
        let mut groups: BTreeMap<usize, (Vec<Rank>, f64)> = BTreeMap::new();
        for r in &self.ranks {
            let g = groups.entry(r.group).or_default();
            g.0.push(r.rank);
            g.1 = g.1.max(r.pause_s);
        }
        groups.into_values().collect()
    }
}

/// Where a destination rank of a stream stands, as it says when the stream stops.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standing {
    /// The destination rank.
    pub rank: Rank,
    /// The name of the stream's method.
    pub method: String,
    /// The version its shards serve; `None` when none known (a refit in place or a commit
    /// failed).
    pub serving: Option<u64>,
    /// A version still staged: only a rank in doubt keeps one.
    pub staged: Option<u64>,
}

impl std::fmt::Display for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.serving {
            Some(v) => write!(f, "rank {} serves version {v}", self.rank)?,
            None => write!(f, "rank {} serves no known version", self.rank)?,
        }
        write!(f, " ({})", self.method)?;
        if let Some(v) = self.staged {
            write!(f, ", version {v} staged (in doubt)")?;
        }
        Ok(())
    }
}

/// One method over a stream, as the report sums it up.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MethodSummary {
    /// The method's name.
    pub method: String,
    /// Versions it moved.
    pub versions: usize,
    /// Versions committed, or written in place.
    pub served: usize,
    /// Median seconds to move a version, over the versions after the first (the first has
    /// no base for a delta).
    pub refit_s: f64,
    /// Median, over the same versions, of the longest pause any rank's engine saw, in seconds.
    pub pause_s: f64,
    /// Median seconds of the commit, over the same versions.
    pub commit_s: f64,
    /// The median pause over the median refit in place (when `in-place` ran too).
    pub pause_over_in_place: Option<f64>,
    /// Passes the engines served while versions were moved, after the first.
    pub passes_during_refit: u64,
    /// The most bytes of shadows one rank held.
    pub staging_bytes_per_rank: u64,
    /// The most bytes of patches one rank's commit applied.
    pub patch_bytes_per_rank: u64,
    /// Whether any pass of any engine saw a mix of versions.
    pub mixed: bool,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// Each method's summary over `versions` (every rank's, combined), in the order the methods
/// first appear.
pub fn summarize(versions: &[VersionServed]) -> Vec<MethodSummary> {
    let mut methods: Vec<String> = Vec::new();
    for v in versions {
        if !methods.contains(&v.method) {
            methods.push(v.method.clone());
        }
    }
    let later = |m: &str| -> Vec<&VersionServed> {
        let all: Vec<&VersionServed> = versions.iter().filter(|v| v.method == m).collect();
        match all.len() > 1 {
            true => all.into_iter().filter(|v| v.version > 1).collect(),
            false => all,
        }
    };
    let in_place = median(later("in-place").iter().map(|v| v.refit_s).collect());
    methods
        .iter()
        .map(|m| {
            let all: Vec<&VersionServed> = versions.iter().filter(|v| &v.method == m).collect();
            let after = later(m);
            let pause_s = median(after.iter().map(|v| v.pause_s()).collect());
            let most = |f: fn(&RankServed) -> u64| {
                all.iter()
                    .flat_map(|v| v.ranks.iter().map(f))
                    .max()
                    .unwrap_or(0)
            };
            MethodSummary {
                method: m.clone(),
                versions: all.len(),
                served: all
                    .iter()
                    .filter(|v| v.outcome == "commit" || v.outcome == "in place")
                    .count(),
                refit_s: median(after.iter().map(|v| v.refit_s).collect()),
                pause_s,
                commit_s: median(after.iter().map(|v| v.commit_s).collect()),
                pause_over_in_place: (in_place > 0.0).then(|| pause_s / in_place),
                passes_during_refit: after
                    .iter()
                    .flat_map(|v| v.ranks.iter().map(|r| r.passes_during_refit))
                    .sum(),
                staging_bytes_per_rank: most(|r| r.staging_bytes),
                patch_bytes_per_rank: most(|r| r.patch_bytes),
                mixed: all.iter().any(|v| v.mixed()),
            }
        })
        .collect()
}
