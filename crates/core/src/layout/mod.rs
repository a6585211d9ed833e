//! Which box of a tensor each rank holds: meshes, placements, and the `torch.chunk` rule.
//!
//! Pure geometry, no I/O. The semantics are DTensor's: a mesh axis with `Shard(d)` splits
//! tensor dim `d` with `torch.chunk` (trailing shards short or empty), axes sharding the same
//! dim apply in mesh-axis order (nested chunking), `Replicate()` copies.

mod buffers;
mod spec;
#[cfg(test)]
mod tests;

use std::fmt;
use std::ops::Range;

pub use spec::{LayoutSpec, PlacementSpec, RankList, parse_shape};

use crate::dtype::DType;
use crate::error::{Dims, LayoutError};
use crate::region::Region;

pub use crate::rank::Rank;

/// Ranks are below 2^31, so that rank arithmetic never overflows (see [`crate::limits`]).
pub const MAX_RANK: Rank = crate::limits::MAX_RANK;

/// How one mesh axis lays the tensor out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split the tensor dim it names across the ranks of this axis.
    Shard(usize),
    /// Every rank along this axis holds the same data.
    Replicate,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::Replicate => f.write_str("R"),
        }
    }
}

/// Shard `index` of a dim of size `n` split over `parts` ranks, exactly as `torch.chunk` and
/// DTensor do it: chunks of `ceil(n / parts)`, the last ones short or empty.
///
/// ```
/// use reshard_core::layout::chunk;
/// let sizes: Vec<u64> = (0..4).map(|i| { let r = chunk(10, 4, i); r.end - r.start }).collect();
/// assert_eq!(sizes, [3, 3, 3, 1]);
/// assert_eq!(chunk(3, 4, 3), 3..3); // empty shards are legal
/// ```
pub fn chunk(n: u64, parts: u64, index: u64) -> Range<u64> {
    debug_assert!(parts > 0 && index < parts);
    let size = n.div_ceil(parts);
    let start = index.saturating_mul(size).min(n);
    let end = (index + 1).saturating_mul(size).min(n);
    start..end
}

/// An n-dimensional array of global ranks, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mesh {
    dims: Vec<usize>,
    ranks: Vec<Rank>,
    /// `(rank, position)` sorted by rank, for lookups.
    positions: Vec<(Rank, usize)>,
}

impl Mesh {
    /// A mesh of shape `dims` over `ranks`, listed in row-major order.
    ///
    /// ```
    /// use reshard_core::layout::Mesh;
    /// let mesh = Mesh::new(vec![2, 4], (8..16).collect()).unwrap();
    /// assert_eq!(mesh.rank_at(&[1, 0]), 12);
    /// ```
    pub fn new(dims: Vec<usize>, ranks: Vec<Rank>) -> Result<Mesh, LayoutError> {
        let dims_u64 = || Dims(dims.iter().map(|&d| d as u64).collect());
        if dims.is_empty() {
            return Err(LayoutError::EmptyMesh);
        }
        if let Some(axis) = dims.iter().position(|&d| d == 0) {
            return Err(LayoutError::ZeroSizeAxis {
                axis,
                mesh: dims_u64(),
            });
        }
        let expected = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .unwrap_or(u64::MAX);
        if expected > crate::limits::MAX_MESH_RANKS as u64 {
            return Err(LayoutError::TooManyRanks {
                mesh: dims_u64(),
                positions: expected,
            });
        }
        if expected != ranks.len() as u64 {
            return Err(LayoutError::MeshSizeMismatch {
                mesh: dims_u64(),
                expected,
                got: ranks.len(),
            });
        }
        if let Some(&rank) = ranks.iter().find(|&&r| r >= MAX_RANK) {
            return Err(LayoutError::RankTooLarge { rank });
        }
        let mut positions: Vec<(Rank, usize)> =
            ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
        positions.sort_unstable();
        if let Some(w) = positions.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(LayoutError::DuplicateRank { rank: w[0].0 });
        }
        Ok(Mesh {
            dims,
            ranks,
            positions,
        })
    }

    /// The mesh's shape: ranks along each axis.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The ranks in row-major mesh order.
    pub fn ranks(&self) -> &[Rank] {
        &self.ranks
    }

    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Row-major position of `rank` in the mesh, if it belongs to it.
    pub fn position(&self, rank: Rank) -> Option<usize> {
        self.positions
            .binary_search_by_key(&rank, |&(r, _)| r)
            .ok()
            .map(|i| self.positions[i].1)
    }

    /// Whether `rank` belongs to the mesh.
    pub fn contains(&self, rank: Rank) -> bool {
        self.position(rank).is_some()
    }

    /// Mesh coordinates of a row-major position.
    pub fn coords(&self, mut position: usize) -> Vec<usize> {
        let mut coords = vec![0; self.dims.len()];
        for axis in (0..self.dims.len()).rev() {
            coords[axis] = position % self.dims[axis];
            position /= self.dims[axis];
        }
        coords
    }

    /// The coordinate along `axis` of a row-major position (one entry of [`Mesh::coords`]).
    pub fn coord(&self, position: usize, axis: usize) -> usize {
        let stride: usize = self.dims[axis + 1..].iter().product();
        position / stride % self.dims[axis]
    }

    /// The rank at mesh coordinates `coords`.
    pub fn rank_at(&self, coords: &[usize]) -> Rank {
        let position = coords
            .iter()
            .zip(&self.dims)
            .fold(0, |acc, (&c, &d)| acc * d + c);
        self.ranks[position]
    }
}

