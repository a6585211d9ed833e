//! `reshard refit --run`: the whole model moved for real, one rank per process, by the batched
//! reshard and by per-tensor gather+broadcast in turn, on the same buffers, every repetition
//! of both verified. Arguments in, a report out: the run itself is the library's
//! ([`reshard::runtime::refit::RefitRun`]).

use clap::Args;

use reshard::agreement::Fingerprint;
use reshard::batch::DEFAULT_PACK_BELOW;
use reshard::error::Field;
use reshard::model::Refit;
use reshard::runtime::harness::{MethodJson, Repeat};
use reshard::runtime::refit::RefitRun;
use reshard::runtime::refit::delta::{DeltaRefitReport, DeltaStream};
use reshard::runtime::refit::stage::{StageStream, StagedRefitReport};
use reshard::runtime::serve::ServeOptions;

use super::delta_args::DeltaArgs;
use reshard::{Error, PlanOptions};

use super::Failure;
use super::exec_args::{ExecArgs, TransportKind, check_memory, run_options};
use super::measure::conclude;
use super::units::{bytes, parse_bytes};

#[derive(Args, Debug)]
#[command(next_help_heading = "Running it (--run)")]
pub struct RefitRunArgs {
    /// Execute the refit: one rank per process (under `reshard launch --nproc N` or `mpirun`),
    /// every tensor filled, moved by reshard and by gather+broadcast in turn, both verified.
    #[arg(long, help_heading = "Running it (--run)")]
    pub run: bool,
    #[command(flatten)]
    pub exec: ExecArgs,
    /// Timed repetitions of each method.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Running it (--run)")]
    pub iters: u32,
    /// Untimed repetitions of each method first.
    #[arg(long, default_value_t = 1, help_heading = "Running it (--run)")]
    pub warmup: u32,
    /// Tensors smaller than this whose source is fully replicated (norms, biases, routers)
    /// go in one packed broadcast per source rank; 0 sends every tensor by reshard.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_PACK_BELOW.to_string(), help_heading = "Running it (--run)")]
    pub pack_below: String,
    /// With --run --delta: a stream of versions instead, each moved as a delta refit and
    /// dense in turn, every tensor evolving between them.
    #[command(flatten)]
    pub delta: DeltaArgs,
}

/// What a run reports: both methods' repetitions, or a stream of delta refits.
#[derive(serde::Serialize)]
#[serde(untagged)]
pub enum Outcome {
    Methods(RunJson),
    Delta(DeltaRefitReport),
    Staged(StagedRefitReport),
}

/// The report of a run: the `run` object of the refit JSON.
pub use reshard::runtime::refit::RefitReport as RunJson;

/// Runs this rank's part; rank 0 returns the report.
///
/// `fingerprint` describes the model and both parallelisms: every rank of the job must run
/// alike ([`reshard::transport::Job::agree`]); this adds the batch's every tensor and the
/// run's options.
pub fn main(
    args: &RefitRunArgs,
    refit: &Refit,
    plan: PlanOptions,
    fingerprint: Fingerprint,
) -> Result<Option<Outcome>, Failure> {
    let pack_below = parse_bytes(Field::Flag("--pack-below"), &args.pack_below)?;
    let options = args.exec.options()?;
    let run = RefitRun::new(refit, plan, pack_below)?;
    let fingerprint = run
        .fingerprint(fingerprint.with("--min-split-bytes", plan.min_split_bytes))
        .with("--iters", args.iters)
        .with("--warmup", args.warmup)
        .with("--delta", args.delta.delta)
        .with("--steps", args.delta.steps())
        .with("--delta-update", format!("{:?}", args.delta.update()))
        .with("--delta-anchor", format!("{:?}", args.delta.delta_anchor))
        .with("--stage", args.delta.stage)
        .with("--stage-methods", format!("{:?}", args.delta.stage_methods))
        .with("--rolling", format!("{:?}", args.delta.rolling));
    args.delta.check()?;
    let stage_methods = match args.delta.stage {
        true => args.delta.stage_methods()?,
        false => Vec::new(),
    };
    // each group whole inference replicas, refused before the job starts
    if let Some(g) = args.delta.rolling {
        run.rolling_groups(g as usize)?;
    }
    let fingerprint = args.exec.agreed(&options, fingerprint);
    let kind = args.exec.transport;
    let threads = || {
        Failure::Input(Error::InvalidOption {
            field: Field::Flag("--run"),
            value: kind.name().into(),
            reason: format!(
                "a refit runs one rank per process: start it with `reshard launch --nproc {} -- refit ... --run` (or under mpirun)",
                refit.world()
            ),
        })
    };
    if kind == TransportKind::Local {
        return Err(threads());
    }
    let world = args.exec.join(&options)?;
    let Some(rank) = world.rank().filter(|_| world.job().is_some()) else {
        return Err(threads());
    };
    let ready = world.check_size(refit.world().saturating_sub(1));
    world.agree("refit --run", ready, || fingerprint)?;
    let repeat = Repeat {
        warmup: args.warmup,
        iters: args.iters,
        verify: true,
    };
    let shape = refit
        .tensors
        .first()
        .map(|t| t.src.shape().to_vec())
        .unwrap_or_default();
    let checked = run
        .rank_bytes(rank)
        .and_then(|bytes| check_memory(bytes, &shape));
    if args.delta.stage {
        let stream = StageStream {
            steps: args.delta.steps(),
            update: args.delta.update(),
            delta: args.delta.options()?,
            methods: stage_methods,
            rolling: args.delta.rolling.map(|g| g as usize),
            serve: ServeOptions::default(),
        };
        let mut standing = Vec::new();
        let outcome = checked.and_then(|()| {
            run.run_staged_rank(&world, &stream, &run_options(&options), &mut standing)
        });
        let stopped = outcome.is_err();
        let concluded = conclude(&world, outcome);
        // a stream that stopped short, or whose job failed at its end: say what is served
        if stopped || concluded.is_err() {
            for s in &standing {
                eprintln!("{s}");
            }
        }
        return Ok(
            concluded?.map(|reports| Outcome::Staged(run.staged_report(&stream, &reports.ranks)))
        );
    }
    if args.delta.delta {
        let stream = DeltaStream {
            steps: args.delta.steps(),
            update: args.delta.update(),
            options: args.delta.options()?,
        };
        let outcome =
            checked.and_then(|()| run.run_delta_rank(&world, &stream, &run_options(&options)));
        return Ok(conclude(&world, outcome)?
            .map(|reports| Outcome::Delta(run.delta_report(&stream, &reports.ranks))));
    }
    let outcome = checked.and_then(|()| run.run_rank(&world, repeat, &run_options(&options)));
    Ok(conclude(&world, outcome)?
        .map(|reports| Outcome::Methods(run.report(repeat, &reports.ranks))))
}

