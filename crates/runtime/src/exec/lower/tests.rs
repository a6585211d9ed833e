//! Lowering: every kind of job has the phases it should, every rank of a job cuts its
//! transfers alike, and every kind runs through the one driver to the reference's bytes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::batch::lower::{batch_chunk, lower_batch};
use crate::batch::{Batch, BatchOptions, Tensor};
use crate::exec::driver::{RankRun, run_threads};
use crate::exec::program::PhaseKind::{Amax, Keep, Round, Values};
use crate::exec::{run_local, zeroed_shards};
use reshard_core::convert::reference::quantize_tensor;
use reshard_core::fill::Fill;
use reshard_core::layout::LayoutSpec;
use reshard_core::plan::{Plan, PlanOptions, QuantRequest, Topology};
use reshard_core::testing::reference_shards;
use reshard_core::topology::HostMap;

fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, dtype, first)
        .unwrap()
}

fn options(chunk_bytes: usize) -> ExecOptions {
    ExecOptions {
        chunk_bytes,
        staging_bytes: 64 * chunk_bytes,
        timeout: Duration::from_secs(30),
        ..ExecOptions::default()
    }
}

/// Every rank's boxes of a plan, for its slots.
struct Boxes {
    src: BTreeMap<Rank, Region>,
    dst: BTreeMap<Rank, Region>,
    parts: BTreeMap<Rank, RankPlan>,
    quant: BTreeMap<Rank, QuantRankPlan>,
}

impl Boxes {
    fn of(plan: &Plan) -> Boxes {
        let boxes = |l: &Layout| {
            l.mesh()
                .ranks()
                .iter()
                .map(|&r| (r, l.local_region(r).unwrap()))
                .collect()
        };
        let parts = plan.rank_plans();
        let quant = match plan.quant() {
            Some(q) => parts
                .iter()
                .map(|(&r, p)| (r, q.for_rank(plan.src(), plan.dst(), p)))
                .collect(),
            None => BTreeMap::new(),
        };
        Boxes {
            src: boxes(plan.src()),
            dst: boxes(plan.dst()),
            parts,
            quant,
        }
    }

    /// `rank`'s program, its shards at `Src(0)` and `Dst(0)`, its scales at `Dst(1)`.
    fn program<'p>(&'p self, plan: &'p Plan, rank: Rank, options: &ExecOptions) -> Program<'p> {
        let slot = |b: Option<&'p Region>, buf, elem: usize| {
            b.map(|region| Slot {
                region: Cow::Borrowed(region),
                buf,
                bytes: 0..region.volume() as usize * elem,
            })
        };
        let job = PlanJob {
            plan: &self.parts[&rank],
            src_layout: plan.src(),
            dst_dtype: plan.dst().dtype(),
            src: slot(self.src.get(&rank), Buf::Src(0), plan.src().dtype().size()),
            dst: slot(self.dst.get(&rank), Buf::Dst(0), plan.dst().dtype().size()),
            quant: plan.quant().map(|q| QuantParts {
                tensor: "tensor",
                plan: q,
                rank: &self.quant[&rank],
                scales: self.dst.get(&rank).map(|_| Buf::Dst(1)),
            }),
        };
        lower_plan(&job, options).unwrap()
    }
}

/// TP4 on host 0 -> DP2 x TP2 on host 1: ranks 4 and 5 relay.
fn relayed(shape: &[u64]) -> Plan {
    let src = layout("mesh=4 place=S(1)", shape, DType::U8, 0);
    let dst = layout("mesh=2x2 place=R,S(1)", shape, DType::U8, 4);
    let topology = Topology::new(HostMap::parse("2x4").unwrap(), true);
    Plan::with_topology(src, dst, PlanOptions::default(), Some(topology)).unwrap()
}

fn quantizing(shape: &[u64]) -> Plan {
    let request = QuantRequest {
        scheme: "block:4x8".parse().unwrap(),
        scale_dtype: None,
    };
    // source rows 0..6 and 6..12 cut the second block row: an amax exchange
    Plan::with_quant(
        layout("mesh=2 place=S(0)", shape, DType::F32, 0),
        layout("mesh=2 place=S(1)", shape, DType::Fp8E4M3, 2),
        PlanOptions::default(),
        Some(request),
    )
    .unwrap()
}

