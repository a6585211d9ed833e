//! One error type for the whole crate: every variant carries the values that caused it, so the
//! message names the field and the value without any formatting at the call site.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

use crate::rank::Rank;

mod convert;
mod field;
mod layout;
mod parse;

pub use convert::ConvertError;
pub use field::{Field, Vocabulary};
pub use layout::LayoutError;

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
    /// A dtype name that names no dtype.
    #[error(
        "{}: unknown dtype `{value}` (expected one of bool, u8, i8, fp8e4m3, fp8e5m2, bf16, f16, i16, u16, f32, i32, u32, f64, i64, u64)",
        Field::DType
    )]
    UnknownDType {
        /// The name given.
        value: String,
    },

    /// A layout that cannot exist, on the side it was given for.
    #[error("{side}: {source}")]
    Layout {
        /// The side whose layout it is.
        side: Side,
        /// What is wrong with the layout.
        #[source]
        source: LayoutError,
    },

    /// A shape that does not parse.
    #[error("{}: malformed shape `{value}`: {reason}", Field::Shape)]
    MalformedShape {
        /// The shape as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Source and destination layouts of different shapes: a reshard moves one tensor.
    #[error(
        "{}: the sides disagree: {} has shape {src}, {} has shape {dst}",
        Field::Shape,
        Field::Src,
        Field::Dst
    )]
    ShapeMismatch {
        /// The source layout's shape.
        src: Dims,
        /// The destination layout's shape.
        dst: Dims,
    },

    /// A rank of a layout that was given no local buffer.
    #[error("{side}: no local buffer given for rank {rank}")]
    MissingBuffer {
        /// The side whose layout holds the rank.
        side: Side,
        /// The rank without a buffer.
        rank: Rank,
    },

    /// A buffer given for a rank that is not part of the layout.
    #[error("{side}: rank {rank} is not part of this layout, yet a buffer was given for it")]
    UnexpectedBuffer {
        /// The side the buffer was given for.
        side: Side,
        /// The rank it was given for.
        rank: Rank,
    },

    /// A local buffer whose length is not its shard's size in bytes.
    #[error(
        "{side}: rank {rank}'s buffer has {got} bytes, but its shard {extent} needs {expected}"
    )]
    BufferSize {
        /// The side whose layout holds the shard.
        side: Side,
        /// The rank whose buffer it is.
        rank: Rank,
        /// The shard's extent.
        extent: Dims,
        /// The bytes the shard needs.
        expected: u64,
        /// The bytes the buffer has.
        got: u64,
    },

    /// An option whose value cannot be used.
    #[error("{field}: {value} is invalid: {reason}")]
    InvalidOption {
        /// The option.
        field: Field,
        /// Its value, as given.
        value: String,
        /// Why the value cannot be used.
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
        /// How many replicas the destination ranks form.
        replicas: usize,
        /// How many destination ranks there are.
        ranks: usize,
    },

    /// A tensor or buffer of a many-tensor reshard (a model refit) that does not fit.
    #[error("{what} `{name}`: {reason}")]
    Batch {
        /// What does not fit: `tensor`, `buffer` or `rank`.
        what: &'static str,
        /// Its name (for a rank, its number).
        name: String,
        /// Why it does not fit.
        reason: String,
    },

    /// An environment variable whose value cannot be used (`WORLD_SIZE`, `RESHARD_TOKEN`).
    #[error("{var}={value:?} is invalid: {reason}")]
    Env {
        /// The variable's name.
        var: &'static str,
        /// Its value (bytes that are not UTF-8 replaced).
        value: String,
        /// Why the value cannot be used.
        reason: String,
    },

    /// A connection a peer refused at rendezvous (e.g. for a different `RESHARD_TOKEN`).
    #[error("rank {rank}: connection {what} refused: {reason}")]
    Refused {
        /// The rank whose connection was refused.
        rank: Rank,
        /// Which connection: `to rank 0`, `to rank 3`.
        what: String,
        /// Why the peer refused it, as it said.
        reason: String,
    },

    /// Ranks whose jobs differ, found before any byte moved: they would compute different
    /// plans and move the wrong bytes.
    #[error(
        "the ranks disagree on the job, so nothing was moved: rank {rank} runs {field} {theirs}; rank 0 runs {field} {ours}"
    )]
    Disagreement {
        /// The first rank whose job differs from rank 0's.
        rank: Rank,
        /// The first field that differs, named as on the command line (`--dtype`).
        field: String,
        /// Rank 0's value.
        ours: String,
        /// That rank's value.
        theirs: String,
    },

    /// A rank that cannot run its part of the job (one of its own checks failed), found
    /// before any byte moved.
    #[error("rank {rank} cannot run its part of the job, so nothing was moved: {reason}")]
    RankRefused {
        /// The rank that cannot run its part.
        rank: Rank,
        /// Why, as the rank reports it.
        reason: String,
    },

    /// A job that failed on one or more ranks, as every rank returns it once rank 0 has
    /// given the verdict.
    #[error("rank {rank}: the job failed: {}", .failures.iter().map(|(r, e)| format!("rank {r}: {e}")).collect::<Vec<_>>().join("; "))]
    JobFailed {
        /// The rank that returns the error.
        rank: Rank,
        /// Every rank that failed, with its error as text.
        failures: Vec<(Rank, String)>,
    },

    /// A rank that voted prepared in a job's two-phase decision lost rank 0 before the
    /// decision came: rank 0 may have decided either way, so the rank neither commits nor
    /// drops what it staged, and a later job resolves it.
    #[error(
        "rank {rank}: in doubt: it voted prepared, then lost rank 0 before the decision came ({detail}); its staged version is kept, neither committed nor dropped, until a later job resolves it"
    )]
    InDoubt {
        /// The rank in doubt.
        rank: Rank,
        /// How it lost rank 0.
        detail: String,
    },

    /// A staged refit's commit or abort on a rank that holds no staged version, or another
    /// one than asked.
    #[error(
        "rank {rank}: cannot {action} version {asked}: {}",
        .staged.map_or("it holds no staged version".to_string(), |v| format!("it holds version {v} staged"))
    )]
    NotStaged {
        /// The rank asked.
        rank: Rank,
        /// What it was asked to do: `commit` or `abort`.
        action: &'static str,
        /// The version it was asked to commit or abort.
        asked: u64,
        /// The version it holds staged (`None`: none).
        staged: Option<u64>,
    },

    /// A commit onto shards that no longer hold the version the staging was prepared
    /// against (a commit would mix the two).
    #[error(
        "rank {rank}: refuses to commit version {version}: it was staged onto {}, but the shards serve {}",
        version_name(*.onto), version_name(*.serves)
    )]
    ServesOther {
        /// The rank that refuses.
        rank: Rank,
        /// The version to commit.
        version: u64,
        /// The version the staging was prepared against (`None`: no version known).
        onto: Option<u64>,
        /// The version the shards serve now (`None`: no version known).
        serves: Option<u64>,
    },

    /// A prepare on a rank that still holds a staged version, not yet committed nor aborted
    /// (it may be in doubt: only a commit or an abort resolves it).
    #[error(
        "rank {rank}: cannot stage version {version}: version {staged} is still staged (commit or abort it first)"
    )]
    StillStaged {
        /// The rank asked to prepare.
        rank: Rank,
        /// The version it was asked to stage.
        version: u64,
        /// The version still staged.
        staged: u64,
    },

    /// Transfers a rank was due that did not arrive whole, reported once its part of the
    /// job failed.
    #[error(
        "rank {rank}: {transfers} transfers ({bytes} bytes) did not arrive, from {}",
        .from.iter().map(|r| format!("rank {r}")).collect::<Vec<_>>().join(", ")
    )]
    NotArrived {
        /// The receiving rank.
        rank: Rank,
        /// How many transfers did not arrive.
        transfers: usize,
        /// Their bytes on the wire, all together.
        bytes: u64,
        /// The ranks that were to send them, in rank order.
        from: Vec<Rank>,
    },

    /// A failure within a rank that is neither bad input nor a peer's doing: a broken
    /// invariant, a thread that panicked.
    #[error("rank {rank}: internal failure: {detail}")]
    Internal {
        /// The rank it happened on.
        rank: Rank,
        /// What went wrong.
        detail: String,
    },

    /// A peer whose connection closed, or that exited, before the job was done.
    #[error("rank {rank}: peer rank {peer} is gone: {detail}")]
    PeerGone {
        /// The rank that lost the peer.
        rank: Rank,
        /// The peer that is gone.
        peer: Rank,
        /// How the loss showed (e.g. `connection reset`).
        detail: String,
    },

    /// A peer that sent nothing for as long as a rank waits (`--timeout`).
    #[error("rank {rank}: timed out after {waited:?} waiting for peer rank {peer}: {detail}")]
    Timeout {
        /// The rank that waited.
        rank: Rank,
        /// The peer it waited for.
        peer: Rank,
        /// How long it waited.
        waited: Duration,
        /// What it waited for.
        detail: String,
    },

    /// A message or transfer from a peer that breaks the protocol: malformed, or not the one
    /// expected.
    #[error("rank {rank}: transfer from rank {peer} is malformed: {detail}")]
    Protocol {
        /// The receiving rank.
        rank: Rank,
        /// The sender.
        peer: Rank,
        /// What is wrong with what it sent.
        detail: String,
    },

    /// What landed differs from what the sender sent (`--checksum`): a byte changed on the way.
    #[error(
        "rank {dst}: checksum mismatch in the transfer from rank {src} to rank {dst} at offset {offset:?} extent {extent}: chunk {chunk} (bytes {}..{} of the transfer) was sent with crc32c {sent:#010x} but landed as {landed:#010x}",
        .bytes.start, .bytes.end
    )]
    ChecksumMismatch {
        /// The sending rank.
        src: Rank,
        /// The receiving rank.
        dst: Rank,
        /// Where the transfer's region starts, in global tensor coordinates.
        offset: Vec<u64>,
        /// The extent of the transfer's region.
        extent: Dims,
        /// The index of the chunk that differs, within the transfer.
        chunk: usize,
        /// The chunk's bytes within the transfer.
        bytes: std::ops::Range<usize>,
        /// The CRC-32C the sender computed over the chunk.
        sent: u32,
        /// The CRC-32C of the chunk as it landed.
        landed: u32,
    },

    /// A delta applied onto a shard that did not hold its base (`--checksum`): the region as
    /// it landed differs from the new region its sender holds.
    #[error(
        "rank {dst}: the delta from rank {src} at offset {offset:?} extent {extent} (version {version} over version {base}) left crc32c {landed:#010x} where the sender's new region has {sent:#010x}: this rank's shard did not hold version {base}"
    )]
    DeltaMismatch {
        /// The sending rank.
        src: Rank,
        /// The receiving rank, whose shard did not hold the base.
        dst: Rank,
        /// Where the region starts, in global tensor coordinates.
        offset: Vec<u64>,
        /// The region's extent.
        extent: Dims,
        /// The version the delta brings.
        version: u64,
        /// The version the delta applies over.
        base: u64,
        /// The CRC-32C of the sender's new region.
        sent: u32,
        /// The CRC-32C of the region once the delta was applied.
        landed: u32,
    },

    /// A reshard that failed on one or more ranks: every failure, each naming its rank.
    #[error("the reshard did not complete: {}", .failures.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Incomplete {
        /// The failures, in one flat list.
        failures: Vec<Error>,
    },

    /// Destination buffers that differ, after a run, from what they should hold (`--verify`).
    #[error(
        "verification failed: {mismatches} wrong bytes; first at rank {rank}, byte {offset} of its local buffer (expected {expected:#04x}, found {found:#04x})"
    )]
    VerifyFailed {
        /// The rank of the first wrong byte.
        rank: Rank,
        /// That byte's offset in the rank's local buffer.
        offset: u64,
        /// What the byte should be.
        expected: u8,
        /// What it is.
        found: u8,
        /// How many bytes are wrong in all.
        mismatches: u64,
    },

    /// Destination scale shards of a quantizing run that differ from the scales they should
    /// hold.
    #[error(
        "verification of the scales failed: {mismatches} wrong bytes; first at rank {rank}, byte {offset} of its scale shard (expected {expected:#04x}, found {found:#04x})"
    )]
    ScalesVerifyFailed {
        /// The rank of the first wrong byte.
        rank: Rank,
        /// That byte's offset in the rank's scale shard.
        offset: u64,
        /// What the byte should be.
        expected: u8,
        /// What it is.
        found: u8,
        /// How many bytes are wrong in all.
        mismatches: u64,
    },

    /// A file, socket or other resource of the operating system that could not be opened,
    /// read or written.
    #[error("{path}: {source}")]
    Io {
        /// What was used: a path, an address, or what it is (`a shared-memory ring`).
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A buffer the machine cannot provide (the tensor is too large for its memory or for the
    /// address space `ulimit -v` allows): a resource failure, not bad input.
    #[error("cannot allocate {bytes} bytes ({}) for {what}: out of memory", human_bytes(*.bytes))]
    OutOfMemory {
        /// What the buffer was for.
        what: String,
        /// Its size in bytes.
        bytes: u64,
    },

    /// A thread the operating system would not start (`ulimit -u`, `ulimit -v`, the
    /// system-wide thread limit): a resource failure, not bad input.
    #[error("cannot start a thread for {what}: {source}")]
    ThreadStart {
        /// What the thread was for.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A conversion (`--dst-dtype`, `--quant`) that cannot be done, for the tensor named.
    #[error("{tensor}: {source}")]
    Convert {
        /// The tensor's name (`tensor` for the one tensor of a reshard).
        tensor: String,
        /// Why the conversion cannot be done.
        #[source]
        source: ConvertError,
    },

    /// A model, parallelism config or layout rule that cannot be refit: a
    /// `reshard_model::ModelError`, held without this crate knowing the model layer above it
    /// (that crate converts its errors into this variant).
    #[error(transparent)]
    Model(Box<dyn std::error::Error + Send + Sync>),
}

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

/// `bytes` in binary units with one decimal, e.g. `128.0 MiB`.
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

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
