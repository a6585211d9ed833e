//! `reshard bench`: reshard against gather+broadcast on the same transport, the same data and
//! the same buffers, repetition after repetition in turn, every repetition's result verified.
//!
//! The command in parts, each importing only those before it: [`coupled`] and [`suite`] build
//! the cases (one layout pair, or a named suite; an already-quantized source's coupled move),
//! [`result`] names the methods and holds a case's result, [`quant`] and [`prequant`] describe
//! the quantizing and already-quantized cases' methods to the library's comparison harness
//! ([`reshard::runtime::refit::harness`]), [`driver`] runs every case (ranks as threads or as
//! processes, the plain cases' methods its own) and collects what every rank measured, and
//! [`mod@report`] prints the comparison as text or JSON.

mod coupled;
mod driver;
mod prequant;
mod quant;
mod report;
mod result;
mod suite;

use clap::{Args, ValueEnum};

use reshard::Error;
use reshard::agreement::Fingerprint;
use reshard::error::Field;
use reshard::exec::ExecOptions;
use reshard::fill::Fill;
use reshard::topology::HostMap;

use super::exec_args::{ExecArgs, with_plan};
use super::units::parse_bytes;
use super::{Failure, HostArgs, TensorArgs};
use driver::{bench_processes, bench_threads};
use report::report;
use suite::{Case, refit_suite};

/// A named set of layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Suite {
    /// Refit-like layouts of training and inference parallelism, on at most 8 ranks.
    Refit,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Global tensor shape (not with --suite).
    #[arg(long, value_name = "D0,D1,...", required_unless_present = "suite")]
    shape: Option<String>,
    /// Element type.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Destination element type (default: --dtype), converted by the senders as they pack.
    #[arg(long, value_name = "DTYPE")]
    dst_dtype: Option<String>,
    /// Quantize into an fp8 --dst-dtype with scales while the bytes move (schemes as for
    /// `run`), and compare with quantizing on the receivers after the move: (a) the reshard
    /// in the source's dtype, then each destination quantizes its shard, and gather+broadcast
    /// in the source's dtype, then each destination quantizes its shard. With an fp8 --dtype
    /// the source is already quantized (the normal fill, quantized): its values and scales
    /// move together, against gather+broadcast of both and against the values alone. Not
    /// with --suite.
    #[arg(long, value_name = "SCHEME", conflicts_with = "suite")]
    quant: Option<String>,
    /// The scales' dtype with --quant: f32, or e8m0 for the power-of-two schemes.
    #[arg(long, value_name = "DTYPE", requires = "quant")]
    scale_dtype: Option<String>,
    /// Source layout, e.g. "mesh=4 place=S(0)" (not with --suite).
    #[arg(long, value_name = "SPEC", required_unless_present = "suite")]
    src: Option<String>,
    /// Destination layout, e.g. "mesh=2 place=S(1)" (not with --suite).
    #[arg(long, value_name = "SPEC", required_unless_present = "suite")]
    dst: Option<String>,
    /// Run a named suite of layouts instead of one.
    #[arg(long, value_enum, conflicts_with_all = ["shape", "src", "dst"])]
    suite: Option<Suite>,
    /// Size of each tensor of the suite (its shapes scale to it).
    #[arg(
        long,
        value_name = "BYTES",
        default_value = "128MiB",
        requires = "suite"
    )]
    suite_bytes: String,
    /// Split a piece among the replicas that hold it only into parts of at least this size.
    #[arg(long, value_name = "BYTES", default_value = "64KiB")]
    min_split_bytes: String,
    #[command(flatten)]
    hosts: HostArgs,
    #[command(flatten)]
    exec: ExecArgs,
    /// Contents of the global tensor: hash or hash:SEED (location-sensitive for every dtype),
    /// index (element i holds i mod 2^bits, which repeats every 2^bits elements), or normal
    /// or normal:SEED (float dtypes only: finite values of varied magnitude). Default: hash,
    /// or normal with --quant (fp8 cannot carry the NaN and infinities a hash holds).
    #[arg(long)]
    fill: Option<String>,
    /// Timed repetitions of each method (the report gives their median, min and max).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed repetitions of each method first.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Print a JSON report instead of text.
    #[arg(long)]
    json: bool,
    /// Predict each method's time on a testbed file (`"kind": "hosts"`, see the `sim`
    /// module docs) and report it beside the measured one.
    #[arg(long, value_name = "FILE")]
    simulate: Option<String>,
}

