//! A rank's whole part of a job as plain data: the [`Program`] that lowering builds from a
//! plan, a quantized plan, a relayed plan, a batch or a gather+broadcast baseline
//! ([`super::lower`], [`crate::batch::lower`]), and that the one executor runs
//! (`run_program`) on a transport, or the one driver ([`super::driver`]) runs for many
//! ranks as threads.
//!
//! A program is an ordered list of [`Phase`]s (the amax exchange, the values, a relay round,
//! the baseline's gather, broadcast and keep); each phase is a set of [`Step`]s in schedule
//! order (sends, receives, local copies) over the buffers it names ([`Buf`]), with the local
//! copies that come before and after its transfers ([`LocalCopy`]) and, for the amax exchange, the
//! quantized tensors whose scales it settles ([`Scaling`]). The chunk size is decided once,
//! here, for both ends of every transfer ([`cut_chunk`]). Nothing in this module does I/O.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use reshard_core::copy::Cast;
use reshard_core::dtype::DType;
use reshard_core::layout::Rank;
use reshard_core::plan::QuantPlan;
use reshard_core::region::Region;
use reshard_transport::Lands;

/// The chunk size a job cuts its transfers into: `requested`, or for a converting job, the
/// largest multiple of 8 bytes not above it (at least 8), so that every chunk holds whole
/// elements of every dtype on both sides. Both ends of a transfer compute the same.
pub fn cut_chunk(requested: usize, converts: bool) -> usize {
    if converts {
        (requested - requested % 8).max(8)
    } else {
        requested
    }
}

/// A buffer of a rank, as a program names it: one the caller gives (its source and
/// destination buffers, in the order the job defines), or one the executor allocates for the
/// run ([`Program::scratch`]: staging, blobs, partial amax, a full tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Buf {
    /// The caller's source buffer of this index.
    Src(usize),
    /// The caller's destination buffer of this index.
    Dst(usize),
    /// The executor's scratch buffer of this index ([`Program::scratch`]).
    Scratch(usize),
}

/// What a step converts while the sender packs (or in a local copy).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Convert {
    /// The bytes as they are (also every receive: only the sender converts).
    #[default]
    Keep,
    /// A float cast known before the run.
    Cast(Cast),
    /// Quantized into fp8 with the scales the amax phase settles for the source piece keyed
    /// `piece` ([`Scaling::pieces`]): known only once that phase has run.
    Quantize {
        /// The source's dtype.
        src: DType,
        /// The fp8 dtype it is quantized into.
        dst: DType,
        /// The source piece whose scales it uses ([`Piece::key`]).
        piece: (usize, usize),
    },
}

impl Convert {
    /// The element size of the source side, when it differs from the wire's.
    pub fn src_elem(&self) -> Option<usize> {
        match self {
            Convert::Keep => None,
            Convert::Cast(c) => Some(c.src_elem),
            Convert::Quantize { src, .. } => Some(src.size()),
        }
    }

    /// Whether it converts at all (anything but [`Convert::Keep`]).
    pub fn is_some(&self) -> bool {
        !matches!(self, Convert::Keep)
    }
}

impl From<Option<Cast>> for Convert {
    fn from(cast: Option<Cast>) -> Convert {
        cast.map_or(Convert::Keep, Convert::Cast)
    }
}

/// One transfer as a rank runs it: the region, the boxes that hold it on both sides, and
/// where those boxes lie in the phase's buffers ([`Phase::src`], [`Phase::dst`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Step<'p> {
    /// The sending rank.
    pub from: Rank,
    /// The receiving rank.
    pub to: Rank,
    /// In global tensor coordinates.
    pub region: Cow<'p, Region>,
    /// Bytes per element on the wire (the destination's).
    pub elem_bytes: usize,
    /// The box holding `region` on the sender: a dense row-major piece of a source buffer.
    pub src_box: Cow<'p, Region>,
    /// The box holding `region` on the receiver.
    pub dst_box: Cow<'p, Region>,
    /// On this rank, when it sends: the source buffer and the bytes of `src_box` in it.
    pub src_at: Option<(usize, Range<usize>)>,
    /// On this rank, when it receives: the destination buffer and the bytes of `dst_box`.
    pub dst_at: Option<(usize, Range<usize>)>,
    /// The conversion from the source's dtype (`elem_bytes` is the destination's), done by
    /// the sender while it packs, or in a local copy.
    pub convert: Convert,
    /// Where the transfer lands on its receiver: in its destination shard (which same-host
    /// senders may write into directly), or beside it. Both ends of a transfer set it alike.
    pub lands: Lands,
}

