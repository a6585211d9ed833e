use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::exec::ExecOptions;
use reshard_core::dtype::DType;
use reshard_core::fill::Fill;
use reshard_core::layout::LayoutSpec;
use reshard_core::plan::QuantPlan;
use reshard_core::testing::{arb_layout_pair, reference_shards};
use reshard_transport::Lands;

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
        let stats =
            run_local_batch(&batch, &src, &mut dst, &mut BTreeMap::new(), &options(64)).unwrap();
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
    let e = run_local_batch(
        &batch,
        &src_bufs,
        &mut dst_bufs,
        &mut BTreeMap::new(),
        &options(64),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("buffer `ab`") && e.contains("rank 3"), "{e}");
}

/// With a direct tensor, exactly its value moves land in the receivers' shards, as every
/// rank computes them (its scales, the other tensors and the packed ones land aside); a
/// direct tensor that is not a tensor of the batch, is fused on the destination side or is
/// packed is refused, naming it.
#[test]
fn only_the_direct_tensors_values_land_in_the_shard() {
    let tensors = vec![
        tensor(
            "o",
            layout("mesh=2 place=S(1)", &[16, 8], 0),
            layout("mesh=2 place=S(0)", &[16, 8], 2),
        ),
        quantized(
            "w",
            &[16, 16],
            "mesh=2 place=S(0)",
            "mesh=2 place=S(1)",
            1,
            "block:8x8",
        ),
        tensor(
            "norm",
            layout("mesh=2 place=R", &[16], 0),
            layout("mesh=2 place=R", &[16], 2),
        ),
    ];
    let direct = |d| BatchOptions {
        direct: Some(d),
        ..BatchOptions::default()
    };
    let batch = Batch::new(tensors.clone(), Vec::new(), direct(1)).unwrap();
    let mut kinds = BTreeSet::new();
    for r in 0..batch.world() {
        let rb = batch.rank_batch(r).unwrap();
        for m in rb.moves.iter().chain(&rb.amax) {
            let values = m.tensor == 1 && m.kind != MoveKind::Scales && m.kind != MoveKind::Amax;
            let want = if values { Lands::Shard } else { Lands::Aside };
            assert_eq!(rb.lands(m), want, "rank {r}: {m:?}");
            kinds.insert((m.tensor, format!("{:?}", rb.lands(m))));
        }
    }
    // both kinds of the direct tensor's moves, and the other tensor's, were seen
    assert!(kinds.contains(&(1, "Shard".into())), "{kinds:?}");
    assert!(kinds.contains(&(1, "Aside".into())), "{kinds:?}");
    assert!(kinds.contains(&(0, "Aside".into())), "{kinds:?}");
    // without the option, nothing lands in a shard
    let plain = Batch::new(tensors.clone(), Vec::new(), BatchOptions::default()).unwrap();
    for r in 0..plain.world() {
        let rb = plain.rank_batch(r).unwrap();
        assert!(rb.moves.iter().all(|m| rb.lands(m) == Lands::Aside));
    }

    let err = |fusions, options| {
        Batch::new(tensors.clone(), fusions, options)
            .unwrap_err()
            .to_string()
    };
    let e = err(Vec::new(), direct(7));
    assert!(e.contains("tensor `7`") && e.contains("3 tensors"), "{e}");
    let e = err(Vec::new(), direct(2));
    assert!(e.contains("tensor `norm`") && e.contains("packed"), "{e}");
    let twins = vec![
        tensors[0].clone(),
        Tensor {
            name: "p".into(),
            ..tensors[0].clone()
        },
    ];
    let fused = vec![Fusion {
        name: "op".into(),
        side: Side::Dst,
        dim: 1,
        members: vec![0, 1],
    }];
    let e = Batch::new(twins, fused, direct(1)).unwrap_err().to_string();
    assert!(
        e.contains("tensor `p`") && e.contains("fused into `op`"),
        "{e}"
    );
}

