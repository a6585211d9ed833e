use proptest::prelude::*;

use super::*;
use crate::dtype::DType;
use crate::layout::LayoutSpec;
use crate::plan::{PlanOptions, gather_broadcast_bytes};
use crate::testing::arb_layout_pair;

/// Round numbers: NVLink domains of 2 GPUs at 100 GB/s, 10 GB/s NICs, copies at 200 GB/s,
/// 1 us per NVLink message, 4 us per network message, 1 MB broadcast chunks.
fn toy() -> Cluster {
    Cluster {
        name: "toy".into(),
        gpus_per_node: 2,
        nvlink_domain: 2,
        nvlink_gb_s: 100.0,
        nic_gb_s: 10.0,
        memory_gb_s: 400.0,
        nvlink_latency_us: 1.0,
        net_latency_us: 4.0,
        broadcast_chunk_bytes: 1_000_000,
        ranks: Vec::new(),
    }
}

fn plan(shape: &[u64], src: &str, dst: &str) -> Plan {
    let layout = |spec: &str| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, DType::U8, 0)
            .unwrap()
    };
    Plan::new(layout(src), layout(dst)).unwrap()
}

fn us(seconds: f64) -> f64 {
    seconds * 1e6
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

macro_rules! assert_us {
    ($seconds:expr, $micros:expr) => {
        let (got, want) = (us($seconds), $micros as f64);
        assert!(close(got, want), "{got} us, expected {want} us");
    };
}

#[test]
fn two_ranks_on_one_nvlink_domain() {
    // 1 MB from GPU 0 to GPU 1: 10 us of NVLink and 1 us of latency, either way
    let p = plan(
        &[1_000_000],
        "mesh=1 ranks=0 place=R",
        "mesh=1 ranks=1 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_us!(priced.reshard.seconds, 11);
    assert_us!(priced.reshard.lower_bound_s, 10);
    assert_eq!(priced.reshard.bytes.nvlink, 1_000_000);
    let busiest = priced.reshard.busiest.unwrap();
    assert_eq!((busiest.gpu, busiest.port), (0, Port::NvlinkSend));
    // the broadcast is the same single hop, in one chunk; nothing to gather
    assert_us!(priced.gather_broadcast.gather_s, 0);
    assert_us!(priced.gather_broadcast.broadcast_s, 11);
    assert_eq!(priced.simulation().speedup, 1.0);
}

#[test]
fn two_ranks_across_domains_use_the_nics() {
    let p = plan(
        &[1_000_000],
        "mesh=1 ranks=0 place=R",
        "mesh=1 ranks=2 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_us!(priced.reshard.seconds, 104);
    assert_us!(priced.reshard.lower_bound_s, 100);
    assert_eq!(priced.reshard.bytes.network, 1_000_000);
    // sender and receiver tie; the first GPU names the busiest port
    let busiest = priced.reshard.busiest.unwrap();
    assert_eq!((busiest.gpu, busiest.port), (0, Port::NicSend));
}

#[test]
fn sharded_source_to_a_replicated_destination_in_another_domain() {
    // GPUs 0,1 hold halves of 2 MB; GPUs 2,3 (the next domain) each need all of it
    let p = plan(
        &[2_000_000],
        "mesh=2 ranks=0,1 place=S(0)",
        "mesh=2 ranks=2,3 place=R",
    );
    let bytes = gather_broadcast_bytes(p.src(), p.dst());
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    // every NIC moves 2 MB in 2 messages: 200 us + 8 us
    assert_us!(priced.reshard.seconds, 208);
    assert_us!(priced.reshard.lower_bound_s, 200);
    assert_eq!(priced.reshard.messages, 4);
    // gather: one ring step over NVLink, 1 MB: 1 + 10 us
    assert_us!(priced.gather_broadcast.gather_s, 11);
    // broadcast 0 -> 2 -> 3 in two 1 MB chunks: the first chunk's trip (4 + 100 + 1 + 10)
    // then one more chunk at the slowest edge (100)
    assert_us!(priced.gather_broadcast.broadcast_s, 215);
    assert_eq!(priced.gather_broadcast.bytes, 6_000_000);
    assert_eq!(priced.gather_broadcast.bytes, bytes);
    // the gather moves 1 MB each way over NVLink; the chain 2 MB over the network (0 -> 2)
    // and 2 MB over NVLink (2 -> 3)
    assert_eq!(
        priced.gather_broadcast.bytes_by_link,
        LinkBytes {
            memory: 0,
            nvlink: 4_000_000,
            network: 2_000_000,
        }
    );
    let sim = priced.simulation();
    assert!(close(sim.speedup, 226.0 / 208.0), "{}", sim.speedup);
}

#[test]
fn replicated_sources_share_the_work_but_not_the_receivers_nic() {
    // two replicas in domain 0 each send half of 2 MB to rank 2: each sender's NIC carries
    // 1 MB, the receiver's 2 MB in two messages
    let p = plan(
        &[2_000_000],
        "mesh=2 ranks=0,1 place=R",
        "mesh=1 ranks=2 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_eq!(priced.reshard.messages, 2);
    assert_us!(priced.reshard.seconds, 208);
    let busiest = priced.reshard.busiest.unwrap();
    assert_eq!((busiest.gpu, busiest.port), (2, Port::NicRecv));
    // the baseline sends it from one replica, in two chunks of one hop: 104 + 100 us; the
    // reshard's extra message makes it the slower one here
    assert_us!(priced.gather_broadcast.seconds, 204);
    assert!(priced.simulation().speedup < 1.0);
}

#[test]
fn many_small_messages_are_latency_bound_unless_coalesced() {
    // 1000 tensors of 100 bytes from rank 0 to rank 2 (another domain)
    let plans: Vec<Plan> = (0..1000)
        .map(|_| plan(&[100], "mesh=1 ranks=0 place=R", "mesh=1 ranks=2 place=R"))
        .collect();
    let one_each = price(&plans, &toy(), &SimOptions::default()).unwrap();
    // 1000 x 4 us of latency, 10 us of bytes
    assert_us!(one_each.reshard.seconds, 4010);
    assert_us!(one_each.reshard.lower_bound_s, 10);
    assert_eq!(one_each.reshard.pairs, 1);
    let chunked = SimOptions {
        messages: Messages::Chunked {
            chunk_bytes: 64 << 10,
        },
    };
    let batched = price(&plans, &toy(), &chunked).unwrap();
    // 100 kB in two 64 KiB messages
    assert_eq!(batched.reshard.messages, 2);
    assert_us!(batched.reshard.seconds, 18);
    let streamed = SimOptions {
        messages: Messages::PerPair,
    };
    let streamed = price(&plans, &toy(), &streamed).unwrap();
    assert_eq!(streamed.reshard.messages, 1);
    assert_us!(streamed.reshard.seconds, 14);
    // the baseline broadcasts each tensor on its own: 1000 x (4 us + 0.01 us)
    assert_us!(one_each.gather_broadcast.seconds, 4010);
}

#[test]
fn colocated_local_copies_cost_memory_bandwidth_only() {
    // the same two GPUs hold both sides: each keeps a quarter of 1 MB (a local copy) and gets
    // a quarter from its NVLink neighbour
    let p = plan(
        &[1000, 1000],
        "mesh=2 ranks=0,1 place=S(0)",
        "mesh=2 ranks=0,1 place=S(1)",
    );
    let same_ranks = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_eq!(same_ranks.reshard.bytes.memory, 500_000);
    assert_eq!(same_ranks.reshard.bytes.nvlink, 500_000);
    // NVLink: 2.5 us + 1 us; the copy (250 kB at 200 GB/s, 1.25 us) runs alongside
    assert_us!(same_ranks.reshard.seconds, 3.5);
    assert_us!(same_ranks.reshard.lower_bound_s, 2.5);
    // the baseline gathers over NVLink (1 + 5 us) and broadcasts to nobody
    assert_us!(same_ranks.gather_broadcast.seconds, 6);

    // the same, with inference as separate processes (ranks 2, 3) on GPUs 0, 1
    let p = plan(
        &[1000, 1000],
        "mesh=2 ranks=0,1 place=S(0)",
        "mesh=2 ranks=2,3 place=S(1)",
    );
    let shared = Cluster {
        ranks: vec![0, 1, 0, 1],
        ..toy()
    };
    let processes = price(&[p], &shared, &SimOptions::default()).unwrap();
    assert_eq!(processes.reshard.bytes, same_ranks.reshard.bytes);
    assert_us!(processes.reshard.seconds, 3.5);
    // memory ports carry the copies: 250 kB each
    let copies = price_reshard(
        &[plan(
            &[250_000],
            "mesh=1 ranks=0 place=R",
            "mesh=1 ranks=2 place=R",
        )],
        &shared,
        Messages::PerTransfer,
    )
    .unwrap();
    assert_eq!(copies.busiest.unwrap().port, Port::Memory);
    assert_us!(copies.seconds, 1.25);
}

#[test]
fn h100_and_gb200_differ_where_the_domain_does() {
    // 16 GPUs: two H100 nodes, but one GB200 rack
    let p = plan(
        &[8192, 8192],
        "mesh=8 ranks=0..8 place=S(0)",
        "mesh=8 ranks=8..16 place=S(1)",
    );
    let h100 = simulate(std::slice::from_ref(&p), &Cluster::h100()).unwrap();
    let gb200 = simulate(&[p], &Cluster::gb200()).unwrap();
    // each GPU sends 8 MiB: over a 50 GB/s NIC on H100, 900 GB/s NVLink on GB200
    let eighth = (8192u64 * 8192 / 8) as f64;
    assert!(close(h100.lower_bound_s, eighth / 50e9));
    assert!(close(gb200.lower_bound_s, eighth / 900e9));
    assert!(h100.speedup > 1.0 && gb200.speedup > 1.0);
}

#[test]
fn ranks_the_cluster_does_not_place_are_errors() {
    let p = plan(&[8], "mesh=1 ranks=0 place=R", "mesh=1 ranks=3 place=R");
    let cluster = Cluster {
        ranks: vec![0, 1],
        ..toy()
    };
    let err = simulate(&[p], &cluster).unwrap_err();
    assert!(
        matches!(err, SimError::RankNotPlaced { rank: 3, placed: 2 }),
        "{err}"
    );
    assert!(err.to_string().contains("rank 3"), "{err}");
}

#[test]
fn nothing_to_move_costs_nothing() {
    let p = plan(&[0, 4], "mesh=2 place=S(0)", "mesh=2 ranks=4,5 place=S(1)");
    let sim = simulate(&[p], &Cluster::h100()).unwrap();
    assert_eq!(
        (sim.reshard_s, sim.gather_broadcast_s, sim.speedup),
        (0.0, 0.0, 1.0)
    );
}

#[test]
fn simulation_serializes_as_the_refit_json_says() {
    let p = plan(&[64], "mesh=2 place=S(0)", "mesh=2 ranks=8,9 place=R");
    let json = serde_json::to_value(simulate(&[p], &Cluster::gb200()).unwrap()).unwrap();
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(
        keys,
        [
            "cluster",
            "gather_broadcast_s",
            "lower_bound_s",
            "reshard_s",
            "speedup"
        ]
    );
    assert_eq!(json["cluster"], "gb200");
}

#[test]
fn cluster_files_name_the_bad_field() {
    let full = r#"{"gpus_per_node": 4, "nvlink_domain": 8, "nvlink_gb_s": 300,
        "nic_gb_s": 25, "memory_gb_s": 2000, "nvlink_latency_us": 3, "net_latency_us": 6,
        "broadcast_chunk_bytes": 1048576, "ranks": [1, 0]}"#;
    let c = Cluster::from_json(full, "mine").unwrap();
    assert_eq!(
        (c.name.as_str(), c.nvlink_domain, c.nic_gb_s),
        ("mine", 8, 25.0)
    );
    assert_eq!((c.gpu(0).unwrap(), c.gpu(1).unwrap()), (1, 0));

    let missing = Cluster::from_json(r#"{"gpus_per_node": 8}"#, "x").unwrap_err();
    assert!(missing.to_string().contains("`nvlink_domain`"), "{missing}");
    let unknown = Cluster::from_json(r#"{"base": "h100", "nvlink_gbs": 1}"#, "x").unwrap_err();
    assert!(unknown.to_string().contains("nvlink_gbs"), "{unknown}");
    let base = Cluster::from_json(r#"{"base": "a100"}"#, "x").unwrap_err();
    assert!(base.to_string().contains("`base`: a100"), "{base}");
    let zero = Cluster::from_json(r#"{"base": "gb200", "nic_gb_s": 0}"#, "x").unwrap_err();
    assert!(zero.to_string().contains("`nic_gb_s`: 0"), "{zero}");
    let domain = Cluster::from_json(r#"{"base": "h100", "nvlink_domain": 12}"#, "x").unwrap_err();
    assert!(
        domain.to_string().contains("`nvlink_domain`: 12"),
        "{domain}"
    );
    let named = Cluster::from_json(
        r#"{"base": "gb200", "name": "gb300", "nic_gb_s": 100}"#,
        "x",
    )
    .unwrap();
    assert_eq!((named.name.as_str(), named.nvlink_domain), ("gb300", 72));
}

#[test]
fn load_reads_presets_and_files() {
    assert_eq!(Cluster::load("h100").unwrap(), Cluster::h100());
    let err = Cluster::load("no-such-cluster.json").unwrap_err();
    assert!(err.to_string().contains("no-such-cluster.json"), "{err}");
    let scratch = tempfile::Builder::new()
        .prefix("reshard-sim-")
        .tempdir()
        .unwrap();
    let dir = scratch.path();
    let path = dir.join("slow-net.json");
    std::fs::write(&path, r#"{"base": "h100", "nic_gb_s": 12.5}"#).unwrap();
    let c = Cluster::load(path.to_str().unwrap()).unwrap();
    assert_eq!((c.name.as_str(), c.nic_gb_s), ("slow-net", 12.5));
    std::fs::write(&path, r#"{"base": "h100", "nic_gb_s": "fast"}"#).unwrap();
    let err = Cluster::load(path.to_str().unwrap()).unwrap_err();
    assert!(err.to_string().contains("slow-net.json"), "{err}");
}

fn arb_cluster() -> impl Strategy<Value = Cluster> {
    prop_oneof![
        Just(Cluster::h100()),
        Just(Cluster::gb200()),
        Just(toy()),
        Just(Cluster {
            nvlink_domain: 1,
            gpus_per_node: 1,
            ..toy()
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The baseline moves exactly the bytes the plan totals report, the reshard exactly the
    /// plan's bytes, and the lower bound never exceeds the modeled time.
    #[test]
    fn bytes_agree_with_the_plan((src, dst) in arb_layout_pair(), cluster in arb_cluster()) {
        let plan = Plan::with_options(src, dst, PlanOptions { min_split_bytes: 0 }).unwrap();
        let totals = plan.totals();
        let priced = price(std::slice::from_ref(&plan), &cluster, &SimOptions::default()).unwrap();
        let g = &priced.gather_broadcast;
        prop_assert_eq!(g.bytes, totals.gather_broadcast_bytes);
        let by_link = g.bytes_by_link;
        prop_assert_eq!(by_link.memory + by_link.nvlink + by_link.network, g.bytes);
        let r = &priced.reshard;
        prop_assert_eq!(r.bytes.nvlink + r.bytes.network + r.bytes.memory,
            totals.bytes_remote + totals.bytes_local);
        prop_assert_eq!(r.messages, totals.messages);
        prop_assert!(r.lower_bound_s <= r.seconds);
        // one domain per GPU: nothing crosses NVLink
        if cluster.nvlink_domain == 1 {
            prop_assert_eq!(r.bytes.nvlink, 0);
        }
        // the same tensor twice: twice the bytes on every port, twice the baseline
        let twice = [plan.clone(), plan];
        let doubled = price(&twice, &cluster, &SimOptions::default()).unwrap();
        prop_assert!(close(doubled.reshard.lower_bound_s, 2.0 * r.lower_bound_s));
        prop_assert!(close(doubled.reshard.seconds, 2.0 * r.seconds));
        prop_assert!(close(doubled.gather_broadcast.seconds, 2.0 * g.seconds));
    }
}

#[test]
fn pairs_priced_directly() {
    // what a batched planner reports: 1 MB in 3 messages across domains, 1 MB locally
    let pairs = [
        (
            (0, 2),
            Load {
                bytes: 1_000_000,
                messages: 3,
            },
        ),
        (
            (2, 2),
            Load {
                bytes: 1_000_000,
                messages: 1,
            },
        ),
    ];
    let cost = price_pairs(&pairs, &toy(), Messages::PerTransfer).unwrap();
    assert_us!(cost.seconds, 112);
    assert_eq!((cost.messages, cost.pairs), (3, 1));
    assert_eq!(cost.bytes.memory, 1_000_000);
    let coalesced = price_pairs(
        &pairs,
        &toy(),
        Messages::Chunked {
            chunk_bytes: 1_000_000,
        },
    )
    .unwrap();
    assert_us!(coalesced.seconds, 104);
}

#[test]
fn ranks_beyond_the_dense_matrix_price_the_same() {
    // the same 1000 tiny tensors as above, between ranks far apart (per-pair totals in a map)
    let near: Vec<Plan> = (0..1000)
        .map(|_| plan(&[100], "mesh=1 ranks=0 place=R", "mesh=1 ranks=2 place=R"))
        .collect();
    let far: Vec<Plan> = (0..1000)
        .map(|_| {
            plan(
                &[100],
                "mesh=1 ranks=0 place=R",
                "mesh=1 ranks=5000 place=R",
            )
        })
        .collect();
    let near = price(&near, &toy(), &SimOptions::default()).unwrap();
    let far = price(&far, &toy(), &SimOptions::default()).unwrap();
    assert_us!(far.reshard.seconds, 4010);
    assert_eq!(far.reshard.seconds, near.reshard.seconds);
    assert_eq!(far.reshard.bytes, near.reshard.bytes);
    assert_eq!(far.reshard.busiest.unwrap().gpu, 0);
}

#[test]
fn the_domain_bound_lets_a_relay_beat_the_direct_plan() {
    // rank 0 (domain 0) holds 1 MB; ranks 2, 3 (domain 1) each need all of it. Sent directly,
    // rank 0's NIC carries 2 MB (200 us); relayed, 1 MB leaves domain 0 through its one GPU's
    // NIC (100 us) and enters domain 1 through two (50 us)
    let p = plan(
        &[1_000_000],
        "mesh=1 ranks=0 place=R",
        "mesh=2 ranks=2,3 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_us!(priced.reshard.lower_bound_s, 200);
    assert_us!(priced.domain_bound_s, 100);
}

#[test]
fn the_domain_bound_counts_what_a_domain_already_holds() {
    // domain 0 holds the top half (rank 0) and needs all of it (rank 1): 500 kB must enter
    // through 2 NICs (25 us); domain 1 holds the bottom half (rank 2) and only it: 500 kB
    // must leave through its GPU's NIC (50 us)
    let p = plan(
        &[2, 500_000],
        "mesh=2 ranks=0,2 place=S(0)",
        "mesh=1 ranks=1 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_us!(priced.domain_bound_s, 50);
    assert_us!(priced.reshard.lower_bound_s, 50);

    // both domains hold all of it: nothing has to cross, yet the plan splits rank 1's piece
    // between its two replicas, and half of it comes over the network
    let p = plan(
        &[1_000_000],
        "mesh=2 ranks=0,2 place=R",
        "mesh=1 ranks=1 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_us!(priced.domain_bound_s, 0);
    assert_us!(priced.reshard.lower_bound_s, 50);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The domain bound holds for every plan, so for this one too.
    #[test]
    fn the_domain_bound_is_below_the_plan_bound(
        (src, dst) in arb_layout_pair(),
        cluster in arb_cluster(),
    ) {
        let plan = Plan::new(src, dst).unwrap();
        let priced = price(std::slice::from_ref(&plan), &cluster, &SimOptions::default()).unwrap();
        prop_assert!(
            priced.domain_bound_s <= priced.reshard.lower_bound_s * (1.0 + 1e-12),
            "domain bound {} above the plan's {}", priced.domain_bound_s,
            priced.reshard.lower_bound_s
        );
    }
}

#[test]
fn the_broadcast_chain_starts_at_the_root_and_wraps_around() {
    // root on GPU 2; receivers on GPUs 0 and 3: the chain is 2 -> 3 (NVLink) -> 0 (network)
    let p = plan(
        &[1_000_000],
        "mesh=1 ranks=2 place=R",
        "mesh=2 ranks=0,3 place=R",
    );
    let priced = price(&[p], &toy(), &SimOptions::default()).unwrap();
    assert_us!(priced.gather_broadcast.broadcast_s, (1 + 10) + (4 + 100));
    assert_eq!(
        priced.gather_broadcast.bytes_by_link,
        LinkBytes {
            memory: 0,
            nvlink: 1_000_000,
            network: 1_000_000,
        }
    );
    // the reshard sends both copies from GPU 2: its NIC carries one
    assert_us!(priced.reshard.seconds, 104);
}

/// Past 2^64 bytes the per-port counts would saturate and the times look real: refused.
#[test]
fn plans_past_64_bits_are_not_priced() {
    let huge = plan(&[1 << 62], "mesh=1 place=R", "mesh=4 place=R");
    let err = price(&[huge], &Cluster::h100(), &SimOptions::default()).unwrap_err();
    assert!(matches!(err, SimError::TooLarge { .. }), "{err}");
    assert!(
        err.to_string()
            .ends_with("more than 2^64-1: too many to price"),
        "{err}"
    );
    let fits = plan(&[1 << 62], "mesh=1 place=R", "mesh=2 place=R");
    assert!(price(&[fits], &Cluster::h100(), &SimOptions::default()).is_ok());
}

#[test]
fn a_relayed_transfer_crosses_the_network_once_and_fans_out_over_nvlink() {
    // domains of 2 GPUs: rank 0 (domain 0) holds the tensor, ranks 2 and 3 (domain 1) need it
    let cluster = Cluster {
        gpus_per_node: 2,
        nvlink_domain: 2,
        ..Cluster::h100()
    };
    let layout = |spec: &str| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&[1024, 1024], DType::F32, 0)
            .unwrap()
    };
    let hosts = cluster.domain_map(4).unwrap();
    assert_eq!(hosts, crate::topology::HostMap::parse("2x2").unwrap());
    let priced = |relay: bool| {
        let topology = crate::plan::Topology::new(hosts.clone(), relay);
        let p = Plan::with_topology(
            layout("mesh=1 place=R"),
            layout("mesh=2 ranks=2..4 place=R"),
            PlanOptions::default(),
            Some(topology),
        )
        .unwrap();
        price_reshard(&[p], &cluster, Messages::PerTransfer).unwrap()
    };
    let t = 4u64 << 20;
    let (on, off) = (priced(true), priced(false));
    assert_eq!((off.bytes.network, off.bytes.nvlink), (2 * t, 0));
    assert_eq!((on.bytes.network, on.bytes.nvlink), (t, t));
    // off: GPU 0's NIC sends the tensor twice; on: once
    let nic = t as f64 / (cluster.nic_gb_s * 1e9);
    assert!((off.lower_bound_s - 2.0 * nic).abs() < 1e-12, "{off:?}");
    assert!((on.lower_bound_s - nic).abs() < 1e-12, "{on:?}");
}