impl Step<'_> {
    /// Bytes of the transfer on the wire (destination elements).
    pub fn bytes(&self) -> u64 {
        self.region.volume() * self.elem_bytes as u64
    }
}

/// One rank's steps of a phase, each list in schedule order. The sends borrow for as long as
/// the transport may hold their chunks (`'s`); the rest only for the run (`'r`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Steps<'s, 'r> {
    /// The rank that runs them.
    pub rank: Rank,
    /// The transfers it sends.
    pub sends: Vec<Step<'s>>,
    /// The transfers it receives.
    pub recvs: Vec<Step<'r>>,
    /// Transfers from the rank to itself: copied without the transport.
    pub locals: Vec<Step<'r>>,
}

impl Steps<'_, '_> {
    /// Whether it has no step at all.
    pub fn is_empty(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty() && self.locals.is_empty()
    }
}

/// A local copy outside the transfers: packing small tensors into a blob, unpacking them,
/// a relayed slab from the staging into the shard, the baseline's keep.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalCopy<'p> {
    /// The region copied, in tensor coordinates.
    pub region: Cow<'p, Region>,
    /// The buffer read, and the bytes of `from_box` in it.
    pub from: (Buf, Range<usize>),
    /// The box the bytes read hold, dense and row-major.
    pub from_box: Cow<'p, Region>,
    /// The buffer written, and the bytes of `to_box` in it.
    pub to: (Buf, Range<usize>),
    /// The box the bytes written hold, dense and row-major.
    pub to_box: Cow<'p, Region>,
    /// Bytes per element written (the destination's).
    pub elem_bytes: usize,
    /// A float cast on the way, when the two sides' dtypes differ.
    pub cast: Option<Cast>,
    /// Whether the rank's stats count it as a local copy.
    pub counted: bool,
}

/// A quantized tensor whose source shard this rank holds: the amax phase computes the amax
/// of its pieces, exchanges the partial amax of shared blocks, and settles its scales.
#[derive(Clone, Debug)]
pub struct Scaling<'p> {
    /// The tensor's name, for errors.
    pub tensor: Cow<'p, str>,
    /// The tensor's quantization over both layouts.
    pub plan: &'p QuantPlan,
    /// The dtype of its source shard.
    pub src_dtype: DType,
    /// The fp8 dtype it is quantized into.
    pub dst_dtype: DType,
    /// The rank's source box of the tensor.
    pub shard: Cow<'p, Region>,
    /// The blocks its shard touches (in grid coordinates).
    pub blocks: Cow<'p, Region>,
    /// Where its pieces lie, each with the key its value steps look their cast up by.
    pub pieces: Vec<Piece<'p>>,
    /// Each partial amax exchange: its blocks, the scratch it is sent from, the one it
    /// lands in.
    pub exchanges: Vec<(Cow<'p, Region>, usize, usize)>,
    /// The scratch its scales are staged in for the scale transfers, and the blocks written.
    pub staged: Option<(usize, Cow<'p, Region>)>,
}

/// A piece of a quantized tensor's source shard: dense, row-major in `bytes` of `buf`.
#[derive(Clone, Debug)]
pub struct Piece<'p> {
    /// The buffer holding it.
    pub buf: Buf,
    /// Its bytes in `buf`.
    pub bytes: Range<usize>,
    /// Its box, in tensor coordinates.
    pub region: Cow<'p, Region>,
    /// Its source buffer and first byte: how [`Convert::Quantize`] steps name it.
    pub key: (usize, usize),
}

/// Which part of a job a phase is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PhaseKind {
    /// The partial amax exchange of the quantized tensors, before any value moves.
    Amax,
    /// The values (and scales) in one schedule.
    Values,
    /// Round `j` of a relay plan.
    Round(usize),
    /// A delta refit's forwards of a relay plan: each relaying rank passes on what it
    /// received for its own shard, as it came, to the ranks of its host that need the same
    /// region ([`super::delta`]).
    Forward,
    /// The baseline's copy of each destination box out of the full tensor.
    Keep,
}

