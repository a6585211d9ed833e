//! `reshard plan`: the transfer plan as a table and a picture, or as JSON.

use std::fmt::Write;

use clap::Args;
use reshard::error::{Dims, Field};
use reshard::plan::{PlanJson, QuantizedMove};
use reshard::sim::{Cluster, Pricing, SimError, SimOptions, Simulation, Testbed, TestbedCost};
use reshard::{Error, Plan};
use serde::Serialize;

use super::units::bytes;
use super::{Failure, TensorArgs, picture};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    tensor: TensorArgs,
    /// Print the plan as JSON (the format of the design notes).
    #[arg(long)]
    json: bool,
    /// Print at most this many transfers in the table (JSON always has all).
    #[arg(long, default_value_t = 64)]
    max_rows: usize,
    /// Price the plan on a cluster, as a reshard and as gather+broadcast: h100, gb200, or a
    /// JSON cluster file (see the `sim` module docs).
    #[arg(long, value_name = "CLUSTER")]
    simulate: Option<String>,
}

/// The plan JSON, with a `simulation` object when `--simulate` is given.
#[derive(Serialize)]
struct PlanWithSimulation {
    #[serde(flatten)]
    plan: PlanJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    simulation: Option<Simulation>,
}

pub fn main(args: &PlanArgs) -> Result<(), Failure> {
    // an fp8 source with --quant: values and scales planned as two coupled reshards
    let moved = match args.tensor.source_is_quantized()? {
        true => Some(args.tensor.quantized_move()?),
        false => None,
    };
    let plans = match &moved {
        Some(mv) => vec![mv.values.clone(), mv.scales.clone()],
        None => vec![args.tensor.plan()?],
    };
    let plan = &plans[0];
    let pricing = match &args.simulate {
        None => None,
        Some(arg) => {
            super::start_thread_pool()?;
            Some(simulate(&plans, arg)?)
        }
    };
    if args.json {
        let json = PlanWithSimulation {
            plan: moved
                .as_ref()
                .map_or_else(|| PlanJson::of(plan), QuantizedMove::json),
            simulation: pricing.as_ref().map(|(_, s)| s.clone()),
        };
        let json = serde_json::to_string_pretty(&json).expect("plan JSON serializes");
        println!("{json}");
    } else {
        print!("{}", describe_with(plan, args.max_rows, moved.as_ref()));
        if let Some((text, _)) = &pricing {
            print!("{text}");
        }
    }
    Ok(())
}

/// The plans and their gather+broadcast priced on a testbed of hosts (`"kind": "hosts"`);
/// the baseline runs on the testbed's hosts, hierarchically. Several plans (the values and
/// the scales of an already-quantized tensor) run one after the other, so their times add
/// up, and so do the bytes on their busiest links.
fn simulate_testbed(plans: &[Plan], bed: &Testbed) -> Result<(String, Simulation), SimError> {
    let topology = reshard::plan::Topology::new(bed.host_map(), true);
    let (mut mine, mut theirs) = (TestbedCost::default(), TestbedCost::default());
    for plan in plans {
        let gb = reshard::plan::GatherBroadcast::on_hosts(plan.src(), plan.dst(), Some(&topology))
            .map_err(|e| SimError::InvalidField {
                field: "hosts",
                value: bed.hosts.to_string(),
                reason: e.to_string(),
            })?;
        add_cost(&mut mine, &reshard::sim::price_on_testbed(plan, bed)?);
        add_cost(&mut theirs, &reshard::sim::price_baseline_on(&gb, bed)?);
    }
    let sim = Simulation {
        cluster: bed.name.clone(),
        reshard_s: mine.seconds,
        gather_broadcast_s: theirs.seconds,
        lower_bound_s: mine.busiest_link_bytes as f64 / bed.link_bytes_s(),
        speedup: theirs.seconds / mine.seconds.max(1e-12),
    };
    let mut out = String::new();
    let _ = writeln!(out);
    let _ = writeln!(out, "simulated on {}", bed.summary());
    for (name, c) in [("reshard", &mine), ("gather+broadcast", &theirs)] {
        let _ = writeln!(
            out,
            "  {name:<17} {} (busiest link {}, busiest rank's core {}, shared cores {}; {} on the busiest link)",
            seconds(c.seconds),
            seconds(c.link_s),
            seconds(c.rank_cpu_s),
            seconds(c.cores_s),
            bytes(c.busiest_link_bytes)
        );
    }
    let _ = writeln!(out, "  speedup           {:.2}x", sim.speedup);
    Ok((out, sim))
}

