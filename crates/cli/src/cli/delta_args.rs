//! What a stream of delta refits takes on the command line (`run --delta`, `refit --run
//! --delta`): how many versions, how the tensors evolve between them, and the anchors.

use clap::Args;

use reshard::DType;
use reshard::Error;
use reshard::evolve::{Evolution, Update};
use reshard::exec::delta::DeltaOptions;
use reshard::fill::Fill;

/// What `run --delta` takes beside `run`'s own arguments.
#[derive(Args, Debug, Default)]
pub struct DeltaArgs {
    /// Refit version after version, sending each destination only the elements that changed
    /// since the version it holds (the first version is sent whole).
    #[arg(long)]
    pub delta: bool,
    /// Versions in the stream (with --delta): the first is dense, the rest deltas.
    #[arg(long, default_value_t = 4, requires = "delta", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub steps: u64,
    /// The fraction of elements each version changes by one ulp of the source dtype.
    #[arg(
        long,
        value_name = "D",
        requires = "delta",
        conflicts_with = "delta_lr"
    )]
    pub delta_density: Option<f64>,
    /// A training-like update instead: f32 masters (the source) take an Adam-like step of
    /// this learning rate every version, and the fraction that changes in the wire dtype
    /// follows from the values (needs --fill normal).
    #[arg(long, value_name = "LR", requires = "delta")]
    pub delta_lr: Option<f32>,
    /// Send everything dense every N versions.
    #[arg(long, value_name = "N", requires = "delta")]
    pub delta_anchor: Option<u64>,
}

impl DeltaArgs {
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
