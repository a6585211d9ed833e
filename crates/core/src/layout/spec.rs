//! The command-line layout grammar: `mesh=AxB... [ranks=LIST] place=P1,P2,...`.

use crate::dtype::DType;
use crate::error::{Dims, Error, LayoutError};
use crate::limits::MAX_MESH_RANKS;

use super::{Layout, Mesh, Placement, Rank};

/// A placement as written by a user: `Shard(-1)` is legal until the tensor's rank is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementSpec {
    /// `S(d)`: split tensor dim `d`, counted from the end when negative.
    Shard(i64),
    /// `R`: every rank along the axis holds the same data.
    Replicate,
}

impl PlacementSpec {
    /// Resolves negative dims against a tensor of `ndim` dims, as torch does.
    pub fn resolve(self, ndim: usize) -> Result<Placement, LayoutError> {
        match self {
            PlacementSpec::Replicate => Ok(Placement::Replicate),
            PlacementSpec::Shard(dim) => {
                let resolved = if dim < 0 { dim + ndim as i64 } else { dim };
                if resolved < 0 || resolved >= ndim as i64 {
                    Err(LayoutError::ShardDimOutOfRange { dim, ndim })
                } else {
                    Ok(Placement::Shard(resolved as usize))
                }
            }
        }
    }

    /// Parses `S(0)`, `Shard(0)`, `R`, `Replicate()`, any case.
    pub fn parse(text: &str) -> Result<PlacementSpec, String> {
        let t = text.trim();
        let lower = t.to_ascii_lowercase();
        if matches!(lower.as_str(), "r" | "replicate" | "replicate()") {
            return Ok(PlacementSpec::Replicate);
        }
        let inner = lower
            .strip_prefix("shard(")
            .or_else(|| lower.strip_prefix("s("))
            .and_then(|rest| rest.strip_suffix(')'))
            .ok_or_else(|| {
                format!("unknown placement `{t}` (expected S(d), Shard(d), R or Replicate())")
            })?;
        let inner = inner.trim();
        let inner = inner.strip_prefix("dim=").unwrap_or(inner);
        inner
            .trim()
            .parse::<i64>()
            .map(PlacementSpec::Shard)
            .map_err(|_| format!("placement `{t}`: `{inner}` is not a tensor dim"))
    }
}

/// A list of global ranks as written on the command line: `8..16`, `0,2,4` or `0..4,8..12`.
pub struct RankList;

impl RankList {
    /// Refuses a list longer than [`MAX_MESH_RANKS`] before building it.
    pub fn parse(text: &str) -> Result<Vec<Rank>, String> {
        let mut ranks = Vec::new();
        for item in text.split(',').map(str::trim) {
            if let Some((a, b)) = item.split_once("..") {
                let a: Rank = parse_num(a, "rank")?;
                let b: Rank = parse_num(b, "rank")?;
                if b < a {
                    return Err(format!("rank range `{item}` runs backwards"));
                }
                if b - a > MAX_MESH_RANKS - ranks.len() {
                    return Err(format!(
                        "rank range `{item}` makes ranks= list more than the {MAX_MESH_RANKS} ranks a side may have"
                    ));
                }
                ranks.extend(a..b);
            } else {
                if ranks.len() >= MAX_MESH_RANKS {
                    return Err(format!(
                        "ranks= lists more than the {MAX_MESH_RANKS} ranks a side may have"
                    ));
                }
                ranks.push(parse_num(item, "rank")?);
            }
        }
        Ok(ranks)
    }

    /// The shortest text that [`RankList::parse`] reads back as `ranks`.
    pub fn describe(ranks: &[Rank]) -> String {
        let mut parts = Vec::new();
        let mut i = 0;
        while i < ranks.len() {
            let mut j = i + 1;
            while j < ranks.len() && ranks[j] == ranks[j - 1] + 1 {
                j += 1;
            }
            if j - i >= 2 {
                parts.push(format!("{}..{}", ranks[i], ranks[j - 1] + 1));
            } else {
                parts.push(ranks[i].to_string());
            }
            i = j;
        }
        parts.join(",")
    }
}

