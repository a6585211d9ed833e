//! What `reshard bench` prints: a table of both methods per case, or the JSON report.

use serde::Serialize;

use super::args::BenchArgs;
use super::result::CaseResult;
use super::suite::Case;
use crate::cli::units::bytes;
use reshard::runtime::harness::MethodJson;

#[derive(Serialize)]
struct CaseJson {
    #[serde(skip_serializing_if = "String::is_empty")]
    name: String,
    shape: Vec<u64>,
    dtype: String,
    /// The destination's dtype (`--dst-dtype`): `dst_bytes` and the reshard's `wire_bytes`
    /// count it; gather+broadcast moves the source's dtype and converts as ranks keep boxes.
    dst_dtype: String,
    src: String,
    dst: String,
    transport: String,
    iters: u32,
    verified: bool,
    /// Whether both methods ran with `--checksum`; left out when not.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    checksummed: bool,
    dst_bytes: u64,
    /// With `--quant`: the scheme. `reshard` then quantizes in flight (its `wire_bytes` are
    /// fp8 values and scales), while `gather_broadcast` and `reshard_then_quantize` move the
    /// source's dtype and quantize on the receivers after the move (their times include it).
    #[serde(skip_serializing_if = "Option::is_none")]
    quant: Option<String>,
    /// `"quantized"` when the source is already fp8 with its scales (an fp8 `dtype` with
    /// `quant`): `reshard` and `gather_broadcast` then move the values and the scales, their
    /// `wire_bytes` count both, and `dst_bytes` is the values' and the scales' shards.
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<&'static str>,
    /// With an already-quantized source: the scales' dtype and the bytes of every
    /// destination's scale shard (counted in `dst_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    scale_dtype: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dst_scale_bytes: Option<u64>,
    reshard: MethodJson,
    gather_broadcast: MethodJson,
    /// With `--quant`: the reshard in the source's dtype, then every destination quantizes
    /// the shard it received.
    #[serde(skip_serializing_if = "Option::is_none")]
    reshard_then_quantize: Option<MethodJson>,
    /// With an already-quantized source: the reshard of the values alone, without their
    /// scales (its `wire_bytes` are the values').
    #[serde(skip_serializing_if = "Option::is_none")]
    values_only: Option<MethodJson>,
    speedup: f64,
    /// With an already-quantized source: `reshard.median_s / values_only.median_s`, what
    /// moving the scales beside the values costs (1: nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    reshard_vs_values_only: Option<f64>,
    /// With `--quant`: `reshard_then_quantize.median_s / reshard.median_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    reshard_then_quantize_speedup: Option<f64>,
    /// Wire bytes of gather+broadcast over those of the reshard: the speedup a machine whose
    /// time follows bytes would show.
    byte_ratio: f64,
    /// Across hosts (`--hosts`): gather+broadcast's busiest link bytes over the reshard's,
    /// the speedup a machine bound by its host links would show.
    #[serde(skip_serializing_if = "Option::is_none")]
    link_ratio: Option<f64>,
}

