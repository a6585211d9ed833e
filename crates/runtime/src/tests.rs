use reshard_core::error::Field;
use std::collections::BTreeMap;

use super::*;
use reshard_core::fill::Fill;
use reshard_core::layout::LayoutSpec;
use reshard_core::{DType, Plan};

fn plan(src: &str, dst: &str) -> Plan {
    let layout = |spec: &str, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&[8, 6], DType::F32, first)
            .unwrap()
    };
    Plan::new(layout(src, 0), layout(dst, 2)).unwrap()
}

fn env(rank: Rank, world: usize) -> GroupEnv {
    GroupEnv {
        rank,
        world,
        master_addr: "127.0.0.1".into(),
        master_port: 1,
        token: "t".into(),
        host: "here".into(),
    }
}

fn with(transport: TransportKind) -> JoinOptions {
    JoinOptions {
        transport,
        ..JoinOptions::default()
    }
}

#[test]
fn transport_names_parse_back_and_others_are_refused_by_name() {
    for kind in TransportKind::ALL {
        assert_eq!(kind.name().parse::<TransportKind>().unwrap(), kind);
    }
    let err = "udp".parse::<TransportKind>().unwrap_err();
    assert!(err.to_string().starts_with("transport: udp"), "{err}");
}

/// A lone process with no rendezvous runs every rank as a thread: the one call moves the
/// tensor, and the verdict is its own outcome.
#[test]
fn a_lone_process_runs_every_rank_as_threads() {
    for kind in [TransportKind::Auto, TransportKind::Local] {
        let world = World::join_env(None, with(kind)).unwrap();
        assert!(world.job().is_none() && world.rank().is_none());
        let plan = plan("mesh=2 place=S(0)", "mesh=3 place=S(1)");
        assert_eq!(world.ranks(plan.dst()).collect::<Vec<_>>(), [2, 3, 4]);
        let fill = Fill::Index;
        let sources = fill.shards(plan.src()).unwrap();
        let mut dests = crate::exec::zeroed_shards(plan.dst()).unwrap();
        let stats = world
            .run(&plan, &sources, &mut dests, &RunOptions::default())
            .unwrap();
        assert_eq!(stats.ranks.len(), 5);
        fill.verify_shards(plan.dst(), &dests).unwrap();
        world.agree("run", Ok(()), || unreachable!()).unwrap();
        let report = serde_json::json!({"rank": "all"});
        assert_eq!(
            world.finish(Ok(report.clone())).unwrap(),
            Some(vec![report])
        );
    }
}

#[test]
fn transports_that_need_processes_are_refused_in_a_lone_process() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let err = World::join_env(None, with(kind)).err().unwrap();
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("transport: {}", kind.name())),
            "{text}"
        );
        assert!(text.contains("RANK, WORLD_SIZE"), "{text}");
    }
}

#[test]
fn local_is_refused_for_one_rank_of_many() {
    let err = World::join_env(Some(env(1, 3)), with(TransportKind::Local))
        .err()
        .unwrap();
    assert!(err.to_string().contains("this is rank 1 of 3"), "{err}");
}

#[cfg(not(feature = "mpi"))]
#[test]
fn mpi_is_refused_in_a_build_without_it() {
    let err = World::join_env(None, with(TransportKind::Mpi))
        .err()
        .unwrap();
    assert!(err.to_string().contains("built without MPI"), "{err}");
}

#[test]
fn a_bad_token_is_refused_before_joining() {
    let options = JoinOptions {
        token: Some(String::new()),
        ..with(TransportKind::Tcp)
    };
    let err = World::join_env(Some(env(0, 2)), options).err().unwrap();
    assert!(
        matches!(
            err,
            Error::Env {
                var: "RESHARD_TOKEN",
                ..
            }
        ),
        "{err}"
    );
}