/// A tensor of `shape` quantized into fp8 with `scheme`, from `src` (bf16) on ranks from
/// `first_src` to `dst` on ranks from `first_dst`.
fn quantized(
    name: &str,
    shape: &[u64],
    src: &str,
    dst: &str,
    first_dst: Rank,
    scheme: &str,
) -> Tensor {
    let src = layout(src, shape, 0);
    let dst = LayoutSpec::parse(dst)
        .unwrap()
        .resolve(shape, DType::Fp8E4M3, first_dst)
        .unwrap();
    let request = reshard_core::plan::QuantRequest {
        scheme: scheme.parse().unwrap(),
        scale_dtype: None,
    };
    let quant = QuantPlan::new(request, &src, &dst).unwrap();
    Tensor {
        quant: Some(quant),
        ..tensor(name, src, dst)
    }
}

/// A refit into fp8 in one batch: `qkv_proj` fused on the inference side from sources whose
/// shards cut the blocks (FSDP-like rows, split columns: partial amax exchanged), the MoE
/// `w13` fused per expert on both sides and partly colocated (local quantizing copies into
/// the fused buffer), and plain tensors beside them. Every fp8 value and scale of every
/// piece equals the whole tensor quantized naively, cut at the piece; the fused scale
/// buffers hold the members' scale shards side by side.
fn quantized_batch() -> Batch {
    let block = "block:8x8";
    let tensors = vec![
        quantized(
            "q",
            &[32, 16],
            "mesh=3 place=S(0)",
            "mesh=2 place=S(0)",
            3,
            block,
        ),
        quantized(
            "k",
            &[16, 16],
            "mesh=3 place=S(1)",
            "mesh=2 place=S(0)",
            3,
            block,
        ),
        quantized(
            "v",
            &[16, 16],
            "mesh=3 place=R",
            "mesh=2 place=S(0)",
            3,
            block,
        ),
        tensor(
            "norm",
            layout("mesh=3 place=R", &[16], 0),
            layout("mesh=2 place=R", &[16], 3),
        ),
        quantized(
            "gate",
            &[4, 16, 8],
            "mesh=2 place=S(0)",
            "mesh=2 place=S(1)",
            1,
            block,
        ),
        quantized(
            "up",
            &[4, 16, 8],
            "mesh=2 place=S(0)",
            "mesh=2 place=S(1)",
            1,
            block,
        ),
        tensor(
            "o",
            layout("mesh=3 place=S(1)", &[16, 24], 0),
            layout("mesh=2 place=S(0)", &[16, 24], 3),
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
        Fusion {
            name: "linear_fc1".into(),
            side: Side::Src,
            dim: 1,
            members: vec![4, 5],
        },
    ];
    Batch::new(tensors, fusions, BatchOptions::default()).unwrap()
}

/// Every rank's source buffers filled with `fill_of(tensor)`.
fn filled_sources(batch: &Batch, fill_of: impl Fn(usize) -> Fill) -> BTreeMap<Rank, Vec<Vec<u8>>> {
    (0..batch.world())
        .map(|r| {
            let bufs = batch.buffers(Side::Src, r).unwrap();
            let filled = bufs
                .iter()
                .map(|b| {
                    let mut bytes = vec![0u8; b.len];
                    for p in &b.pieces {
                        let l = &batch.tensors()[p.tensor].src;
                        fill_of(p.tensor).fill_region(l, &p.region, &mut bytes[p.bytes.clone()]);
                    }
                    bytes
                })
                .collect();
            (r, filled)
        })
        .collect()
}

fn zeroed(batch: &Batch, scales: bool) -> BTreeMap<Rank, Vec<Vec<u8>>> {
    (0..batch.world())
        .map(|r| {
            let bufs = match scales {
                true => batch.scale_buffers(r).unwrap(),
                false => batch.buffers(Side::Dst, r).unwrap(),
            };
            (r, bufs.iter().map(|b| vec![0u8; b.len]).collect())
        })
        .collect()
}

#[test]
fn quantized_tensors_move_in_the_batch_into_fused_buffers() {
    use reshard_core::convert::reference::quantize_tensor;
    let batch = quantized_batch();
    let fill_of = |i: usize| match batch.tensors()[i].quant {
        Some(_) => Fill::Normal { seed: i as u64 },
        None => Fill::Hash { seed: i as u64 },
    };
    // the tensors quantized whole, naively
    let want: Vec<_> = batch
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let q = t.quant.as_ref()?;
            let whole = layout("mesh=1 place=R", t.src.shape(), 0);
            let values = fill_of(i).shard(&whole, 0).unwrap().unwrap();
            Some(quantize_tensor(q.quant, &q.grid, DType::Bf16, &values).unwrap())
        })
        .collect();
    // ranks 0-1 and 1-2 share q's row blocks, and k's column blocks
    assert!(batch.rank_batch(1).unwrap().amax.len() >= 4);
    for (chunk_bytes, checksum) in [(5, false), (4 << 20, true)] {
        let src = filled_sources(&batch, fill_of);
        let mut dst = zeroed(&batch, false);
        let mut scales = zeroed(&batch, true);
        let options = ExecOptions {
            checksum,
            ..options(chunk_bytes)
        };
        run_local_batch(&batch, &src, &mut dst, &mut scales, &options).unwrap();
        for r in 0..batch.world() {
            let rb = batch.rank_batch(r).unwrap();
            for (b, bytes) in rb.dst.iter().zip(&dst[&r]) {
                for p in &b.pieces {
                    let got = &bytes[p.bytes.clone()];
                    match &want[p.tensor] {
                        Some(w) => assert!(
                            w.values_of(&p.region) == got,
                            "rank {r} {} {:?}",
                            b.name,
                            p.region
                        ),
                        None => {
                            let l = &batch.tensors()[p.tensor].dst;
                            fill_of(p.tensor)
                                .verify_region(l, &p.region, got, (r, 0))
                                .unwrap();
                        }
                    }
                }
            }
            for (b, bytes) in rb.scales.iter().zip(&scales[&r]) {
                for p in &b.pieces {
                    let w = want[p.tensor].as_ref().unwrap();
                    let got = &bytes[p.bytes.clone()];
                    assert!(
                        w.scales_of(&p.region) == got,
                        "rank {r} scales of {}",
                        b.name
                    );
                }
            }
        }
    }
    // rank 3 holds rows 0..16 of q, 0..8 of k and v: 2 + 1 + 1 block rows of 2 blocks each,
    // side by side as the engine's qkv_proj.weight_scale_inv
    let qkv = &batch.scale_buffers(3).unwrap()[0];
    assert_eq!(qkv.name, "qkv_proj");
    let starts: Vec<(usize, usize)> = qkv
        .pieces
        .iter()
        .map(|p| (p.tensor, p.bytes.start))
        .collect();
    assert_eq!(starts, [(0, 0), (1, 16), (2, 24)]);
    assert_eq!(qkv.len, 32);
    // w13's scales per expert: [4, 2 x 1, 1] on rank 2, gate's block then up's, expert by expert
    let w13 = &batch.scale_buffers(2).unwrap()[0];
    assert_eq!(
        (w13.name.as_str(), w13.len, w13.pieces.len()),
        ("w13", 4 * 2 * 4, 8)
    );
    assert_eq!(w13.pieces[4].region.offset, [0, 1, 0]);
    assert_eq!(w13.pieces[4].bytes, 4..8);
}

