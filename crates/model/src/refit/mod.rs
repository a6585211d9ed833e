//! A whole-model refit: every parameter with its training and inference layouts, the fused
//! buffers of both sides, and its plan and totals.

use reshard_core::error::Field;
use std::time::Instant;

use rayon::prelude::*;

use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{self, Plan, PlanOptions, RankPlan};

use super::fused::{Fused, megatron_fused, transformers5_fused, vllm_fused};
use super::parallel::{Inference, Training};
use super::params::{ExpertNames, Model};
use super::rules::{ModelFacts, Rules, Which, infer_engines, infer_layout, train_layout};
use crate::error::ModelError;

mod json;
mod quant;
mod replicas;

pub use json::{RefitGatherBroadcastJson, RefitJson, RefitQuantJson, RefitReshardJson};
pub use quant::{RefitQuant, RefitScale};

/// The sizes that divide `heads` nearest to `tp`, below and above, as a user would write
/// them instead: `6` of 16 heads gives `4 or tp=8`.
fn dividing(heads: u64, tp: u64) -> String {
    let below = (1..=tp.min(heads)).rev().find(|d| heads.is_multiple_of(*d));
    let above = (tp..=heads).find(|d| heads.is_multiple_of(*d));
    match (below, above) {
        (Some(b), Some(a)) if a != b => format!("{b} or tp={a}"),
        (Some(b), _) => b.to_string(),
        (None, Some(a)) => a.to_string(),
        (None, None) => "1".into(),
    }
}

/// One parameter of a refit: where it is now and where it must go.
#[derive(Clone, Debug)]
pub struct RefitTensor {
    /// The parameter's name.
    pub name: String,
    /// Its layout on the training side.
    pub src: Layout,
    /// Its layout on the inference side.
    pub dst: Layout,
}

/// Where the inference ranks sit relative to the training ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Ranks {
    /// Inference ranks follow the training ranks (separate GPUs), as in the layout spec.
    #[default]
    Disjoint,
    /// Both sides number their ranks from 0 (the same GPUs, time-shared).
    Colocated,
}

/// Every tensor of a model with its two layouts, and the fused buffers of each side.
#[derive(Clone, Debug)]
pub struct Refit {
    /// The model's name.
    pub model: String,
    /// Every parameter, in the model's order.
    pub tensors: Vec<RefitTensor>,
    /// Megatron-LM's fused buffers (indices into `tensors`).
    pub src_fused: Vec<Fused>,
    /// vLLM's fused buffers (indices into `tensors`).
    pub dst_fused: Vec<Fused>,
    /// Ranks on the training side, numbered from 0.
    pub train_ranks: usize,
    /// Ranks on the inference side, numbered from `infer_base`.
    pub infer_ranks: usize,
    /// The first inference rank.
    pub infer_base: Rank,
    /// The inference side's engines, as its parallelism numbers them: each data-parallel
    /// replica's `tp x pp` ranks ([`crate::rules::infer_engines`]). Empty when not known:
    /// the layouts alone then say which ranks serve together ([`Refit::replicas`]).
    pub infer_engines: Vec<Vec<Rank>>,
    /// Into an fp8 engine ([`Refit::quantized`]): what is quantized, and the scales.
    pub quant: Option<RefitQuant>,
}