/// Between threads there are no links to open: asking for them is an error, not a hang.
#[test]
fn threads_open_no_links() {
    let world = World::join_env(None, JoinOptions::default()).unwrap();
    let err = world.connect(&Links::default(), [], None).err().unwrap();
    assert!(err.to_string().contains("threads of this process"), "{err}");
    let plan = plan("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    assert!(world.prepare(&plan).is_err());
}

#[test]
fn a_job_too_small_for_the_layouts_is_named() {
    let err = check_world(4, 3).unwrap_err();
    assert!(err.to_string().contains("at least 5 processes"), "{err}");
    check_world(2, 3).unwrap();
}

#[test]
fn one_rank_of_a_job_gives_its_own_buffers_only() {
    let plan = plan("mesh=2 place=S(0)", "mesh=2 place=S(1)");
    let mut buffers = BTreeMap::new();
    check_own_for_tests(plan.src(), 1, &buffers).unwrap_err();
    buffers.insert(1, vec![0u8; plan.src().local_bytes(1) as usize]);
    check_own_for_tests(plan.src(), 1, &buffers).unwrap();
    buffers.insert(0, vec![0u8; plan.src().local_bytes(0) as usize]);
    let err = check_own_for_tests(plan.src(), 1, &buffers).unwrap_err();
    assert!(
        matches!(err, Error::UnexpectedBuffer { rank: 0, .. }),
        "{err}"
    );
    buffers.remove(&0);
    buffers.insert(1, vec![0u8; 3]);
    let err = check_own_for_tests(plan.src(), 1, &buffers).unwrap_err();
    assert!(matches!(err, Error::BufferSize { got: 3, .. }), "{err}");
    // rank 3 holds no source shard
    check_own_for_tests(plan.src(), 3, &BTreeMap::new()).unwrap();
}

fn check_own_for_tests(
    layout: &Layout,
    rank: Rank,
    buffers: &BTreeMap<Rank, Vec<u8>>,
) -> Result<()> {
    super::run::check_own(layout, reshard_core::Side::Src, rank, buffers)
}

/// The baseline's one call moves the same tensor as the plan's, between threads.
#[test]
fn the_baseline_moves_the_same_tensor_between_threads() {
    let world = World::join_env(None, JoinOptions::default()).unwrap();
    let plan = plan("mesh=2 place=S(0)", "mesh=3 place=S(1)");
    let fill = Fill::Hash { seed: 3 };
    let mut sources = fill.shards(plan.src()).unwrap();
    let mut dests = crate::exec::zeroed_shards(plan.dst()).unwrap();
    let stats = world
        .run_gather_broadcast(&plan, &mut sources, &mut dests, &RunOptions::default())
        .unwrap();
    fill.verify_shards(plan.dst(), &dests).unwrap();
    assert!(stats.bytes_remote() > plan.totals().bytes_remote);
    assert_eq!(
        sources,
        fill.shards(plan.src()).unwrap(),
        "the sources are back"
    );
}

/// `ranks` ranks of a job over tcp, each a thread of this process joined through the
/// rendezvous as a process would be; returns what `part` returned on each, by rank.
fn job_of_threads<T: Send>(ranks: usize, part: impl Fn(World) -> T + Sync) -> Vec<T> {
    let hosts = vec!["here"; ranks];
    job_on_hosts(&hosts, TransportKind::Tcp, part)
}

/// [`job_of_threads`] with each rank naming its host (`hosts[rank]`), over `transport`.
fn job_on_hosts<T: Send>(
    hosts: &[&str],
    transport: TransportKind,
    part: impl Fn(World) -> T + Sync,
) -> Vec<T> {
    let ranks = hosts.len();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let part = &part;
                s.spawn(move || {
                    let env = GroupEnv {
                        master_port: port,
                        host: hosts[rank].into(),
                        ..env(rank, ranks)
                    };
                    part(World::join_env(Some(env), with(transport)).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One rank of a job runs a plan, its baseline and a batch with one call each, on its own
/// buffers only, and lands what the ranks as threads of one process land.
#[test]
fn one_rank_per_member_runs_a_plan_its_baseline_and_a_batch() {
    use crate::batch::{Batch, BatchOptions, Tensor};
    let plan = plan("mesh=2 place=S(0)", "mesh=2x2 ranks=0..4 place=S(1),R");
    let fill = Fill::Hash { seed: 11 };
    let tensors = vec![
        Tensor::new("a", plan.src().clone(), plan.dst().clone()),
        Tensor::new("b", plan.dst().clone(), plan.src().clone()),
    ];
    let batch = Batch::new(tensors, Vec::new(), BatchOptions::default()).unwrap();
    let batch_buffers = |rank: Rank, side: reshard_core::Side, filled: bool| -> Vec<Vec<u8>> {
        let mut bufs = Vec::new();
        for b in batch.buffers(side, rank).unwrap() {
            let mut buf = vec![0u8; b.len];
            for p in b.pieces.iter().filter(|_| filled) {
                let layout = &batch.tensors()[p.tensor].src;
                fill.fill_region(layout, &p.region, &mut buf[p.bytes.clone()]);
            }
            bufs.push(buf);
        }
        bufs
    };
    let ranks = 4;
    let landed = job_of_threads(ranks, |world| {
        let rank = world.rank().unwrap();
        let own = |layout: &Layout, filled: bool| -> BTreeMap<Rank, Vec<u8>> {
            let shard = match filled {
                true => fill.shard(layout, rank).unwrap(),
                false => layout
                    .local_region(rank)
                    .map(|_| vec![0u8; layout.local_bytes(rank) as usize]),
            };
            shard.map(|s| (rank, s)).into_iter().collect()
        };
        let run = RunOptions::default();
        let mut sources = own(plan.src(), true);
        let mut planned = own(plan.dst(), false);
        world.run(&plan, &sources, &mut planned, &run).unwrap();
        let mut baseline = own(plan.dst(), false);
        world
            .run_gather_broadcast(&plan, &mut sources, &mut baseline, &run)
            .unwrap();
        let src = BTreeMap::from([(rank, batch_buffers(rank, reshard_core::Side::Src, true))]);
        let mut dst = BTreeMap::from([(rank, batch_buffers(rank, reshard_core::Side::Dst, false))]);
        world.run_batch(&batch, &src, &mut dst, &run).unwrap();
        let verdict = world.finish(Ok(serde_json::json!(rank))).unwrap();
        assert_eq!(verdict.is_some(), rank == 0);
        (planned, baseline, dst)
    });
    for (rank, (planned, baseline, dst)) in landed.into_iter().enumerate() {
        assert_eq!(planned, baseline, "rank {rank}");
        match plan.dst().local_region(rank) {
            Some(b) => fill
                .verify_region(plan.dst(), &b, &planned[&rank], (rank, 0))
                .unwrap(),
            None => assert!(planned.is_empty()),
        }
        // the batch's threads run as the reference
        let threads = World::join_env(None, JoinOptions::default()).unwrap();
        let all_src = (0..ranks)
            .map(|r| (r, batch_buffers(r, reshard_core::Side::Src, true)))
            .collect();
        let mut all_dst = (0..ranks)
            .map(|r| (r, batch_buffers(r, reshard_core::Side::Dst, false)))
            .collect::<BTreeMap<_, _>>();
        threads
            .run_batch(&batch, &all_src, &mut all_dst, &RunOptions::default())
            .unwrap();
        assert_eq!(dst[&rank], all_dst[&rank], "rank {rank}'s batch");
    }
}

/// Ranks on two named hosts (all on loopback here): the world knows the host map, `shm` is
/// refused for a peer on the other host, and `auto` moves the tensor, shared memory inside a
/// host and tcp across.
#[test]
fn the_host_map_decides_which_peers_share_memory() {
    let plan = plan(
        "mesh=2 ranks=0,2 place=S(0)",
        "mesh=2x2 ranks=0..4 place=S(1),R",
    );
    let fill = Fill::Hash { seed: 5 };
    let hosts = ["a", "a", "b", "b"];
    for kind in [TransportKind::Shm, TransportKind::Auto] {
        let outcomes = job_on_hosts(&hosts, kind, |world| {
            let rank = world.rank().unwrap();
            assert_eq!(
                world.hosts().unwrap(),
                &reshard_core::topology::HostMap::parse("2x2").unwrap()
            );
            let sources: BTreeMap<_, _> = fill
                .shard(plan.src(), rank)
                .unwrap()
                .map(|s| (rank, s))
                .into_iter()
                .collect();
            let mut dests: BTreeMap<_, _> = plan
                .dst()
                .local_region(rank)
                .map(|_| (rank, vec![0u8; plan.dst().local_bytes(rank) as usize]))
                .into_iter()
                .collect();
            let outcome = world.run(&plan, &sources, &mut dests, &RunOptions::default());
            let verdict = outcome
                .as_ref()
                .map(|_| serde_json::json!(rank))
                .map_err(|e| Error::InvalidOption {
                    field: Field::Transport,
                    value: kind.name().into(),
                    reason: e.to_string(),
                });
            let _ = world.finish(verdict);
            outcome.map(|_| dests)
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            match (kind, outcome) {
                (TransportKind::Auto, Ok(dests)) => {
                    let region = plan.dst().local_region(rank).unwrap();
                    fill.verify_region(plan.dst(), &region, &dests[&rank], (rank, 0))
                        .unwrap();
                }
                (TransportKind::Shm, Err(e)) => {
                    assert!(
                        e.to_string().contains("runs on another host"),
                        "rank {rank}: {e}"
                    )
                }
                (kind, other) => panic!("{kind:?}, rank {rank}: {:?}", other.map(|_| ())),
            }
        }
    }
}

/// A quantizing plan between processes: `World::run` refuses it (it has nowhere to put the
/// scales), `World::run_quantized` runs it, the partial amax of the blocks the source shards
/// cut exchanged first, and every destination's values and scales are the naive reference's
/// boxes, over tcp and shm.
#[test]
fn a_quantizing_plan_runs_between_processes_with_its_scales() {
    use reshard_core::convert::reference::quantize_tensor;
    use reshard_core::plan::QuantRequest;
    let shape = [12u64, 16];
    let layout = |spec: &str, dtype, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&shape, dtype, first)
            .unwrap()
    };
    let request = QuantRequest {
        scheme: "block:4x8".parse().unwrap(),
        scale_dtype: None,
    };
    // source rows 0..6 and 6..12 cut the second block row: an amax exchange
    let plan = Plan::with_quant(
        layout("mesh=2 place=S(0)", DType::F32, 0),
        layout("mesh=2 place=S(1)", DType::Fp8E4M3, 2),
        reshard_core::PlanOptions::default(),
        Some(request),
    )
    .unwrap();
    let q = plan.quant().unwrap();
    let fill = Fill::Normal { seed: 5 };
    let whole = fill
        .shard(&layout("mesh=1 place=R", DType::F32, 0), 0)
        .unwrap()
        .unwrap();
    let want = quantize_tensor(q.quant, &q.grid, DType::F32, &whole).unwrap();
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let landed = job_on_hosts(&["here"; 4], transport, |world| {
            let rank = world.rank().unwrap();
            let sources: BTreeMap<Rank, Vec<u8>> = fill
                .shard(plan.src(), rank)
                .unwrap()
                .map(|s| (rank, s))
                .into_iter()
                .collect();
            let sized = |bytes: u64| {
                plan.dst()
                    .local_region(rank)
                    .map(|_| (rank, vec![0u8; bytes as usize]))
                    .into_iter()
                    .collect::<BTreeMap<_, _>>()
            };
            let mut values = sized(plan.dst().local_bytes(rank));
            let mut scales = sized(q.dst_scale_bytes(plan.dst(), rank));
            let run = RunOptions::default();
            let refused = world.run(&plan, &sources, &mut values, &run).unwrap_err();
            assert!(
                matches!(
                    refused,
                    Error::InvalidOption {
                        field: Field::Quant,
                        ..
                    }
                ),
                "{refused}"
            );
            world
                .run_quantized(&plan, &sources, &mut values, &mut scales, &run)
                .unwrap();
            world.finish(Ok(serde_json::json!(rank))).unwrap();
            (values, scales)
        });
        for (rank, (values, scales)) in landed.into_iter().enumerate() {
            match plan.dst().local_region(rank) {
                Some(b) => {
                    assert_eq!(
                        values[&rank],
                        want.values_of(&b),
                        "{transport:?} rank {rank}"
                    );
                    let blocks = q.grid.scale_region(&b);
                    assert_eq!(scales[&rank], want.scales_of(&blocks), "rank {rank}");
                }
                None => assert!(values.is_empty() && scales.is_empty()),
            }
        }
    }
}

/// A batch that quantizes (two tensors fused on the destination side, colocated ranks, row
/// shards that cut the blocks) runs with one call per member, `World::run_batch_quantized`,
/// over tcp and shm, and lands what the ranks as threads of one process land, every value
/// and scale the naive reference's; `World::run_batch` refuses it before any byte moves.
#[test]
fn one_rank_per_member_runs_a_quantizing_batch() {
    use crate::batch::{Batch, BatchOptions, Fusion, Tensor};
    use reshard_core::convert::reference::quantize_tensor;
    use reshard_core::plan::{QuantPlan, QuantRequest};
    let shape = [32u64, 16];
    let layout = |spec: &str, dtype, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&shape, dtype, first)
            .unwrap()
    };
    // source rows 0..11, 11..22, 22..32 cut the 8-row blocks; destinations on ranks 1 and 2
    let (src, dst) = (
        layout("mesh=3 place=S(0)", DType::Bf16, 0),
        layout("mesh=2 place=S(1)", DType::Fp8E4M3, 1),
    );
    let request = QuantRequest {
        scheme: "block:8x8".parse().unwrap(),
        scale_dtype: None,
    };
    let quant = QuantPlan::new(request, &src, &dst).unwrap();
    let tensor = |name: &str| Tensor {
        quant: Some(quant.clone()),
        ..Tensor::new(name, src.clone(), dst.clone())
    };
    let fused = Fusion {
        name: "ab".into(),
        side: reshard_core::Side::Dst,
        dim: 0,
        members: vec![0, 1],
    };
    let batch = Batch::new(
        vec![tensor("a"), tensor("b")],
        vec![fused],
        BatchOptions::default(),
    )
    .unwrap();
    assert!(!batch.rank_batch(1).unwrap().amax.is_empty());
    let fill = |i: usize| Fill::Normal { seed: i as u64 };
    let buffers = |rank: Rank| -> [Vec<Vec<u8>>; 3] {
        let rb = batch.rank_batch(rank).unwrap();
        let zeroed = |b: &[crate::batch::Buffer]| b.iter().map(|b| vec![0u8; b.len]).collect();
        let mut src: Vec<Vec<u8>> = zeroed(&rb.src);
        for (b, bytes) in rb.src.iter().zip(&mut src) {
            for p in &b.pieces {
                let l = &batch.tensors()[p.tensor].src;
                fill(p.tensor).fill_region(l, &p.region, &mut bytes[p.bytes.clone()]);
            }
        }
        [src, zeroed(&rb.dst), zeroed(&rb.scales)]
    };
    let threads = World::join_env(None, JoinOptions::default()).unwrap();
    let [mut all_src, mut all_dst, mut all_scales] =
        [BTreeMap::new(), BTreeMap::new(), BTreeMap::new()];
    for r in 0..3 {
        let [s, d, sc] = buffers(r);
        all_src.insert(r, s);
        all_dst.insert(r, d);
        all_scales.insert(r, sc);
    }
    let run = RunOptions::default();
    threads
        .run_batch_quantized(&batch, &all_src, &mut all_dst, &mut all_scales, &run)
        .unwrap();
    for r in 1..3 {
        let rb = batch.rank_batch(r).unwrap();
        let box_ = dst.local_region(r).unwrap();
        for (i, piece) in rb.dst[0].pieces.iter().enumerate() {
            let whole = fill(i)
                .shard(&layout("mesh=1 place=R", DType::Bf16, 0), 0)
                .unwrap()
                .unwrap();
            let want = quantize_tensor(quant.quant, &quant.grid, DType::Bf16, &whole).unwrap();
            assert!(want.values_of(&box_) == all_dst[&r][0][piece.bytes.clone()]);
            let scales = &rb.scales[0].pieces[i];
            let got = &all_scales[&r][0][scales.bytes.clone()];
            assert!(want.scales_of(&scales.region) == got, "rank {r}");
        }
    }
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let landed = job_on_hosts(&["here"; 3], transport, |world| {
            let rank = world.rank().unwrap();
            let [s, d, sc] = buffers(rank);
            let src = BTreeMap::from([(rank, s)]);
            let (mut dst, mut scales) = (BTreeMap::from([(rank, d)]), BTreeMap::from([(rank, sc)]));
            let refused = world.run_batch(&batch, &src, &mut dst, &run).unwrap_err();
            assert!(
                refused.to_string().contains("World::run_batch_quantized"),
                "{refused}"
            );
            world
                .run_batch_quantized(&batch, &src, &mut dst, &mut scales, &run)
                .unwrap();
            world.finish(Ok(serde_json::json!(rank))).unwrap();
            (dst, scales)
        });
        for (rank, (dst, scales)) in landed.into_iter().enumerate() {
            assert_eq!(dst[&rank], all_dst[&rank], "{transport:?} rank {rank}");
            assert_eq!(
                scales[&rank], all_scales[&rank],
                "{transport:?} rank {rank}"
            );
        }
    }
}

