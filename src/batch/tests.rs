use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::dtype::DType;
use crate::exec::ExecOptions;
use crate::fill::Fill;
use crate::layout::LayoutSpec;
use crate::testing::{arb_layout_pair, reference_shards};

fn layout(spec: &str, shape: &[u64], first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, DType::Bf16, first)
        .unwrap()
}

fn options(chunk_bytes: usize) -> ExecOptions {
    ExecOptions {
        chunk_bytes,
        staging_bytes: 2 * chunk_bytes,
        timeout: Duration::from_secs(30),
        ..ExecOptions::default()
    }
}

fn tensor(name: &str, src: Layout, dst: Layout) -> Tensor {
    Tensor::new(name, src, dst)
}

/// Every rank's buffers on `side`, filled from the reference shards of each tensor (`fill`
/// seeded per tensor), or zeroed.
fn buffers(batch: &Batch, side: Side, fills: Option<&[Fill]>) -> BTreeMap<Rank, Vec<Vec<u8>>> {
    (0..batch.world())
        .map(|r| {
            let bufs = batch.buffers(side, r).unwrap();
            let filled = bufs
                .iter()
                .map(|b| match fills {
                    None => vec![0u8; b.len],
                    Some(fills) => expected_buffer(batch, side, r, b, fills),
                })
                .collect();
            (r, filled)
        })
        .collect()
}

