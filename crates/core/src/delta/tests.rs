use proptest::prelude::*;

use super::*;
use crate::copy::Place;
use crate::region::Region;

/// A shard box of up to 3 dims and a region inside it.
fn arb_boxes() -> impl Strategy<Value = (Region, Region)> {
    prop::collection::vec((1u64..9, 0u64..9, 0u64..9), 1..=3).prop_map(|dims| {
        let mut shard = Vec::new();
        let mut region = Vec::new();
        for (extent, a, b) in dims {
            let (lo, hi) = (a % (extent + 1), b % (extent + 1));
            let (lo, hi) = (lo.min(hi), lo.max(hi));
            shard.push(0..extent);
            region.push(lo..hi);
        }
        (Region::from_ranges(&shard), Region::from_ranges(&region))
    })
}

/// Deterministic bytes from a seed.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `old` with a seeded fraction `density` of the region's elements changed (every byte of a
/// changed element flipped, so it differs however many bytes it has).
fn evolve(old: &[u8], pack: &CopyGeometry, elem: usize, density: f64, seed: u64) -> Vec<u8> {
    let mut new = old.to_vec();
    let draws = bytes(pack.len() / elem.max(1) * 4 + 4, seed);
    let mut k = 0;
    pack.for_each_run(0..pack.len(), |s, _, len| {
        for e in (s..s + len).step_by(elem) {
            let draw = u32::from_le_bytes(draws[4 * k..4 * k + 4].try_into().unwrap());
            k += 1;
            if (draw as f64) < density * u32::MAX as f64 {
                for b in &mut new[e..e + elem] {
                    *b ^= 0xa5;
                }
            }
        }
    });
    new
}

fn density() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(1e-4),
        Just(0.01),
        Just(0.5),
        Just(1.0),
        0.0f64..1.0
    ]
}

proptest! {
    /// Encoded in block-aligned chunks and applied onto a shard holding the base, a delta
    /// leaves exactly the new values in the region and the rest of the shard untouched, and
    /// leaves the new stream as the sender's base; every block takes its smallest encoding.
    #[test]
    fn a_delta_applied_onto_its_base_gives_the_new_values(
        (shard, region) in arb_boxes(),
        elem in prop::sample::select(vec![1usize, 2, 4, 8]),
        block_elems in prop_oneof![1usize..70, Just(BLOCK_ELEMS)],
        chunk_blocks in 1usize..5,
        density in density(),
        seed in any::<u64>(),
    ) {
        let shard_bytes = shard.volume() as usize * elem;
        let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, elem);
        let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&shard), elem);
        let old = bytes(shard_bytes, seed);
        let new = evolve(&old, &pack, elem, density, seed ^ 0x9e37);
        let mut base = vec![0u8; pack.len()];
        pack.copy(&old, &mut base, 0..pack.len());

        let mut encoder = DeltaEncoder::new(elem, block_elems).unwrap();
        let mut dst = bytes(shard_bytes, !seed);
        unpack.copy(&base, &mut dst, 0..pack.len());
        let mut expected = dst.clone();
        let mut new_stream = vec![0u8; pack.len()];
        pack.copy(&new, &mut new_stream, 0..pack.len());
        unpack.copy(&new_stream, &mut expected, 0..pack.len());

        let chunk = chunk_blocks * block_elems * elem;
        let mut total = DeltaStats::default();
        let mut at = 0;
        while at < pack.len() {
            let range = at..(at + chunk).min(pack.len());
            let mut wire = Vec::new();
            let sent = encoder.encode(&pack, &new, &mut base, range.clone(), &mut wire).unwrap();
            let got = apply(&unpack, &wire, &mut dst).unwrap();
            // the receiver counts what it wrote: a dense block writes every element
            prop_assert_eq!((sent.blocks, sent.elems, sent.bytes), (got.blocks, got.elems, got.bytes));
            prop_assert!(got.changed >= sent.changed);
            total.add(&sent);
            at = range.end;
        }
        prop_assert_eq!(&dst, &expected);
        prop_assert_eq!(&base, &new_stream);
        prop_assert_eq!(total.elems as usize, pack.len() / elem);
        if density == 0.0 {
            prop_assert_eq!(total.changed, 0);
        }
        if density == 1.0 && !pack.is_empty() {
            prop_assert_eq!(total.changed as usize, pack.len() / elem);
        }
    }

    /// Whatever bytes a receiver is handed, applying them never panics, and an encoding it
    /// refuses leaves its shard as it was.
    #[test]
    fn a_corrupt_delta_is_refused_or_stays_inside_the_region(
        (shard, region) in arb_boxes(),
        elem in prop::sample::select(vec![1usize, 2, 4, 8]),
        density in density(),
        seed in any::<u64>(),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in any::<usize>(),
    ) {
        let shard_bytes = shard.volume() as usize * elem;
        let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, elem);
        let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&shard), elem);
        let old = bytes(shard_bytes, seed);
        let new = evolve(&old, &pack, elem, density, seed ^ 1);
        let mut base = vec![0u8; pack.len()];
        pack.copy(&old, &mut base, 0..pack.len());
        let mut wire = Vec::new();
        DeltaEncoder::new(elem, 16).unwrap().encode(&pack, &new, &mut base, 0..pack.len(), &mut wire).unwrap();
        for (at, x) in flips {
            let n = wire.len();
            wire[at % n] ^= x;
        }
        if cut % 3 == 0 {
            wire.truncate(cut % (wire.len() + 1));
        }
        let mut dst = old.clone();
        match apply(&unpack, &wire, &mut dst) {
            Err(_) => prop_assert_eq!(&dst, &old),
            Ok(_) => {
                // outside the region nothing moved
                let mut outside = old.clone();
                let mut mine = dst.clone();
                let zero = vec![0u8; pack.len()];
                unpack.copy(&zero, &mut outside, 0..pack.len());
                unpack.copy(&zero, &mut mine, 0..pack.len());
                prop_assert_eq!(mine, outside);
            }
        }
    }
}

