//! Planning a whole-model refit: DeepSeek-V3, training EP16 x PP16 with dp 16 (256 ranks) to
//! inference TP32 x DP8 (256 ranks). `cargo bench --bench refit_plan`; results in
//! BENCHMARKS.md. Targets: one rank's part < 100 ms, every rank's < 5 s.

use std::hint::black_box;

use reshard::PlanOptions;
use reshard::model::{Inference, Model, Ranks, Refit, Rules, Training};

/// The same allocator as the `reshard` binary.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    divan::main();
}

fn refit() -> Refit {
    let model = Model::load("deepseek-v3").unwrap();
    let train = Training::parse("ep=16,pp=16,dp=16").unwrap();
    let infer = Inference::parse("tp=32,dp=8").unwrap();
    Refit::new(&model, &train, &infer, &Rules::default(), Ranks::Disjoint).unwrap()
}

/// Every parameter's two layouts, from the config (before any planning).
#[divan::bench(sample_count = 10)]
fn layouts() -> Refit {
    refit()
}

/// One rank's sends, receives and local copies for every tensor, from the layouts alone:
/// rank 0 (training stage 0: embedding and the first layers), rank 240 (the last stage:
/// lm_head), rank 256 (the first inference rank, which receives every tensor).
#[divan::bench(args = [0, 240, 256], sample_count = 10)]
fn one_rank(bencher: divan::Bencher, rank: usize) {
    let refit = refit();
    let options = PlanOptions::default();
    bencher.bench_local(|| black_box(refit.rank_plans(rank, &options).unwrap()));
}

/// Every rank's plan of every tensor (planned in parallel), added up into the refit totals.
#[divan::bench(sample_count = 5)]
fn all_ranks(bencher: divan::Bencher) {
    let refit = refit();
    let options = PlanOptions::default();
    bencher.bench_local(|| black_box(refit.summary(&options).unwrap()));
}