fn parse_num<T: std::str::FromStr>(text: &str, what: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{}` is not a valid {what}", text.trim()))
}

/// One side's layout as parsed from a spec, before the tensor's shape is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutSpec {
    /// The mesh's shape (`mesh=AxB...`): ranks along each axis.
    pub mesh: Vec<usize>,
    /// `None`: the caller's default (source from 0, destination right after it).
    pub ranks: Option<Vec<Rank>>,
    /// One placement per mesh axis (`place=P1,P2,...`).
    pub placements: Vec<PlacementSpec>,
}

impl LayoutSpec {
    /// Parses `mesh=2x4 ranks=8..16 place=R,S(0)`.
    ///
    /// ```
    /// use reshard_core::layout::{LayoutSpec, PlacementSpec};
    /// let spec = LayoutSpec::parse("mesh=2x2 place=R,S(1)").unwrap();
    /// assert_eq!(spec.mesh, [2, 2]);
    /// assert_eq!(spec.placements, [PlacementSpec::Replicate, PlacementSpec::Shard(1)]);
    /// ```
    pub fn parse(text: &str) -> Result<LayoutSpec, LayoutError> {
        let bad = |reason: String| LayoutError::MalformedSpec {
            spec: text.to_string(),
            reason,
        };
        let mut mesh = None;
        let mut ranks = None;
        let mut placements = None;
        for token in text.split_whitespace() {
            let (key, value) = token.split_once('=').ok_or_else(|| {
                bad(format!(
                    "`{token}` is not key=value (write lists without spaces: place=S(0),R)"
                ))
            })?;
            let seen = match key {
                "mesh" => mesh
                    .replace(
                        value
                            .split(['x', 'X'])
                            .map(|d| parse_num::<usize>(d, "mesh axis size"))
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(bad)?,
                    )
                    .is_some(),
                "ranks" => ranks
                    .replace(RankList::parse(value).map_err(bad)?)
                    .is_some(),
                "place" | "placements" => placements
                    .replace(
                        split_top_level(value)
                            .into_iter()
                            .map(PlacementSpec::parse)
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(bad)?,
                    )
                    .is_some(),
                _ => {
                    return Err(bad(format!(
                        "unknown key `{key}` (expected mesh=, ranks=, place=)"
                    )));
                }
            };
            if seen {
                return Err(bad(format!("`{key}=` is given twice")));
            }
        }
        let mesh = mesh.ok_or_else(|| bad("missing mesh= (for example mesh=2x4)".into()))?;
        let placements =
            placements.ok_or_else(|| bad("missing place= (for example place=S(0),R)".into()))?;
        Ok(LayoutSpec {
            mesh,
            ranks,
            placements,
        })
    }

    /// Number of ranks the mesh has (saturating; validation reports a mismatch).
    pub fn size(&self) -> usize {
        self.mesh
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// The layout of a tensor of `shape` and `dtype`; without `ranks=`, the mesh takes the
    /// ranks `first_rank..first_rank + size`.
    pub fn resolve(
        &self,
        shape: &[u64],
        dtype: DType,
        first_rank: Rank,
    ) -> Result<Layout, LayoutError> {
        let ranks = match &self.ranks {
            Some(r) => r.clone(),
            None => {
                let size = self.size();
                if size > MAX_MESH_RANKS {
                    // the mesh's own check, before the ranks are listed
                    return Err(LayoutError::TooManyRanks {
                        mesh: Dims(self.mesh.iter().map(|&d| d as u64).collect()),
                        positions: size.try_into().unwrap_or(u64::MAX),
                    });
                }
                // both below 2^31 + 2^24: no overflow
                let end = first_rank.saturating_add(size);
                if end > super::MAX_RANK {
                    return Err(LayoutError::DefaultRanksTooLarge {
                        first: first_rank as u64,
                        end: end as u64,
                    });
                }
                (first_rank..end).collect()
            }
        };
        let mesh = Mesh::new(self.mesh.clone(), ranks)?;
        let placements = self
            .placements
            .iter()
            .map(|p| p.resolve(shape.len()))
            .collect::<Result<Vec<_>, _>>()?;
        Layout::new(shape.to_vec(), dtype, mesh, placements)
    }
}

/// Splits on commas outside parentheses: `S(0),R` -> [`S(0)`, `R`].
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// Parses a tensor shape: `8,8`, `8x8` or `[8, 8]`.
///
/// ```
/// assert_eq!(reshard_core::layout::parse_shape("256,7168,2048").unwrap(), [256, 7168, 2048]);
/// ```
pub fn parse_shape(text: &str) -> Result<Vec<u64>, Error> {
    let bad = |reason: String| Error::MalformedShape {
        value: text.to_string(),
        reason,
    };
    let inner = text.trim().trim_start_matches('[').trim_end_matches(']');
    if inner.trim().is_empty() {
        return Ok(Vec::new());
    }
    // one separator per shape: with commas, an `x` is a typo to report, not a separator (`8,x`
    // once split into `8`, ``, `` and blamed the empty string)
    let items: Vec<&str> = if inner.contains(',') {
        inner.split(',').collect()
    } else {
        inner.split(['x', 'X']).collect()
    };
    items
        .iter()
        .enumerate()
        .map(|(i, d)| {
            if d.trim().is_empty() {
                Err(format!("dimension {i} is empty"))
            } else {
                parse_num::<u64>(d, "dimension size")
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_design_examples() {
        let s = LayoutSpec::parse("mesh=2x4 ranks=8..16 place=S(0),Replicate()").unwrap();
        assert_eq!(s.mesh, [2, 4]);
        assert_eq!(s.ranks, Some((8..16).collect()));
        let l = s.resolve(&[8, 8], DType::Bf16, 0).unwrap();
        assert_eq!(l.mesh().rank_at(&[1, 0]), 12);
        assert_eq!(l.to_string(), "mesh=2x4 ranks=8..16 place=S(0),R");
        let s = LayoutSpec::parse("place=Shard(-1) mesh=3 ranks=5,1,9").unwrap();
        let l = s.resolve(&[4, 6], DType::F32, 0).unwrap();
        assert_eq!(l.placements(), [Placement::Shard(1)]);
        assert_eq!(l.mesh().ranks(), [5, 1, 9]);
    }

    #[test]
    fn default_ranks_start_where_asked() {
        let s = LayoutSpec::parse("mesh=4 place=S(1)").unwrap();
        let l = s.resolve(&[8, 8], DType::Bf16, 2).unwrap();
        assert_eq!(l.mesh().ranks(), [2, 3, 4, 5]);
    }

    #[test]
    fn malformed_specs_say_why() {
        let err = |s: &str| LayoutSpec::parse(s).unwrap_err().to_string();
        assert!(err("mesh=2").contains("missing place="));
        assert!(err("mesh=2 place=Q(0)").contains("unknown placement `Q(0)`"));
        assert!(err("mesh=two place=R").contains("`two` is not a valid mesh axis size"));
        assert!(err("mesh=2 place=R color=red").contains("unknown key `color`"));
        assert!(err("mesh=2 place=S(x)").contains("`x` is not a tensor dim"));
        assert!(err("mesh=2 mesh=3 place=R").contains("given twice"));
        assert!(err("mesh=2 ranks=4..2 place=R").contains("runs backwards"));
    }

    #[test]
    fn rank_lists_round_trip() {
        for text in ["0..4", "0..4,8..12", "5,1,9", "3"] {
            let ranks = RankList::parse(text).unwrap();
            assert_eq!(RankList::describe(&ranks), text);
        }
    }

    #[test]
    fn shapes() {
        assert_eq!(parse_shape("8x8").unwrap(), [8, 8]);
        assert_eq!(parse_shape("[2, 3]").unwrap(), [2, 3]);
        assert!(
            parse_shape("8,,8")
                .unwrap_err()
                .to_string()
                .contains("`8,,8`")
        );
        assert_eq!(parse_shape("4X4").unwrap(), [4, 4]);
    }

    /// The message names the text at fault, not an empty piece of it.
    #[test]
    fn shape_errors_name_the_bad_dimension() {
        let err = |s: &str| parse_shape(s).unwrap_err().to_string();
        assert_eq!(
            err("8,x"),
            "shape: malformed shape `8,x`: `x` is not a valid dimension size"
        );
        assert_eq!(
            err("8,,8"),
            "shape: malformed shape `8,,8`: dimension 1 is empty"
        );
        assert_eq!(
            err("8x"),
            "shape: malformed shape `8x`: dimension 1 is empty"
        );
        assert!(err("8,8x8").contains("`8x8` is not a valid dimension size"));
    }

    /// Default ranks that would cross 2^31 say so, instead of "ranks lists 0".
    #[test]
    fn default_ranks_near_the_rank_limit() {
        let s = LayoutSpec::parse("mesh=2 place=R").unwrap();
        let err = s.resolve(&[8], DType::U8, (1 << 31) - 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the default ranks 2147483647..2147483649 reach 2^31 (ranks must be below 2^31): give ranks="
        );
        let last = s.resolve(&[8], DType::U8, (1 << 31) - 2).unwrap();
        assert_eq!(last.mesh().ranks(), [(1 << 31) - 2, (1 << 31) - 1]);
    }

    #[test]
    fn rank_lists_stop_at_the_side_limit() {
        let err = RankList::parse("0..16777216,16777216").unwrap_err();
        assert!(err.contains("more than the 16777216 ranks"), "{err}");
        let err = RankList::parse("0..10,100..16777400").unwrap_err();
        assert!(err.contains("rank range `100..16777400`"), "{err}");
        assert_eq!(RankList::parse("0..16777216").unwrap().len(), 1 << 24);
        let s = LayoutSpec::parse("mesh=4097x4096 place=R,R").unwrap();
        let err = s.resolve(&[8], DType::U8, 0).unwrap_err().to_string();
        assert!(err.contains("more than the 16777216 ranks"), "{err}");
    }
}
