//! The inputs an error can name, and the words it names them with.
//!
//! The library takes `src`, `dst`, `chunk_bytes`; the command line takes `--src`, `--dst`,
//! `--chunk-bytes`. A message is written once, with a [`Field`] where the input's name goes,
//! and each front end renders it in its own vocabulary: the library's names by default, the
//! command line's flags once the binary calls [`Vocabulary::Flags`]`.speak()` at start-up.
//!
//! ```
//! use reshard_core::error::{Field, Vocabulary};
//! assert_eq!(Field::DstDType.name(), "dst_dtype");
//! assert_eq!(Field::DstDType.flag(), "--dst-dtype");
//! assert_eq!(Vocabulary::current(), Vocabulary::Library);
//! assert_eq!(Field::ChunkBytes.to_string(), "chunk_bytes");
//! ```

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

/// An input of a reshard, a refit or a job: what an error points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    /// The source layout (`--src`).
    Src,
    /// The destination layout (`--dst`).
    Dst,
    /// The global tensor's shape (`--shape`).
    Shape,
    /// The tensor's dtype, the source's where the destination has another (`--dtype`).
    DType,
    /// The dtype the destination receives the tensor in (`--dst-dtype`).
    DstDType,
    /// How the destination is quantized to fp8 (`--quant`).
    Quant,
    /// The dtype of the quantization scales (`--scale-dtype`).
    ScaleDType,
    /// How the global tensor is filled (`--fill`).
    Fill,
    /// The largest chunk a transfer is cut into (`--chunk-bytes`).
    ChunkBytes,
    /// How long a rank waits for a peer before failing (`--timeout`).
    Timeout,
    /// Which transport moves the bytes (`--transport`).
    Transport,
    /// Whether every transfer is checksummed (`--checksum`).
    Checksum,
    /// The model of a refit: a config, a checkpoint folder or a shipped name (`--model`).
    Model,
    /// The training side's parallelism in a refit (`--train`).
    Train,
    /// The inference side's parallelism in a refit (`--infer`).
    Infer,
    /// A layout rule for the parameters a glob matches, ahead of the defaults (`--override`).
    Override,
    /// The host each rank runs on (`--hosts`).
    Hosts,
    /// Whether bytes that several ranks of a host need enter it once (`--relay`).
    Relay,
    /// How the inference side is quantized (`--infer-quant`).
    InferQuant,
    /// The training side's dtype in a refit (`--train-dtype`).
    TrainDType,
    /// The inference side's dtype in a refit (`--infer-dtype`).
    InferDType,
    /// Every how many versions a delta refit sends everything dense (`--delta-anchor`).
    DeltaAnchor,
    /// The fraction of elements a version changes (`--delta-density`).
    DeltaDensity,
    /// How many groups a staged refit's destination ranks commit in, one after the other
    /// (`--rolling`).
    Rolling,
    /// An option only the command line has (`--nproc`, `--dump`): named by its flag everywhere.
    Flag(&'static str),
}

impl Field {
    /// The name the library (and the Python package) uses: a keyword argument's name.
    pub fn name(self) -> &'static str {
        match self {
            Field::Src => "src",
            Field::Dst => "dst",
            Field::Shape => "shape",
            Field::DType => "dtype",
            Field::DstDType => "dst_dtype",
            Field::Quant => "quant",
            Field::ScaleDType => "scale_dtype",
            Field::Fill => "fill",
            Field::ChunkBytes => "chunk_bytes",
            Field::Timeout => "timeout",
            Field::Transport => "transport",
            Field::Checksum => "checksum",
            Field::Model => "model",
            Field::Train => "train",
            Field::Infer => "infer",
            Field::Override => "overrides",
            Field::Hosts => "hosts",
            Field::Relay => "relay",
            Field::InferQuant => "infer_quant",
            Field::TrainDType => "train_dtype",
            Field::InferDType => "infer_dtype",
            Field::DeltaAnchor => "delta_anchor",
            Field::DeltaDensity => "delta_density",
            Field::Rolling => "rolling",
            Field::Flag(flag) => flag,
        }
    }

    /// The command line's flag for the same input.
    pub fn flag(self) -> &'static str {
        match self {
            Field::Src => "--src",
            Field::Dst => "--dst",
            Field::Shape => "--shape",
            Field::DType => "--dtype",
            Field::DstDType => "--dst-dtype",
            Field::Quant => "--quant",
            Field::ScaleDType => "--scale-dtype",
            Field::Fill => "--fill",
            Field::ChunkBytes => "--chunk-bytes",
            Field::Timeout => "--timeout",
            Field::Transport => "--transport",
            Field::Checksum => "--checksum",
            Field::Model => "--model",
            Field::Train => "--train",
            Field::Infer => "--infer",
            Field::Override => "--override",
            Field::Hosts => "--hosts",
            Field::Relay => "--relay",
            Field::InferQuant => "--infer-quant",
            Field::TrainDType => "--train-dtype",
            Field::InferDType => "--infer-dtype",
            Field::DeltaAnchor => "--delta-anchor",
            Field::DeltaDensity => "--delta-density",
            Field::Rolling => "--rolling",
            Field::Flag(flag) => flag,
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match Vocabulary::current() {
            Vocabulary::Library => self.name(),
            Vocabulary::Flags => self.flag(),
        })
    }
}

/// How messages name their [`Field`]s in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vocabulary {
    /// `src`, `chunk_bytes`: the library's argument names (the default).
    Library,
    /// `--src`, `--chunk-bytes`: the command line's flags.
    Flags,
}

/// One process is one front end, so the choice is process-wide and made once, before any
/// message is rendered.
static FLAGS: AtomicBool = AtomicBool::new(false);

impl Vocabulary {
    /// Renders every later message in this vocabulary.
    pub fn speak(self) {
        FLAGS.store(self == Vocabulary::Flags, Ordering::Relaxed);
    }

    /// The vocabulary messages are rendered in now.
    pub fn current() -> Vocabulary {
        if FLAGS.load(Ordering::Relaxed) {
            Vocabulary::Flags
        } else {
            Vocabulary::Library
        }
    }
}