/// A tensor laid out over a mesh: which box every rank of the mesh holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<u64>,
    dtype: DType,
    mesh: Mesh,
    placements: Vec<Placement>,
    /// For every tensor dim, the mesh axes that shard it, in mesh-axis order.
    shard_axes: Vec<Vec<usize>>,
    /// For every tensor dim, the pieces the shard axes cut it into, indexed by the mixed-radix
    /// number of the coordinates along those axes (first axis most significant). They tile the
    /// dim in order; some may be empty.
    pieces: Vec<Vec<Range<u64>>>,
}

impl Layout {
    /// Validates and builds a layout. Errors name the offending value.
    ///
    /// ```
    /// use reshard_core::{DType, Layout, Mesh, Placement, Region};
    /// let mesh = Mesh::new(vec![2], vec![0, 1]).unwrap();
    /// let rows = Layout::new(vec![8, 8], DType::Bf16, mesh, vec![Placement::Shard(0)]).unwrap();
    /// assert_eq!(rows.local_region(1), Some(Region::from_ranges(&[4..8, 0..8])));
    /// ```
    pub fn new(
        shape: Vec<u64>,
        dtype: DType,
        mesh: Mesh,
        placements: Vec<Placement>,
    ) -> Result<Layout, LayoutError> {
        let elements = shape
            .iter()
            .try_fold(1u64, |acc, &e| acc.checked_mul(e))
            .and_then(|n| n.checked_mul(dtype.size() as u64));
        if elements.is_none() {
            return Err(LayoutError::ShapeTooLarge {
                shape: Dims(shape),
                dtype: dtype.to_string(),
            });
        }
        if placements.len() != mesh.dims().len() {
            return Err(LayoutError::PlacementCount {
                mesh_ndim: mesh.dims().len(),
                got: placements.len(),
            });
        }
        let mut shard_axes = vec![Vec::new(); shape.len()];
        for (axis, p) in placements.iter().enumerate() {
            if let Placement::Shard(d) = *p {
                if d >= shape.len() {
                    return Err(LayoutError::ShardDimOutOfRange {
                        dim: d as i64,
                        ndim: shape.len(),
                    });
                }
                shard_axes[d].push(axis);
            }
        }
        let pieces = shard_axes
            .iter()
            .zip(&shape)
            .map(|(axes, &n)| {
                let sizes: Vec<u64> = axes.iter().map(|&a| mesh.dims()[a] as u64).collect();
                nested_chunks(n, &sizes)
            })
            .collect();
        Ok(Layout {
            shape,
            dtype,
            mesh,
            placements,
            shard_axes,
            pieces,
        })
    }

