//! Staged refit: version v+1 lands beside the live shards, which stay untouched and
//! readable, and a commit later applies it in place, in a pause that is one copy (or, for a
//! delta refit, one patch apply) on each rank.
//!
//! A staged run is an ordinary run whose destination buffers are *shadows* of the live
//! shards: the caller gives them (or lets [`stage_shadows`] allocate them), holding what the
//! live shards hold, and the run writes version v+1 there. What the rank then holds is a
//! [`Staged`]: the version, the version it was staged onto, and what the commit must do:
//!
//! - **dense**: copy every shadow over its live buffer;
//! - **delta** (the run is also a delta refit, [`super::delta`]): every delta that landed in a
//!   shadow is kept as its encoded patch (small: the changed elements), and the commit applies
//!   each patch onto the live shard (which holds the patch's base, the version the staging was
//!   prepared onto) and copies from the shadow only the bytes no patch covers (those that came
//!   dense, or by a local copy).
//!
//! Every patch was applied once already, onto the shadow, where it was checked whole (and
//! against its sender's CRC with `--checksum`), so a commit cannot fail half-way: it checks
//! versions and buffers before it writes a byte. A rank's staging and the version its shards
//! serve live in its `RankDelta`, in the caller's `DeltaSession` (`exec::delta`), whose
//! `commit` and `abort` end a staging; a new one is refused until then. A run stages when its
//! options carry a `StageRefit` of that session.

use std::ops::Range;
use std::time::Instant;

use serde::Serialize;

use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Field, Result};
use reshard_core::layout::Rank;
use reshard_core::region::Region;

/// A delta that landed in a shadow, kept to be applied onto the live shard at commit.
#[derive(Debug)]
pub(crate) struct Patch {
    /// Which destination buffer of the program, and the bytes of it that hold `dst_box`.
    pub buf: usize,
    pub at: Range<usize>,
    pub dst_box: Region,
    pub region: Region,
    pub elem: usize,
    pub blob: Vec<u8>,
}

impl Patch {
    fn unpack(&self) -> CopyGeometry {
        CopyGeometry::new(
            &self.region,
            Place::Stream,
            Place::Within(&self.dst_box),
            self.elem,
        )
    }

    /// The byte runs of its buffer the patch writes.
    fn runs(&self, out: &mut Vec<Range<usize>>) {
        let g = self.unpack();
        let base = self.at.start;
        g.for_each_run(0..g.len(), |_, at, len| {
            out.push(base + at..base + at + len)
        });
    }
}

/// What a rank holds staged: version `version`, prepared onto the version its live shards
/// served then (`onto`), and what its commit does.
#[derive(Debug)]
pub struct Staged {
    /// The version staged.
    pub version: u64,
    /// The version the live shards served when it was staged, which they must still serve
    /// at commit (`None`: none known).
    pub onto: Option<u64>,
    /// Each destination buffer's length.
    lens: Vec<usize>,
    /// Per destination buffer, the byte runs the commit copies from the shadow.
    copies: Vec<Vec<Range<usize>>>,
    patches: Vec<Patch>,
}

/// What one rank's commit did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CommitReport {
    /// The rank that committed.
    pub rank: Rank,
    /// The version committed: its shards serve it now.
    pub version: u64,
    /// Bytes copied from the shadows.
    pub copied_bytes: u64,
    /// Patches applied.
    pub patches: u64,
    /// Bytes of the patches' encodings.
    pub patch_bytes: u64,
    /// Elements the patches changed.
    pub changed: u64,
    /// How long the commit held the live shards.
    pub seconds: f64,
}

impl Staged {
    /// The staging of a run that wrote `lens` bytes of destination buffers and kept
    /// `patches`: the commit copies what no patch covers.
    pub(crate) fn new(
        version: u64,
        onto: Option<u64>,
        lens: Vec<usize>,
        patches: Vec<Patch>,
    ) -> Staged {
        let mut covered: Vec<Vec<Range<usize>>> = vec![Vec::new(); lens.len()];
        for p in &patches {
            if let Some(c) = covered.get_mut(p.buf) {
                p.runs(c);
            }
        }
        let copies = covered
            .into_iter()
            .zip(&lens)
            .map(|(c, &len)| complement(c, len))
            .collect();
        Staged {
            version,
            onto,
            lens,
            copies,
            patches,
        }
    }

