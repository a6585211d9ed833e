//! `reshard bench`: reshard against gather+broadcast on the same transport, the same data and
//! the same buffers, repetition after repetition in turn, every repetition's result verified.
//!
//! The command in parts, each importing only those before it: [`args`] (what it takes),
//! [`coupled`] and [`suite`] build
//! the cases (one layout pair, or a named suite; an already-quantized source's coupled move),
//! [`result`] names the methods and holds a case's result, [`quant`] and [`prequant`] describe
//! the quantizing and already-quantized cases' methods to the library's comparison harness
//! ([`reshard::runtime::harness`]), [`driver`] runs every case (ranks as threads or as
//! processes, the plain cases' methods its own) and collects what every rank measured, and
//! [`mod@report`] prints the comparison as text or JSON.

mod args;
mod coupled;
mod driver;
mod prequant;
mod quant;
mod report;
mod result;
mod suite;

use reshard::Error;
use reshard::agreement::Fingerprint;
use reshard::error::Field;
use reshard::exec::ExecOptions;
use reshard::fill::Fill;

use super::Failure;
use super::exec_args::with_plan;
pub use args::{BenchArgs, Suite};
use driver::{bench_processes, bench_threads};
use report::report;
use suite::Case;

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
