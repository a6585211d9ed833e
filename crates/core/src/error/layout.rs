//! The errors of a layout that cannot exist (a spec, a shape, a mesh, a placement).

use thiserror::Error;

use super::Dims;
use crate::rank::Rank;

/// A layout that cannot exist. Carries no side: [`Error::Layout`] adds it.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// A layout spec that does not parse.
    #[error("malformed layout spec `{spec}`: {reason}")]
    MalformedSpec {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor whose size in bytes does not fit in 64 bits.
    #[error("shape {shape} of {dtype} has more than 2^64 bytes")]
    ShapeTooLarge {
        /// The tensor's shape.
        shape: Dims,
        /// Its dtype's name.
        dtype: String,
    },

    /// A mesh without an axis.
    #[error("the mesh needs at least one axis")]
    EmptyMesh,

    /// A mesh axis of size 0.
    #[error("mesh axis {axis} has size 0 (mesh {mesh})")]
    ZeroSizeAxis {
        /// The axis, from 0.
        axis: usize,
        /// The mesh's sizes.
        mesh: Dims,
    },

    /// A list of ranks whose length is not the mesh's number of positions.
    #[error("mesh {mesh} has {} positions but ranks lists {got}", if *.expected == u64::MAX { "more than 2^64".to_string() } else { .expected.to_string() })]
    MeshSizeMismatch {
        /// The mesh's sizes.
        mesh: Dims,
        /// The mesh's number of positions (`u64::MAX` when past 2^64).
        expected: u64,
        /// How many ranks are listed.
        got: usize,
    },

    /// A mesh of more positions than a side may have ranks
    /// ([`MAX_MESH_RANKS`](crate::limits::MAX_MESH_RANKS)).
    #[error("mesh {mesh} has {} positions, more than the {} ranks a side may have", if *.positions == u64::MAX { "more than 2^64".to_string() } else { .positions.to_string() }, crate::limits::MAX_MESH_RANKS)]
    TooManyRanks {
        /// The mesh's sizes.
        mesh: Dims,
        /// Its number of positions (`u64::MAX` when past 2^64).
        positions: u64,
    },

    /// Default ranks (a spec without `ranks=`) that would reach 2^31.
    #[error("the default ranks {first}..{end} reach 2^31 (ranks must be below 2^31): give ranks=")]
    DefaultRanksTooLarge {
        /// The first default rank.
        first: u64,
        /// One past the last.
        end: u64,
    },

    /// A rank listed more than once in a mesh's ranks.
    #[error("rank {rank} appears more than once in ranks")]
    DuplicateRank {
        /// The rank listed twice or more.
        rank: Rank,
    },

    /// A rank of 2^31 or more.
    #[error("rank {rank} is too large (ranks must be below 2^31)")]
    RankTooLarge {
        /// The rank given.
        rank: Rank,
    },

    /// A number of placements other than one per mesh axis.
    #[error("{got} placements for a {mesh_ndim}-D mesh (one per mesh axis)")]
    PlacementCount {
        /// The mesh's number of axes.
        mesh_ndim: usize,
        /// How many placements were given.
        got: usize,
    },

    /// A shard dimension outside the tensor's dimensions.
    #[error("Shard({dim}) is out of range for a {ndim}-D tensor (dims 0..{ndim})")]
    ShardDimOutOfRange {
        /// The dimension given (a negative one counts from the end).
        dim: i64,
        /// The tensor's number of dimensions.
        ndim: usize,
    },
}