/// A prepared quantizing plan over shm (ranks as threads of one process, joined as processes
/// are): same-host senders quantize as they write straight into the receivers' destination
/// shards, every remote value byte of them (`bytes_direct`), while the partial amax and the
/// scales take the rings; values and scales are the naive reference's, bit for bit, for
/// blocks that straddle source shards (amax exchange), power-of-two scales, MX, per-channel
/// scales split across destinations and one scale for the tensor, run twice on the same
/// links, the second time checksummed.
#[test]
fn a_prepared_quantizing_plan_writes_its_values_straight_into_the_shards_over_shm() {
    use reshard_core::convert::reference::quantize_tensor;
    use reshard_core::plan::QuantRequest;
    let shape = [12u64, 64];
    let layout = |spec: &str, dtype, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&shape, dtype, first)
            .unwrap()
    };
    for scheme in [
        "block:4x8",
        "block:4x16:ue8m0",
        "mx:32",
        "channel",
        "tensor",
    ] {
        let request = QuantRequest {
            scheme: scheme.parse().unwrap(),
            scale_dtype: None,
        };
        // source rows 0..6 and 6..12 cut the 4-row blocks; rank 1 is a source and a
        // destination (a local copy beside its sends and receives)
        let plan = Plan::with_quant(
            layout("mesh=2 place=S(0)", DType::Bf16, 0),
            layout("mesh=2 ranks=1..3 place=S(1)", DType::Fp8E4M3, 1),
            reshard_core::PlanOptions::default(),
            Some(request),
        )
        .unwrap();
        let q = plan.quant().unwrap();
        let fill = Fill::Normal { seed: 9 };
        let whole = fill
            .shard(&layout("mesh=1 place=R", DType::Bf16, 0), 0)
            .unwrap()
            .unwrap();
        let want = quantize_tensor(q.quant, &q.grid, DType::Bf16, &whole).unwrap();
        let landed = job_on_hosts(&["here"; 3], TransportKind::Shm, |world| {
            let rank = world.rank().unwrap();
            let source = fill.shard(plan.src(), rank).unwrap();
            let mut mine = world.prepare(&plan).unwrap();
            let mut runs = Vec::new();
            for checksum in [false, true] {
                if let Some(d) = mine.destination_mut() {
                    d.fill(0xA5);
                }
                if let Some(s) = mine.scales_mut() {
                    s.fill(0xA5);
                }
                world.barrier().unwrap();
                let run = RunOptions {
                    checksum,
                    chunk_bytes: 40,
                    delta: None,
                    stage: None,
                };
                let stats = mine.run(source.as_deref(), &run).unwrap();
                let values = mine.destination().map(<[u8]>::to_vec);
                let scales = mine.scales().map(<[u8]>::to_vec);
                runs.push((stats.bytes_direct, values, scales));
            }
            world.finish(Ok(serde_json::json!(rank))).unwrap();
            runs
        });
        for (rank, runs) in landed.into_iter().enumerate() {
            // every remote value byte this rank sends lands by direct write; no amax or
            // scale byte does
            let sent: u64 = plan
                .rank_part(rank)
                .sends
                .iter()
                .map(|t| t.region.volume())
                .sum();
            for (i, (direct, values, scales)) in runs.into_iter().enumerate() {
                let what = format!("{scheme}, rank {rank}, run {i}");
                assert_eq!(direct, sent, "{what}");
                match plan.dst().local_region(rank) {
                    Some(b) => {
                        assert!(values.unwrap() == want.values_of(&b), "{what}: values");
                        let blocks = q.grid.scale_region(&b);
                        assert!(scales.unwrap() == want.scales_of(&blocks), "{what}: scales");
                    }
                    None => assert!(values.is_none() && scales.is_none(), "{what}"),
                }
            }
        }
        // some rank sends values at all
        assert!(
            plan.src()
                .mesh()
                .ranks()
                .iter()
                .any(|&r| !plan.rank_part(r).sends.is_empty()),
            "{scheme}"
        );
    }
}

