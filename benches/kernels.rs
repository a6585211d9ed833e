//! The copy kernels of the executor against `copy_from_slice` of the same number of bytes.
//!
//! Every case copies a column block of a row-major bf16 shard: the block's row segment is one
//! contiguous run of `run` bytes, from 64 B to 1 MiB, and the block holds 32 MiB whatever the
//! run, so every case moves the same bytes as `memcpy`. The shards are twice (2-D) or four
//! times (3-D) the block, so buffers total 96 to 160 MiB and the copies run from memory, not
//! from the caches. Throughput is bytes of the region per second; read ratios within one run.
//!
//! `sum_2d` is `--checksum`'s CRC-32C over the same regions, read in place.
//!
//! `memcpy_source`, `quantize_pack` and `cast_pack` are the converting packs (see below).
//!
//! `cargo bench --bench kernels`; results in BENCHMARKS.md ("Kernels", "Quantize in flight").

use std::hint::black_box;

use divan::Bencher;
use divan::counter::BytesCount;
use reshard::Region;
use reshard::copy::{CopyGeometry, Place};

fn main() {
    divan::main();
}

/// Bytes of the region every case copies.
const COPIED: usize = 32 << 20;
/// bf16.
const ELEM: usize = 2;
/// Contiguous run sizes in bytes.
const RUNS: [usize; 8] = [
    64,
    256,
    1 << 10,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
];
const SAMPLES: u32 = 30;

/// A region and the boxes of the two shards it is copied between (global coordinates).
struct Case {
    region: Region,
    /// The shard the region is read from; it holds the region in its upper half along the
    /// last dim (and along dim 1 in 3-D).
    src_box: Region,
    /// A second shard, shifted so that the region sits in its lower half instead.
    dst_box: Region,
}

/// 2-D: a `rows x cols` block of a `rows x 2 cols` shard, `cols` elements making `run` bytes.
fn case_2d(run: usize) -> Case {
    let cols = (run / ELEM) as u64;
    let rows = (COPIED / run) as u64;
    Case {
        region: Region::from_ranges(&[0..rows, cols..2 * cols]),
        src_box: Region::from_ranges(&[0..rows, 0..2 * cols]),
        dst_box: Region::from_ranges(&[0..rows, cols..3 * cols]),
    }
}

/// 3-D: a `p x q x cols` block of a `p x 2q x 2 cols` shard: two outer loops, one run per
/// (p, q) pair.
fn case_3d(run: usize) -> Case {
    let cols = (run / ELEM) as u64;
    let rows = (COPIED / run) as u64;
    let q = rows.min(16);
    let p = rows / q;
    Case {
        region: Region::from_ranges(&[0..p, q..2 * q, cols..2 * cols]),
        src_box: Region::from_ranges(&[0..p, 0..2 * q, 0..2 * cols]),
        dst_box: Region::from_ranges(&[0..p, q..3 * q, cols..3 * cols]),
    }
}

