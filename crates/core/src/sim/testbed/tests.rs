use super::*;
use crate::DType;
use crate::layout::{Layout, LayoutSpec};
use crate::plan::{PlanOptions, Topology};

/// 2 hosts x 2 ranks, round numbers: a link moves 10^9 payload bytes a second, a core copies
/// 10^9 bytes a second through memory and moves 5 x 10^8 per TCP end.
fn bed() -> Testbed {
    Testbed {
        name: "t".into(),
        hosts: 2,
        ranks_per_host: 2,
        link_gbit: 8.0,
        link_payload: 1.0,
        link_latency_us: 0.0,
        memory_gb_s: 1.0,
        tcp_gb_s: 0.5,
        cores: 2,
        shared_cpu: true,
    }
}

/// A 1 MiB f32 tensor [512, 512].
const T: f64 = (1 << 20) as f64;

fn layout(spec: &str) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(&[512, 512], DType::F32, 0)
        .unwrap()
}

fn plan(src: &str, dst: &str, relay: Option<bool>) -> Plan {
    let topology = relay.map(|relay| Topology::new(bed().host_map(), relay));
    Plan::with_topology(layout(src), layout(dst), PlanOptions::default(), topology).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-9)
}

#[test]
fn rows_across_one_link_are_bound_by_the_shared_cores() {
    // ranks 0 and 1 (host 0) each send their half to rank 2 and 3 (host 1)
    let p = plan("mesh=2 place=S(0)", "mesh=2 ranks=2..4 place=S(0)", None);
    let c = price_on_testbed(&p, &bed()).unwrap();
    assert_eq!(c.busiest_link_bytes, 1 << 20);
    assert!(close(c.link_s, T / 1e9), "{c:?}");
    // every rank moves half the tensor through one TCP end
    assert!(close(c.rank_cpu_s, T / 2.0 / 5e8), "{c:?}");
    // four ranks of that work on two cores
    assert!(close(c.cores_s, 4.0 * T / 2.0 / 5e8 / 2.0), "{c:?}");
    assert!(close(c.seconds, c.cores_s));
    // a link twice as slow binds instead
    let slow = Testbed {
        link_gbit: 1.0,
        ..bed()
    };
    let c = price_on_testbed(&p, &slow).unwrap();
    assert!(close(c.seconds, T / 1.25e8), "{c:?}");
}

#[test]
fn a_relay_crosses_the_link_once_and_fans_out_over_memory() {
    // rank 0 holds the tensor; ranks 2 and 3 (host 1) both need all of it
    let (src, dst) = ("mesh=1 place=R", "mesh=2 ranks=2..4 place=R");
    let slow = Testbed {
        link_gbit: 0.8, // 10^8 bytes a second: the link binds
        ..bed()
    };
    let off = price_on_testbed(&plan(src, dst, Some(false)), &slow).unwrap();
    let on = price_on_testbed(&plan(src, dst, Some(true)), &slow).unwrap();
    assert_eq!(off.busiest_link_bytes, 2 << 20);
    assert_eq!(on.busiest_link_bytes, 1 << 20);
    assert!(close(off.seconds, 2.0 * T / 1e8), "{off:?}");
    assert!(close(on.seconds, T / 1e8), "{on:?}");
    // with relay: rank 0 sends T over TCP; on host 1 the relaying rank receives T over TCP and
    // forwards what the other needs over memory, which that rank takes through its ring
    let p = plan(src, dst, Some(true));
    let forwarded: u64 = p
        .transfers()
        .iter()
        .filter(|t| t.via.is_some())
        .map(|t| t.bytes(4))
        .sum();
    assert_eq!(forwarded, 1 << 20);
    let cpu = [T / 5e8, T / 5e8 + T / 1e9, T / 1e9];
    assert!(close(on.rank_cpu_s, cpu[1]), "{on:?}");
    assert!(close(on.cores_s, cpu.iter().sum::<f64>() / 2.0), "{on:?}");
}

#[test]
fn same_host_copies_cost_memory_only() {
    // host 0 alone: rank 0's rows to ranks 0 and 1
    let p = plan("mesh=1 place=R", "mesh=2 place=S(0)", Some(true));
    let c = price_on_testbed(&p, &bed()).unwrap();
    assert_eq!((c.link_s, c.busiest_link_bytes), (0.0, 0));
    // rank 0 copies both halves: one locally, one into rank 1's shard
    assert!(close(c.rank_cpu_s, T / 1e9), "{c:?}");
    assert!(close(c.cores_s, T / 1e9 / 2.0), "{c:?}");
}

#[test]
fn cores_per_host_split_the_work_by_host() {
    let p = plan("mesh=2 place=S(0)", "mesh=2 ranks=2..4 place=S(0)", None);
    let per_host = Testbed {
        shared_cpu: false,
        ..bed()
    };
    let c = price_on_testbed(&p, &per_host).unwrap();
    assert!(close(c.cores_s, 2.0 * T / 2.0 / 5e8 / 2.0), "{c:?}");
}

#[test]
fn the_baseline_is_its_phases_one_after_the_other_and_the_keep() {
    let (src, dst) = (
        layout("mesh=2 place=S(0)"),
        layout("mesh=2 ranks=2..4 place=S(1)"),
    );
    let topology = Topology::new(bed().host_map(), true);
    let gb = GatherBroadcast::on_hosts(&src, &dst, Some(&topology)).unwrap();
    let b = bed();
    let phases: f64 = [&gb.gather, &gb.broadcast]
        .into_iter()
        .flatten()
        .map(|p| price_on_testbed(p, &b).unwrap().seconds)
        .sum();
    let c = price_baseline_on(&gb, &b).unwrap();
    // each destination rank copies its half out of the whole tensor: T/2 bytes on its core,
    // both ranks on the two cores
    assert!(close(c.seconds, phases + T / 2.0 / 1e9), "{c:?}");
    assert_eq!(c.busiest_link_bytes, gb.host_links().unwrap().busiest());
    // the whole tensor crosses into host 1 once
    assert_eq!(c.busiest_link_bytes, 1 << 20);
}

#[test]
fn files_are_checked_field_by_field() {
    let ok = r#"{"kind": "hosts", "hosts": 2, "ranks_per_host": 4, "link_gbit": 2,
        "memory_gb_s": 3.5, "tcp_gb_s": 0.9, "cores": 2, "shared_cpu": true}"#;
    let bed = Testbed::from_json(ok, "bed").unwrap();
    assert!(close(bed.link_payload, 1448.0 / 1514.0));
    assert!(is_testbed(ok));
    assert!(!is_testbed(r#"{"base": "h100"}"#));
    for (text, field) in [
        (ok.replace("\"hosts\", ", "\"gpus\", "), "kind"),
        (ok.replace("\"hosts\": 2", "\"hosts\": 0"), "hosts"),
        (
            ok.replace("\"link_gbit\": 2", "\"link_gbit\": -1"),
            "link_gbit",
        ),
        (ok.replace(", \"cores\": 2", ""), "cores"),
        (ok.replace("\"cores\"", "\"core\""), "core"),
    ] {
        let e = Testbed::from_json(&text, "bed").unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}

#[test]
fn ranks_off_the_testbed_are_refused() {
    let p = plan("mesh=2 place=S(0)", "mesh=4 ranks=2..6 place=S(0)", None);
    let e = price_on_testbed(&p, &bed()).unwrap_err().to_string();
    assert!(e.contains("rank 4"), "{e}");
}
