//! The delta kernels against a one-thread `copy_from_slice` of the region: encoding (pack a
//! block from the shard, compare it with the base, write the changed values, update the base)
//! and applying (write the changed values into the shard). The bar is 50% of memcpy.
//!
//! A 2048x8192 bf16 shard (32 MiB, far beyond the caches), the region its whole box (one
//! run) or its left half (2048 runs of 8 KiB); a seeded fraction of the elements changed by
//! one ulp. Throughput counts the region's bytes, so ratios to `memcpy` read straight off.
//!
//! `cargo bench --bench delta`

use std::hint::black_box;

use divan::Bencher;
use divan::counter::BytesCount;
use reshard::Region;
use reshard::copy::{CopyGeometry, Place};
use reshard::delta::{BLOCK_ELEMS, DeltaEncoder, apply};

fn main() {
    divan::main();
}

const ROWS: u64 = 2048;
const COLS: u64 = 8192;
const SAMPLES: u32 = 10;
const DENSITIES: [f64; 4] = [0.0, 0.01, 0.1, 1.0];

/// The shard's box and the region: the whole box, or its left half.
fn boxes(half: bool) -> (Region, Region) {
    let shard = Region::from_ranges(&[0..ROWS, 0..COLS]);
    let cols = if half { COLS / 2 } else { COLS };
    (shard, Region::from_ranges(&[0..ROWS, 0..cols]))
}

/// A shard of bf16 values, and the same with a seeded fraction `density` of the region's
/// elements one ulp up.
fn shards(region: &Region, density: f64) -> (Vec<u8>, Vec<u8>) {
    let n = (ROWS * COLS) as usize;
    let mut x = 0x2545_f491u32;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let old: Vec<u8> = (0..n)
        .flat_map(|_| ((next() & 0x3fff) as u16 | 0x3c00).to_le_bytes())
        .collect();
    let mut new = old.clone();
    let cols = region.extent[1] as usize;
    for i in 0..n {
        if i % COLS as usize >= cols {
            continue;
        }
        if (next() as f64) < density * u32::MAX as f64 {
            let v = u16::from_le_bytes([new[2 * i], new[2 * i + 1]]).wrapping_add(1);
            new[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    (old, new)
}

#[divan::bench(args = [false, true], sample_count = SAMPLES)]
fn memcpy(bencher: Bencher, half: bool) {
    let (_, region) = boxes(half);
    let len = region.volume() as usize * 2;
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    bencher
        .counter(BytesCount::new(len))
        .bench_local(|| dst.copy_from_slice(black_box(&src)));
}

#[divan::bench(args = DENSITIES, consts = [false, true], sample_count = SAMPLES)]
fn encode<const HALF: bool>(bencher: Bencher, density: f64) {
    let (shard, region) = boxes(HALF);
    let (old, new) = shards(&region, density);
    let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, 2);
    let mut stream = vec![0u8; pack.len()];
    pack.copy(&old, &mut stream, 0..pack.len());
    let mut encoder = DeltaEncoder::new(2, BLOCK_ELEMS).unwrap();
    let mut out = Vec::with_capacity(pack.len() + pack.len() / 1000 + 64);
    bencher
        .counter(BytesCount::new(pack.len()))
        .with_inputs(|| stream.clone())
        .bench_local_refs(|base| {
            out.clear();
            encoder
                .encode(&pack, black_box(&new), base, 0..pack.len(), &mut out)
                .unwrap()
        });
}

#[divan::bench(args = DENSITIES, consts = [false, true], sample_count = SAMPLES)]
fn apply_onto_base<const HALF: bool>(bencher: Bencher, density: f64) {
    let (shard, region) = boxes(HALF);
    let (old, new) = shards(&region, density);
    let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, 2);
    let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&shard), 2);
    let mut base = vec![0u8; pack.len()];
    pack.copy(&old, &mut base, 0..pack.len());
    let mut wire = Vec::new();
    DeltaEncoder::new(2, BLOCK_ELEMS)
        .unwrap()
        .encode(&pack, &new, &mut base, 0..pack.len(), &mut wire)
        .unwrap();
    let mut dst = old.clone();
    bencher
        .counter(BytesCount::new(pack.len()))
        .bench_local(|| apply(&unpack, black_box(&wire), &mut dst).unwrap());
}