/// A buffer of `len` bytes, every page written, with contents that tell offsets apart.
fn filled(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

fn bytes_of(b: &Region) -> usize {
    b.volume() as usize * ELEM
}

/// Byte offset of `region`'s first element inside the row-major buffer of `holder`.
fn first_byte(region: &Region, holder: &Region) -> usize {
    (0..holder.ndim()).fold(0, |acc, d| {
        acc * holder.extent[d] as usize + (region.offset[d] - holder.offset[d]) as usize
    }) * ELEM
}

fn counted<'a, 'b>(bencher: Bencher<'a, 'b>) -> Bencher<'a, 'b> {
    bencher.counter(BytesCount::new(COPIED))
}

/// Shard -> stream: what a sender does before a message leaves.
fn pack(bencher: Bencher, case: Case) {
    let g = CopyGeometry::new(
        &case.region,
        Place::Within(&case.src_box),
        Place::Stream,
        ELEM,
    );
    assert_eq!(g.len(), COPIED);
    let src = filled(bytes_of(&case.src_box));
    let mut stream = vec![1u8; COPIED];
    g.copy(&src, &mut stream, 0..COPIED);
    // the stream starts with the block's first run, where the region's corner sits
    let corner = first_byte(&case.region, &case.src_box);
    assert_eq!(stream[..g.run_bytes()], src[corner..corner + g.run_bytes()]);
    counted(bencher).bench_local(|| g.copy(black_box(&src), black_box(&mut stream), 0..COPIED));
}

/// Stream -> shard: what a receiver does when a message arrives.
fn unpack(bencher: Bencher, case: Case) {
    let g = CopyGeometry::new(
        &case.region,
        Place::Stream,
        Place::Within(&case.dst_box),
        ELEM,
    );
    assert_eq!(g.len(), COPIED);
    let stream = filled(COPIED);
    let mut dst = vec![1u8; bytes_of(&case.dst_box)];
    g.copy(&stream, &mut dst, 0..COPIED);
    let corner = first_byte(&case.region, &case.dst_box);
    assert_eq!(dst[corner..corner + g.run_bytes()], stream[..g.run_bytes()]);
    counted(bencher).bench_local(|| g.copy(black_box(&stream), black_box(&mut dst), 0..COPIED));
}

/// Shard -> shard: a local copy, or a receive straight from a peer's mapped shard.
fn direct(bencher: Bencher, case: Case) {
    let g = CopyGeometry::new(
        &case.region,
        Place::Within(&case.src_box),
        Place::Within(&case.dst_box),
        ELEM,
    );
    assert_eq!(g.len(), COPIED);
    let src = filled(bytes_of(&case.src_box));
    let mut dst = vec![1u8; bytes_of(&case.dst_box)];
    g.copy(&src, &mut dst, 0..COPIED);
    let (s, d) = (
        first_byte(&case.region, &case.src_box),
        first_byte(&case.region, &case.dst_box),
    );
    assert_eq!(dst[d..d + g.run_bytes()], src[s..s + g.run_bytes()]);
    counted(bencher).bench_local(|| g.copy(black_box(&src), black_box(&mut dst), 0..COPIED));
}

/// The CRC-32C of the region where it lies in a shard: what `--checksum` adds on each side
/// of a transfer (the sender's sum, the receiver's check), against the copies above.
fn sum(bencher: Bencher, case: Case) {
    let src = filled(bytes_of(&case.src_box));
    let sum = || {
        reshard::checksum::region_sum(
            black_box(&src),
            &case.src_box,
            &case.region,
            ELEM,
            0..COPIED,
        )
    };
    assert_ne!(sum(), 0);
    counted(bencher).bench_local(sum);
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn sum_2d(bencher: Bencher, run: usize) {
    sum(bencher, case_2d(run));
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn pack_2d(bencher: Bencher, run: usize) {
    pack(bencher, case_2d(run));
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn unpack_2d(bencher: Bencher, run: usize) {
    unpack(bencher, case_2d(run));
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn direct_2d(bencher: Bencher, run: usize) {
    direct(bencher, case_2d(run));
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn pack_3d(bencher: Bencher, run: usize) {
    pack(bencher, case_3d(run));
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn unpack_3d(bencher: Bencher, run: usize) {
    unpack(bencher, case_3d(run));
}

#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn direct_3d(bencher: Bencher, run: usize) {
    direct(bencher, case_3d(run));
}

/// The reference: one `copy_from_slice` of the same 32 MiB between two touched buffers.
#[divan::bench(sample_count = SAMPLES, sample_size = 1)]
fn memcpy(bencher: Bencher) {
    let src = filled(COPIED);
    let mut dst = vec![1u8; COPIED];
    counted(bencher).bench_local(|| black_box(&mut dst).copy_from_slice(black_box(&src)));
}

/// The same 32 MiB, dense on both sides, one `copy_from_slice` per run: what the per-run call
/// costs without any stride.
#[divan::bench(args = RUNS, sample_count = SAMPLES, sample_size = 1)]
fn memcpy_runs(bencher: Bencher, run: usize) {
    let src = filled(COPIED);
    let mut dst = vec![1u8; COPIED];
    counted(bencher).bench_local(|| {
        let dst = black_box(&mut dst);
        for (d, s) in dst
            .chunks_exact_mut(run)
            .zip(black_box(&src).chunks_exact(run))
        {
            d.copy_from_slice(s);
        }
    });
}

/// Run of the chunked cases: 6 KiB, so that chunk boundaries fall inside runs.
const CHUNKED_RUN: usize = 6 << 10;
/// Chunk sizes of the chunked cases; 4 MiB is the executor's default.
const CHUNKS: [usize; 3] = [64 << 10, 1 << 20, 4 << 20];

/// Shard -> message in chunks, as a sender does: every chunk is packed into the same
/// chunk-sized message buffer, starting where the previous one stopped.
#[divan::bench(args = CHUNKS, sample_count = SAMPLES, sample_size = 1)]
fn pack_chunks(bencher: Bencher, chunk: usize) {
    let case = case_2d(CHUNKED_RUN);
    let g = CopyGeometry::new(
        &case.region,
        Place::Within(&case.src_box),
        Place::Stream,
        ELEM,
    );
    let src = filled(bytes_of(&case.src_box));
    let mut message = vec![1u8; chunk];
    bencher.counter(BytesCount::new(g.len())).bench_local(|| {
        for start in (0..g.len()).step_by(chunk) {
            let end = (start + chunk).min(g.len());
            g.copy(
                black_box(&src),
                black_box(&mut message[..end - start]),
                start..end,
            );
        }
    });
}

/// Message -> shard in chunks, as a receiver does, from one chunk-sized message buffer.
#[divan::bench(args = CHUNKS, sample_count = SAMPLES, sample_size = 1)]
fn unpack_chunks(bencher: Bencher, chunk: usize) {
    let case = case_2d(CHUNKED_RUN);
    let g = CopyGeometry::new(
        &case.region,
        Place::Stream,
        Place::Within(&case.dst_box),
        ELEM,
    );
    let message = filled(chunk);
    let mut dst = vec![1u8; bytes_of(&case.dst_box)];
    bencher.counter(BytesCount::new(g.len())).bench_local(|| {
        for start in (0..g.len()).step_by(chunk) {
            let end = (start + chunk).min(g.len());
            g.copy(
                black_box(&message[..end - start]),
                black_box(&mut dst),
                start..end,
            );
        }
    });
}

// ---------------------------------------------------------------------------------------
// Converting packs: what a sender does when the destination's dtype differs (`--dst-dtype`,
// `--quant`), against a one-thread memcpy of the same source bytes. The region is an
// 8192 x 2048 column block of an 8192 x 4096 source shard (a receiver's slab of a TP S(0) ->
// S(1) move), so every row is one 2048-element run; throughput counts source bytes.

/// Rows and columns of the converted region; the shard is twice as wide.
const CONVERT_ROWS: u64 = 8192;
const CONVERT_COLS: u64 = 2048;

/// A shard of `dtype` holding finite values of every magnitude.
fn float_shard(dtype: reshard::DType, elems: usize) -> Vec<u8> {
    let mut out = vec![0u8; elems * dtype.size()];
    let mut x = 0x2545_f491u32;
    for i in 0..elems {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = f32::from_bits((x & 0x3fff_ffff) | 0x3000_0000) - 1.0;
        reshard::convert::cast::write_f32(dtype, v, &mut out[i * dtype.size()..]);
    }
    out
}

fn convert_case() -> (Region, Region) {
    let rows = CONVERT_ROWS;
    let cols = CONVERT_COLS;
    (
        Region::from_ranges(&[0..rows, cols..2 * cols]),
        Region::from_ranges(&[0..rows, 0..2 * cols]),
    )
}

/// One `copy_from_slice` of the region's source bytes (bf16: 32 MiB, f32: 64 MiB).
#[divan::bench(args = ["bf16", "f32"], sample_count = SAMPLES, sample_size = 1)]
fn memcpy_source(bencher: Bencher, dtype: &str) {
    let dtype: reshard::DType = dtype.parse().unwrap();
    let bytes = (CONVERT_ROWS * CONVERT_COLS) as usize * dtype.size();
    let src = filled(bytes);
    let mut dst = vec![1u8; bytes];
    bencher
        .counter(BytesCount::new(bytes))
        .bench_local(|| black_box(&mut dst).copy_from_slice(black_box(&src)));
}

/// bf16 -> fp8e4m3 `block:128x128`, quantized as it is packed (the scales taken before).
#[divan::bench(sample_count = SAMPLES, sample_size = 1)]
fn quantize_pack(bencher: Bencher) {
    use reshard::DType;
    use reshard::convert::{AmaxGrid, BlockGrid, Quant, QuantScheme, Scales};
    use reshard::copy::{Cast, Quantizer};
    let (region, shard) = convert_case();
    let scheme = QuantScheme::parse("block:128x128").unwrap();
    let quant = Quant::new(scheme, DType::Bf16, DType::Fp8E4M3, None).unwrap();
    let grid = BlockGrid::new(scheme, &shard.extent).unwrap();
    let src = float_shard(DType::Bf16, shard.volume() as usize);
    let amax = AmaxGrid::local(&grid, &shard, &src, DType::Bf16).unwrap();
    let quantizer = Quantizer {
        scales: Scales::new(quant, &grid, &amax),
        shard: shard.clone(),
    };
    let cast = Cast::quantizing(
        DType::Bf16,
        DType::Fp8E4M3,
        Some(std::sync::Arc::new(quantizer)),
    );
    let g = CopyGeometry::converting(&region, Place::Within(&shard), Place::Stream, 1, Some(cast));
    let mut stream = vec![0u8; g.len()];
    g.copy(&src, &mut stream, 0..g.len());
    assert!(stream.iter().any(|&b| b != 0));
    bencher
        .counter(BytesCount::new(g.len() * 2))
        .bench_local(|| g.copy(black_box(&src), black_box(&mut stream), 0..g.len()));
}

/// f32 -> bf16, cast as it is packed.
#[divan::bench(sample_count = SAMPLES, sample_size = 1)]
fn cast_pack(bencher: Bencher) {
    use reshard::DType;
    use reshard::copy::Cast;
    let (region, shard) = convert_case();
    let src = float_shard(DType::F32, shard.volume() as usize);
    let cast = Cast::between(DType::F32, DType::Bf16).unwrap();
    let g = CopyGeometry::converting(&region, Place::Within(&shard), Place::Stream, 2, cast);
    let mut stream = vec![0u8; g.len()];
    g.copy(&src, &mut stream, 0..g.len());
    assert!(stream.iter().any(|&b| b != 0));
    bencher
        .counter(BytesCount::new(g.len() * 2))
        .bench_local(|| g.copy(black_box(&src), black_box(&mut stream), 0..g.len()));
}