/// A NaN in a quantized tensor's source fails the run, naming the tensor, its block and the
/// element, on every rank (its peers see the broken links) rather than hanging.
#[test]
fn a_non_finite_source_value_names_the_tensor_and_block() {
    let batch = quantized_batch();
    let mut src = filled_sources(&batch, |i| Fill::Normal { seed: i as u64 });
    // rank 1's first source buffer is its shard of q, rows 11..22: a NaN at row 12, column 3
    let at = (16 + 3) * 2;
    src.get_mut(&1).unwrap()[0][at..at + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    let (mut dst, mut scales) = (zeroed(&batch, false), zeroed(&batch, true));
    let err = run_local_batch(&batch, &src, &mut dst, &mut scales, &options(64))
        .unwrap_err()
        .to_string();
    assert!(err.contains("q: block [1, 0]"), "{err}");
    assert!(err.contains("[12, 3]"), "{err}");
}

/// A fused buffer whose leading member holds part of a block along the fused dim has no
/// engine layout for its scales: refused, naming the fusion, the rank and the member.
#[test]
fn fused_scales_that_would_straddle_members_are_refused() {
    let tensors = vec![
        quantized(
            "q",
            &[12, 16],
            "mesh=1 place=R",
            "mesh=1 place=R",
            1,
            "block:8x8",
        ),
        quantized(
            "k",
            &[8, 16],
            "mesh=1 place=R",
            "mesh=1 place=R",
            1,
            "block:8x8",
        ),
    ];
    let fusion = Fusion {
        name: "qkv_proj".into(),
        side: Side::Dst,
        dim: 0,
        members: vec![0, 1],
    };
    let batch = Batch::new(tensors, vec![fusion], BatchOptions::default()).unwrap();
    let err = batch.rank_batch(1).unwrap_err().to_string();
    assert!(
        err.contains("fusion `qkv_proj`: on rank 1, `q` holds 12 elements along dim 0"),
        "{err}"
    );
}

/// The batch of an already-quantized move ([`Batch::quantized`]).
mod quantized_move {
    use proptest::prelude::*;

    use super::super::Batch;
    use reshard_core::layout::Rank;
    use reshard_core::plan::{PlanOptions, QuantizedMove};
    use reshard_core::region::Region;

    use reshard_core::testing::{
        arb_block_spec as spec, fp8_layout as layout, quant_request as request,
    };

    proptest! {
        /// The batch of a coupled move carries exactly the two plans' transfers, each as one
        /// move between the same ranks (so the same bytes, remote and local), and every rank
        /// sends each peer its value moves and then its scale moves, with no other peer's in
        /// between: one stream per pair.
        #[test]
        fn the_batch_moves_the_two_plans_one_stream_per_pair(
            rows in 1u64..=6, cols in 1u64..=6, br in 0u32..3, bc in 0u32..3,
            src in spec(), dst in spec(), overlap in any::<bool>(),
        ) {
            let (br, bc) = (1u64 << br, 2u64 << bc);
            let shape = [rows * br * 2, cols * bc * 2];
            let src = layout(&src, &shape, 0);
            let first = match overlap {
                true => 0,
                false => src.mesh().ranks().iter().max().map_or(0, |&r| r + 1),
            };
            let dst = layout(&dst, &shape, first);
            let Ok(mv) = QuantizedMove::new(
                src, dst, PlanOptions::default(), request(&format!("block:{br}x{bc}")),
            ) else {
                return Ok(());
            };
            let batch = Batch::quantized(&mv).unwrap();
            type Key = (usize, Rank, Rank, Region);
            let mut planned: Vec<Key> = [&mv.values, &mv.scales]
                .iter()
                .enumerate()
                .flat_map(|(i, p)| {
                    p.transfers().iter().map(move |t| (i, t.src, t.dst, t.region.clone()))
                })
                .filter(|k| k.3.volume() > 0)
                .collect();
            let mut moved: Vec<Key> = Vec::new();
            for r in 0..batch.world() {
                let rb = batch.rank_batch(r).unwrap();
                prop_assert!(rb.packs.is_empty());
                // each move once: by its receiver
                moved.extend(
                    rb.moves
                        .iter()
                        .filter(|m| m.to == r && m.region.volume() > 0)
                        .map(|m| (m.tensor, m.from, m.to, m.region.clone())),
                );
                let sends: Vec<(Rank, usize)> = rb
                    .moves
                    .iter()
                    .filter(|m| m.from == r && m.to != r)
                    .map(|m| (m.to, m.tensor))
                    .collect();
                for (i, w) in sends.windows(2).enumerate() {
                    if w[0].0 != w[1].0 {
                        prop_assert!(
                            sends[i + 1..].iter().all(|s| s.0 != w[0].0),
                            "rank {r} sends to {} again after {}: {sends:?}", w[0].0, w[1].0
                        );
                    } else {
                        prop_assert!(w[0].1 <= w[1].1, "rank {r}: scales before values: {sends:?}");
                    }
                }
            }
            planned.sort();
            moved.sort();
            prop_assert_eq!(moved, planned);
        }
    }
}

/// Every rank's source buffers at `version` of each tensor's evolution.
fn evolved_sources(
    batch: &Batch,
    evolutions: &[reshard_core::evolve::Evolution],
    version: u64,
) -> BTreeMap<Rank, Vec<Vec<u8>>> {
    (0..batch.world())
        .map(|r| {
            let bufs = batch.buffers(Side::Src, r).unwrap();
            let filled = bufs
                .iter()
                .map(|b| {
                    let mut bytes = vec![0u8; b.len];
                    for p in &b.pieces {
                        let l = &batch.tensors()[p.tensor].src;
                        evolutions[p.tensor].fill_region(
                            l,
                            &p.region,
                            &mut bytes[p.bytes.clone()],
                            version,
                        );
                    }
                    bytes
                })
                .collect();
            (r, filled)
        })
        .collect()
}

/// A batch refit as deltas, version after version, leaves exactly what dense refits of the
/// same versions leave: values and scales, packed blobs, fused buffers, quantized tensors
/// (their values and scales diffed after quantizing).
fn delta_equals_dense(batch: &Batch, evolutions: &[reshard_core::evolve::Evolution], chunk: usize) {
    use crate::exec::delta::{DeltaOptions, DeltaRefit, DeltaSession};
    let session = DeltaSession::new();
    let (mut dense, mut dense_scales) = (zeroed(batch, false), zeroed(batch, true));
    let (mut delta, mut delta_scales) = (zeroed(batch, false), zeroed(batch, true));
    for version in 1..=4 {
        let src = evolved_sources(batch, evolutions, version);
        run_local_batch(batch, &src, &mut dense, &mut dense_scales, &options(chunk)).unwrap();
        let refit = ExecOptions {
            delta: Some(DeltaRefit {
                session: session.clone(),
                version,
                options: DeltaOptions {
                    anchor: None,
                    block_elems: 16,
                },
            }),
            ..options(chunk)
        };
        run_local_batch(batch, &src, &mut delta, &mut delta_scales, &refit).unwrap();
        assert_eq!(delta, dense, "values of version {version}");
        assert_eq!(delta_scales, dense_scales, "scales of version {version}");
        let reports = session.take_reports();
        let deltas: u64 = reports.iter().map(|r| r.sent.delta).sum();
        if version == 1 {
            assert_eq!(deltas, 0, "the first version has no base to diff against");
        }
    }
}

#[test]
fn quantized_batches_refit_as_deltas_exactly() {
    use reshard_core::evolve::{Evolution, Update};
    let batch = quantized_batch();
    let evolutions: Vec<Evolution> = batch
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (fill, update) = match t.quant {
                Some(_) => (
                    Fill::Normal { seed: i as u64 },
                    Update::Training { lr: 1e-3 },
                ),
                None => (Fill::Hash { seed: i as u64 }, Update::Density(0.05)),
            };
            Evolution::new(fill, update, 7 + i as u64, t.src.dtype()).unwrap()
        })
        .collect();
    for chunk in [5, 4 << 20] {
        delta_equals_dense(&batch, &evolutions, chunk);
    }
    // and later versions move as deltas: the values and the scales that changed
    let session = crate::exec::delta::DeltaSession::new();
    let (mut dst, mut scales) = (zeroed(&batch, false), zeroed(&batch, true));
    for version in 1..=2 {
        let src = evolved_sources(&batch, &evolutions, version);
        let refit = ExecOptions {
            delta: Some(crate::exec::delta::DeltaRefit {
                session: session.clone(),
                version,
                options: Default::default(),
            }),
            ..options(4 << 20)
        };
        run_local_batch(&batch, &src, &mut dst, &mut scales, &refit).unwrap();
    }
    let deltas: u64 = session.take_reports().iter().map(|r| r.sent.delta).sum();
    assert!(deltas > 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]

    #[test]
    fn batches_refit_as_deltas_exactly(
        pairs in prop::collection::vec(arb_layout_pair(), 1..4),
        seed in any::<u64>(),
        pack_below in prop_oneof![Just(0u64), Just(u64::MAX), 1u64..256],
        density in prop::sample::select(vec![0.0, 0.01, 0.5, 1.0]),
    ) {
        use reshard_core::evolve::{Evolution, Update};
        let tensors: Vec<Tensor> = pairs
            .into_iter()
            .enumerate()
            .map(|(i, (s, d))| tensor(&format!("t{i}"), s, d))
            .collect();
        let evolutions: Vec<Evolution> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| Evolution::new(Fill::Hash { seed: seed ^ i as u64 }, Update::Density(density), seed, t.src.dtype()).unwrap())
            .collect();
        let batch = Batch::new(tensors, Vec::new(), BatchOptions { pack_below, ..BatchOptions::default() }).unwrap();
        delta_equals_dense(&batch, &evolutions, 4 << 20);
    }
}
