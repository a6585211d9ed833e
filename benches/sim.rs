//! The cluster cost model on refits of published size: `cargo bench --bench sim`.
//!
//! Builds plans that approximate the refits NVIDIA and NeMo RL published (DeepSeek-V3 and
//! Qwen3-235B-A22B, bf16, one plan per weight, Megatron-style training layouts to vLLM-style
//! inference layouts), prints what the model prices them at, then times `sim::price` alone on
//! the largest. The layouts here are a sketch written for this benchmark (separate q/k/v and
//! gate/up, experts tensor-parallel on the inference side, layers split evenly over pipeline
//! stages); `reshard refit` builds the real ones. Results in BENCHMARKS.md ("Cost model").

use std::hint::black_box;
use std::sync::OnceLock;

use reshard::layout::LayoutSpec;
use reshard::sim::{self, Cluster, SimOptions};
use reshard::{DType, Plan};

/// How a weight is split by tensor parallelism.
#[derive(Clone, Copy)]
enum Split {
    /// Column-parallel: the output dim (Shard(0) of `[out, in]`).
    Column,
    /// Row-parallel: the input dim (Shard(1)).
    Row,
    Replicated,
}

/// The weights of a decoder, as far as a refit cares.
struct Arch {
    name: &'static str,
    layers: u64,
    /// Leading layers with a dense MLP instead of experts.
    dense_layers: u64,
    hidden: u64,
    vocab: u64,
    dense_inter: u64,
    experts: u64,
    moe_inter: u64,
    /// Intermediate size of the shared expert, if any.
    shared_inter: Option<u64>,
    /// Attention weights and norms of one layer.
    attention: Vec<(Vec<u64>, Split)>,
}

fn deepseek_v3() -> Arch {
    use Split::*;
    Arch {
        name: "DeepSeek-V3",
        layers: 61,
        dense_layers: 3,
        hidden: 7168,
        vocab: 129280,
        dense_inter: 18432,
        experts: 256,
        moe_inter: 2048,
        shared_inter: Some(2048),
        attention: vec![
            (vec![1536, 7168], Replicated),  // q_a_proj
            (vec![1536], Replicated),        // q_a_layernorm
            (vec![128 * 192, 1536], Column), // q_b_proj
            (vec![576, 7168], Replicated),   // kv_a_proj_with_mqa
            (vec![512], Replicated),         // kv_a_layernorm
            (vec![128 * 256, 512], Column),  // kv_b_proj
            (vec![7168, 128 * 128], Row),    // o_proj
        ],
    }
}

fn qwen3_235b() -> Arch {
    use Split::*;
    Arch {
        name: "Qwen3-235B-A22B",
        layers: 94,
        dense_layers: 0,
        hidden: 4096,
        vocab: 151936,
        dense_inter: 0,
        experts: 128,
        moe_inter: 1536,
        shared_inter: None,
        attention: vec![
            (vec![64 * 128, 4096], Column), // q_proj
            (vec![4 * 128, 4096], Column),  // k_proj
            (vec![4 * 128, 4096], Column),  // v_proj
            (vec![4096, 64 * 128], Row),    // o_proj
            (vec![128], Replicated),        // q_norm
            (vec![128], Replicated),        // k_norm
        ],
    }
}

/// Megatron sizes: the world is tp x cp x dp x pp (tp fastest); experts regroup each stage's
/// ranks as ep x edp (expert tensor parallelism 1).
struct Train {
    tp: u64,
    cp: u64,
    dp: u64,
    pp: u64,
    ep: u64,
}

/// vLLM sizes: tp x dp (tp fastest).
struct Infer {
    tp: u64,
    dp: u64,
}

struct Case {
    label: &'static str,
    arch: Arch,
    train: Train,
    infer: Infer,
    cluster: Cluster,
    /// Inference ranks on the training ranks' GPUs (separate processes).
    colocated: bool,
    published: &'static str,
}

