use super::*;
use crate::{JoinOptions, TransportKind};
use reshard_core::DType;
use reshard_core::layout::LayoutSpec;
use reshard_model::{Fused, RefitTensor};
use reshard_transport::group::GroupEnv;

fn layout(spec: &str, shape: &[u64], first: Rank) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, DType::Bf16, first)
        .unwrap()
}

/// gate and up (TP2 rows on ranks 0-1) into one fused gate_up buffer on ranks 2-3, and a
/// replicated norm small enough to be packed.
fn tiny() -> Refit {
    let tensor = |name: &str, shape: &[u64], src: &str, dst: &str| RefitTensor {
        name: name.into(),
        src: layout(src, shape, 0),
        dst: layout(dst, shape, 2),
    };
    Refit {
        model: "tiny".into(),
        tensors: vec![
            tensor("gate", &[32, 16], "mesh=2 place=S(0)", "mesh=2 place=S(0)"),
            tensor("up", &[32, 16], "mesh=2 place=S(0)", "mesh=2 place=S(0)"),
            tensor("norm", &[16], "mesh=2 place=R", "mesh=2 place=R"),
        ],
        src_fused: vec![],
        dst_fused: vec![Fused {
            name: "gate_up".into(),
            dim: 0,
            members: vec![0, 1],
        }],
        train_ranks: 2,
        infer_ranks: 2,
        infer_base: 2,
        infer_engines: vec![],
        quant: None,
    }
}

/// Every rank of a job of `ranks` threads, each joined over TCP on this host, runs `part`.
fn job<T: Send>(ranks: usize, part: impl Fn(World) -> T + Sync) -> Vec<T> {
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
                        rank,
                        world: ranks,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        token: "refit-test".into(),
                        host: "here".into(),
                    };
                    let options = JoinOptions {
                        transport: TransportKind::Tcp,
                        ..JoinOptions::default()
                    };
                    part(World::join_env(Some(env), options).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn repeat(verify: bool) -> Repeat {
    Repeat {
        warmup: 1,
        iters: 2,
        verify,
    }
}

/// Both methods move every byte, every repetition checked: rank 0 reports for the job.
#[test]
fn a_refit_runs_verified_and_rank_0_reports() {
    let run = RefitRun::new(&tiny(), PlanOptions::default(), 1024).unwrap();
    let reports = job(4, |world| {
        run.run(&world, repeat(true), &RunOptions::default())
            .unwrap()
    });
    let report = reports[0].as_ref().unwrap();
    assert!(reports[1..].iter().all(Option::is_none));
    assert!(report.verified);
    assert_eq!(report.transport, "tcp");
    assert_eq!(report.iters, 2);
    assert_eq!(report.pack_below, 1024);
    // gate and up once, the norm on both destinations
    assert_eq!(report.dst_bytes, 2 * 32 * 16 * 2 + 2 * 16 * 2);
    assert_eq!(report.scale_bytes, None);
    assert!(report.reshard.wire_bytes < report.gather_broadcast.wire_bytes);
    let json = serde_json::to_value(report).unwrap();
    assert_eq!(json["verified"], true);
    assert!(json.get("scale_bytes").is_none());
}

/// Without checks a report never says verified, however the bytes landed.
#[test]
fn a_refit_run_unchecked_is_not_verified() {
    let run = RefitRun::new(&tiny(), PlanOptions::default(), 0).unwrap();
    let reports = job(4, |world| {
        run.run(&world, repeat(false), &RunOptions::default())
            .unwrap()
    });
    let report = reports[0].as_ref().unwrap();
    assert!(!report.verified);
    assert_eq!(report.reshard.wire_bytes, 2 * 32 * 16 * 2 + 2 * 16 * 2);
}

/// A report of no ranks is not verified; one whose rank did not check all is not either.
#[test]
fn the_job_is_verified_only_if_every_rank_was() {
    let run = RefitRun::new(&tiny(), PlanOptions::default(), 0).unwrap();
    assert!(!run.report(repeat(true), &[]).verified);
    let rank = |verified: bool| serde_json::json!({ "verified": verified, "transport": "tcp" });
    assert!(run.report(repeat(true), &[rank(true), rank(true)]).verified);
    assert!(
        !run.report(repeat(true), &[rank(true), rank(false)])
            .verified
    );
}

/// Ranks as threads of one world share its memory and open no links: refused, naming the
/// transport.
#[test]
fn a_world_of_threads_is_refused() {
    let run = RefitRun::new(&tiny(), PlanOptions::default(), 0).unwrap();
    let world = World::join_env(
        None,
        JoinOptions {
            transport: TransportKind::Local,
            ..JoinOptions::default()
        },
    )
    .unwrap();
    let err = run
        .run(&world, repeat(true), &RunOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("local"), "{err}");
    assert!(err.to_string().contains("one rank per process"), "{err}");
}

/// A batch of some tensors keeps only the fused buffers whose members it all keeps, and
/// names each tensor by its refit index.
#[test]
fn a_partial_batch_drops_the_fusions_it_splits() {
    let refit = tiny();
    let (batch, ids) = batch_of(&refit, PlanOptions::default(), 0, |i| i != 0, false).unwrap();
    assert_eq!(ids, [1, 2]);
    assert!(batch.fusions().is_empty());
    let (batch, _) = batch_of(&refit, PlanOptions::default(), 0, |_| true, false).unwrap();
    assert_eq!(batch.fusions().len(), 1);
}

/// The fingerprint tells two refits apart by their layouts and by --pack-below.
#[test]
fn the_fingerprint_covers_the_batch_and_packing() {
    let fp = |refit: &Refit, pack: u64| {
        let run = RefitRun::new(refit, PlanOptions::default(), pack).unwrap();
        format!("{:?}", run.fingerprint(Fingerprint::new("refit --run")))
    };
    let mut other = tiny();
    other.tensors[2].dst = layout("mesh=2 place=R", &[16], 2);
    other.tensors[0].src = layout("mesh=2 place=S(1)", &[32, 16], 0);
    assert_eq!(fp(&tiny(), 0), fp(&tiny(), 0));
    assert_ne!(fp(&tiny(), 0), fp(&tiny(), 64));
    assert_ne!(fp(&tiny(), 0), fp(&other, 0));
}
