//! `reshard refit`: a whole model from a training parallelism to an inference parallelism,
//! planned; what reshard moves against gather+broadcast.

use std::fmt::Write;
use std::time::Instant;

use clap::Args;
use reshard::agreement::Fingerprint;
use reshard::error::Field;
use reshard::model::{
    InferQuant, Inference, Model, Ranks, Refit, RefitJson, RefitTotals, Rules, Training, Which,
    refit_dtype,
};
use reshard::sim::{Cluster, Messages, SimOptions};
use reshard::{Error, PlanOptions};

use super::Failure;
use super::units::{bytes, parse_bytes};

#[derive(Args, Debug)]
#[command(after_help = REFIT_HELP)]
pub struct RefitArgs {
    /// An HF config.json, a checkpoint folder (safetensors headers), or a shipped model:
    /// deepseek-v3, deepseek-v3-fp8, kimi-k2, qwen3-235b-a22b, qwen3-30b-a3b, qwen3-32b,
    /// qwen3-0.6b, llama-3.1-8b.
    #[arg(
        long,
        value_name = "CONFIG_OR_DIR",
        help_heading = "Model and parallelism"
    )]
    pub model: String,
    /// Training parallelism (Megatron-LM), e.g. "tp=2,cp=2,dp=4,ep=16,pp=4"; keys tp, cp, ep,
    /// etp, dp, pp, fsdp[=N], world (to infer dp).
    #[arg(long, value_name = "PAR", help_heading = "Model and parallelism")]
    pub train: String,
    /// Inference parallelism (vLLM), e.g. "tp=8,dp=8"; keys tp, dp, pp, ep, world.
    #[arg(long, value_name = "PAR", help_heading = "Model and parallelism")]
    pub infer: String,
    /// Inference ranks are the training ranks (numbered from 0) instead of the ranks after
    /// them.
    #[arg(long, help_heading = "Model and parallelism")]
    pub colocated: bool,
    /// Lay out parameters matching GLOB as KIND (replicate, column, row, kv-column,
    /// expert-column, expert-row), before the default rules; `train:` or `infer:` limits it to
    /// one side. Repeatable.
    #[arg(
        long = "override",
        value_name = "[train:|infer:]GLOB=KIND",
        help_heading = "Model and parallelism"
    )]
    pub overrides: Vec<String>,
    /// Split a piece among the source replicas that hold it only into parts of at least this
    /// size (0 splits every piece).
    #[arg(
        long,
        value_name = "BYTES",
        default_value = "64KiB",
        help_heading = "Model and parallelism"
    )]
    pub min_split_bytes: String,
    /// Which host each rank runs on, for the bytes on every host's link (see `plan --help`).
    #[command(flatten)]
    pub hosts: super::HostArgs,
    /// Refit into an fp8 engine: `fp8-block` (e4m3, 128x128 blocks), `fp8-block:RxC`
    /// (`:e5m2` for e5m2), or `none`; without it, the config's `quantization_config` says.
    /// Linear weights become fp8 with f32 `weight_scale_inv` block scales, as vLLM loads them.
    #[arg(long, value_name = "SCHEME", help_heading = "Precision")]
    pub infer_quant: Option<String>,
    /// The dtype training holds the weights in (f64, f32, bf16, f16; default: the config's
    /// `torch_dtype`), e.g. f32 master weights.
    #[arg(long, value_name = "DTYPE", help_heading = "Precision")]
    pub train_dtype: Option<String>,
    /// The dtype inference receives them in (f64, f32, bf16, f16; default: the config's);
    /// with fp8 weights (`--infer-quant`), the dtype of the tensors not quantized. Senders
    /// convert while they pack: the wire carries this dtype.
    #[arg(long, value_name = "DTYPE", help_heading = "Precision")]
    pub infer_dtype: Option<String>,
    /// Price the refit on a cluster: h100, gb200 or a cluster JSON file (see README,
    /// "Pricing on a cluster"), as the batched executor runs it (one stream per peer pair).
    #[arg(long, value_name = "CLUSTER", help_heading = "Report")]
    pub simulate: Option<String>,
    /// Print the refit JSON of the design notes.
    #[arg(long, help_heading = "Report")]
    pub json: bool,
    /// Also list every tensor with its kind and layout on both sides (and the rule that
    /// chose the kind), and the fused buffers.
    #[arg(long, conflicts_with = "json", help_heading = "Report")]
    pub layouts: bool,
    #[command(flatten)]
    pub execute: super::refit_run::RefitRunArgs,
}

