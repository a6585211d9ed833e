//! Plan agreement: what every rank of a job is about to run, compared before any byte moves.
//!
//! The reshard is exact only when every rank computes the same plan, and every rank computes
//! it alone, from its own command line. A rank given `--dst "ranks=0,2,1"` where the others
//! have `ranks=0..3`, or `i32` where the others have `f32`, would move the wrong bytes and
//! still report success. So every rank describes its job as a [`Fingerprint`] (ordered,
//! named fields with their values as typed), rank 0 compares every rank's with its own at
//! rendezvous, and the first difference ends the job on every rank with an error that names
//! the rank, the field and both values.
//!
//! This module is pure data: the exchange itself belongs to the job (`reshard_transport::Job`).
//!
//! ```
//! use reshard_core::agreement::Fingerprint;
//!
//! let ours = Fingerprint::new("run").with("--dtype", "f32");
//! let theirs = Fingerprint::new("run").with("--dtype", "i32");
//! let d = ours.first_difference(&theirs).unwrap();
//! assert_eq!(
//!     d.into_error(2).to_string(),
//!     "the ranks disagree on the job, so nothing was moved: rank 2 runs --dtype i32; rank 0 runs --dtype f32"
//! );
//! ```

use serde::{Deserialize, Serialize};

use crate::layout::{Layout, Placement, RankList};

/// The version of the messages ranks exchange (rendezvous, control, data frames). Ranks of
/// different versions refuse to run together.
pub const PROTOCOL_VERSION: u32 = 4;

/// What one rank is about to run: named fields in a fixed order, each with its value as the
/// user would type it. Two ranks agree when their fingerprints are equal.
///
/// A rank whose own checks failed after it learned its place in the job (too few processes
/// for its layouts, too little memory here) still takes part, with a fingerprint that carries
/// its reason ([`Fingerprint::refusal`]), so that every rank hears of it at once.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    fields: Vec<(String, String)>,
    refusal: Option<String>,
}

/// How a rank's job differs from the reference (rank 0's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Difference {
    /// The first field whose value differs.
    Field {
        /// The field, named as on the command line (`--dst ranks`, `--dtype`, `command`).
        field: String,
        /// The reference's value (`(none)` where it has no such field).
        ours: String,
        /// The other rank's value.
        theirs: String,
    },
    /// The rank cannot run its part, for this reason.
    Refused {
        /// Why, as the rank reports it (its own check that failed).
        reason: String,
    },
}

impl Difference {
    /// The error every rank returns when `rank`'s job differs from rank 0's in this way.
    pub fn into_error(self, rank: crate::Rank) -> crate::Error {
        match self {
            Difference::Field {
                field,
                ours,
                theirs,
            } => crate::Error::Disagreement {
                rank,
                field,
                ours,
                theirs,
            },
            Difference::Refused { reason } => crate::Error::RankRefused { rank, reason },
        }
    }
}

/// What a field's value reads as where a fingerprint lacks the field.
const ABSENT: &str = "(none)";

impl Fingerprint {
    /// A fingerprint for `command` (`run`, `bench`, `refit --run`, ...), with the protocol
    /// version: the first two fields, so that a different command is the difference named.
    pub fn new(command: &str) -> Fingerprint {
        Fingerprint::default()
            .with("command", command)
            .with("protocol version", PROTOCOL_VERSION)
    }

    /// The fingerprint of a rank that cannot run its part of `command`, for `reason` (its
    /// own checks failed): every rank then fails naming it.
    pub fn refusal(command: &str, reason: impl ToString) -> Fingerprint {
        Fingerprint {
            refusal: Some(reason.to_string()),
            ..Fingerprint::new(command)
        }
    }

    /// Adds a field. Fields compare in the order they were added.
    pub fn with(mut self, field: impl Into<String>, value: impl ToString) -> Fingerprint {
        self.fields.push((field.into(), value.to_string()));
        self
    }

    /// Adds a side's layout as resolved (`side` is `--src` or `--dst`): its mesh, its ranks
    /// (so that a reordered list is told apart) and its placements.
    pub fn with_layout(self, side: &str, layout: &Layout) -> Fingerprint {
        let mesh: Vec<String> = layout.mesh().dims().iter().map(usize::to_string).collect();
        let place: Vec<String> = layout
            .placements()
            .iter()
            .map(Placement::to_string)
            .collect();
        self.with(format!("{side} mesh"), mesh.join("x"))
            .with(
                format!("{side} ranks"),
                RankList::describe(layout.mesh().ranks()),
            )
            .with(format!("{side} place"), place.join(","))
    }

    /// Adds a digest of `parts` (in order) as one field, for what is too long to list: a
    /// whole model's tensors and layouts. A difference then names the field, not the part.
    pub fn with_digest<P: AsRef<[u8]>>(
        self,
        field: impl Into<String>,
        parts: impl IntoIterator<Item = P>,
    ) -> Fingerprint {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut count = 0u64;
        for part in parts {
            let part = part.as_ref();
            // length-prefixed, so that ("ab", "c") and ("a", "bc") differ
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
            count += 1;
        }
        self.with(
            field,
            format!("{count} parts, digest {:016x}", hasher.digest()),
        )
    }

    /// The fields, in order.
    pub fn fields(&self) -> impl Iterator<Item = (&str, &str)> {
        self.fields.iter().map(|(f, v)| (f.as_str(), v.as_str()))
    }