/// What a buffer holds by definition: one tensor's reference shard, or the members' reference
/// shards concatenated along the fused dim (outer index by outer index, member by member).
fn expected_buffer(batch: &Batch, side: Side, rank: Rank, b: &Buffer, fills: &[Fill]) -> Vec<u8> {
    let shard = |i: usize| {
        let t = &batch.tensors()[i];
        let l = if side == Side::Src { &t.src } else { &t.dst };
        (
            reference_shards(l, fills[i]).remove(&rank).unwrap(),
            l.local_region(rank).unwrap().extent,
            l.dtype().size(),
        )
    };
    let fusion = batch
        .fusions()
        .iter()
        .find(|f| f.side == side && f.name == b.name);
    let Some(f) = fusion else {
        return shard(b.pieces[0].tensor).0;
    };
    let members: Vec<_> = f.members.iter().map(|&m| shard(m)).collect();
    let (_, extent, elem) = &members[0];
    let outer: u64 = extent[..f.dim].iter().product();
    let mut out = Vec::new();
    for o in 0..outer as usize {
        for (bytes, extent, _) in &members {
            let block = extent[f.dim..].iter().product::<u64>() as usize * elem;
            out.extend_from_slice(&bytes[o * block..(o + 1) * block]);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Several tensors at once, packed or not, land exactly where the reference puts them.
    #[test]
    fn batches_match_the_reference(
        pairs in prop::collection::vec(arb_layout_pair(), 1..4),
        seed in any::<u64>(),
        pack_below in prop_oneof![Just(0u64), Just(u64::MAX), 1u64..256],
        chunk_bytes in prop_oneof![Just(5usize), Just(4 << 20)],
        checksum in any::<bool>(),
    ) {
        let tensors: Vec<Tensor> = pairs
            .into_iter()
            .enumerate()
            .map(|(i, (s, d))| tensor(&format!("t{i}"), s, d))
            .collect();
        let fills: Vec<Fill> = (0..tensors.len())
            .map(|i| Fill::Hash { seed: seed.wrapping_add(i as u64) })
            .collect();
        let batch = Batch::new(
            tensors,
            Vec::new(),
            BatchOptions { pack_below, ..BatchOptions::default() },
        ).unwrap();
        let src = buffers(&batch, Side::Src, Some(&fills));
        let mut dst = buffers(&batch, Side::Dst, None);
        let options = ExecOptions { checksum, ..options(chunk_bytes) };
        run_local_batch(&batch, &src, &mut dst, &mut BTreeMap::new(), &options).unwrap();
        prop_assert_eq!(dst, buffers(&batch, Side::Dst, Some(&fills)));
    }
}

/// vLLM's fused buffers: `qkv_proj` = [q; k; v] along dim 0, and the MoE `w13` = [gate; up]
/// per expert along dim 1, written in place, also from fused sources.
#[test]
fn fused_buffers_hold_the_members_side_by_side() {
    let (h, q, kv) = (12, 16, 8);
    let tp2 = "mesh=2 place=S(0)";
    let tensors = vec![
        tensor(
            "q",
            layout("mesh=4 place=S(0)", &[q, h], 0),
            layout(tp2, &[q, h], 4),
        ),
        tensor(
            "k",
            layout("mesh=4 place=S(1)", &[kv, h], 0),
            layout(tp2, &[kv, h], 4),
        ),
        tensor(
            "v",
            layout("mesh=2x2 place=R,S(0)", &[kv, h], 0),
            layout(tp2, &[kv, h], 4),
        ),
        tensor(
            "norm",
            layout("mesh=4 place=R", &[h], 0),
            layout("mesh=2 place=R", &[h], 4),
        ),
        // experts [E, I, H]: EP4 on training, TP2 on the intermediate dim for inference
        tensor(
            "gate",
            layout("mesh=4 place=S(0)", &[6, 10, 4], 0),
            layout("mesh=2 place=S(1)", &[6, 10, 4], 4),
        ),
        tensor(
            "up",
            layout("mesh=4 place=S(0)", &[6, 10, 4], 0),
            layout("mesh=2 place=S(1)", &[6, 10, 4], 4),
        ),
    ];
    let fusions = vec![
        Fusion {
            name: "qkv_proj".into(),
            side: Side::Dst,
            dim: 0,
            members: vec![0, 1, 2],
        },
        Fusion {
            name: "w13".into(),
            side: Side::Dst,
            dim: 1,
            members: vec![4, 5],
        },
        // Megatron-style fused source: [gate; up] per expert
        Fusion {
            name: "linear_fc1".into(),
            side: Side::Src,
            dim: 1,
            members: vec![4, 5],
        },
    ];
    for pack_below in [0, 1 << 20] {
        let batch = Batch::new(
            tensors.clone(),
            fusions.clone(),
            BatchOptions {
                pack_below,
                ..BatchOptions::default()
            },
        )
        .unwrap();
        assert_eq!(batch.is_packed(3), pack_below > 0);
        let names: Vec<String> = batch
            .buffers(Side::Dst, 4)
            .unwrap()
            .into_iter()
            .map(|b| b.name)
            .collect();
        assert_eq!(names, ["qkv_proj", "norm", "w13"]);
        // w13 on a TP rank: [6, 2 x 5, 4], one piece per member and expert
        let w13 = &batch.buffers(Side::Dst, 5).unwrap()[2];
        assert_eq!(w13.len, 6 * 10 * 4 * 2);
        assert_eq!(w13.pieces.len(), 12);
        let fills: Vec<Fill> = (0..6).map(|i| Fill::Hash { seed: i }).collect();
        let src = buffers(&batch, Side::Src, Some(&fills));
        let mut dst = buffers(&batch, Side::Dst, None);
        let stats = run_local_batch(&batch, &src, &mut dst, &mut BTreeMap::new(), &options(64)).unwrap();
        assert_eq!(dst, buffers(&batch, Side::Dst, Some(&fills)));
        if pack_below == 0 {
            // every destination byte is written once
            let dst_bytes: u64 = dst.values().flatten().map(|b| b.len() as u64).sum();
            assert_eq!(stats.bytes_remote() + stats.bytes_local(), dst_bytes);
        }
    }
}

#[test]
fn bad_fusions_are_named() {
    let tp2 = |shape: &[u64]| layout("mesh=2 place=S(0)", shape, 2);
    let src = |shape: &[u64]| layout("mesh=2 place=S(1)", shape, 0);
    let tensors = vec![
        tensor("a", src(&[8, 4]), tp2(&[8, 4])),
        tensor("b", src(&[8, 6]), tp2(&[8, 6])),
    ];
    let fuse = |dim, members: Vec<usize>| Fusion {
        name: "ab".into(),
        side: Side::Dst,
        dim,
        members,
    };
    let err = |fusions| {
        Batch::new(tensors.clone(), fusions, BatchOptions::default())
            .and_then(|b| b.buffers(Side::Dst, 2))
            .unwrap_err()
            .to_string()
    };
    let e = err(vec![fuse(0, vec![0, 1])]);
    assert!(
        e.contains("fusion `ab`") && e.contains("along dim 0 only"),
        "{e}"
    );
    let e = err(vec![fuse(0, vec![0, 7])]);
    assert!(e.contains("member 7"), "{e}");
    let e = err(vec![fuse(2, vec![0, 1])]);
    assert!(e.contains("dim 2"), "{e}");
    let e = err(vec![fuse(1, vec![0, 0])]);
    assert!(e.contains("already fused"), "{e}");
    // along dim 1 they fit
    let batch = Batch::new(
        tensors.clone(),
        vec![fuse(1, vec![0, 1])],
        BatchOptions::default(),
    )
    .unwrap();
    assert_eq!(batch.buffers(Side::Dst, 2).unwrap()[0].len, 4 * 10 * 2);
    // and a buffer of the wrong size is refused before anything moves
    let src_bufs = buffers(&batch, Side::Src, Some(&[Fill::Index, Fill::Index]));
    let mut dst_bufs = buffers(&batch, Side::Dst, None);
    dst_bufs.get_mut(&3).unwrap()[0].pop();
    let e = run_local_batch(&batch, &src_bufs, &mut dst_bufs, &mut BTreeMap::new(), &options(64))
        .unwrap_err()
        .to_string();
    assert!(e.contains("buffer `ab`") && e.contains("rank 3"), "{e}");
}
