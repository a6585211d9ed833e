//! What a stream of refits takes on the command line (`run --delta`, `run --stage`, `refit
//! --run --delta`, `refit --run --stage`): how many versions, how the tensors evolve between
//! them, the anchors, and whether each version is staged beside the served one and committed.

use clap::Args;

use reshard::DType;
use reshard::Error;
use reshard::evolve::{Evolution, Update};
use reshard::exec::delta::DeltaOptions;
use reshard::fill::Fill;
use reshard::runtime::refit::stage::StageMethod;

/// What `run --delta` takes beside `run`'s own arguments.
#[derive(Args, Debug, Default)]
#[command(next_help_heading = "Delta and staged refit (--delta, --stage)")]
pub struct DeltaArgs {
    /// Refit version after version, sending each destination only the elements that changed
    /// since the version it holds (the first version is sent whole).
    #[arg(long)]
    pub delta: bool,
    /// Versions in the stream (with --delta or --stage): with --delta the first is dense,
    /// the rest deltas. Default 4.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub steps: Option<u64>,
    /// The fraction of elements each version changes by one ulp of the source dtype (with
    /// --delta or --stage; default 0.01).
    #[arg(long, value_name = "D", conflicts_with = "delta_lr")]
    pub delta_density: Option<f64>,
    /// A training-like update instead: f32 masters (the source) take an Adam-like step of
    /// this learning rate every version, and the fraction that changes in the wire dtype
    /// follows from the values (`run` needs --fill normal; `refit` fills normal values itself).
    #[arg(long, value_name = "LR")]
    pub delta_lr: Option<f32>,
    /// Send everything dense every N versions.
    #[arg(long, value_name = "N", requires = "delta")]
    pub delta_anchor: Option<u64>,
    /// Refit while serving: every destination rank serves from its live shards (a stand-in
    /// engine reading them pass after pass) while each version is staged beside them; the
    /// job then commits it on every rank or on none, in place, in a pause of one copy (or
    /// one patch apply, with --delta). Compared with the refit in place (the engine stopped).
    #[arg(long)]
    pub stage: bool,
    /// With --stage: the methods compared, in turn: in-place, staged, and with --delta
    /// in-place-delta and staged-delta. Default: in-place,staged (and staged-delta with
    /// --delta).
    #[arg(long, value_name = "LIST", requires = "stage")]
    pub stage_methods: Option<String>,
    /// With --stage: commit the destination ranks in G groups of equal size, one group at a
    /// time, so that the others keep serving. Each group must be whole inference replicas
    /// (for `run`, the ranks of one copy of the tensor; for `refit`, an engine's tp x pp
    /// ranks): a G that would cut a replica is refused, naming it.
    #[arg(long, value_name = "G", requires = "stage", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub rolling: Option<u64>,
}

impl DeltaArgs {
    /// Versions in the stream.
    pub fn steps(&self) -> u64 {
        self.steps.unwrap_or(4)
    }

    /// Refuses the stream's options without a stream (neither --delta nor --stage).
    pub fn check(&self) -> Result<(), Error> {
        if self.delta || self.stage {
            return Ok(());
        }
        let given = [
            ("--steps", self.steps.map(|s| s.to_string())),
            ("--delta-density", self.delta_density.map(|d| d.to_string())),
            ("--delta-lr", self.delta_lr.map(|l| l.to_string())),
        ];
        match given.into_iter().find_map(|(flag, v)| Some((flag, v?))) {
            Some((flag, value)) => Err(Error::InvalidOption {
                field: reshard::error::Field::Flag(flag),
                value,
                reason: "applies to a stream of refits: add --delta or --stage".into(),
            }),
            None => Ok(()),
        }
    }

    /// The methods `--stage-methods` lists (checked against --delta).
    pub fn stage_methods(&self) -> Result<Vec<StageMethod>, Error> {
        let default = match self.delta {
            true => "in-place,staged,staged-delta",
            false => "in-place,staged",
        };
        let list = self.stage_methods.as_deref().unwrap_or(default);
        let mut out = Vec::new();
        for m in list.split(',').map(str::trim) {
            let method = match m {
                "in-place" => StageMethod {
                    staged: false,
                    delta: false,
                },
                "in-place-delta" => StageMethod {
                    staged: false,
                    delta: true,
                },
                "staged" => StageMethod {
                    staged: true,
                    delta: false,
                },
                "staged-delta" => StageMethod {
                    staged: true,
                    delta: true,
                },
                other => {
                    return Err(Error::InvalidOption {
                        field: reshard::error::Field::Flag("--stage-methods"),
                        value: other.into(),
                        reason: "expected a list of in-place, staged, in-place-delta, staged-delta"
                            .into(),
                    });
                }
            };
            if method.delta && !self.delta {
                return Err(Error::InvalidOption {
                    field: reshard::error::Field::Flag("--stage-methods"),
                    value: m.into(),
                    reason: "moves deltas: add --delta".into(),
                });
            }
            if !out.contains(&method) {
                out.push(method);
            }
        }
        Ok(out)
    }

    /// How the tensors evolve from version to version.
    pub fn update(&self) -> Update {
        match (self.delta_lr, self.delta_density) {
            (Some(lr), _) => Update::Training { lr },
            (None, d) => Update::Density(d.unwrap_or(0.01)),
        }
    }

    /// The evolution of a tensor filled with `fill` in `dtype` (the source's).
    pub fn evolution(&self, fill: Fill, dtype: DType) -> Result<Evolution, Error> {
        let seed = match fill {
            Fill::Hash { seed } | Fill::Normal { seed } => seed,
            _ => 0,
        };
        Evolution::new(fill, self.update(), seed ^ 0x5eed, dtype)
    }

    /// The delta's options, checked.
    pub fn options(&self) -> Result<DeltaOptions, Error> {
        let options = DeltaOptions {
            anchor: self.delta_anchor,
            ..DeltaOptions::default()
        };
        options.validate()?;
        Ok(options)
    }
}