#[test]
fn a_plain_or_cast_plan_is_one_phase_of_values_cut_alike_on_both_ends() {
    let shape = [8, 8];
    for (dst_dtype, chunk) in [(DType::F32, 13), (DType::Bf16, 8)] {
        let plan = Plan::new(
            layout("mesh=2 place=S(0)", &shape, DType::F32, 0),
            layout("mesh=4 place=S(1)", &shape, dst_dtype, 2),
        )
        .unwrap();
        let boxes = Boxes::of(&plan);
        for r in plan.ranks() {
            let p = boxes.program(&plan, r, &options(13));
            assert_eq!(p.kinds(), [Values], "rank {r}");
            // senders and receivers alike: 13 bytes, or whole elements when it casts
            assert_eq!(p.chunk_bytes, chunk, "rank {r}");
            let values = &p.phases[0];
            assert!(
                values
                    .steps
                    .sends
                    .iter()
                    .all(|s| s.convert.is_some() == (chunk == 8))
            );
            assert!(values.steps.recvs.iter().all(|s| !s.convert.is_some()));
        }
    }
}

#[test]
fn a_quantizing_plan_exchanges_amax_before_its_values() {
    let plan = quantizing(&[12, 16]);
    let boxes = Boxes::of(&plan);
    for r in plan.ranks() {
        let p = boxes.program(&plan, r, &options(13));
        assert_eq!(p.kinds(), [Amax, Values], "rank {r}");
        assert_eq!(p.chunk_bytes, 8, "rank {r}");
        let amax = &p.phases[0];
        assert!(!amax.counted);
        match plan.src().local_region(r) {
            // both sources share a block row: one exchange each way
            Some(_) => {
                assert_eq!(amax.scaling.len(), 1);
                assert_eq!((amax.steps.sends.len(), amax.steps.recvs.len()), (1, 1));
                let sends = &p.phases[1].steps.sends;
                assert!(
                    sends
                        .iter()
                        .any(|s| matches!(s.convert, Convert::Quantize { .. }))
                );
            }
            // a destination alone skips the exchange
            None => assert!(amax.scaling.is_empty() && !amax.moves()),
        }
    }
}

#[test]
fn a_relay_plan_is_one_phase_per_round_with_its_staging() {
    let plan = relayed(&[64, 64]);
    let boxes = Boxes::of(&plan);
    let options = ExecOptions {
        staging_bytes: 2048,
        ..options(64)
    };
    let p = boxes.program(&plan, 4, &options);
    let kinds = p.kinds();
    assert!(kinds.len() > 2, "{kinds:?}");
    assert!(kinds.iter().enumerate().all(|(j, k)| *k == Round(j)));
    let rounds = Rounds::of(&boxes.parts[&4], 1, slab_bytes(&options)).unwrap();
    assert_eq!(p.staging_bytes, 2 * rounds.staging_bytes() as u64);
    assert_eq!(p.scratch.len(), 2);
    // what a round staged is copied into the shard after it
    assert!(p.phases.iter().any(|ph| !ph.after.is_empty()));
}

#[test]
fn the_baseline_gathers_broadcasts_and_keeps() {
    let shape = [8, 8];
    let src = layout("mesh=2 place=S(0)", &shape, DType::F32, 0);
    let dst = layout("mesh=2 place=S(1)", &shape, DType::F32, 2);
    let gb = GatherBroadcast::new(&src, &dst).unwrap();
    let whole = Region::full(&shape);
    for rank in gb.ranks() {
        let (gather, broadcast) = gb.rank_parts(rank);
        let src_box = src.local_region(rank);
        let dst_box = dst.local_region(rank);
        let full = gb.needs_full_buffer(rank).then_some((Buf::Dst(1), 0..256));
        let parts = BaselineParts {
            rank,
            baseline: &gb,
            gather: gather.as_ref(),
            broadcast: broadcast.as_ref(),
            src: src_box.as_ref().map(|b| Slot {
                region: Cow::Borrowed(b),
                buf: Buf::Src(0),
                bytes: 0..128,
            }),
            full,
            dst: dst_box.as_ref().map(|b| Slot {
                region: Cow::Borrowed(b),
                buf: Buf::Dst(0),
                bytes: 0..128,
            }),
            whole: Cow::Borrowed(&whole),
        };
        let p = lower_gather_broadcast(parts, &options(13)).unwrap();
        assert_eq!(p.chunk_bytes, 13);
        let parts: Vec<(usize, PhaseKind)> = p.phases.iter().map(|ph| (ph.part, ph.kind)).collect();
        let want: Vec<(usize, PhaseKind)> = match (gather.is_some(), broadcast.is_some()) {
            // a source gathers, then broadcasts the whole tensor
            (true, true) => vec![(0, Values), (1, Values)],
            (true, false) => vec![(0, Values)],
            // a destination receives it, then keeps its box
            (false, true) => vec![(1, Values), (2, Keep)],
            (false, false) => vec![(2, Keep)],
        };
        assert_eq!(parts, want, "rank {rank}");
    }
}