    /// The global tensor's shape, in elements.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Number of tensor dims.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The mesh the tensor is laid out over.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// How each mesh axis lays the tensor out, one per axis.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Total bytes of the global tensor.
    pub fn total_bytes(&self) -> u64 {
        Region::full(&self.shape).volume() * self.dtype.size() as u64
    }

    /// The pieces tensor dim `dim` is cut into (see [`Layout::piece_index`]).
    pub fn dim_pieces(&self, dim: usize) -> &[Range<u64>] {
        &self.pieces[dim]
    }

    /// Per tensor dim, the index into [`Layout::dim_pieces`] of the piece the rank at mesh
    /// `coords` holds.
    pub fn piece_index(&self, coords: &[usize]) -> Vec<usize> {
        self.shard_axes
            .iter()
            .map(|axes| {
                axes.iter()
                    .fold(0, |acc, &a| acc * self.mesh.dims()[a] + coords[a])
            })
            .collect()
    }

    /// The box held by the rank at row-major mesh `position`.
    pub fn region_at(&self, position: usize) -> Region {
        let index = self.piece_index(&self.mesh.coords(position));
        let ranges: Vec<Range<u64>> = index
            .iter()
            .enumerate()
            .map(|(d, &i)| self.pieces[d][i].clone())
            .collect();
        Region::from_ranges(&ranges)
    }

    /// The box `rank` holds, or `None` if the rank is not in the mesh. An empty box is a
    /// legal (empty) shard.
    pub fn local_region(&self, rank: Rank) -> Option<Region> {
        self.mesh.position(rank).map(|p| self.region_at(p))
    }

    /// Bytes of `rank`'s local buffer (0 if it holds nothing).
    pub fn local_bytes(&self, rank: Rank) -> u64 {
        self.local_region(rank)
            .map_or(0, |r| r.volume() * self.dtype.size() as u64)
    }

    /// Bytes of all the ranks' local buffers together (replicas counted each time).
    pub fn shard_bytes(&self) -> u64 {
        (0..self.mesh.size()).fold(0u64, |acc, p| {
            acc.saturating_add(
                self.region_at(p)
                    .volume()
                    .saturating_mul(self.dtype.size() as u64),
            )
        })
    }

    /// The ranks that hold the box with per-dim piece indices `index`, in mesh order: the
    /// replicas of that box. A rank can compute this for any box, without communication.
    pub fn holders(&self, index: &[usize]) -> Vec<Rank> {
        let dims = self.mesh.dims();
        let mut fixed: Vec<Option<usize>> = vec![None; dims.len()];
        for (d, axes) in self.shard_axes.iter().enumerate() {
            let mut rest = index[d];
            for &a in axes.iter().rev() {
                fixed[a] = Some(rest % dims[a]);
                rest /= dims[a];
            }
        }
        let free: Vec<usize> = (0..dims.len()).filter(|&a| fixed[a].is_none()).collect();
        let count: usize = free.iter().map(|&a| dims[a]).product();
        let mut coords: Vec<usize> = fixed.iter().map(|c| c.unwrap_or(0)).collect();
        let mut out = Vec::with_capacity(count);
        for mut k in 0..count {
            for &a in free.iter().rev() {
                coords[a] = k % dims[a];
                k /= dims[a];
            }
            out.push(self.mesh.rank_at(&coords));
        }
        out
    }

