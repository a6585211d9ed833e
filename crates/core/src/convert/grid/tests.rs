use super::amax::max_abs;
use super::*;
use crate::convert::cast::read_f32;
use crate::dtype::DType;
use crate::layout::LayoutSpec;
use crate::layout::Rank;

fn layout(spec: &str, shape: &[u64], first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, DType::Bf16, first)
        .unwrap()
}

fn block(r: u64, c: u64) -> QuantScheme {
    QuantScheme::Block {
        rows: r,
        cols: c,
        ue8m0: false,
    }
}

#[test]
fn blocks_a_region_touches_and_holds() {
    let g = BlockGrid::new(block(128, 128), &[2, 300, 256]).unwrap();
    assert_eq!(g.grid_shape(), [2, 3, 2]);
    let r = Region::from_ranges(&[1..2, 100..300, 0..130]);
    assert_eq!(
        g.blocks_touching(&r),
        Region::from_ranges(&[1..2, 0..3, 0..2])
    );
    // rows 128..256 whole, and 256..300 is the short last block, whole too
    assert_eq!(
        g.blocks_inside(&r),
        Region::from_ranges(&[1..2, 1..3, 0..1])
    );
    assert_eq!(
        g.block_region(&[1, 2, 1]),
        Region::from_ranges(&[1..2, 256..300, 128..256])
    );
    let empty = Region::from_ranges(&[0..0, 0..10, 0..10]);
    assert!(g.blocks_touching(&empty).is_empty());
    assert_eq!(
        BlockGrid::new(QuantScheme::Mx, &[4, 70])
            .unwrap()
            .grid_shape(),
        [4, 3]
    );
    assert_eq!(
        BlockGrid::new(QuantScheme::Tensor, &[4, 70])
            .unwrap()
            .grid_shape(),
        [1, 1]
    );
}

#[test]
fn destination_boundaries_must_fall_on_blocks() {
    let shape = [512, 384];
    let g = BlockGrid::new(block(128, 128), &shape).unwrap();
    assert!(
        g.check_aligned(&layout("mesh=4 place=S(0)", &shape, 0), Side::Dst)
            .is_ok()
    );
    assert!(
        g.check_aligned(&layout("mesh=3 place=S(1)", &shape, 0), Side::Dst)
            .is_ok()
    );
    let err = g
        .check_aligned(&layout("mesh=2x2 place=S(1),S(1)", &shape, 0), Side::Dst)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "dst: a shard boundary at 96 along dim 1 cuts a quantization block of 128x128 (boundaries must be multiples of the block size)"
    );
    // an uneven last shard ends at the tensor's end, which is fine
    let g = BlockGrid::new(block(128, 128), &[300, 128]).unwrap();
    assert!(
        g.check_aligned(&layout("mesh=3 place=S(0)", &[300, 128], 0), Side::Dst)
            .is_err()
    );
    assert!(
        g.check_aligned(&layout("mesh=2 place=S(0)", &[300, 128], 0), Side::Dst)
            .is_err()
    );
    assert!(
        g.check_aligned(&layout("mesh=2 place=S(0)", &[256 + 44, 128], 0), Side::Src)
            .is_err()
    );
    let g = BlockGrid::new(block(128, 128), &[255, 128]).unwrap();
    assert!(
        g.check_aligned(&layout("mesh=2 place=S(0)", &[255, 128], 0), Side::Dst)
            .is_ok()
    );
    // channel and tensor scales may be cut (replicated) where their block spans the dim
    let g = BlockGrid::new(QuantScheme::Channel, &[8, 10]).unwrap();
    assert!(
        g.check_aligned(&layout("mesh=3 place=S(1)", &[8, 10], 0), Side::Dst)
            .is_ok()
    );
    let g = BlockGrid::new(QuantScheme::Tensor, &[8, 10]).unwrap();
    assert!(
        g.check_aligned(&layout("mesh=3x3 place=S(0),S(1)", &[8, 10], 0), Side::Dst)
            .is_ok()
    );
    let g = BlockGrid::new(QuantScheme::Mx, &[8, 64]).unwrap();
    assert!(
        g.check_aligned(&layout("mesh=4 place=S(1)", &[8, 64], 0), Side::Dst)
            .is_err()
    );
}

#[test]
fn channel_scales_are_replicated_on_column_shards() {
    let g = BlockGrid::new(QuantScheme::Channel, &[4, 10]).unwrap();
    let shard = Region::from_ranges(&[0..4, 4..8]);
    assert_eq!(g.scale_region(&shard), Region::from_ranges(&[0..4, 0..1]));
    // two transfers tile the shard: the first carries the scales, the second none
    let a = Region::from_ranges(&[0..4, 4..6]);
    let b = Region::from_ranges(&[0..4, 6..8]);
    assert_eq!(
        g.scales_carried(&shard, &a),
        Region::from_ranges(&[0..4, 0..1])
    );
    assert!(g.scales_carried(&shard, &b).is_empty());
}