const REFIT_HELP: &str = "\
Layout rules (README, section \"Whole-model refit\"): column-parallel weights Shard(0),
row-parallel Shard(1), vocab-parallel embedding and lm_head, norms/router/biases replicated,
experts stacked [E, out, in] and split by EP on dim 0 (and by expert TP inside), CP as
replication, PP by layer blocks, FSDP as an extra Shard(0) axis.

Example: reshard refit --model deepseek-v3 --train ep=16,pp=16,dp=16 --infer tp=32,dp=8";

impl RefitArgs {
    /// The default rules with the `--override`s before them.
    pub fn rules(&self) -> Result<Rules, Error> {
        Ok(self
            .overrides
            .iter()
            .try_fold(Rules::default(), |rules, o| rules.with_override_text(o))?)
    }

    /// What every rank of a `--run` job must run alike: the model, both parallelisms as
    /// understood (not as typed: `tp=2,pp=2` and `pp=2,tp=2` agree), the ranks and rules.
    pub fn fingerprint(&self, refit: &Refit) -> Fingerprint {
        let train = Training::parse(&self.train)
            .map(|t| format!("{t:?}"))
            .unwrap_or_else(|_| self.train.clone());
        let infer = Inference::parse(&self.infer)
            .map(|i| format!("{i:?}"))
            .unwrap_or_else(|_| self.infer.clone());
        Fingerprint::new("refit --run")
            .with("--model", &refit.model)
            .with("--train", train)
            .with("--infer", infer)
            .with("--colocated", self.colocated)
            .with("--override", self.overrides.join(" "))
            .with("--train-dtype", dtype_name(refit.train_dtype()))
            .with("--infer-dtype", dtype_name(refit.infer_dtype()))
            .with(
                "--infer-quant",
                refit
                    .quant
                    .as_ref()
                    .map_or("none".into(), |q| q.spec.to_string()),
            )
    }

    /// The model and its refit, everything parsed and checked before any planning.
    pub fn refit(&self) -> Result<(Model, Refit, PlanOptions), Error> {
        let options = PlanOptions {
            min_split_bytes: parse_bytes(Field::Flag("--min-split-bytes"), &self.min_split_bytes)?,
        };
        let train = Training::parse(&self.train)?;
        let infer = Inference::parse(&self.infer)?;
        let rules = self.rules()?;
        let dtype = |field, text: &Option<String>| {
            text.as_deref().map(|t| refit_dtype(field, t)).transpose()
        };
        let train_dtype = dtype(Field::TrainDType, &self.train_dtype)?;
        let infer_dtype = dtype(Field::InferDType, &self.infer_dtype)?;
        let start = Instant::now();
        let model = Model::load_with_dtype(&self.model, train_dtype)?;
        tracing::debug!(
            "model {}: {} tensors in {:.3} s",
            model.name,
            model.params.len(),
            start.elapsed().as_secs_f64()
        );
        let ranks = if self.colocated {
            Ranks::Colocated
        } else {
            Ranks::Disjoint
        };
        let start = Instant::now();
        let mut refit = Refit::new(&model, &train, &infer, &rules, ranks)?
            .with_dtypes(train_dtype, infer_dtype)?;
        let quant = match &self.infer_quant {
            Some(text) => InferQuant::parse(text)?,
            None => model.quant.clone(),
        };
        if let Some(q) = &quant {
            refit = refit.quantized(q)?;
        }
        tracing::debug!(
            "layouts of both sides and fused buffers checked in {:.3} s",
            start.elapsed().as_secs_f64()
        );
        Ok((model, refit, options))
    }
}