#[derive(Serialize)]
struct SuiteJson {
    suite: String,
    transport: String,
    cases: Vec<CaseJson>,
}
pub(super) fn report(
    args: &BenchArgs,
    cases: &[Case],
    transport: &str,
    results: &[CaseResult],
    predicted: Option<&[(f64, f64)]>,
) {
    let json_of = |(i, (case, r)): (usize, (&Case, &CaseResult))| {
        let dst_bytes = case.dst_bytes();
        let predicted = predicted.map(|p| p[i]);
        let reshard = MethodJson {
            busiest_link_bytes: case.plan.host_links().map(|l| l.busiest()),
            predicted_s: predicted.map(|p| p.0),
            ..MethodJson::of(&r.reshard, dst_bytes)
        };
        let gather_broadcast = MethodJson {
            busiest_link_bytes: case.baseline.host_links().map(|l| l.busiest()),
            predicted_s: predicted.map(|p| p.1),
            ..MethodJson::of(&r.gather_broadcast, dst_bytes)
        };
        let link_ratio = reshard
            .busiest_link_bytes
            .zip(gather_broadcast.busiest_link_bytes)
            .map(|(mine, theirs)| theirs as f64 / mine.max(1) as f64);
        let then = r
            .reshard_then_quantize
            .as_ref()
            .map(|m| MethodJson::of(m, dst_bytes));
        let coupled = case.coupled.as_ref();
        let values_only = r
            .values_only
            .as_ref()
            .map(|m| MethodJson::of(m, case.plan.dst().shard_bytes()));
        CaseJson {
            quant: case
                .plan
                .quant()
                .map(|q| q.quant)
                .or(coupled.map(|c| c.mv.quant))
                .map(|q| q.scheme.to_string()),
            source: coupled.map(|_| "quantized"),
            scale_dtype: coupled.map(|c| c.mv.quant.scale_dtype.to_string()),
            dst_scale_bytes: coupled.map(|c| c.dst_scale_bytes()),
            reshard_vs_values_only: values_only
                .as_ref()
                .map(|v| reshard.median_s / v.median_s.max(1e-12)),
            values_only,
            reshard_then_quantize_speedup: then
                .as_ref()
                .map(|t| t.median_s / reshard.median_s.max(1e-12)),
            reshard_then_quantize: then,
            name: case.name.clone(),
            shape: case.plan.src().shape().to_vec(),
            dtype: case.plan.src().dtype().to_string(),
            dst_dtype: case.plan.dst().dtype().to_string(),
            src: case.src_spec.clone(),
            dst: case.dst_spec.clone(),
            transport: transport.to_string(),
            iters: args.iters,
            verified: r.verified,
            checksummed: args.exec.checksum,
            dst_bytes,
            speedup: gather_broadcast.median_s / reshard.median_s.max(1e-12),
            byte_ratio: r.gather_broadcast.wire_bytes as f64 / r.reshard.wire_bytes.max(1) as f64,
            link_ratio,
            reshard,
            gather_broadcast,
        }
    };
    let all: Vec<CaseJson> = cases.iter().zip(results).enumerate().map(json_of).collect();
    if args.json {
        let text = match (args.suite, all.len()) {
            (None, 1) => serde_json::to_string_pretty(&all[0]),
            _ => serde_json::to_string_pretty(&SuiteJson {
                suite: "refit".into(),
                transport: transport.to_string(),
                cases: all,
            }),
        };
        println!("{}", text.expect("bench JSON serializes"));
        return;
    }
    let coupled = cases.iter().any(|c| c.coupled.is_some());
    let compared = match args.quant {
        Some(_) if coupled => {
            "an already-quantized tensor's values and scales: reshard vs gather+broadcast of both vs the values alone,"
        }
        Some(_) => {
            "reshard quantizing in flight vs reshard or gather+broadcast of the source dtype, then quantizing on the receivers,"
        }
        None => "reshard vs gather+broadcast",
    };
    // what the checks found: every case's every byte, or not
    let verified = match results.iter().all(|r| r.verified) {
        true => "every",
        false => "NOT every",
    };
    println!(
        "{compared} over {transport}, median of {} (after {} warm-up), {verified} destination byte{} verified{}",
        args.iters,
        args.warmup,
        if args.quant.is_some() {
            " and scale"
        } else {
            ""
        },
        if args.exec.checksum {
            ", every transfer checksummed"
        } else {
            ""
        }
    );
    if args.quant.is_none() {
        table_header();
    }
    for (case, j) in cases.iter().zip(&all) {
        case_line(case, j);
    }
    if let Some(path) = &args.simulate {
        println!(
            "predicted by the cost model of {path} against measured (error: predicted over measured, less 1)"
        );
        for (case, j) in cases.iter().zip(&all) {
            let name = if case.name.is_empty() {
                "-"
            } else {
                case.name.as_str()
            };
            let line = |m: &MethodJson| {
                let p = m.predicted_s.unwrap_or(0.0);
                format!(
                    "{:>9.2} ms predicted {:>9.2} ms measured {:>+6.1}%",
                    p * 1e3,
                    m.median_s * 1e3,
                    (p / m.median_s.max(1e-12) - 1.0) * 100.0
                )
            };
            println!(
                "{name:<22} reshard {}   g+b {}",
                line(&j.reshard),
                line(&j.gather_broadcast)
            );
        }
    }
}