/// Adds the cost of a phase that runs after those `total` holds.
fn add_cost(total: &mut TestbedCost, phase: &TestbedCost) {
    total.seconds += phase.seconds;
    total.link_s += phase.link_s;
    total.rank_cpu_s += phase.rank_cpu_s;
    total.cores_s += phase.cores_s;
    total.busiest_link_bytes += phase.busiest_link_bytes;
}

/// Prices the plans (one, or the values and the scales of an already-quantized tensor) on
/// the cluster or testbed `arg` names: the report's text and the JSON `simulation` object.
/// Errors name `--simulate`.
fn simulate(plans: &[Plan], arg: &str) -> Result<(String, Simulation), Error> {
    let invalid = |e: SimError| Error::InvalidOption {
        field: Field::Flag("--simulate"),
        value: arg.to_string(),
        reason: e.to_string(),
    };
    let testbed = std::fs::read_to_string(arg).is_ok_and(|t| reshard::sim::is_testbed(&t));
    if testbed {
        let bed = Testbed::load(arg).map_err(invalid)?;
        return simulate_testbed(plans, &bed).map_err(invalid);
    }
    let cluster = Cluster::load(arg).map_err(invalid)?;
    let pricing = reshard::sim::price(plans, &cluster, &SimOptions::default()).map_err(invalid)?;
    Ok((describe_pricing(&cluster, &pricing), pricing.simulation()))
}

/// Seconds as people read them: `12.3 us`, `4.56 ms`, `1.23 s`.
fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

/// The modeled times, the busiest port, and the speedup.
pub(super) fn describe_pricing(cluster: &Cluster, p: &Pricing) -> String {
    let sim = p.simulation();
    let mut out = String::new();
    let _ = writeln!(out);
    let _ = writeln!(out, "simulated on {}", cluster.summary());
    let busiest = p.reshard.busiest.map_or(String::new(), |b| {
        format!("; busiest: GPU {} {}", b.gpu, b.port)
    });
    let _ = writeln!(
        out,
        "  reshard           {} (lower bound {}{busiest})",
        seconds(sim.reshard_s),
        seconds(sim.lower_bound_s)
    );
    let _ = writeln!(
        out,
        "  any plan          at least {} (what must cross the NVLink domains' NICs)",
        seconds(p.domain_bound_s)
    );
    let g = &p.gather_broadcast;
    let _ = writeln!(
        out,
        "  gather+broadcast  {} (all-gather {}, broadcast {})",
        seconds(sim.gather_broadcast_s),
        seconds(g.gather_s),
        seconds(g.broadcast_s)
    );
    let _ = writeln!(out, "  speedup           {:.1}x", sim.speedup);
    out
}

/// The layouts, the transfer table, the totals and (for 2-D tensors) the picture.
pub fn describe(plan: &Plan, max_rows: usize) -> String {
    describe_with(plan, max_rows, None)
}