/// One phase of a rank's program.
#[derive(Clone, Debug)]
pub struct Phase<'p> {
    /// Which part of the job it is.
    pub kind: PhaseKind,
    /// Which job of a chain it belongs to (the baseline's gather and broadcast of each tensor):
    /// phases of every rank with the same `(part, kind)` run together.
    pub part: usize,
    /// The buffers the steps' `src_at` index.
    pub src: Vec<Buf>,
    /// The buffers the steps' `dst_at` index.
    pub dst: Vec<Buf>,
    /// Its sends, receives and local copies.
    pub steps: Steps<'p, 'p>,
    /// Local copies before the transfers (packing, assembling a fused shard).
    pub before: Vec<LocalCopy<'p>>,
    /// Local copies after them (unpacking, relayed slabs into the shard, the keep).
    pub after: Vec<LocalCopy<'p>>,
    /// The quantized tensors whose amax this phase settles.
    pub scaling: Vec<Scaling<'p>>,
    /// Whether the phase skips the transport when it has no transfers (a relay round, the
    /// amax exchange), rather than taking part with nothing to move.
    pub skip_empty: bool,
    /// Whether its counts join the rank's stats (the amax exchange's do not).
    pub counted: bool,
    /// In a [`PhaseKind::Forward`] phase: the sends that forward a hop, by index, each with
    /// the rank the hop came from.
    pub forwards: BTreeMap<usize, Rank>,
}

impl<'p> Phase<'p> {
    /// An empty phase of `kind` over the buffers `src` and `dst`.
    pub fn new(rank: Rank, kind: PhaseKind, part: usize, src: Vec<Buf>, dst: Vec<Buf>) -> Self {
        Phase {
            kind,
            part,
            src,
            dst,
            steps: Steps {
                rank,
                ..Steps::default()
            },
            before: Vec::new(),
            after: Vec::new(),
            scaling: Vec::new(),
            skip_empty: false,
            counted: true,
            forwards: BTreeMap::new(),
        }
    }

    /// Whether the transport is used in this phase.
    pub fn moves(&self) -> bool {
        !(self.skip_empty && self.steps.is_empty())
    }

    /// The links its sends use, `(from, to)`.
    pub fn pairs(&self) -> impl Iterator<Item = (Rank, Rank)> + '_ {
        self.steps
            .sends
            .iter()
            .filter(|s| s.from != s.to)
            .map(|s| (s.from, s.to))
    }
}

/// A buffer the executor allocates for a run, zeroed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scratch {
    /// Its size in bytes.
    pub len: usize,
    /// What it holds, for the out-of-memory error.
    pub what: String,
}

/// One rank's whole part of a job.
#[derive(Clone, Debug)]
pub struct Program<'p> {
    /// The rank that runs it.
    pub rank: Rank,
    /// The chunk size of every transfer, the same on both ends ([`cut_chunk`]).
    pub chunk_bytes: usize,
    /// The buffers the executor allocates for the run, by [`Buf::Scratch`] index.
    pub scratch: Vec<Scratch>,
    /// Its phases, in the order they run.
    pub phases: Vec<Phase<'p>>,
    /// Staging the program holds beside the transport's (relay staging, blobs, partial
    /// amax and staged scales), added to the rank's peak.
    pub staging_bytes: u64,
    /// The two halves of the relay staging (round `j` receives into one and forwards from the other), shared by every
    /// relayed part of the program (they run one after the other).
    pub relay_staging: Option<[usize; 2]>,
}

impl<'p> Program<'p> {
    /// An empty program of `rank`, its transfers cut into chunks of `chunk_bytes`.
    pub fn new(rank: Rank, chunk_bytes: usize) -> Self {
        Program {
            rank,
            chunk_bytes,
            scratch: Vec::new(),
            phases: Vec::new(),
            staging_bytes: 0,
            relay_staging: None,
        }
    }

    /// Adds a scratch buffer of `len` bytes; its index ([`Buf::Scratch`]).
    pub fn add_scratch(&mut self, len: usize, what: impl Into<String>) -> usize {
        self.scratch.push(Scratch {
            len,
            what: what.into(),
        });
        self.scratch.len() - 1
    }

    /// The kinds of its phases, in order.
    pub fn kinds(&self) -> Vec<PhaseKind> {
        self.phases.iter().map(|p| p.kind).collect()
    }

    /// Every peer it sends to or receives from, in any phase: `(senders, receivers)`.
    pub fn peers(&self) -> (BTreeSet<Rank>, BTreeSet<Rank>) {
        let mut senders = BTreeSet::new();
        let mut receivers = BTreeSet::new();
        for p in &self.phases {
            receivers.extend(p.steps.sends.iter().map(|s| s.to));
            senders.extend(p.steps.recvs.iter().map(|s| s.from));
        }
        receivers.remove(&self.rank);
        senders.remove(&self.rank);
        (senders, receivers)
    }
}
