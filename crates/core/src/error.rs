//! One error type for the whole crate: every variant carries the values that caused it, so the
//! message names the field and the value without any formatting at the call site.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

use crate::rank::Rank;

mod convert;
mod field;
mod parse;

pub use convert::ConvertError;
pub use field::{Field, Vocabulary};

/// Which side of a reshard a layout or buffer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The ranks that hold the tensor now (training).
    Src,
    /// The ranks that must hold it afterwards (inference).
    Dst,
}

impl Side {
    /// The input that holds this side's layout.
    pub fn field(self) -> Field {
        match self {
            Side::Src => Field::Src,
            Side::Dst => Field::Dst,
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.field().fmt(f)
    }
}

/// Dimensions written the way users type them: `2x4`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dims(pub Vec<u64>);

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("[]");
        }
        let parts: Vec<String> = self.0.iter().map(u64::to_string).collect();
        f.write_str(&parts.join("x"))
    }
}

/// Everything that can go wrong, from parsing a spec to a peer that stops answering.
#[derive(Debug, Error)]
pub enum Error {
    #[error(
        "{}: unknown dtype `{value}` (expected one of bool, u8, i8, fp8e4m3, fp8e5m2, bf16, f16, i16, u16, f32, i32, u32, f64, i64, u64)",
        Field::DType
    )]
    UnknownDType { value: String },

    #[error("{side}: {source}")]
    Layout {
        side: Side,
        #[source]
        source: LayoutError,
    },

    #[error("{}: malformed shape `{value}`: {reason}", Field::Shape)]
    MalformedShape { value: String, reason: String },

    #[error(
        "{}: the sides disagree: {} has shape {src}, {} has shape {dst}",
        Field::Shape,
        Field::Src,
        Field::Dst
    )]
    ShapeMismatch { src: Dims, dst: Dims },

    #[error("{side}: no local buffer given for rank {rank}")]
    MissingBuffer { side: Side, rank: Rank },

    #[error("{side}: rank {rank} is not part of this layout, yet a buffer was given for it")]
    UnexpectedBuffer { side: Side, rank: Rank },

    #[error(
        "{side}: rank {rank}'s buffer has {got} bytes, but its shard {extent} needs {expected}"
    )]
    BufferSize {
        side: Side,
        rank: Rank,
        extent: Dims,
        expected: u64,
        got: u64,
    },

    #[error("{field}: {value} is invalid: {reason}")]
    InvalidOption {
        field: Field,
        value: String,
        reason: String,
    },

    /// Rolling commit groups that cut an inference replica: between the commits of the groups
    /// it falls into, the replica would serve a mix of two versions.
    #[error(
        "{}: {count} is invalid: it cuts the inference replica of ranks {} across commit groups {}, so that replica would serve a mix of two versions between their commits; the {ranks} destination ranks form {}, and each group must hold whole replicas",
        Field::Rolling, rank_list(.replica), and_list(.groups), counted(*.replicas, "replica")
    )]
    CutReplica {
        /// The number of groups asked for (`--rolling`).
        count: usize,
        /// The ranks of the replica cut, in rank order.
        replica: Vec<Rank>,
        /// The groups (from 0, in commit order) its ranks fall into.
        groups: Vec<usize>,
        /// How many replicas the destination ranks form, and how many ranks they are.
        replicas: usize,
        ranks: usize,
    },

    /// A tensor or buffer of a many-tensor reshard (a model refit) that does not fit.
    #[error("{what} `{name}`: {reason}")]
    Batch {
        what: &'static str,
        name: String,
        reason: String,
    },

    #[error("{var}={value:?} is invalid: {reason}")]
    Env {
        var: &'static str,
        value: String,
        reason: String,
    },

    #[error("rank {rank}: connection {what} refused: {reason}")]
    Refused {
        rank: Rank,
        what: String,
        reason: String,
    },

    #[error(
        "the ranks disagree on the job, so nothing was moved: rank {rank} runs {field} {theirs}; rank 0 runs {field} {ours}"
    )]
    Disagreement {
        /// The first rank whose job differs from rank 0's.
        rank: Rank,
        field: String,
        /// Rank 0's value.
        ours: String,
        theirs: String,
    },

    #[error("rank {rank} cannot run its part of the job, so nothing was moved: {reason}")]
    RankRefused { rank: Rank, reason: String },

    #[error("rank {rank}: the job failed: {}", .failures.iter().map(|(r, e)| format!("rank {r}: {e}")).collect::<Vec<_>>().join("; "))]
    JobFailed {
        rank: Rank,
        failures: Vec<(Rank, String)>,
    },

    /// A rank that voted prepared in a job's two-phase decision lost rank 0 before the
    /// decision came: rank 0 may have decided either way, so the rank neither commits nor
    /// drops what it staged, and a later job resolves it.
    #[error(
        "rank {rank}: in doubt: it voted prepared, then lost rank 0 before the decision came ({detail}); its staged version is kept, neither committed nor dropped, until a later job resolves it"
    )]
    InDoubt { rank: Rank, detail: String },

    /// A staged refit's commit or abort on a rank that holds no staged version, or another
    /// one than asked.
    #[error(
        "rank {rank}: cannot {action} version {asked}: {}",
        .staged.map_or("it holds no staged version".to_string(), |v| format!("it holds version {v} staged"))
    )]
    NotStaged {
        rank: Rank,
        action: &'static str,
        asked: u64,
        staged: Option<u64>,
    },

    /// A commit onto shards that no longer hold the version the staging was prepared
    /// against (a commit would mix the two).
    #[error(
        "rank {rank}: refuses to commit version {version}: it was staged onto {}, but the shards serve {}",
        version_name(*.onto), version_name(*.serves)
    )]
    ServesOther {
        rank: Rank,
        version: u64,
        onto: Option<u64>,
        serves: Option<u64>,
    },

    /// A prepare on a rank that still holds a staged version, not yet committed nor aborted
    /// (it may be in doubt: only a commit or an abort resolves it).
    #[error(
        "rank {rank}: cannot stage version {version}: version {staged} is still staged (commit or abort it first)"
    )]
    StillStaged {
        rank: Rank,
        version: u64,
        staged: u64,
    },

    #[error(
        "rank {rank}: {transfers} transfers ({bytes} bytes) did not arrive, from {}",
        .from.iter().map(|r| format!("rank {r}")).collect::<Vec<_>>().join(", ")
    )]
    NotArrived {
        rank: Rank,
        transfers: usize,
        bytes: u64,
        from: Vec<Rank>,
    },

    #[error("rank {rank}: internal failure: {detail}")]
    Internal { rank: Rank, detail: String },

    #[error("rank {rank}: peer rank {peer} is gone: {detail}")]
    PeerGone {
        rank: Rank,
        peer: Rank,
        detail: String,
    },

    #[error("rank {rank}: timed out after {waited:?} waiting for peer rank {peer}: {detail}")]
    Timeout {
        rank: Rank,
        peer: Rank,
        waited: Duration,
        detail: String,
    },

    #[error("rank {rank}: transfer from rank {peer} is malformed: {detail}")]
    Protocol {
        rank: Rank,
        peer: Rank,
        detail: String,
    },

    /// What landed differs from what the sender sent (`--checksum`): a byte changed on the way.
    #[error(
        "rank {dst}: checksum mismatch in the transfer from rank {src} to rank {dst} at offset {offset:?} extent {extent}: chunk {chunk} (bytes {}..{} of the transfer) was sent with crc32c {sent:#010x} but landed as {landed:#010x}",
        .bytes.start, .bytes.end
    )]
    ChecksumMismatch {
        src: Rank,
        dst: Rank,
        /// The transfer's region, in global tensor coordinates.
        offset: Vec<u64>,
        extent: Dims,
        chunk: usize,
        bytes: std::ops::Range<usize>,
        sent: u32,
        landed: u32,
    },

    /// A delta applied onto a shard that did not hold its base (`--checksum`): the region as
    /// it landed differs from the new region its sender holds.
    #[error(
        "rank {dst}: the delta from rank {src} at offset {offset:?} extent {extent} (version {version} over version {base}) left crc32c {landed:#010x} where the sender's new region has {sent:#010x}: this rank's shard did not hold version {base}"
    )]
    DeltaMismatch {
        src: Rank,
        dst: Rank,
        offset: Vec<u64>,
        extent: Dims,
        version: u64,
        base: u64,
        sent: u32,
        landed: u32,
    },

    #[error("the reshard did not complete: {}", .failures.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Incomplete { failures: Vec<Error> },

    #[error(
        "verification failed: {mismatches} wrong bytes; first at rank {rank}, byte {offset} of its local buffer (expected {expected:#04x}, found {found:#04x})"
    )]
    VerifyFailed {
        rank: Rank,
        offset: u64,
        expected: u8,
        found: u8,
        mismatches: u64,
    },

    #[error(
        "verification of the scales failed: {mismatches} wrong bytes; first at rank {rank}, byte {offset} of its scale shard (expected {expected:#04x}, found {found:#04x})"
    )]
    ScalesVerifyFailed {
        rank: Rank,
        offset: u64,
        expected: u8,
        found: u8,
        mismatches: u64,
    },

    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    /// A buffer the machine cannot provide (the tensor is too large for its memory or for the
    /// address space `ulimit -v` allows): a resource failure, not bad input.
    #[error("cannot allocate {bytes} bytes ({}) for {what}: out of memory", human_bytes(*.bytes))]
    OutOfMemory { what: String, bytes: u64 },

    /// A thread the operating system would not start (`ulimit -u`, `ulimit -v`, the
    /// system-wide thread limit): a resource failure, not bad input.
    #[error("cannot start a thread for {what}: {source}")]
    ThreadStart {
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// A conversion (`--dst-dtype`, `--quant`) that cannot be done, for the tensor named.
    #[error("{tensor}: {source}")]
    Convert {
        tensor: String,
        #[source]
        source: ConvertError,
    },

    /// A model, parallelism config or layout rule that cannot be refit: a
    /// `reshard_model::ModelError`, held without this crate knowing the model layer above it
    /// (that crate converts its errors into this variant).
    #[error(transparent)]
    Model(Box<dyn std::error::Error + Send + Sync>),
}

