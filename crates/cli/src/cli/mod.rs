//! Command-line interface: argument parsing and output only; the work is the library's.

mod bench;
mod delta_args;
mod demo;
mod exec_args;
mod launch;
mod measure;
mod picture;
mod plan;
mod refit;
mod refit_run;
mod run;
mod stage_report;
mod units;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use reshard::convert::{QuantScheme, ScaleDType};
use reshard::error::Field;
use reshard::layout::{LayoutSpec, parse_shape};
use reshard::plan::{QuantRequest, QuantizedMove, Topology};
use reshard::topology::HostMap;
use reshard::{DType, Error, Plan, PlanOptions, Side};

/// Move a distributed tensor from M ranks in one layout to N ranks in another, sending each
/// destination exactly the overlapping parts of the source shards, point to point.
///
/// Layouts follow PyTorch DTensor: a mesh of ranks and one placement per mesh axis, Shard(d)
/// (S(d)) or Replicate() (R); uneven shards follow torch.chunk.
#[derive(Parser, Debug)]
#[command(name = "reshard", version, about, long_about = None, after_help = LAYOUT_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

const LAYOUT_HELP: &str = "\
Layout spec (--src, --dst): mesh=AxB... [ranks=LIST] place=P1,P2,...
  mesh=2x4        a 2-D mesh of 8 ranks, row-major
  ranks=8..16     the global ranks of the mesh (also 0,2,4 or 0..4,8..12); by default the
                  source starts at rank 0 and the destination right after it
  place=R,S(0)    one placement per mesh axis: S(d)/Shard(d) splits tensor dim d, R replicates

Example: the 8x8 seed example, two row shards into four column shards:
  reshard plan --shape 8,8 --dtype bf16 --src \"mesh=2 place=S(0)\" --dst \"mesh=4 place=S(1)\"

Environment: RESHARD_LOG=debug shows what the planner and executor do.";

#[derive(Subcommand, Debug)]
enum Command {
    /// Compute the transfer plan, without moving data.
    Plan(plan::PlanArgs),
    /// Execute a reshard on filled buffers, optionally verify and dump the result.
    Run(run::RunArgs),
    /// Reshard against gather+broadcast on the same transport and data, both verified.
    Bench(bench::BenchArgs),
    /// The seed example, planned, drawn, executed, verified and compared to gather+broadcast.
    Demo,
    /// Start N local processes with the rendezvous environment (RANK, WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT, RESHARD_TOKEN), each running the given reshard command.
    Launch(launch::LaunchArgs),
    /// A whole model (HF config or checkpoint) from a training to an inference parallelism:
    /// planned, with what reshard moves against gather+broadcast.
    Refit(refit::RefitArgs),
    /// Holds the namespaces of an emulated host for `launch --hosts` until its input closes.
    #[command(name = launch::HOLDER_COMMAND, hide = true)]
    NetnsHolder,
}

/// The tensor and the two layouts, shared by the commands.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Tensor and layouts")]
pub struct TensorArgs {
    /// Global tensor shape, e.g. 8,8 or 256,7168,2048.
    #[arg(long, value_name = "D0,D1,...")]
    shape: String,
    /// Element type: bool u8 i8 fp8e4m3 fp8e5m2 bf16 f16 i16 u16 f32 i32 u32 f64 i64 u64.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Destination element type (default: --dtype). Float casts among f64 f32 bf16 f16 are
    /// done by the senders while they pack (the wire carries destination bytes), rounding to
    /// nearest even exactly as torch's `.to()`; other pairs are refused before any byte moves.
    #[arg(long, value_name = "DTYPE")]
    dst_dtype: Option<String>,
    /// Quantize into an fp8 --dst-dtype (fp8e4m3, fp8e5m2) while the bytes move, with scales:
    /// block:RxC (f32 amax/FMAX per RxC block of the last two dims), block:RxC:ue8m0
    /// (power-of-two scales), mx:32 (OCP MXFP8, e8m0 scales per 32 elements), channel (one
    /// f32 scale per row) or tensor (one f32 scale).
    #[arg(long, value_name = "SCHEME")]
    quant: Option<String>,
    /// The scales' dtype with --quant: f32, or e8m0 (a biased exponent byte) for the
    /// power-of-two schemes (block:RxC:ue8m0, mx:32). Default: e8m0 for mx:32, f32 otherwise.
    #[arg(long, value_name = "DTYPE")]
    scale_dtype: Option<String>,
    /// Source layout, e.g. "mesh=2 place=S(0)".
    #[arg(long, value_name = "SPEC")]
    src: String,
    /// Destination layout, e.g. "mesh=4 place=S(1)".
    #[arg(long, value_name = "SPEC")]
    dst: String,
    /// Split a piece among the replicas that hold it only into parts of at least this size
    /// (e.g. 64KiB; 0 splits every piece).
    #[arg(long, value_name = "BYTES", default_value = "64KiB")]
    min_split_bytes: String,
    #[command(flatten)]
    hosts: HostArgs,
}