/// [`describe`] of `plan`, which is `moved`'s values when the source is already quantized:
/// then with the scale tensor's totals and transfers after the values'.
fn describe_with(plan: &Plan, max_rows: usize, moved: Option<&QuantizedMove>) -> String {
    let (src, dst) = (plan.src(), plan.dst());
    let shape: Vec<String> = src.shape().iter().map(u64::to_string).collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tensor  {} {} ({})",
        shape.join("x"),
        src.dtype(),
        bytes(src.total_bytes())
    );
    if let Some(mv) = moved {
        let _ = writeln!(
            out,
            "quant   {} already quantized by {} (scales {}, grid {}): values and scales move as they are, as two coupled reshards",
            src.dtype(),
            mv.quant.scheme,
            mv.quant.scale_dtype,
            Dims(mv.grid.grid_shape())
        );
    } else if let Some(q) = plan.quant() {
        let _ = writeln!(
            out,
            "quant   {} -> {} by {} (scales {}, grid {}): the senders quantize as they pack",
            src.dtype(),
            dst.dtype(),
            q.quant.scheme,
            q.quant.scale_dtype,
            q.grid
                .grid_shape()
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("x")
        );
    } else if dst.dtype() != src.dtype() {
        let _ = writeln!(
            out,
            "convert {} -> {} by the senders as they pack: byte counts are {}'s",
            src.dtype(),
            dst.dtype(),
            dst.dtype()
        );
    }
    let _ = writeln!(out, "src     {src}  ({} ranks)", src.mesh().size());
    let _ = writeln!(out, "dst     {dst}  ({} ranks)", dst.mesh().size());
    let _ = writeln!(out);
    let _ = writeln!(out, "{} transfers:", plan.transfers().len());
    transfer_rows(&mut out, plan, max_rows);
    let t = moved.map_or_else(|| plan.totals(), QuantizedMove::totals);
    // a count that overflowed 64 bits is shown as such, never as the saturated number
    let size = |field: &str, n: u64| {
        if t.overflow.contains(field) {
            "more than 16.0 EiB (overflows 64 bits)".to_string()
        } else {
            bytes(n)
        }
    };
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "remote  {} in {} messages; local copies {}",
        size("bytes_remote", t.bytes_remote),
        t.messages,
        size("bytes_local", t.bytes_local)
    );
    let _ = writeln!(
        out,
        "busiest rank sends {}, receives {}",
        size("max_rank_send_bytes", t.max_rank_send_bytes),
        size("max_rank_recv_bytes", t.max_rank_recv_bytes)
    );
    let ratio = if !t.overflow.is_empty() {
        "the ratio is unknown: a total overflows 64 bits".to_string()
    } else if t.bytes_remote > 0 {
        format!(
            "{:.1}x what reshard moves",
            t.gather_broadcast_bytes as f64 / t.bytes_remote as f64
        )
    } else {
        "reshard moves nothing".to_string()
    };
    let _ = writeln!(
        out,
        "gather+broadcast would move {} ({ratio})",
        size("gather_broadcast_bytes", t.gather_broadcast_bytes)
    );
    if let Some(q) = t.quant.filter(|_| moved.is_none()) {
        let _ = writeln!(
            out,
            "amax    {} in {} messages between source ranks whose shards cut a block",
            bytes(q.amax_bytes),
            q.amax_messages
        );
        let _ = writeln!(
            out,
            "scales  {} in {} messages beside the values; local copies {}",
            bytes(q.scale_bytes),
            q.scale_messages,
            bytes(q.scale_bytes_local)
        );
    }
    if let (Some(mv), Some(q)) = (moved, t.quant) {
        let _ = writeln!(
            out,
            "scales  {} in {} messages after the values; local copies {}",
            bytes(q.scale_bytes),
            q.scale_messages,
            bytes(q.scale_bytes_local)
        );
        let _ = writeln!(
            out,
            "gather+broadcast of the scales would move {}",
            bytes(q.scale_gather_broadcast_bytes.unwrap_or(0))
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{} scale transfers (regions of the {} scale grid):",
            mv.scales.transfers().len(),
            Dims(mv.grid.grid_shape())
        );
        transfer_rows(&mut out, &mv.scales, max_rows);
    }
    if let Some(links) = plan.host_links() {
        let relay = plan.topology().is_some_and(|t| t.relay);
        let _ = writeln!(
            out,
            "host links ({} hosts{}): busiest carries {}",
            links.links.len(),
            if relay { ", relay on" } else { ", relay off" },
            bytes(links.busiest())
        );
        for l in &links.links {
            let _ = writeln!(
                out,
                "  host {:>3}  out {:>12}  in {:>12}",
                l.host,
                bytes(l.out_bytes),
                bytes(l.in_bytes)
            );
        }
    }
    if let Some(picture) = picture::draw(plan) {
        let _ = writeln!(out);
        out.push_str(&picture);
    }
    out
}

/// The table of `plan`'s transfers, at most `max_rows` of them.
fn transfer_rows(out: &mut String, plan: &Plan, max_rows: usize) {
    let elem = plan.elem_bytes();
    let _ = writeln!(
        out,
        "  {:>6} {:>6}  {:<28} {:>12}",
        "src", "dst", "region", "bytes"
    );
    for t in plan.transfers().iter().take(max_rows) {
        let kind = match t.via {
            _ if t.is_local() => "  (local)".to_string(),
            Some(v) => format!("  (via {v})"),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:>6} {:>6}  {:<28} {:>12}{kind}",
            t.src,
            t.dst,
            t.region.to_string(),
            t.bytes(elem)
        );
    }
    if plan.transfers().len() > max_rows {
        let _ = writeln!(
            out,
            "  ... {} more (--max-rows, or --json)",
            plan.transfers().len() - max_rows
        );
    }
}