impl Refit {
    /// Lays out every parameter of `model` on both sides and checks the fused buffers.
    ///
    /// ```
    /// use reshard_model::{Inference, Model, Ranks, Refit, Rules, Training};
    /// let model = Model::load("qwen3-0.6b").unwrap();
    /// let refit = Refit::new(&model, &Training::parse("tp=2,pp=2").unwrap(),
    ///     &Inference::parse("tp=4").unwrap(), &Rules::default(), Ranks::Disjoint).unwrap();
    /// assert_eq!((refit.train_ranks, refit.infer_ranks, refit.infer_base), (4, 4, 4));
    /// let totals = refit.summary(&Default::default()).unwrap();
    /// assert_eq!(totals.logical_payload_bytes, 2 * model.weight_bytes());
    /// ```
    pub fn new(
        model: &Model,
        train: &Training,
        infer: &Inference,
        rules: &Rules,
        ranks: Ranks,
    ) -> Result<Refit, ModelError> {
        if let Some(heads) = model.heads {
            for (side, tp) in [(Field::Train, train.tp), (Field::Infer, infer.tp)] {
                if !heads.attention.is_multiple_of(tp as u64) {
                    return Err(ModelError::Parallel {
                        side,
                        key: "tp".into(),
                        value: tp.to_string(),
                        reason: format!(
                            "does not divide the model's {} attention heads (write tp={})",
                            heads.attention,
                            dividing(heads.attention, tp as u64)
                        ),
                    });
                }
            }
        }
        let facts = ModelFacts {
            num_layers: model.num_layers,
            heads: model.heads,
            tied_embeddings: !model.params.iter().any(|p| p.name == "lm_head.weight"),
        };
        let infer_base = match ranks {
            Ranks::Disjoint => train.world(),
            Ranks::Colocated => 0,
        };
        let tensors = model
            .params
            .par_iter()
            .map(|p| {
                let src = train_layout(p, rules.kind(&p.name, Which::Train), train, &facts)?;
                let dst = infer_layout(
                    p,
                    rules.kind(&p.name, Which::Infer),
                    infer,
                    &facts,
                    infer_base,
                )?;
                Ok(RefitTensor {
                    name: p.name.clone(),
                    src,
                    dst,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let refit = Refit {
            model: model.name.clone(),
            src_fused: match model.expert_names {
                ExpertNames::Split => megatron_fused(&names),
                ExpertNames::Transformers5 => transformers5_fused(&names),
            },
            dst_fused: vllm_fused(&names),
            tensors,
            train_ranks: train.world(),
            infer_ranks: infer.world(),
            infer_base,
            infer_engines: infer_engines(infer, infer_base),
            quant: None,
        };
        refit.validate_fused()?;
        Ok(refit)
    }

    /// Checks every fused buffer of both sides ([`Fused::validate`]).
    pub fn validate_fused(&self) -> Result<(), ModelError> {
        for f in &self.src_fused {
            f.validate(&self.member_layouts(f, |t| &t.src))?;
        }
        for f in &self.dst_fused {
            f.validate(&self.member_layouts(f, |t| &t.dst))?;
        }
        Ok(())
    }

    /// The layouts of `fused`'s members on one side (`side` picks it from a tensor).
    pub fn member_layouts<'a>(
        &'a self,
        fused: &Fused,
        side: impl Fn(&'a RefitTensor) -> &'a Layout,
    ) -> Vec<&'a Layout> {
        fused
            .members
            .iter()
            .map(|&m| side(&self.tensors[m]))
            .collect()
    }

    /// Every rank of either side, counted once.
    pub fn world(&self) -> usize {
        self.train_ranks.max(self.infer_base + self.infer_ranks)
    }

    /// Bytes of all the weights (saturating at `u64::MAX`; [`Refit::summary`] refuses a
    /// model whose totals overflow).
    pub fn weight_bytes(&self) -> u64 {
        u64::try_from(self.weight_bytes_wide()).unwrap_or(u64::MAX)
    }

    fn weight_bytes_wide(&self) -> u128 {
        self.tensors
            .iter()
            .map(|t| u128::from(t.src.total_bytes()))
            .sum()
    }

    /// Elements in all the weights (saturating at `u64::MAX`).
    pub fn params(&self) -> u64 {
        // a layout's bytes fit in u64, so its element count does too
        self.tensors.iter().fold(0, |acc, t| {
            acc.saturating_add(t.src.total_bytes() / t.src.dtype().size() as u64)
        })
    }

    /// The plan of every tensor, in tensor order (planned in parallel).
    pub fn plans(&self, options: &PlanOptions) -> Result<Vec<Plan>, ModelError> {
        self.plans_on(options, None)
    }

    /// [`Refit::plans`] knowing the hosts (relaying if the topology says so); tensors the
    /// refit quantizes are planned knowing none.
    pub fn plans_on(
        &self,
        options: &PlanOptions,
        topology: Option<&reshard_core::plan::Topology>,
    ) -> Result<Vec<Plan>, ModelError> {
        self.tensors
            .par_iter()
            .enumerate()
            // a quantizing plan knows no hosts
            .map(|(i, t)| match (topology, self.quant_plan(i)) {
                (None, quant) | (Some(_), quant @ Some(_)) => plan_tensor(t, quant, options),
                (Some(topology), None) => Plan::with_topology(
                    t.src.clone(),
                    t.dst.clone(),
                    *options,
                    Some(topology.clone()),
                )
                .map_err(|source| ModelError::Plan {
                    tensor: t.name.clone(),
                    source,
                }),
            })
            .collect()
    }

    /// Plans every tensor and adds up the totals, keeping no plan (memory stays flat however
    /// large the model).
    pub fn summary(&self, options: &PlanOptions) -> Result<RefitTotals, ModelError> {
        let start = Instant::now();
        let world = self.world();
        let sum = self
            .tensors
            .par_iter()
            .enumerate()
            .try_fold(
                || Sums::new(world),
                |mut acc, (i, t)| {
                    acc.add(&plan_tensor(t, self.quant_plan(i), options)?);
                    Ok::<_, ModelError>(acc)
                },
            )
            .try_reduce(|| Sums::new(world), |a, b| Ok(a.merge(b)))?;
        self.totals(sum, start.elapsed().as_secs_f64())
    }

    /// The bytes on every host's link, over every tensor planned on `topology` (with relay
    /// if it says so), and over the hierarchical gather+broadcast of every tensor.
    pub fn host_links(
        &self,
        options: &PlanOptions,
        topology: &reshard_core::plan::Topology,
    ) -> Result<(reshard_core::plan::HostLinks, reshard_core::plan::HostLinks), ModelError> {
        let none = || {
            (
                reshard_core::plan::HostLinks::default(),
                reshard_core::plan::HostLinks::default(),
            )
        };
        self.tensors
            .par_iter()
            .try_fold(none, |(mut mine, mut theirs), t| {
                let plan = Plan::with_topology(
                    t.src.clone(),
                    t.dst.clone(),
                    *options,
                    Some(topology.clone()),
                )
                .and_then(|p| {
                    let gb = reshard_core::plan::GatherBroadcast::on_hosts(
                        &t.src,
                        &t.dst,
                        Some(topology),
                    )?;
                    Ok((p, gb))
                })
                .map_err(|source| ModelError::Plan {
                    tensor: t.name.clone(),
                    source,
                })?;
                if let Some(l) = plan.0.host_links() {
                    mine.add(&l);
                }
                if let Some(l) = plan.1.host_links() {
                    theirs.add(&l);
                }
                Ok::<_, ModelError>((mine, theirs))
            })
            .try_reduce(none, |(mut a, mut b), (c, d)| {
                a.add(&c);
                b.add(&d);
                Ok((a, b))
            })
    }

    /// The totals of plans already made by [`Refit::plans`] (`plan_seconds` as given).
    pub fn totals_of(&self, plans: &[Plan], plan_seconds: f64) -> Result<RefitTotals, ModelError> {
        let mut sum = Sums::new(self.world());
        plans.iter().for_each(|p| sum.add(p));
        self.totals(sum, plan_seconds)
    }

    /// Tensor `i`'s quantization, if the refit quantizes it.
    pub fn quant_plan(&self, i: usize) -> Option<&plan::QuantPlan> {
        self.quant.as_ref().and_then(|q| q.plans[i].as_ref())
    }

    /// `rank`'s part of every tensor's plan, in tensor order, computed from the layouts alone
    /// ([`plan::rank_plan`]); tensors the rank has no part in give empty plans.
    pub fn rank_plans(
        &self,
        rank: Rank,
        options: &PlanOptions,
    ) -> Result<Vec<RankPlan>, ModelError> {
        self.tensors
            .iter()
            .map(|t| {
                plan::rank_plan(&t.src, &t.dst, rank, options).map_err(|source| ModelError::Plan {
                    tensor: t.name.clone(),
                    source,
                })
            })
            .collect()
    }

    /// The totals, or an error naming the first that does not fit in 64 bits: a model whose
    /// byte counts pass 2^64 is not a real one, and a saturated count would read as real.
    fn totals(&self, sum: Sums, plan_seconds: f64) -> Result<RefitTotals, ModelError> {
        let fit = |field: &'static str, value: u128| {
            u64::try_from(value).map_err(|_| ModelError::TotalOverflow {
                model: self.model.clone(),
                field,
                value: value.to_string(),
            })
        };
        let weight_bytes = self.weight_bytes_wide();
        let max = |v: &[u128]| v.iter().copied().max().unwrap_or(0);
        Ok(RefitTotals {
            tensors: self.tensors.len(),
            params: self.params(),
            weight_bytes: fit("weight_bytes", weight_bytes)?,
            bytes_remote: fit("reshard.bytes_remote", sum.bytes_remote)?,
            bytes_local: fit("reshard.bytes_local", sum.bytes_local)?,
            messages: fit("reshard.messages", sum.messages)?,
            max_rank_send_bytes: fit("reshard.max_rank_send_bytes", max(&sum.sent))?,
            max_rank_recv_bytes: fit("reshard.max_rank_recv_bytes", max(&sum.received))?,
            gather_broadcast_bytes: fit("gather_broadcast.bytes", sum.gather_broadcast)?,
            logical_payload_bytes: fit("gather_broadcast.logical_payload_bytes", weight_bytes * 2)?,
            plan_seconds,
            scale_bytes: fit("reshard.scale_bytes", sum.scale_bytes)?,
            amax_bytes: fit("reshard.amax_bytes", sum.amax_bytes)?,
        })
    }
}

fn plan_tensor(
    t: &RefitTensor,
    quant: Option<&plan::QuantPlan>,
    options: &PlanOptions,
) -> Result<Plan, ModelError> {
    match quant {
        None => Plan::with_options(t.src.clone(), t.dst.clone(), *options),
        Some(q) => Plan::quantized(t.src.clone(), t.dst.clone(), *options, q.clone()),
    }
    .map_err(|source| ModelError::Plan {
        tensor: t.name.clone(),
        source,
    })
}

/// Running sums over tensors; per-rank bytes are summed over tensors before taking the max.
/// In u128, so that an overflow of 64 bits is reported ([`Refit::summary`]) rather than
/// saturated: 2^31 ranks and tensors of at most 2^64 bytes cannot overflow 128 bits.
struct Sums {
    bytes_remote: u128,
    bytes_local: u128,
    messages: u128,
    gather_broadcast: u128,
    scale_bytes: u128,
    amax_bytes: u128,
    sent: Vec<u128>,
    received: Vec<u128>,
}

impl Sums {
    fn new(world: usize) -> Sums {
        Sums {
            bytes_remote: 0,
            bytes_local: 0,
            messages: 0,
            gather_broadcast: 0,
            scale_bytes: 0,
            amax_bytes: 0,
            sent: vec![0; world],
            received: vec![0; world],
        }
    }

    fn add(&mut self, plan: &Plan) {
        let elem = plan.elem_bytes();
        for t in plan.transfers() {
            let bytes = u128::from(t.bytes(elem));
            if t.is_local() {
                self.bytes_local += bytes;
            } else {
                self.bytes_remote += bytes;
                self.messages += 1;
                self.sent[t.src] += bytes;
                self.received[t.dst] += bytes;
            }
        }
        self.gather_broadcast += plan::report::gather_broadcast_bytes_wide(plan.src(), plan.dst());
        if let Some(q) = plan.quant() {
            let scale = q.scale_bytes() as u128;
            self.scale_bytes += q
                .scale_transfers(plan.dst(), plan.transfers())
                .iter()
                .filter(|t| !t.is_local())
                .map(|t| u128::from(t.region.volume()) * scale)
                .sum::<u128>();
            self.amax_bytes += q
                .amax_messages(plan.src())
                .iter()
                .map(|t| u128::from(t.region.volume()) * plan::quant::AMAX_BYTES as u128)
                .sum::<u128>();
        }
    }

    fn merge(mut self, other: Sums) -> Sums {
        self.bytes_remote += other.bytes_remote;
        self.bytes_local += other.bytes_local;
        self.messages += other.messages;
        self.gather_broadcast += other.gather_broadcast;
        self.scale_bytes += other.scale_bytes;
        self.amax_bytes += other.amax_bytes;
        for (a, b) in self.sent.iter_mut().zip(other.sent) {
            *a += b;
        }
        for (a, b) in self.received.iter_mut().zip(other.received) {
            *a += b;
        }
        self
    }
}

/// The totals of a whole-model refit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefitTotals {
    /// Tensors refitted.
    pub tensors: usize,
    /// Elements in all the weights.
    pub params: u64,
    /// Bytes of all the weights, in the training side's dtypes.
    pub weight_bytes: u64,
    /// Bytes that cross between ranks, over all tensors.
    pub bytes_remote: u64,
    /// Bytes copied inside a rank (colocated sides).
    pub bytes_local: u64,
    /// Transfers between ranks (one per box sent), over all tensors.
    pub messages: u64,
    /// The most bytes one rank sends, over all tensors together.
    pub max_rank_send_bytes: u64,
    /// The most bytes one rank receives, over all tensors together.
    pub max_rank_recv_bytes: u64,
    /// What gather+broadcast moves, tensor by tensor ([`plan::gather_broadcast_bytes`]).
    pub gather_broadcast_bytes: u64,
    /// 2x the weights: how NVIDIA counts the traffic of gather+broadcast.
    pub logical_payload_bytes: u64,
    /// Wall-clock time spent planning every tensor, in seconds.
    pub plan_seconds: f64,
    /// Bytes of scales sent between ranks (quantized refits; 0 otherwise).
    pub scale_bytes: u64,
    /// Bytes of partial amax the source ranks exchange (quantized refits; 0 otherwise).
    pub amax_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelConfig, Rules};

    /// A vocabulary of 10^15 sent to 200 replicas is more than 2^64 bytes: an error, not a
    /// total of 18446744073709551615.
    #[test]
    fn totals_past_64_bits_are_an_error() {
        let json = r#"{"model_type": "llama", "vocab_size": 1000000000000000, "hidden_size": 64,
            "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4}"#;
        let config = ModelConfig::from_json(json, "wide").unwrap();
        let model = Model::from_config(&config, "wide").unwrap();
        let refit = |dp: &str| {
            Refit::new(
                &model,
                &Training::parse("tp=1").unwrap(),
                &Inference::parse(dp).unwrap(),
                &Rules::default(),
                Ranks::Disjoint,
            )
            .unwrap()
        };
        let err = refit("dp=200")
            .summary(&PlanOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("model wide: the refit's reshard.bytes_remote would be "),
            "{err}"
        );
        assert!(
            err.ends_with("more than 2^64-1: too large to report"),
            "{err}"
        );
        // one replica fits
        let totals = refit("dp=1").summary(&PlanOptions::default()).unwrap();
        assert_eq!(totals.bytes_remote, totals.weight_bytes);
        assert!(totals.weight_bytes > 2 * 2 * 64 * 1_000_000_000_000_000);
    }
}