    fn value(&self, field: &str) -> Option<&str> {
        self.fields().find(|&(f, _)| f == field).map(|(_, v)| v)
    }

    /// How `theirs` differs: its refusal, or the first field (in this fingerprint's order,
    /// then `theirs`' extra fields) whose value differs; `None` when the two agree.
    pub fn first_difference(&self, theirs: &Fingerprint) -> Option<Difference> {
        if let Some(reason) = &theirs.refusal {
            return Some(Difference::Refused {
                reason: reason.clone(),
            });
        }
        let differ = |field: &str, ours: Option<&str>, other: Option<&str>| {
            (ours != other).then(|| Difference::Field {
                field: field.to_string(),
                ours: ours.unwrap_or(ABSENT).to_string(),
                theirs: other.unwrap_or(ABSENT).to_string(),
            })
        };
        self.fields()
            .find_map(|(f, v)| differ(f, Some(v), theirs.value(f)))
            .or_else(|| {
                theirs
                    .fields()
                    .find_map(|(f, v)| differ(f, self.value(f), Some(v)))
            })
    }

    /// Rank 0's check of every rank's fingerprint against its own (`reference`): rank 0's
    /// own refusal, or the first rank, in rank order, that refuses or differs, and how.
    pub fn first_disagreement<'a>(
        reference: &Fingerprint,
        ranks: impl IntoIterator<Item = (crate::Rank, &'a Fingerprint)>,
    ) -> Option<(crate::Rank, Difference)> {
        if let Some(reason) = &reference.refusal {
            let reason = reason.clone();
            return Some((0, Difference::Refused { reason }));
        }
        ranks
            .into_iter()
            .find_map(|(rank, fp)| reference.first_difference(fp).map(|d| (rank, d)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::layout::LayoutSpec;

    /// A field difference as (field, ours, theirs).
    fn field(d: Difference) -> (String, String, String) {
        match d {
            Difference::Field {
                field,
                ours,
                theirs,
            } => (field, ours, theirs),
            other => panic!("expected a field difference, got {other:?}"),
        }
    }

    fn layout(spec: &str) -> Layout {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&[8, 8], DType::F32, 0)
            .unwrap()
    }

    #[test]
    fn equal_jobs_agree() {
        let a = Fingerprint::new("run").with_layout("--dst", &layout("mesh=3 place=S(1)"));
        assert_eq!(a.first_difference(&a.clone()), None);
    }

    #[test]
    fn a_reordered_rank_list_is_named() {
        let ours = Fingerprint::new("run").with_layout("--dst", &layout("mesh=3 place=S(1)"));
        let theirs =
            Fingerprint::new("run").with_layout("--dst", &layout("mesh=3 ranks=0,2,1 place=S(1)"));
        let d = field(ours.first_difference(&theirs).unwrap());
        assert_eq!(d, ("--dst ranks".into(), "0..3".into(), "0,2,1".into()));
    }

    #[test]
    fn the_command_is_named_before_anything_else() {
        let ours = Fingerprint::new("run").with("--iters", 1);
        let theirs = Fingerprint::new("bench")
            .with("--iters", 5)
            .with("--suite", "refit");
        let (f, ours, _) = field(ours.first_difference(&theirs).unwrap());
        assert_eq!((f.as_str(), ours.as_str()), ("command", "run"));
    }

    #[test]
    fn a_field_only_one_side_has_is_a_difference() {
        let ours = Fingerprint::new("run");
        let theirs = Fingerprint::new("run").with("--checksum", true);
        let d = field(ours.first_difference(&theirs).unwrap());
        assert_eq!(d, ("--checksum".into(), ABSENT.into(), "true".into()));
        assert_eq!(field(theirs.first_difference(&ours).unwrap()).2, ABSENT);
    }

    #[test]
    fn digests_tell_parts_apart() {
        let fp = |parts: &[&str]| Fingerprint::new("refit").with_digest("tensors", parts);
        assert_eq!(fp(&["a", "b"]), fp(&["a", "b"]));
        assert_ne!(fp(&["ab", "c"]), fp(&["a", "bc"]));
        assert_ne!(fp(&["a", "b"]), fp(&["b", "a"]));
    }

    #[test]
    fn the_first_differing_rank_is_named() {
        let reference = Fingerprint::new("run").with("--dtype", "f32");
        let other = Fingerprint::new("run").with("--dtype", "i32");
        let ranks = [(1, &reference), (2, &other), (3, &other)];
        let (rank, d) = Fingerprint::first_disagreement(&reference, ranks).unwrap();
        assert_eq!(rank, 2);
        assert_eq!(field(d).2, "i32");
    }

    #[test]
    fn a_refusal_is_named_before_any_later_difference() {
        let reference = Fingerprint::new("run").with("--dtype", "f32");
        let other = Fingerprint::new("run").with("--dtype", "i32");
        let refused = Fingerprint::refusal("run", "too little memory");
        let ranks = [(1, &refused), (2, &other)];
        let (rank, d) = Fingerprint::first_disagreement(&reference, ranks).unwrap();
        assert_eq!(rank, 1);
        assert_eq!(
            d.into_error(rank).to_string(),
            "rank 1 cannot run its part of the job, so nothing was moved: too little memory"
        );
        // rank 0's own refusal comes first
        let (rank, _) = Fingerprint::first_disagreement(&refused, [(1, &reference)]).unwrap();
        assert_eq!(rank, 0);
    }
}