#[test]
fn a_batch_is_its_amax_exchange_then_every_move_cut_alike() {
    let shape = [16, 16];
    let cast = Tensor::new(
        "cast",
        layout("mesh=2 place=S(0)", &shape, DType::F32, 0),
        layout("mesh=2 place=S(1)", &shape, DType::Bf16, 2),
    );
    let plain = Tensor::new(
        "plain",
        layout("mesh=2 place=S(1)", &shape, DType::F32, 0),
        layout("mesh=2 place=S(0)", &shape, DType::F32, 2),
    );
    let batch = Batch::new(vec![cast, plain], Vec::new(), BatchOptions::default()).unwrap();
    for r in 0..batch.world() {
        let rb = batch.rank_batch(r).unwrap();
        let p = lower_batch(&batch, &rb, &options(13)).unwrap();
        assert_eq!(p.kinds(), [Amax, Values], "rank {r}");
        // the plain tensor's transfers too are cut at whole elements, as the cast's are
        assert_eq!(p.chunk_bytes, batch_chunk(&batch, &options(13)));
        assert_eq!(p.chunk_bytes, 8);
        assert!(!p.phases[0].moves());
    }
    // an already-quantized move: its values and scales in one schedule, bytes as they are
    let fp8 = |spec: &str, first| layout(spec, &[256, 256], DType::Fp8E4M3, first);
    let request = QuantRequest {
        scheme: "block:128x128".parse().unwrap(),
        scale_dtype: None,
    };
    let mv = reshard_core::plan::QuantizedMove::new(
        fp8("mesh=2 place=S(0)", 0),
        fp8("mesh=2 place=S(1)", 2),
        PlanOptions::default(),
        request,
    )
    .unwrap();
    let batch = Batch::quantized(&mv).unwrap();
    for r in 0..batch.world() {
        let rb = batch.rank_batch(r).unwrap();
        let p = lower_batch(&batch, &rb, &options(13)).unwrap();
        assert_eq!(p.kinds(), [Amax, Values], "rank {r}");
        assert_eq!(p.chunk_bytes, 13);
        let values = &p.phases[1];
        let tensors: Vec<usize> = values.steps.recvs.iter().map(|s| s.elem_bytes).collect();
        // a destination receives values (1-byte fp8) and then their scales (4-byte f32)
        if r >= 2 {
            assert!(tensors.contains(&1) && tensors.contains(&4), "{tensors:?}");
        }
    }
}

/// The programs of every rank of a plan, with their buffers.
fn runs<'a, 'p>(
    plan: &'p Plan,
    boxes: &'p Boxes,
    src: &'a BTreeMap<Rank, Vec<u8>>,
    dst: &'a mut BTreeMap<Rank, Vec<u8>>,
    scales: &'a mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Vec<RankRun<'a, 'p>> {
    let mut scales: BTreeMap<Rank, &mut Vec<u8>> =
        scales.iter_mut().map(|(&r, b)| (r, b)).collect();
    let mut dst: BTreeMap<Rank, &mut Vec<u8>> = dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    plan.ranks()
        .into_iter()
        .map(|r| {
            let mut d: Vec<&mut [u8]> =
                vec![dst.remove(&r).map_or(&mut [][..], |b| b.as_mut_slice())];
            d.extend(scales.remove(&r).map(|b| b.as_mut_slice()));
            RankRun {
                program: boxes.program(plan, r, options),
                src: src.get(&r).map(Vec::as_slice).into_iter().collect(),
                dst: d,
            }
        })
        .collect()
}