pub fn main(args: &RefitArgs) -> Result<(), Failure> {
    super::start_thread_pool()?;
    let (_, refit, options) = args.refit()?;
    // with --simulate the plans are kept for pricing; otherwise only their totals
    let (totals, pricing) = match &args.simulate {
        None => (refit.summary(&options).map_err(Error::from)?, None),
        Some(arg) => {
            let invalid = |e: reshard::sim::SimError| Error::InvalidOption {
                field: Field::Flag("--simulate"),
                value: arg.to_string(),
                reason: e.to_string(),
            };
            let cluster = Cluster::load(arg).map_err(invalid)?;
            // planned on the hosts given; else, relaying, on the cluster's NVLink domains as
            // hosts; else (--relay off) knowing no hosts
            let topology = match args.hosts.topology()? {
                Some(t) => Some(t),
                None if args.hosts.relay == "on" => Some(reshard::plan::Topology::new(
                    cluster.domain_map(refit.world()).map_err(invalid)?,
                    true,
                )),
                None => None,
            };
            let started = std::time::Instant::now();
            let plans = refit
                .plans_on(&options, topology.as_ref())
                .map_err(Error::from)?;
            tracing::info!(
                "{} plans in {:.3} s",
                plans.len(),
                started.elapsed().as_secs_f64()
            );
            let totals = refit
                .totals_of(&plans, started.elapsed().as_secs_f64())
                .map_err(Error::from)?;
            let sim = SimOptions {
                messages: Messages::PerPair,
            };
            let pricing = reshard::sim::price(&plans, &cluster, &sim).map_err(invalid)?;
            (totals, Some((cluster, pricing)))
        }
    };
    let topology = args.hosts.topology()?;
    if let (Some(_), true) = (&topology, args.execute.run) {
        return Err(Failure::Input(Error::InvalidOption {
            field: reshard::error::Field::Flag("--hosts"),
            value: args.hosts.hosts.clone().unwrap_or_default(),
            reason: "refit --run does not run plans across hosts yet; plan the refit with \
                     --hosts, or run it without"
                .into(),
        }));
    }
    let links = match &topology {
        Some(t) => Some(refit.host_links(&options, t).map_err(Error::from)?),
        None => None,
    };
    // with --run every process runs its rank, and rank 0 reports
    let run = if args.execute.run {
        match super::refit_run::main(&args.execute, &refit, options, args.fingerprint(&refit))? {
            Some(run) => Some(run),
            None => return Ok(()),
        }
    } else {
        None
    };
    if args.json {
        let mut json =
            serde_json::to_value(RefitJson::of(&refit, &totals)).expect("refit JSON serializes");
        if let Some((_, p)) = &pricing {
            json["simulation"] =
                serde_json::to_value(p.simulation()).expect("simulation JSON serializes");
        }
        if let Some(run) = &run {
            json["run"] = serde_json::to_value(run).expect("run JSON serializes");
        }
        if let Some((mine, theirs)) = &links {
            let links_json = |l: &reshard::plan::HostLinks| {
                serde_json::to_value(&l.links).expect("host links serialize")
            };
            json["reshard"]["host_links"] = links_json(mine);
            json["reshard"]["busiest_link_bytes"] = mine.busiest().into();
            json["gather_broadcast"]["host_links"] = links_json(theirs);
            json["gather_broadcast"]["busiest_link_bytes"] = theirs.busiest().into();
            json["link_ratio"] = (theirs.busiest() as f64 / mine.busiest().max(1) as f64).into();
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&json).expect("refit JSON serializes")
        );
    } else {
        if args.layouts {
            print!("{}", list_layouts(&refit, &args.rules()?));
        }
        print!("{}", describe(args, &refit, &totals));
        if let Some((mine, theirs)) = &links {
            println!(
                "busiest host link: reshard {}, hierarchical gather+broadcast {} ({:.2}x)",
                super::units::bytes(mine.busiest()),
                super::units::bytes(theirs.busiest()),
                theirs.busiest() as f64 / mine.busiest().max(1) as f64
            );
        }
        if let Some((cluster, p)) = &pricing {
            print!("{}", super::plan::describe_pricing(cluster, p));
        }
        if let Some(run) = &run {
            match run {
                super::refit_run::Outcome::Methods(run) => {
                    print!("{}", super::refit_run::describe(run))
                }
                super::refit_run::Outcome::Delta(d) => {
                    print!("{}", super::refit_run::describe_delta(d))
                }
                super::refit_run::Outcome::Staged(d) => {
                    print!("{}", super::refit_run::describe_staged(d))
                }
            }
        }
    }
    Ok(())
}