    /// Whether `rank` holds the box with per-dim piece indices `index`: the same answer as
    /// `holders(index).contains(&rank)`, in constant time (a lookup of the rank's position)
    /// rather than a scan of every replica, which made a plan with many replicas quadratic.
    pub fn holds(&self, rank: Rank, index: &[usize]) -> bool {
        let Some(position) = self.mesh.position(rank) else {
            return false;
        };
        // piece_index of the rank's coordinates, without allocating: the planner asks for
        // every piece of every destination
        let dims = self.mesh.dims();
        self.shard_axes.iter().zip(index).all(|(axes, &i)| {
            axes.iter()
                .fold(0, |acc, &a| acc * dims[a] + self.mesh.coord(position, a))
                == i
        })
    }

    /// Which replica of its box the rank at row-major mesh `position` holds: the mixed-radix
    /// number of its coordinates along the replicated axes (first axis most significant), in
    /// `0..replication()`.
    pub fn replica_index(&self, position: usize) -> usize {
        self.mixed_radix(position, |p| *p == Placement::Replicate)
    }

    /// The replicas of the whole tensor: the ranks that together hold one copy of it. Ranks
    /// that differ only along replicated axes hold different replicas; ranks that differ
    /// along a sharding axis hold parts of the same one. In [`Layout::replica_index`] order,
    /// each replica's ranks in mesh order.
    ///
    /// ```
    /// use reshard_core::{DType, layout::LayoutSpec};
    /// let l = LayoutSpec::parse("mesh=2x2 ranks=2..6 place=R,S(1)").unwrap();
    /// let l = l.resolve(&[8, 8], DType::Bf16, 0).unwrap();
    /// assert_eq!(l.replicas(), vec![vec![2, 3], vec![4, 5]]);
    /// ```
    pub fn replicas(&self) -> Vec<Vec<Rank>> {
        let mut out = vec![Vec::new(); self.replication()];
        for (position, &rank) in self.mesh.ranks().iter().enumerate() {
            out[self.replica_index(position)].push(rank);
        }
        out
    }

    /// The rank's position among the ranks of one replica: the mixed-radix number of its
    /// coordinates along the sharding axes. Without replicated axes, the mesh position itself.
    pub fn shard_position(&self, position: usize) -> usize {
        self.mixed_radix(position, |p| *p != Placement::Replicate)
    }

    fn mixed_radix(&self, position: usize, axis: impl Fn(&Placement) -> bool) -> usize {
        let coords = self.mesh.coords(position);
        self.placements
            .iter()
            .zip(self.mesh.dims())
            .zip(coords)
            .filter(|((p, _), _)| axis(p))
            .fold(0, |acc, ((_, &d), c)| acc * d + c)
    }

    /// Number of replicas of every box (product of the replicated mesh axes).
    pub fn replication(&self) -> usize {
        self.placements
            .iter()
            .zip(self.mesh.dims())
            .filter(|(p, _)| **p == Placement::Replicate)
            .map(|(_, &d)| d)
            .product()
    }

    /// A stable number for the box with per-dim piece indices `index` (mixed radix).
    pub fn box_id(&self, index: &[usize]) -> usize {
        index
            .iter()
            .zip(&self.pieces)
            .fold(0, |acc, (&i, p)| acc * p.len() + i)
    }
}

/// Nested `torch.chunk`: split `0..n` over `sizes[0]`, each piece over `sizes[1]`, and so on.
/// Returns the leaves in order (first axis most significant).
fn nested_chunks(n: u64, sizes: &[u64]) -> Vec<Range<u64>> {
    let mut pieces: Vec<Range<u64>> = std::iter::once(0..n).collect();
    for &k in sizes {
        pieces = pieces
            .iter()
            .flat_map(|p| {
                let len = p.end - p.start;
                (0..k).map(move |i| {
                    let c = chunk(len, k, i);
                    p.start + c.start..p.start + c.end
                })
            })
            .collect();
    }
    pieces
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mesh: Vec<String> = self.mesh.dims().iter().map(usize::to_string).collect();
        let place: Vec<String> = self.placements.iter().map(Placement::to_string).collect();
        write!(
            f,
            "mesh={} ranks={} place={}",
            mesh.join("x"),
            RankList::describe(self.mesh.ranks()),
            place.join(",")
        )
    }
}
