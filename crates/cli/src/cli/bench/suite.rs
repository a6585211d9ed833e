//! The cases `reshard bench` measures: the one layout pair the user typed, or a named suite of
//! them scaled to a tensor size.

use reshard::convert::check_whole_blocks;
use reshard::error::Dims;
use reshard::error::Field;
use reshard::plan::GatherBroadcast;
use reshard::{Error, Plan, Rank};

use super::coupled::Coupled;
use crate::cli::TensorArgs;
use crate::cli::exec_args::check_memory;

/// One layout pair to measure.
pub(super) struct Case {
    pub(super) name: String,
    pub(super) src_spec: String,
    pub(super) dst_spec: String,
    pub(super) plan: Plan,
    pub(super) baseline: GatherBroadcast,
    /// The `--suite-bytes` text a suite case's shape was scaled from: the option to blame when
    /// the case is too large, since the user never wrote its `--shape`.
    pub(super) sized_by: Option<String>,
    /// With `--quant`: the same move without quantizing (the destination in the source's
    /// dtype), which the methods that quantize on the receivers run first; `baseline` is then
    /// its gather+broadcast.
    pub(super) plain: Option<Plan>,
    /// With an already-quantized source (an fp8 `--dtype` with `--quant`): the coupled move,
    /// whose values' plan is `plan` (and their gather+broadcast `baseline`), and the scales'.
    pub(super) coupled: Option<Coupled>,
}

impl Case {
    pub(super) fn new(name: &str, tensor: TensorArgs) -> Result<Case, Error> {
        if tensor.source_is_quantized()? {
            let coupled = Coupled::new(tensor.quantized_move()?)?;
            let values = &coupled.mv.values;
            return Ok(Case {
                name: name.to_string(),
                baseline: GatherBroadcast::on_hosts(values.src(), values.dst(), None)?,
                plan: values.clone(),
                src_spec: tensor.src,
                dst_spec: tensor.dst,
                sized_by: None,
                plain: None,
                coupled: Some(coupled),
            });
        }
        let plan = tensor.plan()?;
        let plain = match plan.quant() {
            None => None,
            Some(q) => {
                // the baselines quantize each destination shard on its own after the move
                for &r in plan.dst().mesh().ranks() {
                    if let Some(shard) = plan.dst().local_region(r) {
                        check_whole_blocks(&q.grid, &shard).map_err(|e| Error::InvalidOption {
                            field: Field::Quant,
                            value: q.quant.scheme.to_string(),
                            reason: format!(
                                "bench compares with quantizing on the receivers, which needs every block inside one destination shard: {e}"
                            ),
                        })?;
                    }
                }
                Some(tensor.unquantized().plan()?)
            }
        };
        let moved = plain.as_ref().unwrap_or(&plan);
        let baseline = GatherBroadcast::on_hosts(moved.src(), moved.dst(), plan.topology())?;
        Ok(Case {
            name: name.to_string(),
            src_spec: tensor.src,
            dst_spec: tensor.dst,
            plan,
            baseline,
            sized_by: None,
            plain,
            coupled: None,
        })
    }

    /// [`check_memory`] for this case's buffers on `rank` (all ranks: `None`); a suite case
    /// names `--suite-bytes` and the case rather than a `--shape` nobody gave.
    pub(super) fn check_memory(&self, rank: Option<Rank>) -> Result<(), Error> {
        let shape = self.plan.src().shape();
        check_memory(self.memory(rank), shape).map_err(|e| match (e, &self.sized_by) {
            (Error::InvalidOption { reason, .. }, Some(text)) => Error::InvalidOption {
                field: Field::Flag("--suite-bytes"),
                value: text.clone(),
                reason: format!(
                    "case {} (shape {}): {reason}",
                    self.name,
                    Dims(shape.to_vec())
                ),
            },
            (e, _) => e,
        })
    }

    /// Bytes of every destination shard; of the values' and the scales' with an
    /// already-quantized source, since both are what the destinations hold afterwards.
    pub(super) fn dst_bytes(&self) -> u64 {
        let scales = self.coupled.as_ref().map_or(0, Coupled::dst_scale_bytes);
        self.plan.dst().shard_bytes().saturating_add(scales)
    }

    pub(super) fn highest_rank(&self) -> Rank {
        self.plan
            .ranks()
            .into_iter()
            .chain(self.baseline.ranks())
            .max()
            .unwrap_or(0)
    }