#[test]
fn each_encoding_is_chosen_where_it_is_smallest() {
    // 4096 bf16 elements: offsets cost 4 bytes a change, a bitmask 512 bytes + 2 a change
    assert_eq!(choose(4096, 0, 2), Encoding::Unchanged);
    assert_eq!(choose(4096, 1, 2), Encoding::Offsets);
    assert_eq!(choose(4096, 255, 2), Encoding::Offsets);
    assert_eq!(choose(4096, 257, 2), Encoding::Bitmask);
    assert_eq!(choose(4096, 3800, 2), Encoding::Bitmask);
    assert_eq!(choose(4096, 3900, 2), Encoding::Dense);
    assert_eq!(choose(4096, 4096, 2), Encoding::Dense);
    assert_eq!(encoded_len(Encoding::Unchanged, 4096, 1, 2), None);
}

#[test]
fn bad_parameters_and_headers_name_the_field() {
    let e = DeltaEncoder::new(3, 4096).unwrap_err();
    assert_eq!(
        e.to_string(),
        "delta: elem is 3: must be 1, 2, 4 or 8 bytes"
    );
    let e = DeltaEncoder::new(2, 1 << 17).unwrap_err();
    assert!(
        e.to_string().starts_with("delta: block_elems is 131072"),
        "{e}"
    );
    let region = Region::full(&[4]);
    let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&region), 2);
    let mut dst = vec![0u8; 8];
    let e = apply(&unpack, &[1, 2], &mut dst).unwrap_err();
    assert_eq!(e.to_string(), "delta: header is 2: needs 18 bytes");
    // a header that reaches past the region's one block
    let mut wire = Vec::new();
    Header {
        elem: 2,
        block_elems: 4,
        first_block: 1,
        blocks: 1,
    }
    .write(&mut wire);
    wire.push(0);
    let e = apply(&unpack, &wire, &mut dst).unwrap_err();
    assert_eq!(
        e.to_string(),
        "delta: blocks is 1..2: reach past the region's blocks"
    );
}

#[test]
fn a_range_off_the_blocks_is_refused() {
    let region = Region::full(&[100]);
    let pack = CopyGeometry::new(&region, Place::Within(&region), Place::Stream, 4);
    let src = vec![0u8; 400];
    let mut base = vec![0u8; 400];
    let mut enc = DeltaEncoder::new(4, 16).unwrap();
    let e = enc
        .encode(&pack, &src, &mut base, 4..64, &mut Vec::new())
        .unwrap_err();
    assert!(
        e.to_string().starts_with("delta: range is 4..64 of 400"),
        "{e}"
    );
    assert!(
        enc.encode(&pack, &src, &mut base, 64..400, &mut Vec::new())
            .is_ok()
    );
}