impl BenchArgs {
    /// The cases, planned on the hosts the ranks learned at rendezvous when no `--hosts` was
    /// given ([`HostArgs::or_learned`]).
    fn cases(&self, learned: Option<&HostMap>) -> Result<Vec<Case>, Error> {
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

    fn repetitions(&self) -> u32 {
        self.warmup + self.iters
    }
}

/// What every rank of the job must run alike: every case's tensor and layouts (a suite's
/// named by case), the fill, the repetitions and the executor's options.
fn fingerprint(args: &BenchArgs, cases: &[Case], fill: Fill, options: &ExecOptions) -> Fingerprint {
    let fingerprint = Fingerprint::new("bench").with(
        "--suite",
        args.suite.map_or("(none)", |s| match s {
            Suite::Refit => "refit",
        }),
    );
    let fingerprint = cases.iter().fold(fingerprint, |fp, case| {
        let prefix = match case.name.as_str() {
            "" => String::new(),
            name => format!("case {name}: "),
        };
        let fp = with_plan(fp, &prefix, &case.plan);
        match &case.coupled {
            Some(c) => fp
                .with(format!("{prefix}--quant (source)"), c.mv.quant.scheme)
                .with(
                    format!("{prefix}--scale-dtype (source)"),
                    c.mv.quant.scale_dtype,
                ),
            None => fp,
        }
    });
    let fingerprint = fingerprint
        .with("--fill", fill)
        .with("--iters", args.iters)
        .with("--warmup", args.warmup);
    args.exec.agreed(options, fingerprint)
}

/// Each case's predicted seconds (reshard, gather+broadcast) on the testbed file `path`;
/// errors name `--simulate`.
fn predict(path: &str, cases: &[Case]) -> Result<Vec<(f64, f64)>, Error> {
    let invalid = |e: reshard::sim::SimError| Error::InvalidOption {
        field: Field::Flag("--simulate"),
        value: path.to_string(),
        reason: e.to_string(),
    };
    let bed = reshard::sim::Testbed::load(path).map_err(invalid)?;
    cases
        .iter()
        .map(|c| {
            let mine = reshard::sim::price_on_testbed(&c.plan, &bed).map_err(invalid)?;
            let theirs = reshard::sim::price_baseline_on(&c.baseline, &bed).map_err(invalid)?;
            Ok((mine.seconds, theirs.seconds))
        })
        .collect()
}

pub fn main(args: &BenchArgs) -> Result<(), Failure> {
    // Everything the user typed is checked before a buffer is allocated or a byte moves.
    let cases = args.cases(None)?;
    let predicted = match &args.simulate {
        None => None,
        Some(path) => Some(predict(path, &cases)?),
    };
    let fill: Fill = match (&args.fill, &args.quant) {
        (Some(text), _) => text.parse()?,
        (None, Some(_)) => Fill::Normal { seed: 0 },
        (None, None) => Fill::Hash { seed: 0 },
    };
    for case in &cases {
        match case.coupled {
            // the source is the normal fill, quantized
            Some(_) => crate::cli::run::check_quantized_fill(fill)?,
            None => fill.check_dtype(case.plan.src().dtype())?,
        }
    }
    let options = args.exec.options()?;
    let world = args.exec.join(&options)?;
    let cases = match world.hosts() {
        Some(learned) => args.cases(Some(learned))?,
        None => cases,
    };
    // checked before joining; priced again on the plans the job runs
    let predicted = match (&args.simulate, predicted) {
        (Some(path), Some(_)) => Some(predict(path, &cases)?),
        _ => None,
    };
    let results = match world.rank() {
        None => bench_threads(args, &cases, fill, &options)?,
        Some(rank) => {
            let highest = cases.iter().map(Case::highest_rank).max().unwrap_or(0);
            let ready = world.check_size(highest).and_then(|()| {
                cases
                    .iter()
                    .try_for_each(|case| case.check_memory(Some(rank)))
            });
            world.agree("bench", ready, || fingerprint(args, &cases, fill, &options))?;
            bench_processes(args, &cases, fill, &options, &world)?
        }
    };
    if let Some((name, results)) = results {
        report(args, &cases, &name, &results, predicted.as_deref());
    }
    Ok(())
}
