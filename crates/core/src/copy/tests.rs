use super::*;

/// Copies element by element, the obvious way, to check the folded walker against.
fn naive(region: &Region, src_box: &Region, dst_box: &Region, src: &[u8], elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; dst_box.volume() as usize * elem];
    let n = region.ndim();
    for lin in 0..region.volume() {
        let mut rest = lin;
        let mut coord = vec![0u64; n];
        for d in (0..n).rev() {
            coord[d] = region.offset[d] + rest % region.extent[d];
            rest /= region.extent[d];
        }
        let at = |b: &Region| {
            (0..n).fold(0u64, |acc, d| acc * b.extent[d] + coord[d] - b.offset[d]) as usize * elem
        };
        let (s, d) = (at(src_box), at(dst_box));
        out[d..d + elem].copy_from_slice(&src[s..s + elem]);
    }
    out
}

#[test]
fn folds_whole_inner_dims_into_one_run() {
    let holder = Region::from_ranges(&[0..4, 0..8, 0..6]);
    let rows = Region::from_ranges(&[1..3, 0..8, 0..6]);
    let g = CopyGeometry::new(&rows, Place::Within(&holder), Place::Stream, 2);
    assert_eq!((g.runs(), g.run_bytes()), (1, 2 * 8 * 6 * 2));
    let cols = Region::from_ranges(&[0..4, 0..8, 2..4]);
    let g = CopyGeometry::new(&cols, Place::Within(&holder), Place::Stream, 2);
    assert_eq!((g.runs(), g.run_bytes()), (32, 4));
    // a dim of extent 1 does not break folding
    let one = Region::from_ranges(&[2..3, 3..4, 0..6]);
    let g = CopyGeometry::new(&one, Place::Within(&holder), Place::Stream, 4);
    assert_eq!((g.runs(), g.run_bytes()), (1, 24));
}

#[test]
fn pack_then_unpack_in_chunks_equals_direct_copy() {
    let src_box = Region::from_ranges(&[2..9, 0..5, 1..8]);
    let dst_box = Region::from_ranges(&[0..6, 1..5, 0..8]);
    let region = src_box.intersect(&dst_box).unwrap();
    let elem = 2;
    let src: Vec<u8> = (0..src_box.volume() as usize * elem)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let want = naive(&region, &src_box, &dst_box, &src, elem);

    let direct = CopyGeometry::new(
        &region,
        Place::Within(&src_box),
        Place::Within(&dst_box),
        elem,
    );
    let mut got = vec![0u8; want.len()];
    direct.copy(&src, &mut got, 0..direct.len());
    assert_eq!(got, want);

    for chunk in [1, 3, 7, 16, 1000] {
        let pack = CopyGeometry::new(&region, Place::Within(&src_box), Place::Stream, elem);
        let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&dst_box), elem);
        let mut got = vec![0u8; want.len()];
        let mut start = 0;
        while start < pack.len() {
            let end = (start + chunk).min(pack.len());
            let mut msg = vec![0u8; end - start];
            pack.copy(&src, &mut msg, start..end);
            unpack.copy(&msg, &mut got, start..end);
            start = end;
        }
        assert_eq!(got, want, "chunk {chunk}");
    }
}

/// A converting copy (f32 -> bf16, bf16 -> f64) packed in chunks of whole destination
/// elements and unpacked, or written directly, equals the naive copy of the cast source,
/// and its checksum is that of the destination bytes.
#[test]
fn converting_copies_equal_the_cast_of_the_naive_copy() {
    use crate::DType;
    let src_box = Region::from_ranges(&[2..9, 0..5, 1..8]);
    let dst_box = Region::from_ranges(&[0..6, 1..5, 0..8]);
    let region = src_box.intersect(&dst_box).unwrap();
    // whole tensors of the source box, cast as a block: the reference
    for (from, to) in [(DType::F32, DType::Bf16), (DType::Bf16, DType::F64)] {
        let (se, de) = (from.size(), to.size());
        let src: Vec<u8> = (0..src_box.volume() as usize * se)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut cast_box = vec![0u8; src_box.volume() as usize * de];
        crate::convert::cast(from, to, &src, &mut cast_box).unwrap();
        let want = naive(&region, &src_box, &dst_box, &cast_box, de);
        let cast = Cast::between(from, to).unwrap();
        assert!(cast.is_some());
        let direct = CopyGeometry::converting(
            &region,
            Place::Within(&src_box),
            Place::Within(&dst_box),
            de,
            cast.clone(),
        );
        assert_eq!(direct.len(), region.volume() as usize * de);
        let mut got = vec![0u8; want.len()];
        direct.copy(&src, &mut got, 0..direct.len());
        assert!(got == want, "{from} -> {to} direct");
        for chunk in [de, 3 * de, 8, 48, 1000 * de] {
            let pack = CopyGeometry::converting(
                &region,
                Place::Within(&src_box),
                Place::Stream,
                de,
                cast.clone(),
            );
            let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&dst_box), de);
            let mut got = vec![0u8; want.len()];
            let mut start = 0;
            while start < pack.len() {
                let end = (start + chunk).min(pack.len());
                let mut msg = vec![0u8; end - start];
                let mut sum = 0;
                pack.copy_summing(&src, &mut msg, start..end, &mut sum);
                assert_eq!(sum, crate::crc::append(0, &msg));
                unpack.copy(&msg, &mut got, start..end);
                start = end;
            }
            assert!(got == want, "{from} -> {to}, chunk {chunk}");
        }
    }
    assert_eq!(Cast::between(DType::F32, DType::F32).unwrap(), None);
    assert!(Cast::between(DType::F32, DType::I32).is_err());
}