/// Every tensor's kind and layout on both sides, and the fused buffers.
pub fn list_layouts(refit: &Refit, rules: &Rules) -> String {
    let mut out = String::new();
    for t in &refit.tensors {
        let shape: Vec<String> = t.src.shape().iter().map(u64::to_string).collect();
        let _ = writeln!(out, "{}  {} {}", t.name, shape.join("x"), t.src.dtype());
        for (side, which, layout) in [
            ("train", Which::Train, &t.src),
            ("infer", Which::Infer, &t.dst),
        ] {
            let _ = writeln!(
                out,
                "  {side}  {:<13} {layout}  (rule `{}`)",
                rules.kind(&t.name, which).to_string(),
                rules.pattern(&t.name, which).unwrap_or("-")
            );
        }
        if t.dst.dtype() != t.src.dtype() {
            let _ = writeln!(out, "  infer  as {}", t.dst.dtype());
        }
    }
    for (side, groups) in [("train", &refit.src_fused), ("infer", &refit.dst_fused)] {
        for f in groups.iter() {
            let members: Vec<&str> = f
                .members
                .iter()
                .map(|&m| refit.tensors[m].name.as_str())
                .collect();
            let _ = writeln!(
                out,
                "fused ({side}) {} = concat(dim {}: {})",
                f.name,
                f.dim,
                members.join(", ")
            );
        }
    }
    if let Some(q) = &refit.quant {
        for s in &q.scales {
            let shape: Vec<String> = s.shape.iter().map(u64::to_string).collect();
            let _ = writeln!(
                out,
                "scales {}  {} f32 (of {})",
                s.name,
                shape.join("x"),
                refit.tensors[s.tensor].name
            );
        }
        for f in &q.fused {
            let members: Vec<&str> = f
                .members
                .iter()
                .map(|&m| q.scales[m].name.as_str())
                .collect();
            let _ = writeln!(
                out,
                "fused (infer) {} = concat(dim {}: {})",
                f.name,
                f.dim,
                members.join(", ")
            );
        }
    }
    let _ = writeln!(out);
    out
}

/// A side's dtype as the reports name it: `mixed` when its tensors differ.
fn dtype_name(dtype: Option<reshard::DType>) -> String {
    dtype.map_or_else(|| "mixed".into(), |d| d.to_string())
}

fn ratio(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.1}x", a as f64 / b as f64)
    }
}

/// The text report.
pub fn describe(args: &RefitArgs, refit: &Refit, t: &RefitTotals) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model              {}: {} tensors, {:.2}B parameters, {} of weights",
        refit.model,
        t.tensors,
        t.params as f64 / 1e9,
        bytes(t.weight_bytes)
    );
    let _ = writeln!(
        out,
        "training           {} -> {} ranks (0..{})",
        args.train, refit.train_ranks, refit.train_ranks
    );
    let _ = writeln!(
        out,
        "inference          {} -> {} ranks ({}..{}{})",
        args.infer,
        refit.infer_ranks,
        refit.infer_base,
        refit.infer_base + refit.infer_ranks,
        if args.colocated { ", colocated" } else { "" }
    );
    if refit.train_dtype() != refit.infer_dtype() {
        let _ = writeln!(
            out,
            "precision          {} in training -> {} in inference, converted by the senders as they pack",
            dtype_name(refit.train_dtype()),
            dtype_name(refit.infer_dtype())
        );
    }
    let _ = writeln!(
        out,
        "fused buffers      {} in training, {} in inference",
        refit.src_fused.len(),
        refit.dst_fused.len()
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "reshard            {} between ranks in {} messages, {} copied locally",
        bytes(t.bytes_remote),
        t.messages,
        bytes(t.bytes_local)
    );
    if let Some(q) = &refit.quant {
        let _ = writeln!(
            out,
            "quantized          {} weights to {} with {} f32 scales ({}): {} of scales and {} of partial amax between ranks",
            q.tensors(),
            q.spec.fp8,
            q.spec.scheme(),
            q.spec,
            bytes(t.scale_bytes),
            bytes(t.amax_bytes)
        );
    }
    let _ = writeln!(
        out,
        "busiest rank       sends {}, receives {}",
        bytes(t.max_rank_send_bytes),
        bytes(t.max_rank_recv_bytes)
    );
    let _ = writeln!(
        out,
        "gather+broadcast   {} ({} what reshard moves)",
        bytes(t.gather_broadcast_bytes),
        ratio(t.gather_broadcast_bytes, t.bytes_remote)
    );
    let _ = writeln!(
        out,
        "logical payload    {} (2x the weights, as NVIDIA counts gather+broadcast)",
        bytes(t.logical_payload_bytes)
    );
    let _ = writeln!(
        out,
        "plan               {:.3} s for all ranks",
        t.plan_seconds
    );
    out
}