/// Which host each rank runs on, for a plan that minds the links between hosts.
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Hosts")]
pub struct HostArgs {
    /// The host of every global rank, `0,0,1,1`, or `HxK`: H hosts of K consecutive ranks.
    /// The plan then serves destinations from their own host where it can, spreads the
    /// bytes that cross over the hosts' links, and relays (see --relay).
    #[arg(long, value_name = "MAP")]
    pub hosts: Option<String>,
    /// With --hosts: bytes that several ranks of one host need cross into it once, to one of
    /// them, which forwards them to the others over shared memory.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = ["on", "off"])]
    pub relay: String,
}

impl HostArgs {
    /// The topology the plan is made for, if hosts are given; errors name `--hosts`.
    pub fn topology(&self) -> Result<Option<Topology>, Error> {
        let Some(text) = &self.hosts else {
            return Ok(None);
        };
        let hosts = HostMap::parse(text)?;
        Ok(Some(Topology::new(hosts, self.relay == "on")))
    }

    /// These options; or, when no `--hosts` was given and the ranks found themselves on
    /// several hosts at rendezvous (under `launch --hosts`, or a job across machines), the
    /// map they learned, so that the plan minds the links between hosts without being told.
    /// A quantizing plan (`quantizing`) takes no host map, so it keeps these options.
    pub fn or_learned(&self, learned: Option<&HostMap>, quantizing: bool) -> HostArgs {
        match learned {
            Some(map) if !quantizing && self.hosts.is_none() && map.num_hosts() > 1 => HostArgs {
                hosts: Some(map.to_string()),
                relay: self.relay.clone(),
            },
            _ => self.clone(),
        }
    }
}

impl TensorArgs {
    /// [`TensorArgs::plan`] on the hosts the job's ranks learned at rendezvous, when no
    /// `--hosts` was given ([`HostArgs::or_learned`]); a quantizing plan keeps to one host's.
    pub fn plan_on(&self, learned: Option<&HostMap>) -> Result<Plan, Error> {
        TensorArgs {
            hosts: self.hosts.or_learned(learned, self.quant.is_some()),
            ..self.clone()
        }
        .plan()
    }

    /// Parses and validates everything, before any byte moves.
    pub fn plan(&self) -> Result<Plan, Error> {
        let (src, dst, options) = self.layouts()?;
        let topology = self.hosts.topology()?;
        match (self.quant_request()?, topology) {
            (None, topology) => Plan::with_topology(src, dst, options, topology),
            (quant @ Some(_), None) => Plan::with_quant(src, dst, options, quant),
            (Some(q), Some(_)) => Err(Error::InvalidOption {
                field: Field::Quant,
                value: q.scheme.to_string(),
                reason: "a quantizing plan does not take a host map: leave out --hosts".into(),
            }),
        }
    }

    /// Whether the source is already quantized: an fp8 `--dtype` with `--quant` (the values
    /// and their scales then move as they are, [`QuantizedMove`]).
    pub fn source_is_quantized(&self) -> Result<bool, Error> {
        let dtype: DType = self.dtype.parse()?;
        Ok(matches!(dtype, DType::Fp8E4M3 | DType::Fp8E5M2) && self.quant.is_some())
    }

    /// The already-quantized move of an fp8 `--dtype` with `--quant`. Like a quantizing
    /// plan, it is planned without a host map: `--hosts` is refused rather than ignored.
    pub fn quantized_move(&self) -> Result<QuantizedMove, Error> {
        let (src, dst, options) = self.layouts()?;
        let request = self.quant_request()?.ok_or_else(|| Error::InvalidOption {
            field: Field::Quant,
            value: "none".into(),
            reason: "an already-quantized source needs its scheme".into(),
        })?;
        if let Some(hosts) = &self.hosts.hosts {
            return Err(Error::InvalidOption {
                field: Field::Flag("--hosts"),
                value: hosts.clone(),
                reason:
                    "an already-quantized source is planned without a host map: leave out --hosts"
                        .into(),
            });
        }
        QuantizedMove::new(src, dst, options, request)
    }