/// A converted run longer than [`SUMMED_PIECE`] is cast and summed piece by piece: the
/// same bytes and the same sum as one cast of the whole run.
#[test]
fn long_converted_runs_are_summed_piece_by_piece() {
    use crate::DType;
    let holder = Region::from_ranges(&[0..3, 0..7001]);
    let src: Vec<u8> = (0..holder.volume() as usize * 4)
        .map(|i| (i * 13 % 251) as u8)
        .collect();
    let mut want = vec![0u8; holder.volume() as usize * 2];
    crate::convert::cast(DType::F32, DType::Bf16, &src, &mut want).unwrap();
    let cast = Cast::between(DType::F32, DType::Bf16).unwrap();
    let g = CopyGeometry::converting(&holder, Place::Within(&holder), Place::Stream, 2, cast);
    assert_eq!(g.runs(), 1);
    assert!(g.run_bytes() > 2 * SUMMED_PIECE);
    for range in [0..g.len(), 6..g.len() - 4] {
        let mut got = vec![0u8; range.len()];
        let mut sum = 0;
        g.copy_summing(&src, &mut got, range.clone(), &mut sum);
        assert!(got == want[range.clone()], "{range:?}");
        assert_eq!(sum, crate::crc::append(0, &want[range]));
    }
}

#[test]
fn line_copies_match_plain_copies_at_every_alignment() {
    let src: Vec<u8> = (0..5000).map(|i| (i * 13 % 251) as u8).collect();
    for streaming in [false, true] {
        for len in [0, 1, 63, 64, 127, 128, 129, 191, 200, 1000, 4097] {
            for (s_at, d_at) in [(0, 0), (1, 0), (0, 1), (5, 17), (63, 62), (64, 33)] {
                // prefetching nothing, less than the copy, and more than it
                for ahead in [&src[..0], &src[4000..4100], &src[100..]] {
                    let mut got = vec![0u8; 4200];
                    let mut want = got.clone();
                    let (from, to) = (&src[s_at..s_at + len], &mut got[d_at..d_at + len]);
                    lines::copy(to, from, ahead, streaming);
                    lines::fence();
                    want[d_at..d_at + len].copy_from_slice(&src[s_at..s_at + len]);
                    assert_eq!(got, want, "len {len}, {s_at} -> {d_at}, {streaming}");
                }
            }
        }
    }
}

#[test]
fn large_regions_copy_the_same_bytes_through_the_streaming_path() {
    // 130 rows of 65557 bytes; the region is 128 rows of 65536 bytes: 8 MiB, enough
    // for the streaming stores, and its rows start at odd offsets.
    let (rows, cols) = (130u64, 65557u64);
    let src_box = Region::from_ranges(&[0..rows, 0..cols]);
    let dst_box = Region::from_ranges(&[1..rows + 3, 7..cols + 7]);
    let region = Region::from_ranges(&[1..129, 11..65547]);
    let width = region.extent[1] as usize;
    assert!(region.volume() as usize >= STREAMING_BYTES);
    let src: Vec<u8> = (0..(rows * cols) as usize)
        .map(|i| (i % 241) as u8)
        .collect();
    // the region's rows, one after another
    let stream: Vec<u8> = (1..129usize)
        .flat_map(|r| {
            let at = r * cols as usize + 11;
            src[at..at + width].iter().copied()
        })
        .collect();

    let pack = CopyGeometry::new(&region, Place::Within(&src_box), Place::Stream, 1);
    let mut packed = vec![0u8; pack.len()];
    pack.copy(&src, &mut packed, 0..pack.len());
    assert!(packed == stream, "packed stream differs");

    let dst_len = dst_box.volume() as usize;
    let unpack = CopyGeometry::new(&region, Place::Stream, Place::Within(&dst_box), 1);
    let mut unpacked = vec![0u8; dst_len];
    let chunk = 1_000_003;
    for start in (0..unpack.len()).step_by(chunk) {
        let end = (start + chunk).min(unpack.len());
        unpack.copy(&stream[start..end], &mut unpacked, start..end);
    }
    let direct = CopyGeometry::new(&region, Place::Within(&src_box), Place::Within(&dst_box), 1);
    let mut copied = vec![0u8; dst_len];
    direct.copy(&src, &mut copied, 0..direct.len());
    let mut want = vec![0u8; dst_len];
    let dst_cols = dst_box.extent[1] as usize;
    for (k, row) in stream.chunks(width).enumerate() {
        // region row 1 + k sits at dst row k, column 11 - 7
        let at = k * dst_cols + 4;
        want[at..at + width].copy_from_slice(row);
    }
    assert!(unpacked == want, "unpacked shard differs");
    assert!(copied == want, "directly copied shard differs");
}
