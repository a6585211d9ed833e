//! In-process reshard of an 8192x8192 bf16 tensor against a plain memcpy of the same bytes,
//! in the same run. `cargo bench --bench local`; results in BENCHMARKS.md.

use std::collections::BTreeMap;
use std::hint::black_box;

use divan::Bencher;
use divan::counter::BytesCount;
use reshard::exec::{self, ExecOptions};
use reshard::fill::Fill;
use reshard::layout::LayoutSpec;
use reshard::{DType, Plan, Rank};

const SHAPE: [u64; 2] = [8192, 8192];
const BYTES: usize = 8192 * 8192 * 2;

fn main() {
    divan::main();
}

fn plan(src: &str, dst: &str) -> Plan {
    let src = LayoutSpec::parse(src)
        .unwrap()
        .resolve(&SHAPE, DType::Bf16, 0)
        .unwrap();
    let first = src.mesh().size();
    let dst = LayoutSpec::parse(dst)
        .unwrap()
        .resolve(&SHAPE, DType::Bf16, first)
        .unwrap();
    Plan::new(src, dst).unwrap()
}

const CASES: [(&str, &str, &str); 2] = [
    ("4xS(0) -> 2xS(1)", "mesh=4 place=S(0)", "mesh=2 place=S(1)"),
    ("2xS(0) -> 4xS(1)", "mesh=2 place=S(0)", "mesh=4 place=S(1)"),
];

/// The reshard, all ranks as threads, buffers allocated and touched once outside the timing.
#[divan::bench(args = ["4xS(0) -> 2xS(1)", "2xS(0) -> 4xS(1)"], sample_count = 30, sample_size = 1)]
fn reshard(bencher: Bencher, case: &str) {
    let (_, src, dst) = CASES.into_iter().find(|c| c.0 == case).unwrap();
    let plan = plan(src, dst);
    let sources = Fill::Index.shards(plan.src()).unwrap();
    let mut shards: BTreeMap<Rank, Vec<u8>> = exec::zeroed_shards(plan.dst()).unwrap();
    let options = ExecOptions::default();
    exec::run_local(&plan, &sources, &mut shards, &options).unwrap();
    Fill::Index.verify_shards(plan.dst(), &shards).unwrap();
    bencher.counter(BytesCount::new(BYTES)).bench_local(|| {
        exec::run_local(&plan, &sources, black_box(&mut shards), &options).unwrap()
    });
}

/// One thread copying the same number of bytes between two touched buffers.
#[divan::bench(sample_count = 30, sample_size = 1)]
fn memcpy(bencher: Bencher) {
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    bencher
        .counter(BytesCount::new(BYTES))
        .bench_local(|| black_box(&mut dst).copy_from_slice(black_box(&src)));
}

/// Two threads each copying half: what the machine's two cores can copy at best.
#[divan::bench(sample_count = 30, sample_size = 1)]
fn memcpy_two_threads(bencher: Bencher) {
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    bencher.counter(BytesCount::new(BYTES)).bench_local(|| {
        let (a, b) = dst.split_at_mut(BYTES / 2);
        std::thread::scope(|s| {
            s.spawn(|| a.copy_from_slice(&src[..BYTES / 2]));
            b.copy_from_slice(&src[BYTES / 2..]);
        });
    });
}