    /// Both layouts and the plan options, parsed and checked.
    fn layouts(&self) -> Result<(reshard::Layout, reshard::Layout, PlanOptions), Error> {
        let shape = parse_shape(&self.shape)?;
        let dtype: DType = self.dtype.parse()?;
        let dst_dtype: DType = match &self.dst_dtype {
            Some(text) => text.parse().map_err(|e| match e {
                Error::UnknownDType { value } => Error::InvalidOption {
                    field: Field::DstDType,
                    value,
                    reason: "unknown dtype (bool u8 i8 fp8e4m3 fp8e5m2 bf16 f16 i16 u16 f32 i32 u32 f64 i64 u64)".into(),
                },
                other => other,
            })?,
            None => dtype,
        };
        let spec = |side: Side, text: &str| {
            LayoutSpec::parse(text).map_err(|source| Error::Layout { side, source })
        };
        let (src_spec, dst_spec) = (spec(Side::Src, &self.src)?, spec(Side::Dst, &self.dst)?);
        let src = src_spec
            .resolve(&shape, dtype, 0)
            .map_err(|source| Error::Layout {
                side: Side::Src,
                source,
            })?;
        // by default the destination ranks start right after the source ranks
        let after_src = src.mesh().ranks().iter().max().map_or(0, |&r| r + 1); // r < 2^31
        let dst = dst_spec
            .resolve(&shape, dst_dtype, after_src)
            .map_err(|source| Error::Layout {
                side: Side::Dst,
                source,
            })?;
        let options = PlanOptions {
            min_split_bytes: units::parse_bytes(
                Field::Flag("--min-split-bytes"),
                &self.min_split_bytes,
            )?,
        };
        Ok((src, dst, options))
    }

    /// The same tensor and layouts moved as they are: the destination in the source's dtype,
    /// nothing quantized.
    pub fn unquantized(&self) -> TensorArgs {
        TensorArgs {
            dst_dtype: None,
            quant: None,
            scale_dtype: None,
            ..self.clone()
        }
    }

    /// `--quant` and `--scale-dtype`, parsed; a scale dtype without a scheme is refused.
    pub fn quant_request(&self) -> Result<Option<QuantRequest>, Error> {
        let scale_dtype: Option<ScaleDType> =
            self.scale_dtype.as_deref().map(str::parse).transpose()?;
        match (&self.quant, scale_dtype) {
            (None, None) => Ok(None),
            (None, Some(d)) => Err(Error::InvalidOption {
                field: Field::ScaleDType,
                value: d.to_string(),
                reason: "scales come with quantization: give --quant SCHEME too".into(),
            }),
            (Some(text), scale_dtype) => Ok(Some(QuantRequest {
                scheme: QuantScheme::parse(text)?,
                scale_dtype,
            })),
        }
    }
}

/// Starts rayon's global pool of worker threads, which planning a whole model and the
/// simulator use. Started lazily, rayon would panic on its first use when the system refuses
/// a thread (`ulimit -u`, `ulimit -v`); started here, that is an error naming the pool.
pub fn start_thread_pool() -> Result<(), Error> {
    rayon::ThreadPoolBuilder::new()
        .build_global()
        .map_err(|e| Error::ThreadStart {
            what: "the worker pool".into(),
            source: std::io::Error::other(e.to_string()),
        })
}

/// A failure of a command, with the exit code it deserves.
pub enum Failure {
    /// Bad input: nothing was moved (exit code 2, as for a usage error).
    Input(Error),
    /// The reshard ran and failed, or its result is wrong (exit code 1).
    Run(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        match e {
            Error::Incomplete { .. }
            | Error::VerifyFailed { .. }
            | Error::ScalesVerifyFailed { .. }
            | Error::PeerGone { .. }
            | Error::Timeout { .. }
            | Error::Protocol { .. }
            | Error::Io { .. }
            | Error::Refused { .. }
            | Error::JobFailed { .. }
            | Error::InDoubt { .. }
            | Error::OutOfMemory { .. }
            | Error::ThreadStart { .. } => Failure::Run(e),
            _ => Failure::Input(e),
        }
    }
}

pub fn main() -> ExitCode {
    // every message names the inputs by the flags this program takes
    reshard::error::Vocabulary::Flags.speak();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RESHARD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Plan(args) => plan::main(&args).map(|()| ExitCode::SUCCESS),
        Command::Run(args) => run::main(&args).map(|()| ExitCode::SUCCESS),
        Command::Bench(args) => bench::main(&args).map(|()| ExitCode::SUCCESS),
        Command::Demo => demo::main().map(|()| ExitCode::SUCCESS),
        Command::Launch(args) => launch::main(&args),
        Command::Refit(args) => refit::main(&args).map(|()| ExitCode::SUCCESS),
        Command::NetnsHolder => {
            launch::hold();
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(Failure::Input(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(Failure::Run(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
