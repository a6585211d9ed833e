//! Boxes in global tensor coordinates: what a rank holds and what a transfer moves.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// An axis-aligned box of a tensor: `offset[d] .. offset[d] + extent[d]` along every dim `d`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Region {
    /// The box's first element along each dim.
    pub offset: Vec<u64>,
    /// The box's size along each dim, in elements.
    pub extent: Vec<u64>,
}

impl Region {
    /// The whole tensor of `shape`.
    pub fn full(shape: &[u64]) -> Region {
        Region {
            offset: vec![0; shape.len()],
            extent: shape.to_vec(),
        }
    }

    /// A box from per-dim half-open ranges.
    pub fn from_ranges(ranges: &[Range<u64>]) -> Region {
        Region {
            offset: ranges.iter().map(|r| r.start).collect(),
            extent: ranges.iter().map(|r| r.end - r.start).collect(),
        }
    }

    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.extent.len()
    }

    /// The half-open range the box covers along `dim`.
    pub fn range(&self, dim: usize) -> Range<u64> {
        self.offset[dim]..self.offset[dim] + self.extent[dim]
    }

    /// Number of elements (1 for a 0-D box). Saturates instead of overflowing; layouts
    /// reject shapes whose byte size overflows, so this never saturates for a valid layout.
    pub fn volume(&self) -> u64 {
        self.extent
            .iter()
            .try_fold(1u64, |acc, &e| acc.checked_mul(e))
            .unwrap_or(u64::MAX)
    }

    /// Whether the box holds no element (some dim's extent is 0).
    pub fn is_empty(&self) -> bool {
        self.extent.contains(&0)
    }

    /// The common part of two boxes, or `None` if they do not share an element.
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        debug_assert_eq!(self.ndim(), other.ndim());
        let mut offset = Vec::with_capacity(self.ndim());
        let mut extent = Vec::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.extent[d]).min(other.offset[d] + other.extent[d]);
            if hi <= lo {
                return None;
            }
            offset.push(lo);
            extent.push(hi - lo);
        }
        Some(Region { offset, extent })
    }

    /// Whether every element of `other` lies in `self`.
    pub fn contains(&self, other: &Region) -> bool {
        (0..self.ndim()).all(|d| {
            other.extent[d] == 0
                || (other.offset[d] >= self.offset[d]
                    && other.offset[d] + other.extent[d] <= self.offset[d] + self.extent[d])
        })
    }
}

impl fmt::Display for Region {
    /// Python slice notation: `[0:4, 2:4]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}:{}", self.offset[d], self.offset[d] + self.extent[d])?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intersect_and_contain() {
        let a = Region::from_ranges(&[0..4, 0..8]);
        let b = Region::from_ranges(&[2..8, 6..10]);
        let c = a.intersect(&b).unwrap();
        assert_eq!(c, Region::from_ranges(&[2..4, 6..8]));
        assert!(a.contains(&c) && b.contains(&c));
        assert_eq!(c.volume(), 4);
        assert!(a.intersect(&Region::from_ranges(&[4..5, 0..1])).is_none());
        assert_eq!(c.to_string(), "[2:4, 6:8]");
    }

    #[test]
    fn zero_dim_box_has_one_element() {
        let s = Region::full(&[]);
        assert_eq!(s.volume(), 1);
        assert_eq!(s.intersect(&s), Some(s.clone()));
    }
}