    /// Bytes of every buffer the case allocates on `rank` (or on all ranks).
    fn memory(&self, rank: Option<Rank>) -> u64 {
        let (src, dst) = (self.plan.src(), self.plan.dst());
        let full = self.baseline.full_bytes();
        let ranks = match rank {
            Some(r) => vec![r],
            None => self.baseline.ranks(),
        };
        let fulls = ranks
            .iter()
            .filter(|&&r| self.baseline.needs_full_buffer(r))
            .count() as u64;
        let shards = match rank {
            Some(r) => src.local_bytes(r).saturating_add(dst.local_bytes(r)),
            None => src.shard_bytes().saturating_add(dst.shard_bytes()),
        };
        // quantizing: the receivers' source-dtype shards and the scale shards besides
        let extra = match (&self.plain, self.plan.quant()) {
            (Some(plain), Some(q)) => {
                let dst_ranks = match rank {
                    Some(r) => vec![r],
                    None => dst.mesh().ranks().to_vec(),
                };
                dst_ranks
                    .iter()
                    .map(|&r| {
                        plain
                            .dst()
                            .local_bytes(r)
                            .saturating_add(q.dst_scale_bytes(dst, r))
                    })
                    .fold(0u64, u64::saturating_add)
            }
            _ => 0,
        };
        // already quantized: the scale shards and their full buffers, and the expected
        // values and scales every destination checks against
        let coupled = self.coupled.as_ref().map_or(0, |c| {
            let (scales, gb) = (&c.mv.scales, &c.scale_baseline);
            let (ss, sd) = (scales.src(), scales.dst());
            let shards = match rank {
                Some(r) => ss.local_bytes(r) + 2 * sd.local_bytes(r) + dst.local_bytes(r),
                None => ss.shard_bytes() + 2 * sd.shard_bytes() + dst.shard_bytes(),
            };
            let fulls = ranks.iter().filter(|&&r| gb.needs_full_buffer(r)).count() as u64;
            shards.saturating_add(fulls.saturating_mul(gb.full_bytes()))
        });
        let shards = shards.saturating_add(extra).saturating_add(coupled);
        shards.saturating_add(fulls.saturating_mul(full))
    }
}

/// The layouts of `--suite refit`: training-to-inference moves scaled to `bytes` per tensor.
pub(super) fn refit_suite(
    bytes: u64,
    bytes_text: &str,
    (dtype, dst_dtype): (&str, Option<&str>),
    min_split_bytes: &str,
    hosts: &crate::cli::HostArgs,
) -> Result<Vec<Case>, Error> {
    let elem = dtype.parse::<reshard::DType>()?.size() as u64;
    let elements = (bytes / elem).max(64 * 64);
    // a square matrix of about `elements`, and 16 stacked experts [16, m, 2m]
    let side = round_down((elements as f64).sqrt() as u64, 64).max(64);
    let m = round_down(((elements / 32) as f64).sqrt() as u64, 16).max(16);
    let square = format!("{side},{side}");
    let experts = format!("16,{m},{}", 2 * m);
    let cases: [(&str, &str, &str, &str); 9] = [
        (
            "tp4-to-tp2",
            &square,
            "mesh=4 place=S(0)",
            "mesh=2 place=S(1)",
        ),
        (
            "dp2xtp2-to-tp4",
            &square,
            "mesh=2x2 place=R,S(0)",
            "mesh=4 place=S(1)",
        ),
        (
            "ep4-experts-to-tp2",
            &experts,
            "mesh=4 place=S(0)",
            "mesh=2 place=S(1)",
        ),
        (
            "fsdp2xtp2-to-tp4",
            &square,
            "mesh=2x2 place=S(0),S(1)",
            "mesh=4 place=S(0)",
        ),
        (
            "tp2-to-dp2xtp2",
            &square,
            "mesh=2 place=S(0)",
            "mesh=2x2 place=R,S(0)",
        ),
        (
            "colocated-tp4-to-tp2",
            &square,
            "mesh=4 place=S(0)",
            "mesh=2 ranks=0..2 place=S(1)",
        ),
        (
            "seed-2-to-4",
            &square,
            "mesh=2 place=S(0)",
            "mesh=4 place=S(1)",
        ),
        (
            "replicated-2-to-4",
            &square,
            "mesh=2 place=R",
            "mesh=4 place=R",
        ),
        (
            "tp4-s0-to-tp4-s1",
            &square,
            "mesh=4 place=S(0)",
            "mesh=4 place=S(1)",
        ),
    ];
    cases
        .iter()
        .map(|(name, shape, src, dst)| {
            let tensor = TensorArgs {
                shape: shape.to_string(),
                dtype: dtype.to_string(),
                dst_dtype: dst_dtype.map(str::to_string),
                quant: None,
                scale_dtype: None,
                src: src.to_string(),
                dst: dst.to_string(),
                min_split_bytes: min_split_bytes.to_string(),
                hosts: hosts.clone(),
            };
            Case::new(name, tensor).map(|case| Case {
                sized_by: Some(bytes_text.to_string()),
                ..case
            })
        })
        .collect()
}

fn round_down(n: u64, to: u64) -> u64 {
    n / to * to
}