fn cases() -> Vec<Case> {
    let t = |tp, cp, dp, pp, ep| Train { tp, cp, dp, pp, ep };
    vec![
        Case {
            label: "PP16 x EP16 (dp 16) -> TP32 x DP8, colocated",
            arch: deepseek_v3(),
            train: t(1, 1, 16, 16, 16),
            infer: Infer { tp: 32, dp: 8 },
            cluster: Cluster::h100(),
            colocated: true,
            published: "NeMo RL + NCCL reshard: 2.39-2.83 s",
        },
        Case {
            label: "PP16 x EP16 (dp 16) -> TP32 x DP8, apart",
            arch: deepseek_v3(),
            train: t(1, 1, 16, 16, 16),
            infer: Infer { tp: 32, dp: 8 },
            cluster: Cluster::h100(),
            colocated: false,
            published: "NeMo RL + NCCL reshard: 2.39-2.83 s",
        },
        Case {
            label: "TP4 x PP8 x EP16 (dp 4) -> TP8 x DP16, colocated",
            arch: qwen3_235b(),
            train: t(4, 1, 4, 8, 16),
            infer: Infer { tp: 8, dp: 16 },
            cluster: Cluster::h100(),
            colocated: true,
            published: "NeMo RL (early): 4.56-4.85 s",
        },
        Case {
            label: "EP16 x DP2 x PP4 (dp 32) -> TP8 x DP16, apart",
            arch: deepseek_v3(),
            train: t(1, 1, 32, 4, 16),
            infer: Infer { tp: 8, dp: 16 },
            cluster: Cluster::gb200(),
            colocated: false,
            published: "NCCL M2N, 256 GPUs: 1.45 s",
        },
        Case {
            label: "TP2 x CP2 x EP16 x PP4 (dp 4) -> TP8 x DP8, apart",
            arch: qwen3_235b(),
            train: t(2, 2, 4, 4, 16),
            infer: Infer { tp: 8, dp: 8 },
            cluster: Cluster::gb200(),
            colocated: false,
            published: "NCCL M2N, 128 GPUs: 0.99 s",
        },
    ]
}

fn layout_plan(shape: &[u64], src: &str, dst: &str) -> Plan {
    let layout = |spec: &str| {
        LayoutSpec::parse(spec)
            .unwrap_or_else(|e| panic!("{spec}: {e}"))
            .resolve(shape, DType::Bf16, 0)
            .unwrap_or_else(|e| panic!("{spec} {shape:?}: {e}"))
    };
    Plan::new(layout(src), layout(dst)).unwrap()
}

