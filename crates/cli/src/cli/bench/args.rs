//! What `reshard bench` takes: one layout pair or a named suite, the fill, the repetitions,
//! the transport's options; and the cases they make.

use clap::{Args, ValueEnum};

use reshard::Error;
use reshard::error::Field;
use reshard::runtime::harness::Repeat;
use reshard::topology::HostMap;

use super::suite::{Case, refit_suite};
use crate::cli::exec_args::ExecArgs;
use crate::cli::units::parse_bytes;
use crate::cli::{HostArgs, TensorArgs};

/// A named set of layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Suite {
    /// Refit-like layouts of training and inference parallelism, on at most 8 ranks.
    Refit,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Global tensor shape (not with --suite).
    #[arg(
        long,
        value_name = "D0,D1,...",
        required_unless_present = "suite",
        help_heading = "Tensor and layouts"
    )]
    pub(super) shape: Option<String>,
    /// Element type.
    #[arg(long, default_value = "bf16", help_heading = "Tensor and layouts")]
    pub(super) dtype: String,
    /// Destination element type (default: --dtype), converted by the senders as they pack.
    #[arg(long, value_name = "DTYPE", help_heading = "Tensor and layouts")]
    pub(super) dst_dtype: Option<String>,
    /// Quantize into an fp8 --dst-dtype with scales while the bytes move (schemes as for
    /// `run`), and compare with quantizing on the receivers after the move: (a) the reshard
    /// in the source's dtype, then each destination quantizes its shard, and gather+broadcast
    /// in the source's dtype, then each destination quantizes its shard. With an fp8 --dtype
    /// the source is already quantized (the normal fill, quantized): its values and scales
    /// move together, against gather+broadcast of both and against the values alone. Not
    /// with --suite.
    #[arg(
        long,
        value_name = "SCHEME",
        conflicts_with = "suite",
        help_heading = "Tensor and layouts"
    )]
    pub(super) quant: Option<String>,
    /// The scales' dtype with --quant: f32, or e8m0 for the power-of-two schemes.
    #[arg(
        long,
        value_name = "DTYPE",
        requires = "quant",
        help_heading = "Tensor and layouts"
    )]
    pub(super) scale_dtype: Option<String>,
    /// Source layout, e.g. "mesh=4 place=S(0)" (not with --suite).
    #[arg(
        long,
        value_name = "SPEC",
        required_unless_present = "suite",
        help_heading = "Tensor and layouts"
    )]
    pub(super) src: Option<String>,
    /// Destination layout, e.g. "mesh=2 place=S(1)" (not with --suite).
    #[arg(
        long,
        value_name = "SPEC",
        required_unless_present = "suite",
        help_heading = "Tensor and layouts"
    )]
    pub(super) dst: Option<String>,
    /// Run a named suite of layouts instead of one.
    #[arg(long, value_enum, conflicts_with_all = ["shape", "src", "dst"], help_heading = "Tensor and layouts")]
    pub(super) suite: Option<Suite>,
    /// Size of each tensor of the suite (its shapes scale to it).
    #[arg(
        long,
        value_name = "BYTES",
        default_value = "128MiB",
        requires = "suite",
        help_heading = "Tensor and layouts"
    )]
    pub(super) suite_bytes: String,
    /// Split a piece among the replicas that hold it only into parts of at least this size.
    #[arg(
        long,
        value_name = "BYTES",
        default_value = "64KiB",
        help_heading = "Tensor and layouts"
    )]
    pub(super) min_split_bytes: String,
    #[command(flatten)]
    pub(super) hosts: HostArgs,
    #[command(flatten)]
    pub(super) exec: ExecArgs,
    /// Contents of the global tensor: hash or hash:SEED (location-sensitive for every dtype),
    /// index (element i holds i mod 2^bits, which repeats every 2^bits elements), or normal
    /// or normal:SEED (float dtypes only: finite values of varied magnitude). Default: hash,
    /// or normal with --quant (fp8 cannot carry the NaN and infinities a hash holds).
    #[arg(long, help_heading = "Data, repetitions and report")]
    pub(super) fill: Option<String>,
    /// Timed repetitions of each method (the report gives their median, min and max).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Data, repetitions and report")]
    pub(super) iters: u32,
    /// Untimed repetitions of each method first.
    #[arg(
        long,
        default_value_t = 1,
        help_heading = "Data, repetitions and report"
    )]
    pub(super) warmup: u32,
    /// Print a JSON report instead of text.
    #[arg(long, help_heading = "Data, repetitions and report")]
    pub(super) json: bool,
    /// Predict each method's time on a testbed file (`"kind": "hosts"`, see the `sim`
    /// module docs) and report it beside the measured one.
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "Data, repetitions and report"
    )]
    pub(super) simulate: Option<String>,
}

impl BenchArgs {
    /// The cases, planned on the hosts the ranks learned at rendezvous when no `--hosts` was
    /// given ([`HostArgs::or_learned`]).
    pub(super) fn cases(&self, learned: Option<&HostMap>) -> Result<Vec<Case>, Error> {
        let hosts = self.hosts.or_learned(learned, self.quant.is_some());
        if self.suite.is_some() {
            let bytes = parse_bytes(Field::Flag("--suite-bytes"), &self.suite_bytes)?;
            return refit_suite(
                bytes,
                &self.suite_bytes,
                (&self.dtype, self.dst_dtype.as_deref()),
                &self.min_split_bytes,
                &hosts,
            );
        }
        let tensor = TensorArgs {
            shape: self.shape.clone().unwrap_or_default(),
            dtype: self.dtype.clone(),
            dst_dtype: self.dst_dtype.clone(),
            quant: self.quant.clone(),
            scale_dtype: self.scale_dtype.clone(),
            src: self.src.clone().unwrap_or_default(),
            dst: self.dst.clone().unwrap_or_default(),
            min_split_bytes: self.min_split_bytes.clone(),
            hosts,
        };
        Ok(vec![Case::new("", tensor)?])
    }

    pub(super) fn repetitions(&self) -> u32 {
        self.warmup + self.iters
    }
}

impl BenchArgs {
    /// Every repetition of every method is checked.
    pub(super) fn repeat(&self) -> Repeat {
        Repeat {
            warmup: self.warmup,
            iters: self.iters,
            verify: true,
        }
    }
}
