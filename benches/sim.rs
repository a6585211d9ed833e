//! The cluster cost model on the published refits: `cargo bench --bench sim`.
//!
//! Plans the refits NVIDIA and NeMo RL published (DeepSeek-V3 and Qwen3-235B-A22B, with the
//! layouts `reshard refit` gives them), prints what the model prices them at, then times
//! `sim::price` alone on the largest (DeepSeek-V3 on 512 ranks). Results in BENCHMARKS.md
//! ("Cost model").

use std::hint::black_box;
use std::sync::OnceLock;

use reshard::model::{Inference, Model, Ranks, Refit, Rules, Training};
use reshard::sim::{self, Cluster, SimOptions};
use reshard::{Plan, PlanOptions};

/// The published refits: model, training and inference parallelism (as `reshard refit`
/// takes them), cluster, colocated (inference ranks are the training ranks), published time.
const REFITS: [(&str, &str, &str, &str, bool, &str); 5] = [
    (
        "deepseek-v3",
        "ep=16,pp=16,dp=16",
        "tp=32,dp=8",
        "h100",
        true,
        "2.39-2.83 s",
    ),
    (
        "deepseek-v3",
        "ep=16,pp=16,dp=16",
        "tp=32,dp=8",
        "h100",
        false,
        "2.39-2.83 s",
    ),
    (
        "qwen3-235b-a22b",
        "tp=4,pp=8,ep=16,dp=4",
        "tp=8,dp=16",
        "h100",
        true,
        "4.56-4.85 s",
    ),
    (
        "deepseek-v3",
        "ep=16,dp=32,pp=4",
        "tp=8,dp=16",
        "gb200",
        false,
        "1.45 s",
    ),
    (
        "qwen3-235b-a22b",
        "tp=2,cp=2,ep=16,pp=4,dp=4",
        "tp=8,dp=8",
        "gb200",
        false,
        "0.99 s",
    ),
];

fn plans(model: &str, train: &str, infer: &str, colocated: bool) -> Vec<Plan> {
    let ranks = if colocated {
        Ranks::Colocated
    } else {
        Ranks::Disjoint
    };
    let refit = Refit::new(
        &Model::load(model).unwrap(),
        &Training::parse(train).unwrap(),
        &Inference::parse(infer).unwrap(),
        &Rules::default(),
        ranks,
    )
    .unwrap();
    refit.plans(&PlanOptions::default()).unwrap()
}

/// DeepSeek-V3 on 512 ranks, planned once for the timed benchmark.
fn largest() -> &'static [Plan] {
    static PLANS: OnceLock<Vec<Plan>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let (model, train, infer, _, colocated, _) = REFITS[1];
        plans(model, train, infer, colocated)
    })
}

fn main() {
    for (i, (model, train, infer, cluster, colocated, published)) in REFITS.into_iter().enumerate()
    {
        let built;
        let plans: &[Plan] = if i == 1 {
            largest()
        } else {
            built = plans(model, train, infer, colocated);
            &built
        };
        let cluster = Cluster::preset(cluster).unwrap();
        let p = sim::price(plans, &cluster, &SimOptions::default()).unwrap();
        let s = p.simulation();
        let transfers: usize = plans.iter().map(|p| p.transfers().len()).sum();
        let busiest = p
            .reshard
            .busiest
            .map(|b| format!("GPU {} {}", b.gpu, b.port));
        // the batched executor: one stream per peer pair
        let streamed = sim::price_reshard(plans, &cluster, sim::Messages::PerPair).unwrap();
        println!(
            "{model} {train} -> {infer}{} on {}: {} tensors, {transfers} transfers\n  \
             published {published}\n  \
             modeled reshard {:.3} s ({:.3} s streamed per peer pair), \
             lower bound {:.3} s (busiest {}), \
             any plan at least {:.3} s, gather+broadcast {:.2} s, speedup {:.1}x",
            if colocated { " colocated" } else { "" },
            cluster.name,
            plans.len(),
            s.reshard_s,
            streamed.seconds,
            s.lower_bound_s,
            busiest.unwrap_or_default(),
            p.domain_bound_s,
            s.gather_broadcast_s,
            s.speedup
        );
    }
    divan::main();
}

#[divan::bench(args = ["h100", "gb200"], sample_count = 10, sample_size = 1)]
fn price(cluster: &str) -> f64 {
    let cluster = Cluster::preset(cluster).unwrap();
    let plans = black_box(largest());
    sim::price(plans, &cluster, &SimOptions::default())
        .unwrap()
        .simulation()
        .reshard_s
}