/// An already-quantized tensor moves its values and scales in one call, between threads and
/// between processes over tcp and shm (source and destination ranks overlapping), landing
/// each destination's boxes of both; a scale buffer of the wrong size is refused naming it,
/// and so is another rank's buffer given to one rank of a job.
#[test]
fn an_already_quantized_move_runs_values_and_scales_in_one_call() {
    use reshard_core::convert::reference::{quantize_tensor, slice};
    use reshard_core::plan::{QuantRequest, QuantizedMove};
    let shape = [16u64, 48];
    let layout = |spec: &str, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&shape, DType::Fp8E4M3, first)
            .unwrap()
    };
    let request = QuantRequest {
        scheme: "block:4x8".parse().unwrap(),
        scale_dtype: None,
    };
    let mv = QuantizedMove::new(
        layout("mesh=2 place=S(0)", 0),
        layout("mesh=3 ranks=1..4 place=S(1)", 1),
        reshard_core::PlanOptions::default(),
        request,
    )
    .unwrap();
    let whole = Fill::Normal { seed: 3 }
        .shard(
            &LayoutSpec::parse("mesh=1 place=R")
                .unwrap()
                .resolve(&shape, DType::F32, 0)
                .unwrap(),
            0,
        )
        .unwrap()
        .unwrap();
    let q = quantize_tensor(mv.quant, &mv.grid, DType::F32, &whole).unwrap();
    let gshape = mv.grid.grid_shape();
    let boxes = |values: &Layout, rank: Rank, filled: bool| -> Option<Vec<Vec<u8>>> {
        let b = values.local_region(rank)?;
        let s = mv.grid.scale_region(&b);
        Some(match filled {
            true => vec![
                slice(&q.values, &shape, 1, &b),
                slice(&q.scales, &gshape, 4, &s),
            ],
            false => vec![
                vec![0u8; b.volume() as usize],
                vec![0u8; s.volume() as usize * 4],
            ],
        })
    };
    let (src, dst) = (mv.values.src(), mv.values.dst());
    let all = |layout: &Layout, filled: bool| -> BTreeMap<Rank, Vec<Vec<u8>>> {
        (0..4)
            .filter_map(|r| boxes(layout, r, filled).map(|b| (r, b)))
            .collect()
    };
    let want = all(dst, true);
    let run = RunOptions::default();
    // threads
    let threads = World::join_env(None, JoinOptions::default()).unwrap();
    let mut landed = all(dst, false);
    let stats = threads
        .run_quantized_move(&mv, &all(src, true), &mut landed, &run)
        .unwrap();
    assert_eq!(landed, want);
    let t = mv.totals();
    let scale_bytes = t.quant.as_ref().unwrap().scale_bytes;
    assert_eq!(stats.bytes_remote(), t.bytes_remote + scale_bytes);
    // a scale shard one byte short, named
    let mut short = all(dst, false);
    short.get_mut(&2).unwrap()[QuantizedMove::SCALES].pop();
    let err = threads
        .run_quantized_move(&mv, &all(src, true), &mut short, &run)
        .unwrap_err();
    assert!(err.to_string().contains("`scales`"), "{err}");
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let landed = job_on_hosts(&["here"; 4], transport, |world| {
            let rank = world.rank().unwrap();
            let own = |layout: &Layout, filled: bool| -> BTreeMap<Rank, Vec<Vec<u8>>> {
                boxes(layout, rank, filled)
                    .map(|b| (rank, b))
                    .into_iter()
                    .collect()
            };
            let mut dests = own(dst, false);
            if rank == 0 {
                // the buffers of a rank this process does not run
                let mut theirs = all(dst, false);
                let err = world
                    .run_quantized_move(&mv, &own(src, true), &mut theirs, &run)
                    .unwrap_err();
                assert!(
                    matches!(
                        err,
                        Error::UnexpectedBuffer {
                            side: reshard_core::Side::Dst,
                            rank: 1
                        }
                    ),
                    "{err}"
                );
            }
            world
                .run_quantized_move(&mv, &own(src, true), &mut dests, &run)
                .unwrap();
            world.finish(Ok(serde_json::json!(rank))).unwrap();
            dests
        });
        for (rank, got) in landed.into_iter().enumerate() {
            let expected: BTreeMap<Rank, Vec<Vec<u8>>> = want
                .get(&rank)
                .map(|w| (rank, w.clone()))
                .into_iter()
                .collect();
            assert_eq!(got, expected, "{transport:?}: rank {rank}");
        }
    }
}