    /// Checks that `shadows` and `live` are the buffers this staging was made for (empty
    /// buffers at the end may be left out: a rank with no destination shard gives none).
    pub(crate) fn check(&self, rank: Rank, shadows: &[&[u8]], live: &[&mut [u8]]) -> Result<()> {
        let fits = |lens: &[usize]| {
            lens.len() <= self.lens.len()
                && (0..self.lens.len()).all(|i| lens.get(i).copied().unwrap_or(0) == self.lens[i])
        };
        let shadow_lens: Vec<usize> = shadows.iter().map(|b| b.len()).collect();
        let live_lens: Vec<usize> = live.iter().map(|b| b.len()).collect();
        if !fits(&shadow_lens) || !fits(&live_lens) {
            return Err(Error::Internal {
                rank,
                detail: format!(
                    "the commit of version {} was given buffers of {shadow_lens:?} (shadows) \
                     and {live_lens:?} (live) bytes, staged for {:?}",
                    self.version, self.lens
                ),
            });
        }
        Ok(())
    }

    /// Applies the staging onto `live` (checked by [`Staged::check`]): the copies from the
    /// shadows, then the patches.
    pub(crate) fn apply(
        &self,
        rank: Rank,
        shadows: &[&[u8]],
        live: &mut [&mut [u8]],
    ) -> Result<CommitReport> {
        let started = Instant::now();
        let mut report = CommitReport {
            rank,
            version: self.version,
            ..CommitReport::default()
        };
        for ((runs, shadow), live) in self.copies.iter().zip(shadows).zip(live.iter_mut()) {
            for r in runs {
                live[r.clone()].copy_from_slice(&shadow[r.clone()]);
                report.copied_bytes += r.len() as u64;
            }
        }
        for p in &self.patches {
            let shard = live
                .get_mut(p.buf)
                .and_then(|b| b.get_mut(p.at.clone()))
                .ok_or_else(|| Error::Internal {
                    rank,
                    detail: format!("a staged patch of {} lies outside its buffer", p.region),
                })?;
            // checked whole when it was applied onto the shadow
            let applied = reshard_core::delta::apply(&p.unpack(), &p.blob, shard).map_err(|e| {
                Error::Internal {
                    rank,
                    detail: format!("a staged patch of {} no longer applies: {e}", p.region),
                }
            })?;
            report.patches += 1;
            report.patch_bytes += p.blob.len() as u64;
            report.changed += applied.changed;
        }
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }
}

/// The byte ranges of `0..len` that `covered` (any order, overlapping or not) leaves out.
fn complement(mut covered: Vec<Range<usize>>, len: usize) -> Vec<Range<usize>> {
    covered.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut at = 0;
    for r in covered {
        if r.start > at {
            out.push(at..r.start.min(len));
        }
        at = at.max(r.end);
    }
    if at < len {
        out.push(at..len);
    }
    out.retain(|r| !r.is_empty());
    out
}

/// Shadows of `live`, allocated by the library: one copy of each buffer, to stage into.
pub fn stage_shadows(rank: Rank, live: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
    live.iter()
        .map(|b| {
            let mut s = reshard_core::memory::zeroed(b.len() as u64, || {
                format!("rank {rank}'s staging shadow")
            })?;
            s.copy_from_slice(b);
            Ok(s)
        })
        .collect()
}

/// Makes caller-given shadows hold what `live` holds (they must have the live buffers'
/// sizes), before a staged run writes into them.
pub fn refresh_shadows(rank: Rank, shadows: &mut [&mut [u8]], live: &[&[u8]]) -> Result<()> {
    if shadows.len() != live.len() || shadows.iter().zip(live).any(|(s, l)| s.len() != l.len()) {
        return Err(Error::InvalidOption {
            field: Field::Flag("staging"),
            value: format!("{:?}", shadows.iter().map(|s| s.len()).collect::<Vec<_>>()),
            reason: format!(
                "rank {rank}'s staging buffers must have the sizes of its shards, {:?} bytes",
                live.iter().map(|l| l.len()).collect::<Vec<_>>()
            ),
        });
    }
    for (s, l) in shadows.iter_mut().zip(live) {
        s.copy_from_slice(l);
    }
    Ok(())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // ranges are the data here
mod complement_tests {
    use super::complement;

    #[test]
    fn the_complement_leaves_out_exactly_what_is_covered() {
        assert_eq!(complement(vec![], 10), vec![0..10]);
        assert_eq!(
            complement(vec![0..10], 10),
            Vec::<std::ops::Range<usize>>::new()
        );
        assert_eq!(complement(vec![6..8, 2..4], 10), vec![0..2, 4..6, 8..10]);
        assert_eq!(complement(vec![2..5, 3..4, 4..7], 8), vec![0..2, 7..8]);
        assert_eq!(
            complement(vec![0..3, 3..6], 6),
            Vec::<std::ops::Range<usize>>::new()
        );
    }
}