#[test]
fn partial_amax_is_exchanged_only_for_cut_blocks() {
    let shape = [256, 256];
    let g = BlockGrid::new(block(128, 128), &shape).unwrap();
    // two shards of 128 rows: every block lies in one shard
    let even = layout("mesh=2 place=S(0)", &shape, 0);
    assert!(amax_exchange(&even, &g, 0).is_empty());
    assert!(amax_exchange(&even, &g, 1).is_empty());
    // three shards of 86, 86, 84 rows: block row 0 is cut between ranks 0 and 1, block
    // row 1 between ranks 1 and 2
    let three = layout("mesh=3 place=S(0)", &shape, 0);
    assert_eq!(
        amax_exchange(&three, &g, 0),
        [(1, Region::from_ranges(&[0..1, 0..2]))]
    );
    assert_eq!(
        amax_exchange(&three, &g, 1),
        [
            (0, Region::from_ranges(&[0..1, 0..2])),
            (2, Region::from_ranges(&[1..2, 0..2]))
        ]
    );
    // with two replicas (mesh 2x3, replicated rows), each replica group exchanges alone
    let replicas = layout("mesh=2x3 ranks=10..16 place=R,S(0)", &shape, 0);
    assert_eq!(
        amax_exchange(&replicas, &g, 13),
        [(14, Region::from_ranges(&[0..1, 0..2]))]
    );
    // tensor: every rank with data meets every other of its replica group
    let g = BlockGrid::new(QuantScheme::Tensor, &shape).unwrap();
    let peers: Vec<Rank> = amax_exchange(&layout("mesh=2x2 place=S(0),S(1)", &shape, 0), &g, 3)
        .into_iter()
        .map(|(p, b)| {
            assert_eq!(b, Region::from_ranges(&[0..1, 0..1]));
            p
        })
        .collect();
    assert_eq!(peers, [0, 1, 2]);
    assert!(amax_exchange(&three, &g, 99).is_empty());
}

#[test]
fn amax_payloads_merge_and_are_checked() {
    let g = BlockGrid::new(block(2, 2), &[2, 4]).unwrap();
    let shard = Region::from_ranges(&[0..2, 1..4]);
    let vals: [f32; 6] = [1.0, -5.0, 2.0, 0.5, 0.25, -3.0];
    let buf: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut amax = AmaxGrid::local(&g, &shard, &buf, DType::F32).unwrap();
    assert_eq!(amax.amax, [1.0, 5.0]);
    let sub = Region::from_ranges(&[0..1, 0..1]);
    assert_eq!(amax.payload(&sub), 1f32.to_le_bytes());
    amax.merge(&sub, &7f32.to_le_bytes()).unwrap();
    assert_eq!(amax.amax, [7.0, 5.0]);
    let err = amax.merge(&sub, &[0; 3]).unwrap_err();
    assert!(matches!(err, ConvertError::AmaxPayload { got: 3, .. }));
    // a NaN names its block and element
    let mut bad = buf.clone();
    bad[16..20].copy_from_slice(&f32::NAN.to_le_bytes());
    let err = AmaxGrid::local(&g, &shard, &bad, DType::F32).unwrap_err();
    assert_eq!(
        err.to_string(),
        "block [0, 1] holds a non-finite value (NaN) at element [1, 2], which fp8 cannot carry"
    );
    // an f64 beyond the f32 range is an infinity to the f32 arithmetic of the schemes
    let big: Vec<u8> = [1.0f64, 2.0, 1e300, 4.0, 5.0, 6.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let err = AmaxGrid::local(&g, &shard, &big, DType::F64).unwrap_err();
    assert!(
        matches!(&err, ConvertError::NonFinite { block, element, value }
            if block == &[0, 1] && element == &[0, 3] && *value == f32::INFINITY),
        "{err}"
    );
    // the magnitude scan of every float dtype agrees with reading each element
    let xs = [0.0f32, -0.0, 1e-40, -3.5, 448.0, -1e-3, 65000.0, 2.5e-8];
    for dtype in [DType::F32, DType::Bf16, DType::F16, DType::F64] {
        let mut buf = vec![0u8; xs.len() * dtype.size()];
        for (i, &x) in xs.iter().enumerate() {
            crate::convert::cast::write_f32(dtype, x, &mut buf[i * dtype.size()..]);
        }
        let want = buf
            .chunks_exact(dtype.size())
            .map(|s| read_f32(dtype, s).abs())
            .fold(0f32, f32::max);
        assert_eq!(max_abs(dtype, &buf), (want, true), "{dtype}");
    }
}