proptest! {
    /// The vector comparison marks exactly the elements a byte-by-byte comparison finds.
    #[test]
    fn the_fast_diff_marks_what_bytes_differ(
        elem in prop::sample::select(vec![1usize, 2, 4, 8]),
        n in 1usize..300,
        seed in any::<u64>(),
        flips in prop::collection::vec((any::<usize>(), 1u8..=255), 0..40),
    ) {
        let old = bytes(n * elem, seed);
        let mut new = old.clone();
        for (at, x) in flips {
            new[at % (n * elem)] ^= x;
        }
        let mut mask = vec![0u64; n.div_ceil(64)];
        let changed = super::block::diff(elem, &new, &old, &mut mask);
        let mut want = 0;
        for i in 0..n {
            let differs = new[i * elem..(i + 1) * elem] != old[i * elem..(i + 1) * elem];
            prop_assert_eq!(mask[i / 64] >> (i % 64) & 1 == 1, differs, "element {}", i);
            want += usize::from(differs);
        }
        prop_assert_eq!(changed, want);
    }
}

proptest! {
    /// An encoding given up after any block leaves nothing in the output and the whole new
    /// stream in the base, as a dense send would: the next delta is against what was sent.
    #[test]
    fn an_encoding_given_up_leaves_the_new_stream_as_base(
        (shard, region) in arb_boxes(),
        elem in prop::sample::select(vec![1usize, 2, 4, 8]),
        block_elems in 1usize..70,
        after in 0usize..400,
        density in density(),
        seed in any::<u64>(),
    ) {
        let shard_bytes = shard.volume() as usize * elem;
        let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, elem);
        let old = bytes(shard_bytes, seed);
        let new = evolve(&old, &pack, elem, density, seed ^ 0x51);
        let mut base = vec![0u8; pack.len()];
        pack.copy(&old, &mut base, 0..pack.len());
        let mut new_stream = vec![0u8; pack.len()];
        pack.copy(&new, &mut new_stream, 0..pack.len());
        let mut out = vec![7u8; 3];
        let mut encoder = DeltaEncoder::new(elem, block_elems).unwrap();
        let cut = after * elem;
        let got = encoder
            .encode_unless(&pack, &new, &mut base, 0..pack.len(), &mut out, |_, covered| covered > cut)
            .unwrap();
        prop_assert_eq!(&base, &new_stream);
        match got {
            // gave up: the output is as it was
            None => prop_assert_eq!(&out, &vec![7u8; 3]),
            // never gave up: a whole encoding, after what was there
            Some(stats) => {
                prop_assert!(cut >= pack.len().saturating_sub(block_elems * elem));
                prop_assert_eq!(stats.bytes as usize, out.len() - 3);
            }
        }
    }
}

proptest! {
    /// The elements an encoding writes, written by hand onto the base's stream, give the new
    /// stream, as `apply` does; they come in increasing order, as many as it counts.
    #[test]
    fn the_written_elements_are_what_apply_writes(
        (shard, region) in arb_boxes(),
        elem in prop::sample::select(vec![1usize, 2, 4, 8]),
        block_elems in prop_oneof![1usize..70, Just(BLOCK_ELEMS)],
        density in density(),
        seed in any::<u64>(),
    ) {
        let shard_bytes = shard.volume() as usize * elem;
        let pack = CopyGeometry::new(&region, Place::Within(&shard), Place::Stream, elem);
        let old = bytes(shard_bytes, seed);
        let new = evolve(&old, &pack, elem, density, seed ^ 0x77);
        let mut base = vec![0u8; pack.len()];
        pack.copy(&old, &mut base, 0..pack.len());
        let mut stream = base.clone();
        let mut new_stream = vec![0u8; pack.len()];
        pack.copy(&new, &mut new_stream, 0..pack.len());
        let mut wire = Vec::new();
        let sent = DeltaEncoder::new(elem, block_elems)
            .unwrap()
            .encode(&pack, &new, &mut base, 0..pack.len(), &mut wire)
            .unwrap();
        let (mut written, mut last) = (0u64, None);
        let got = for_each_written(&wire, pack.len(), |i, value| {
            assert!(last.is_none_or(|l| i > l), "element {i} after {last:?}");
            last = Some(i);
            written += 1;
            stream[i * elem..(i + 1) * elem].copy_from_slice(value);
        })
        .unwrap();
        prop_assert_eq!(&stream, &new_stream);
        prop_assert_eq!(written, got.changed);
        prop_assert_eq!((sent.blocks, sent.elems, sent.bytes), (got.blocks, got.elems, got.bytes));
        // a cut encoding calls nothing and is refused
        let mut called = false;
        let cut = for_each_written(&wire[..wire.len() - 1], pack.len(), |_, _| called = true);
        prop_assert!(cut.is_err() && !called);
    }
}
