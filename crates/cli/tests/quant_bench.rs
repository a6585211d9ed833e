//! `bench --quant`: the quantizing reshard against (a) the reshard in the source's dtype and
//! (b) gather+broadcast, each then quantizing on the receivers. Every repetition of all three
//! verifies values and scales against the naive reference (a mismatch fails the bench); here
//! the report's shape and its wire bytes are checked against the plans, in one process and
//! over tcp and shm.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{EXE, text, wait_bounded};
use reshard::layout::LayoutSpec;
use reshard::plan::QuantRequest;
use reshard::{DType, Plan, PlanOptions};

fn plans(shape: &[u64], src: &str, dst: &str, scheme: &str) -> (Plan, Plan) {
    let layout = |spec: &str, dtype, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, dtype, first)
            .unwrap()
    };
    let s = layout(src, DType::Bf16, 0);
    let after = s.mesh().ranks().iter().max().unwrap() + 1;
    let request = QuantRequest {
        scheme: scheme.parse().unwrap(),
        scale_dtype: None,
    };
    let quant = Plan::with_quant(
        s.clone(),
        layout(dst, DType::Fp8E4M3, after),
        PlanOptions::default(),
        Some(request),
    )
    .unwrap();
    let plain = Plan::new(s, layout(dst, DType::Bf16, after)).unwrap();
    (quant, plain)
}

#[test]
fn bench_quant_compares_three_methods_with_their_wire_bytes() {
    let cases = [
        (
            "local",
            "64,48",
            "mesh=4 place=S(0)",
            "mesh=2 place=S(1)",
            "block:16x8",
        ),
        (
            "local",
            "40,64",
            "mesh=2 place=R",
            "mesh=2 place=S(0)",
            "mx:32",
        ),
        (
            "tcp",
            "64,64",
            "mesh=2 place=S(0)",
            "mesh=2 place=S(1)",
            "block:32x32",
        ),
        (
            "shm",
            "64,64",
            "mesh=2 place=S(1)",
            "mesh=2 place=S(0)",
            "channel",
        ),
    ];
    for (transport, shape, src, dst, scheme) in cases {
        let mut c = Command::new(EXE);
        if transport != "local" {
            c.args(["launch", "--nproc", "4", "--"]);
        }
        let child = c
            .args(["bench", "--shape", shape, "--dtype", "bf16"])
            .args([
                "--dst-dtype",
                "fp8e4m3",
                "--quant",
                scheme,
                "--fill",
                "normal:3",
            ])
            .args(["--src", src, "--dst", dst, "--iters", "2"])
            .args(["--transport", transport, "--timeout", "60", "--json"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let what = format!("bench --quant {scheme} {src} -> {dst} over {transport}");
        let out = wait_bounded(child, Duration::from_secs(180), &what);
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["verified"], true, "{what}: {j}");
        assert_eq!(j["quant"], scheme, "{what}: {j}");
        let dims: Vec<u64> = shape.split(',').map(|d| d.parse().unwrap()).collect();
        let (quant, plain) = plans(&dims, src, dst, scheme);
        let q = quant.quant().unwrap().totals(&quant);
        let wire = |key: &str| j[key]["wire_bytes"].as_u64().unwrap();
        let values = quant.totals().bytes_remote;
        assert_eq!(values * 2, plain.totals().bytes_remote, "{what}");
        assert_eq!(wire("reshard"), values + q.scale_bytes, "{what}: {j}");
        assert_eq!(
            wire("reshard_then_quantize"),
            plain.totals().bytes_remote,
            "{what}: {j}"
        );
        assert!(j["reshard_then_quantize_speedup"].as_f64().unwrap() > 0.0);
        for key in ["reshard", "reshard_then_quantize", "gather_broadcast"] {
            assert_eq!(j[key]["median_s"].as_f64().map(|t| t > 0.0), Some(true));
        }
    }
}

/// A layout whose destination shards cut the receivers' blocks cannot be compared: refused
/// with exit code 2, naming the scheme and the boundary.
#[test]
fn bench_quant_refuses_blocks_spread_over_destination_shards() {
    let out = Command::new(EXE)
        .args(["bench", "--shape", "16,16", "--dst-dtype", "fp8e4m3"])
        .args(["--quant", "channel", "--fill", "normal"])
        .args(["--src", "mesh=2 place=S(0)", "--dst", "mesh=2 place=S(1)"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("--quant") && err.contains("channel"), "{err}");
    assert!(err.contains("boundary at 8 along dim 1"), "{err}");
}