#[test]
fn every_kind_runs_through_the_one_driver_to_the_reference() {
    let fill = Fill::Hash { seed: 7 };
    let options = options(13);
    // plain, cast and relayed plans
    let shape = [16, 16];
    let plain = Plan::new(
        layout("mesh=2 place=S(0)", &shape, DType::F32, 0),
        layout("mesh=4 place=S(1)", &shape, DType::F32, 1),
    )
    .unwrap();
    let cast = Plan::new(
        layout("mesh=2 place=S(0)", &shape, DType::F32, 0),
        layout("mesh=4 place=S(1)", &shape, DType::Bf16, 2),
    )
    .unwrap();
    for plan in [plain, cast, relayed(&[64, 64])] {
        let boxes = Boxes::of(&plan);
        let src = fill.shards(plan.src()).unwrap();
        let mut dst = zeroed_shards(plan.dst()).unwrap();
        let stats = run_threads(
            runs(
                &plan,
                &boxes,
                &src,
                &mut dst,
                &mut BTreeMap::new(),
                &options,
            ),
            &options,
            &[],
        )
        .unwrap();
        fill.verify_shards_converted(plan.src().dtype(), plan.dst(), &dst)
            .unwrap();
        assert_eq!(stats.bytes_remote(), plan.totals().bytes_remote);
    }
    // a quantizing plan: values and scales the naive quantizer's
    let plan = quantizing(&[12, 16]);
    let q = plan.quant().unwrap();
    let normal = Fill::Normal { seed: 5 };
    let whole = normal
        .shard(&layout("mesh=1 place=R", &[12, 16], DType::F32, 0), 0)
        .unwrap()
        .unwrap();
    let want = quantize_tensor(q.quant, &q.grid, DType::F32, &whole).unwrap();
    let boxes = Boxes::of(&plan);
    let src = normal.shards(plan.src()).unwrap();
    let mut dst = zeroed_shards(plan.dst()).unwrap();
    let mut scales = crate::exec::zeroed_scale_shards(&plan).unwrap();
    run_threads(
        runs(&plan, &boxes, &src, &mut dst, &mut scales, &options),
        &options,
        &[],
    )
    .unwrap();
    for (r, b) in &boxes.dst {
        assert_eq!(dst[r], want.values_of(b), "rank {r}");
        assert_eq!(
            scales[r],
            want.scales_of(&q.grid.scale_region(b)),
            "rank {r}"
        );
    }
    // a batch: every tensor's shards the reference's
    let t = |name: &str, s: &str, d: &str| {
        Tensor::new(
            name,
            layout(s, &shape, DType::F32, 0),
            layout(d, &shape, DType::F32, 2),
        )
    };
    let batch = Batch::new(
        vec![
            t("a", "mesh=2 place=S(0)", "mesh=2 place=S(1)"),
            t("b", "mesh=2 place=R", "mesh=2 place=S(0)"),
        ],
        Vec::new(),
        BatchOptions::default(),
    )
    .unwrap();
    let parts: Vec<_> = (0..batch.world())
        .map(|r| batch.rank_batch(r).unwrap())
        .collect();
    let src: Vec<Vec<Vec<u8>>> = (0..batch.world())
        .map(|r| {
            batch
                .tensors()
                .iter()
                .filter_map(|t| fill.shard(&t.src, r).unwrap())
                .collect()
        })
        .collect();
    let mut dst: Vec<Vec<Vec<u8>>> = parts
        .iter()
        .map(|rb| rb.dst.iter().map(|b| vec![0u8; b.len]).collect())
        .collect();
    let runs: Vec<RankRun<'_, '_>> = parts
        .iter()
        .zip(&src)
        .zip(&mut dst)
        .map(|((rb, s), d)| RankRun {
            program: lower_batch(&batch, rb, &options).unwrap(),
            src: s.iter().map(Vec::as_slice).collect(),
            dst: d.iter_mut().map(Vec::as_mut_slice).collect(),
        })
        .collect();
    run_threads(runs, &options, &[]).unwrap();
    for (r, bufs) in dst.iter().enumerate() {
        let want: Vec<Vec<u8>> = batch
            .tensors()
            .iter()
            .filter_map(|t| reference_shards(&t.dst, fill).remove(&r))
            .collect();
        assert_eq!(bufs, &want, "rank {r}");
    }
    // the baseline, through the same driver, lands what a reshard lands
    let plan = Plan::new(
        layout("mesh=2 place=S(0)", &shape, DType::F32, 0),
        layout("mesh=2 place=S(1)", &shape, DType::F32, 2),
    )
    .unwrap();
    let gb = GatherBroadcast::new(plan.src(), plan.dst()).unwrap();
    let mut src = fill.shards(plan.src()).unwrap();
    let mut dst = zeroed_shards(plan.dst()).unwrap();
    let mut full = crate::exec::baseline::full_buffers(&gb).unwrap();
    crate::exec::baseline::run_local_gather_broadcast(&gb, &mut src, &mut dst, &mut full, &options)
        .unwrap();
    let mut direct = zeroed_shards(plan.dst()).unwrap();
    run_local(&plan, &src, &mut direct, &options).unwrap();
    assert_eq!(dst, direct);
    assert_eq!(dst, reference_shards(plan.dst(), fill));
}