/// The text lines of a stream of refits while serving.
pub fn describe_staged(d: &StagedRefitReport) -> String {
    format!(
        "\nrefit while serving over {}: {} versions, {}, {} of destination shards, {}\n{}",
        d.transport,
        d.steps,
        d.update,
        bytes(d.dst_bytes),
        match d.verified {
            true => "every version of every method verified",
            false => "NOT every version verified",
        },
        super::stage_report::describe(&d.versions, &d.methods)
    )
}

/// The text lines of a stream of delta refits.
pub fn describe_delta(d: &DeltaRefitReport) -> String {
    let mut out = format!(
        "\ndelta refit over {}: {} versions, {}, {}\nversion   delta s   dense s   delta wire   dense wire   changed   dense to\n",
        d.transport,
        d.steps,
        d.update,
        match d.verified {
            true => "every version verified",
            false => "NOT every version verified",
        },
    );
    for v in &d.versions {
        let dense = match v.dense_to.is_empty() {
            true => "-".to_string(),
            false => {
                let mut whys: Vec<&str> = v.dense_to.iter().map(|(_, w)| w.as_str()).collect();
                whys.dedup();
                format!("{} ranks ({})", v.dense_to.len(), whys.join(", "))
            }
        };
        out += &format!(
            "{:>7}  {:>8.3}  {:>8.3}  {:>11}  {:>11}  {:>7.3}%   {dense}\n",
            v.version,
            v.delta_s,
            v.dense_s,
            bytes(v.delta_wire_bytes),
            bytes(v.dense_wire_bytes),
            100.0 * v.changed as f64 / v.elems.max(1) as f64,
        );
    }
    out += &format!(
        "after the first version: {:.2}x faster than dense, {:.1}x fewer bytes; bases {} per rank\n",
        d.speedup,
        d.wire_ratio,
        bytes(d.base_bytes_per_rank)
    );
    out
}

/// The text lines of a run.
pub fn describe(run: &RunJson) -> String {
    let line = |name: &str, m: &MethodJson| {
        format!(
            "{name:<18} {:.3} s (min {:.3}, max {:.3}), {:.2} GB/s, {} on the wire, {} extra per rank\n",
            m.median_s,
            m.min_s,
            m.max_s,
            m.gbps,
            bytes(m.wire_bytes),
            bytes(m.peak_extra_bytes_per_rank)
        )
    };
    format!(
        "\nrun over {}, median of {}, {} ({} of destination buffers; packed below {})\n{}{}speedup            {:.2}x\n",
        run.transport,
        run.iters,
        match run.verified {
            true => "every destination byte verified",
            false => "NOT every destination byte verified",
        },
        bytes(run.dst_bytes),
        bytes(run.pack_below),
        line("reshard", &run.reshard),
        line("gather+broadcast", &run.gather_broadcast),
        run.speedup
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::runtime::harness::Measured;

    fn run(verified: bool) -> RunJson {
        let m = MethodJson::of(
            &Measured {
                times: vec![1.0],
                ..Measured::default()
            },
            8,
        );
        RunJson {
            transport: "tcp".into(),
            iters: 1,
            verified,
            pack_below: 0,
            dst_bytes: 8,
            scale_bytes: None,
            reshard: m.clone(),
            gather_broadcast: m,
            speedup: 1.0,
        }
    }

    /// The text says every byte was verified only when the run says so.
    #[test]
    fn the_text_reads_whether_the_run_verified() {
        let yes = describe(&run(true));
        assert!(yes.contains(", every destination byte verified"), "{yes}");
        let no = describe(&run(false));
        assert!(no.contains("NOT every destination byte verified"), "{no}");
        assert!(!no.contains(", every destination byte verified"), "{no}");
    }
}
