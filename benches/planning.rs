//! Planning time against the number of ranks and the number of pieces per dim.
//!
//! `Plan::new` computes every transfer of every rank; `rank_plan` computes one rank's part
//! from the layouts alone, as each rank does at run time. The tensor is 65543 x 32771 bf16, so
//! every cut is uneven (`torch.chunk` sizes). Cases:
//! - `transpose`: n x S(0) -> n x S(1), every destination needs a piece of every source:
//!   n^2 transfers, the worst case;
//! - `replicas`: 2 x n [R, S(0)] -> n x S(0), each destination piece held by two replicas and
//!   split between them: 2n transfers;
//! - `blocks`: p x p [S(0), S(1)] -> p x p [S(0), S(0)] (two shard axes on one dim: p^2 uneven
//!   row strips), each strip crosses one or two block rows of p blocks: about p^3 transfers.
//!
//! `cargo bench --bench planning`; results in BENCHMARKS.md ("Kernels").

use std::hint::black_box;

use divan::Bencher;
use reshard::layout::LayoutSpec;
use reshard::plan::{self, PlanOptions};
use reshard::{DType, Layout, Plan};

fn main() {
    divan::main();
}

const SHAPE: [u64; 2] = [65543, 32771];

/// Source and destination layouts; the destination ranks follow the source ranks.
fn layouts(src: &str, dst: &str) -> (Layout, Layout) {
    let src = LayoutSpec::parse(src)
        .unwrap()
        .resolve(&SHAPE, DType::Bf16, 0)
        .unwrap();
    let first = src.mesh().size();
    let dst = LayoutSpec::parse(dst)
        .unwrap()
        .resolve(&SHAPE, DType::Bf16, first)
        .unwrap();
    (src, dst)
}

fn transpose(n: usize) -> (Layout, Layout) {
    layouts(
        &format!("mesh={n} place=S(0)"),
        &format!("mesh={n} place=S(1)"),
    )
}

fn replicas(n: usize) -> (Layout, Layout) {
    layouts(
        &format!("mesh=2x{n} place=R,S(0)"),
        &format!("mesh={n} place=S(0)"),
    )
}

fn blocks(p: usize) -> (Layout, Layout) {
    layouts(
        &format!("mesh={p}x{p} place=S(0),S(1)"),
        &format!("mesh={p}x{p} place=S(0),S(0)"),
    )
}

/// Times `Plan::new`, reporting the transfers it makes as items.
fn full(bencher: Bencher, (src, dst): (Layout, Layout)) {
    let transfers = Plan::new(src.clone(), dst.clone())
        .unwrap()
        .transfers()
        .len();
    bencher
        .counter(divan::counter::ItemsCount::new(transfers))
        .with_inputs(|| (src.clone(), dst.clone()))
        .bench_local_values(|(src, dst)| Plan::new(src, dst).unwrap());
}

/// Times `rank_plan` for the middle destination rank, reporting its sends, receives and local
/// copies as items, and checks it against the full plan's part once where that plan is small.
fn one_rank(bencher: Bencher, (src, dst): (Layout, Layout)) {
    let ranks = dst.mesh().ranks();
    let rank = ranks[ranks.len() / 2];
    let options = PlanOptions::default();
    let got = plan::rank_plan(&src, &dst, rank, &options).unwrap();
    if src.mesh().size() * dst.mesh().size() <= 1 << 20 {
        let want = Plan::new(src.clone(), dst.clone()).unwrap().for_rank(rank);
        assert_eq!(got, want);
    }
    bencher
        .counter(divan::counter::ItemsCount::new(
            got.sends.len() + got.recvs.len() + got.locals.len(),
        ))
        .bench_local(|| plan::rank_plan(black_box(&src), black_box(&dst), rank, &options).unwrap());
}

mod full_plan {
    use super::*;

    /// Beyond 1024 ranks a side the full all-to-all plan holds 16.7 M transfers (GiBs).
    #[divan::bench(args = [1, 16, 256, 1024], sample_count = 10)]
    fn transpose(bencher: Bencher, n: usize) {
        full(bencher, super::transpose(n));
    }

    #[divan::bench(args = [1, 16, 256, 4096], sample_count = 10)]
    fn replicas(bencher: Bencher, n: usize) {
        full(bencher, super::replicas(n));
    }

    #[divan::bench(args = [1, 4, 16, 64], sample_count = 10)]
    fn blocks(bencher: Bencher, p: usize) {
        full(bencher, super::blocks(p));
    }
}

mod rank_plan {
    use super::*;

    #[divan::bench(args = [1, 16, 256, 4096], sample_count = 20)]
    fn transpose(bencher: Bencher, n: usize) {
        one_rank(bencher, super::transpose(n));
    }

    #[divan::bench(args = [1, 16, 256, 4096], sample_count = 20)]
    fn replicas(bencher: Bencher, n: usize) {
        one_rank(bencher, super::replicas(n));
    }

    #[divan::bench(args = [1, 4, 16, 64], sample_count = 20)]
    fn blocks(bencher: Bencher, p: usize) {
        one_rank(bencher, super::blocks(p));
    }
}