/// The coupled batch of an already-quantized move over one shm link offered each rank's
/// shared value shard: the batch marks its value moves direct ([`BatchOptions::direct`]), so
/// every remote value byte is written straight into its receiver's shard by its sender
/// (`bytes_direct`), while the scale chunks (another buffer) go through rings, in one
/// schedule, checksummed or not; every destination lands its boxes of both (source and
/// destination ranks overlapping, so local copies run beside).
///
/// [`BatchOptions::direct`]: crate::batch::BatchOptions::direct
#[test]
fn a_direct_batch_writes_the_values_into_shared_shards_and_rings_the_scales() {
    use crate::batch::run_rank_batch;
    use reshard_core::convert::reference::{quantize_tensor, slice};
    use reshard_core::plan::{QuantRequest, QuantizedMove};
    use reshard_transport::segment::SharedBuffer;
    let shape = [16u64, 48];
    let layout = |spec: &str, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&shape, DType::Fp8E4M3, first)
            .unwrap()
    };
    let request = QuantRequest {
        scheme: "block:4x8".parse().unwrap(),
        scale_dtype: None,
    };
    let mv = QuantizedMove::new(
        layout("mesh=2 place=S(0)", 0),
        layout("mesh=3 ranks=1..4 place=S(1)", 1),
        reshard_core::PlanOptions::default(),
        request,
    )
    .unwrap();
    let whole = Fill::Normal { seed: 8 }
        .shard(
            &LayoutSpec::parse("mesh=1 place=R")
                .unwrap()
                .resolve(&shape, DType::F32, 0)
                .unwrap(),
            0,
        )
        .unwrap()
        .unwrap();
    let q = quantize_tensor(mv.quant, &mv.grid, DType::F32, &whole).unwrap();
    let gshape = mv.grid.grid_shape();
    let boxes = |values: &Layout, rank: Rank| -> Option<(Vec<u8>, Vec<u8>)> {
        let b = values.local_region(rank)?;
        let s = mv.grid.scale_region(&b);
        Some((
            slice(&q.values, &shape, 1, &b),
            slice(&q.scales, &gshape, 4, &s),
        ))
    };
    let (src, dst) = (mv.values.src(), mv.values.dst());
    let batch = crate::batch::Batch::quantized(&mv).unwrap();
    let landed = job_on_hosts(&["here"; 4], TransportKind::Shm, |world| {
        let rank = world.rank().unwrap();
        let rb = batch.rank_batch(rank).unwrap();
        let links = Links::of_batch(&rb);
        let source = boxes(src, rank);
        let dst_box = dst.local_region(rank);
        let mut values = SharedBuffer::new(dst.local_bytes(rank) as usize).unwrap();
        let mut scales = vec![0u8; mv.scales.dst().local_bytes(rank) as usize];
        let layouts = [src, mv.scales.src()];
        let shard = dst_box.as_ref().map(|b| (&values, b));
        let transport = world.connect(&links, layouts, shard).unwrap();
        let srcs: Vec<&[u8]> = source
            .as_ref()
            .map(|(v, s)| vec![v.as_slice(), s.as_slice()])
            .unwrap_or_default();
        let mut runs = Vec::new();
        for checksum in [false, true] {
            values.fill(0xA5);
            scales.fill(0xA5);
            world.barrier().unwrap();
            let mut dsts: Vec<&mut [u8]> = match dst_box {
                Some(_) => vec![&mut values[..], &mut scales[..]],
                None => Vec::new(),
            };
            let run = RunOptions {
                checksum,
                chunk_bytes: 40,
                delta: None,
                stage: None,
            };
            let stats = run_rank_batch(
                &batch,
                &rb,
                &srcs,
                &mut dsts,
                &mut [],
                &*transport,
                &world.exec_options(&run),
            )
            .unwrap();
            world.barrier().unwrap();
            runs.push((
                stats.bytes_direct,
                dst_box.as_ref().map(|_| (values.to_vec(), scales.clone())),
            ));
        }
        drop(transport);
        world.finish(Ok(serde_json::json!(rank))).unwrap();
        runs
    });
    for (rank, runs) in landed.into_iter().enumerate() {
        // every value byte this rank sends to another rank, and no scale byte
        let sent: u64 = mv
            .values
            .rank_part(rank)
            .sends
            .iter()
            .map(|t| t.region.volume())
            .sum();
        for (i, (direct, got)) in runs.into_iter().enumerate() {
            assert_eq!(direct, sent, "rank {rank}, run {i}: bytes written directly");
            assert!(
                got == boxes(dst, rank),
                "rank {rank}, run {i}: values and scales"
            );
        }
    }
    // the values cross between ranks at all
    assert!((0..4).any(|r| !mv.values.rank_part(r).sends.is_empty()));
}
