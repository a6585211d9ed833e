//! The conversion kernels against `copy_from_slice` of the source bytes: the bar for a fused
//! convert-and-pack is 70% of a one-thread memcpy of what it reads.
//!
//! Each case converts 32 MiB of source elements, from memory (buffers far beyond the caches);
//! throughput counts source bytes, so ratios to `memcpy` read straight off. `quantize` is the
//! `block:128x128` path of the executor: `Scales::quantize_run` over whole rows of a bf16
//! shard, one multiplier per 128 elements.
//!
//! `cargo bench --bench convert`

use std::hint::black_box;

use divan::Bencher;
use divan::counter::BytesCount;
use reshard::DType;
use reshard::Region;
use reshard::convert::{AmaxGrid, BlockGrid, Quant, QuantScheme, Scales, cast_fn};

fn main() {
    divan::main();
}

/// Source bytes of every case.
const SRC: usize = 32 << 20;
const SAMPLES: u32 = 20;

/// Source bytes of `dtype` holding values of every magnitude (no NaN).
fn source(dtype: DType) -> Vec<u8> {
    let n = SRC / dtype.size();
    let mut out = vec![0u8; SRC];
    let mut x = 0x1234_5678u32;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = f32::from_bits((x & 0x3fff_ffff) | 0x3000_0000) - 1.0;
        reshard::convert::cast::write_f32(dtype, v, &mut out[i * dtype.size()..]);
    }
    out
}

#[divan::bench(sample_count = SAMPLES)]
fn memcpy(bencher: Bencher) {
    let src = source(DType::F32);
    let mut dst = vec![0u8; SRC];
    bencher
        .counter(BytesCount::new(SRC))
        .bench_local(|| dst.copy_from_slice(black_box(&src)));
}

#[divan::bench(
    sample_count = SAMPLES,
    args = [("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"), ("f16", "f32"), ("f64", "bf16"), ("bf16", "f16")]
)]
fn cast(bencher: Bencher, (from, to): (&str, &str)) {
    let (from, to): (DType, DType) = (from.parse().unwrap(), to.parse().unwrap());
    let src = source(from);
    let mut dst = vec![0u8; SRC / from.size() * to.size()];
    let kernel = cast_fn(from, to).unwrap();
    bencher
        .counter(BytesCount::new(SRC))
        .bench_local(|| kernel(black_box(&src), &mut dst));
}

#[divan::bench(sample_count = SAMPLES, args = ["bf16", "f32"])]
fn quantize(bencher: Bencher, from: &str) {
    let from: DType = from.parse().unwrap();
    let cols = 8192u64;
    let rows = (SRC / from.size()) as u64 / cols;
    let shape = [rows, cols];
    let scheme = QuantScheme::parse("block:128x128").unwrap();
    let quant = Quant::new(scheme, from, DType::Fp8E4M3, None).unwrap();
    let grid = BlockGrid::new(scheme, &shape).unwrap();
    let shard = Region::full(&shape);
    let src = source(from);
    let amax = AmaxGrid::local(&grid, &shard, &src, from).unwrap();
    let scales = Scales::new(quant, &grid, &amax);
    let mut dst = vec![0u8; SRC / from.size()];
    bencher
        .counter(BytesCount::new(SRC))
        .bench_local(|| scales.quantize_run(&shard, from, 0, black_box(&src), &mut dst));
}

#[divan::bench(sample_count = SAMPLES)]
fn amax(bencher: Bencher) {
    let shape = [(SRC / 2) as u64 / 8192, 8192];
    let grid = BlockGrid::new(QuantScheme::parse("block:128x128").unwrap(), &shape).unwrap();
    let shard = Region::full(&shape);
    let src = source(DType::Bf16);
    bencher
        .counter(BytesCount::new(SRC))
        .bench_local(|| AmaxGrid::local(&grid, &shard, black_box(&src), DType::Bf16).unwrap());
}

/// The fp8 encoding loop alone, over the whole buffer with one multiplier: the bound on
/// `quantize`, without its per-block lookups.
#[divan::bench(sample_count = SAMPLES, args = ["bf16", "f32"])]
fn encode(bencher: Bencher, from: &str) {
    let from: DType = from.parse().unwrap();
    let src = source(from);
    let mut dst = vec![0u8; SRC / from.size()];
    bencher.counter(BytesCount::new(SRC)).bench_local(|| {
        reshard::convert::Fp8::E4M3.encode_scaled(from, black_box(&src), 3.0, &mut dst)
    });
}
