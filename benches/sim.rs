//! Pricing a DeepSeek-V3-sized refit with the cluster cost model: `cargo bench --bench sim`.
//!
//! The plans approximate DeepSeek-V3 (61 layers, MLA attention, 256 routed experts of
//! 7168x2048 in 58 MoE layers, bf16) trained with PP16 x EP16 (dp 16, 256 ranks) and served
//! with TP32 x DP8 (256 more ranks): every weight is one plan. They are built once, before
//! timing; the benchmark times `sim::price` alone. Results in BENCHMARKS.md ("Cost model").

use std::hint::black_box;
use std::sync::OnceLock;

use reshard::layout::LayoutSpec;
use reshard::sim::{self, Cluster, SimOptions};
use reshard::{DType, Plan};

const HIDDEN: u64 = 7168;
const LAYERS: u64 = 61;
const DENSE_LAYERS: u64 = 3;
const EXPERTS: u64 = 256;
const STAGES: u64 = 16;
const DP: u64 = 16;

fn main() {
    let plans = plans();
    let transfers: usize = plans.iter().map(|p| p.transfers().len()).sum();
    println!("{} tensors, {transfers} transfers, 512 ranks", plans.len());
    for cluster in [
        Cluster::h100(),
        colocated(Cluster::h100()),
        Cluster::gb200(),
        colocated(Cluster::gb200()),
    ] {
        let p = sim::price(plans, &cluster, &SimOptions::default()).unwrap();
        let s = p.simulation();
        let busiest = p
            .reshard
            .busiest
            .map(|b| format!("GPU {} {}", b.gpu, b.port));
        let gb = |b: u64| b as f64 / 1e9;
        let bytes = p.reshard.bytes;
        println!(
            "{:<16} reshard {:.3} s (lower bound {:.3} s, busiest {}; GB over network {:.0}, \
             NVLink {:.0}, memory {:.0}), gather+broadcast {:.2} s, speedup {:.1}x",
            cluster.name,
            s.reshard_s,
            s.lower_bound_s,
            busiest.unwrap_or_default(),
            gb(bytes.network),
            gb(bytes.nvlink),
            gb(bytes.memory),
            s.gather_broadcast_s,
            s.speedup
        );
    }
    divan::main();
}

/// Inference rank `256 + i` on the GPU of training rank `i`.
fn colocated(mut c: Cluster) -> Cluster {
    c.name.push_str("-colocated");
    c.ranks = (0..512).map(|r| r % 256).collect();
    c
}

fn plan(shape: &[u64], src: &str, dst: &str) -> Plan {
    let layout = |spec: &str| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, DType::Bf16, 0)
            .unwrap()
    };
    Plan::new(layout(src), layout(dst)).unwrap()
}

/// One plan per weight. Training stage `s` is ranks `16s..16s+16`: dense weights replicated
/// over its 16 data-parallel ranks, experts split over them (EP16). Inference is ranks
/// 256..512, a TP32 x DP8 mesh: column-parallel weights Shard(0) (Shard(1) when stacked),
/// row-parallel Shard(1) (Shard(2)), MLA's compressed projections replicated.
fn plans() -> &'static [Plan] {
    static PLANS: OnceLock<Vec<Plan>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let infer = |place: &str| format!("mesh=8x32 ranks=256..512 place=R,{place}");
        let mut out = Vec::new();
        for layer in 0..LAYERS {
            let stage = layer * STAGES / LAYERS;
            let ranks = format!("ranks={}..{}", stage * DP, stage * DP + DP);
            let dense = format!("mesh={DP} {ranks} place=R");
            let experts = format!("mesh={DP} {ranks} place=S(0)");
            let mut weight = |shape: &[u64], src: &str, place: &str| {
                out.push(plan(shape, src, &infer(place)));
            };
            weight(&[1536, HIDDEN], &dense, "R"); // q_a_proj
            weight(&[128 * 192, 1536], &dense, "S(0)"); // q_b_proj
            weight(&[576, HIDDEN], &dense, "R"); // kv_a_proj_with_mqa
            weight(&[128 * 256, 512], &dense, "S(0)"); // kv_b_proj
            weight(&[HIDDEN, 128 * 128], &dense, "S(1)"); // o_proj
            if layer < DENSE_LAYERS {
                weight(&[18432, HIDDEN], &dense, "S(0)"); // gate_proj
                weight(&[18432, HIDDEN], &dense, "S(0)"); // up_proj
                weight(&[HIDDEN, 18432], &dense, "S(1)"); // down_proj
            } else {
                weight(&[EXPERTS, 2048, HIDDEN], &experts, "S(1)"); // experts' gate
                weight(&[EXPERTS, 2048, HIDDEN], &experts, "S(1)"); // experts' up
                weight(&[EXPERTS, HIDDEN, 2048], &experts, "S(2)"); // experts' down
                weight(&[2048, HIDDEN], &dense, "S(0)"); // shared expert gate
                weight(&[2048, HIDDEN], &dense, "S(0)"); // shared expert up
                weight(&[HIDDEN, 2048], &dense, "S(1)"); // shared expert down
            }
        }
        let first = format!("mesh={DP} ranks=0..{DP} place=R");
        let last = format!("mesh={DP} ranks={}..{} place=R", 15 * DP, 16 * DP);
        out.push(plan(&[129280, HIDDEN], &first, &infer("S(0)"))); // embed_tokens
        out.push(plan(&[129280, HIDDEN], &last, &infer("S(0)"))); // lm_head
        out
    })
}

#[divan::bench(args = ["h100", "gb200"], sample_count = 10, sample_size = 1)]
fn price(cluster: &str) -> f64 {
    let cluster = Cluster::preset(cluster).unwrap();
    let plans = black_box(plans());
    sim::price(plans, &cluster, &SimOptions::default())
        .unwrap()
        .simulation()
        .reshard_s
}