fn table_header() {
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>11} {:>11}",
        "case",
        "dst",
        "reshard",
        "g+b",
        "reshard",
        "GB/s",
        "g+b GB/s",
        "speedup",
        "bytes",
        "extra mem",
        "g+b extra"
    );
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8} {:>7} {:>11} {:>11}",
        "", "bytes", "ms", "ms", "wire", "", "", "", "ratio", "reshard", "per rank"
    );
}

fn case_line(case: &Case, j: &CaseJson) {
    let name = if case.name.is_empty() {
        println!(
            "{}: {} -> {}",
            j.shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("x"),
            case.src_spec,
            case.dst_spec
        );
        format!("{}-D {}", j.shape.len(), j.dtype)
    } else {
        case.name.clone()
    };
    if let (Some(scheme), Some(then)) = (&j.quant, &j.reshard_then_quantize) {
        quant_lines(j, scheme, then);
        return;
    }
    if let (Some(scheme), Some(alone)) = (&j.quant, &j.values_only) {
        prequant_lines(j, scheme, alone);
        return;
    }
    println!(
        "{:<22} {:>10} {:>10.2} {:>10.2} {:>10} {:>9.2} {:>9.2} {:>7.2}x {:>6.2}x {:>11} {:>11}",
        name,
        bytes(j.dst_bytes),
        j.reshard.median_s * 1e3,
        j.gather_broadcast.median_s * 1e3,
        bytes(j.reshard.wire_bytes),
        j.reshard.gbps,
        j.gather_broadcast.gbps,
        j.speedup,
        j.byte_ratio,
        bytes(j.reshard.peak_extra_bytes_per_rank),
        bytes(j.gather_broadcast.peak_extra_bytes_per_rank),
    );
}

/// A quantizing case: the three methods, one a line.
fn quant_lines(j: &CaseJson, scheme: &str, then: &MethodJson) {
    println!(
        "{} -> {} {scheme}: quantize in flight vs on the receivers after moving {} (their times include it)",
        j.dtype, j.dst_dtype, j.dtype
    );
    method_table(
        j,
        &[
            ("reshard, quantizing in flight", &j.reshard),
            ("(a) reshard, then quantize", then),
            ("(b) gather+broadcast, then quantize", &j.gather_broadcast),
        ],
    );
}

/// An already-quantized case: the three methods, one a line.
fn prequant_lines(j: &CaseJson, scheme: &str, alone: &MethodJson) {
    println!(
        "{} {scheme}, already quantized: values and {} scales ({} of them at the destinations) move together",
        j.dtype,
        j.scale_dtype.as_deref().unwrap_or("f32"),
        bytes(j.dst_scale_bytes.unwrap_or(0))
    );
    method_table(
        j,
        &[
            ("reshard, values and scales", &j.reshard),
            ("gather+broadcast, values and scales", &j.gather_broadcast),
            ("reshard, the values alone", alone),
        ],
    );
}

/// The methods of a three-way case, one a line, timed against the reshard.
fn method_table(j: &CaseJson, methods: &[(&str, &MethodJson)]) {
    println!(
        "  {:<34} {:>10} {:>12} {:>9} {:>9} {:>11}",
        "method", "ms", "wire", "GB/s", "vs ours", "extra mem"
    );
    for (name, m) in methods {
        println!(
            "  {:<34} {:>10.2} {:>12} {:>9.2} {:>8.2}x {:>11}",
            name,
            m.median_s * 1e3,
            bytes(m.wire_bytes),
            m.gbps,
            m.median_s / j.reshard.median_s.max(1e-12),
            bytes(m.peak_extra_bytes_per_rank),
        );
    }
}