/// `bytes` in binary units with one decimal, e.g. `128.0 MiB`.
/// A version as an error names it (`None`: no version known).
fn version_name(v: Option<u64>) -> String {
    v.map_or("no known version".into(), |v| format!("version {v}"))
}

/// Ranks as a list: `2,3,5`.
fn rank_list(ranks: &[Rank]) -> String {
    let parts: Vec<String> = ranks.iter().map(Rank::to_string).collect();
    parts.join(",")
}

/// `1 replica`, `2 replicas`.
fn counted(n: usize, what: &str) -> String {
    match n {
        1 => format!("1 {what}"),
        n => format!("{n} {what}s"),
    }
}

/// Numbers as a sentence lists them: `0 and 1`, `0, 1 and 2`.
fn and_list(items: &[usize]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(usize::to_string).collect();
            format!("{} and {last}", init.join(", "))
        }
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A layout that cannot exist. Carries no side: [`Error::Layout`] adds it.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    #[error("malformed layout spec `{spec}`: {reason}")]
    MalformedSpec { spec: String, reason: String },

    #[error("shape {shape} of {dtype} has more than 2^64 bytes")]
    ShapeTooLarge { shape: Dims, dtype: String },

    #[error("the mesh needs at least one axis")]
    EmptyMesh,

    #[error("mesh axis {axis} has size 0 (mesh {mesh})")]
    ZeroSizeAxis { axis: usize, mesh: Dims },

    #[error("mesh {mesh} has {} positions but ranks lists {got}", if *.expected == u64::MAX { "more than 2^64".to_string() } else { .expected.to_string() })]
    MeshSizeMismatch {
        mesh: Dims,
        expected: u64,
        got: usize,
    },

    #[error("mesh {mesh} has {} positions, more than the {} ranks a side may have", if *.positions == u64::MAX { "more than 2^64".to_string() } else { .positions.to_string() }, crate::limits::MAX_MESH_RANKS)]
    TooManyRanks { mesh: Dims, positions: u64 },

    #[error("the default ranks {first}..{end} reach 2^31 (ranks must be below 2^31): give ranks=")]
    DefaultRanksTooLarge { first: u64, end: u64 },

    #[error("rank {rank} appears more than once in ranks")]
    DuplicateRank { rank: Rank },

    #[error("rank {rank} is too large (ranks must be below 2^31)")]
    RankTooLarge { rank: Rank },

    #[error("{got} placements for a {mesh_ndim}-D mesh (one per mesh axis)")]
    PlacementCount { mesh_ndim: usize, got: usize },

    #[error("Shard({dim}) is out of range for a {ndim}-D tensor (dims 0..{ndim})")]
    ShardDimOutOfRange { dim: i64, ndim: usize },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