/// One plan per weight. Training ranks are `0..world`, inference ranks follow them.
fn plans(arch: &Arch, train: &Train, infer: &Infer) -> Vec<Plan> {
    let stage_size = train.tp * train.cp * train.dp;
    let world = stage_size * train.pp;
    let edp = stage_size / train.ep;
    let place = |split: Split, stacked: bool| {
        let d = usize::from(stacked);
        match split {
            Split::Column => format!("S({d})"),
            Split::Row => format!("S({})", d + 1),
            Split::Replicated => "R".to_string(),
        }
    };
    let infer_spec = |split: Split, stacked: bool| {
        format!(
            "mesh={}x{} ranks={world}..{} place=R,{}",
            infer.dp,
            infer.tp,
            world + infer.dp * infer.tp,
            place(split, stacked)
        )
    };
    let stage_ranks = |s: u64| format!("ranks={}..{}", s * stage_size, (s + 1) * stage_size);
    // dense weights: mesh dp x cp x tp, tensor parallelism on the last axis
    let dense_spec = |s: u64, split: Split| {
        format!(
            "mesh={}x{}x{} {} place=R,R,{}",
            train.dp,
            train.cp,
            train.tp,
            stage_ranks(s),
            place(split, false)
        )
    };
    // experts, stacked [E, ...]: mesh edp x ep, split by ep
    let expert_spec = |s: u64| format!("mesh={edp}x{} {} place=R,S(0)", train.ep, stage_ranks(s));
    let mut out = Vec::new();
    let mut dense = |s: u64, shape: Vec<u64>, split: Split| {
        out.push(layout_plan(
            &shape,
            &dense_spec(s, split),
            &infer_spec(split, false),
        ))
    };
    let (h, e, m) = (arch.hidden, arch.experts, arch.moe_inter);
    let mut stacked = Vec::new();
    for layer in 0..arch.layers {
        let s = layer * train.pp / arch.layers;
        for (shape, split) in &arch.attention {
            dense(s, shape.clone(), *split);
        }
        dense(s, vec![h], Split::Replicated); // input_layernorm
        dense(s, vec![h], Split::Replicated); // post_attention_layernorm
        if layer < arch.dense_layers {
            let i = arch.dense_inter;
            dense(s, vec![i, h], Split::Column); // gate_proj
            dense(s, vec![i, h], Split::Column); // up_proj
            dense(s, vec![h, i], Split::Row); // down_proj
            continue;
        }
        dense(s, vec![e, h], Split::Replicated); // router
        if let Some(i) = arch.shared_inter {
            dense(s, vec![i, h], Split::Column);
            dense(s, vec![i, h], Split::Column);
            dense(s, vec![h, i], Split::Row);
        }
        stacked.push((s, vec![e, m, h], Split::Column)); // experts' gate
        stacked.push((s, vec![e, m, h], Split::Column)); // experts' up
        stacked.push((s, vec![e, h, m], Split::Row)); // experts' down
    }
    dense(0, vec![arch.vocab, h], Split::Column); // embed_tokens (vocab-parallel)
    dense(train.pp - 1, vec![h], Split::Replicated); // final norm
    dense(train.pp - 1, vec![arch.vocab, h], Split::Column); // lm_head
    for (s, shape, split) in stacked {
        out.push(layout_plan(
            &shape,
            &expert_spec(s),
            &infer_spec(split, true),
        ));
    }
    out
}

/// Inference rank `world + i` on the GPU of training rank `i`.
fn colocate(mut cluster: Cluster, world: usize) -> Cluster {
    cluster.ranks = (0..2 * world).map(|r| r % world).collect();
    cluster
}

/// The largest case's plans, built once for the timed benchmark.
fn largest() -> &'static [Plan] {
    static PLANS: OnceLock<Vec<Plan>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let case = &cases()[1];
        plans(&case.arch, &case.train, &case.infer)
    })
}

fn main() {
    for (i, case) in cases().into_iter().enumerate() {
        let built;
        let plans: &[Plan] = if i == 1 {
            largest()
        } else {
            built = plans(&case.arch, &case.train, &case.infer);
            &built
        };
        let world = (case.train.tp * case.train.cp * case.train.dp * case.train.pp) as usize;
        let cluster = if case.colocated {
            colocate(case.cluster.clone(), world)
        } else {
            case.cluster.clone()
        };
        let transfers: usize = plans.iter().map(|p| p.transfers().len()).sum();
        let weights: u64 = plans.iter().map(|p| p.src().total_bytes()).sum();
        let p = sim::price(plans, &cluster, &SimOptions::default()).unwrap();
        let s = p.simulation();
        let busiest = p
            .reshard
            .busiest
            .map(|b| format!("GPU {} {}", b.gpu, b.port));
        println!(
            "{} {} on {}: {} tensors, {:.0} GB, {transfers} transfers\n  \
             published {}\n  \
             modeled reshard {:.3} s, lower bound {:.3} s (busiest {}), \
             any plan at least {:.3} s, gather+broadcast {:.2} s, speedup {:.1}x",
            case.arch.name,
            case.label,
            cluster.name,
            plans.len(),
            weights as f64 / 1e9,
            case.published,
            s.reshard_s,
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
