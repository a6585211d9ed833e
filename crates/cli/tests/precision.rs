//! Precision in flight from the command line: `--dst-dtype` over local, tcp and shm, checked
//! bit for bit against a naive reference built from the dumped source shards (materialize the
//! global tensor, cast every element with `convert::cast`, slice each destination's box).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::{EXE, temp_dir, text, wait_bounded};
use reshard::DType;
use reshard::layout::{Layout, LayoutSpec};
use reshard::region::Region;

const FLOATS: [&str; 4] = ["f64", "f32", "bf16", "f16"];

/// Uneven shards both ways, a replicated source (two holders of each piece), and rank 2 in
/// both meshes (a local copy that converts too).
const SHAPE: [u64; 2] = [64, 41];
const SRC: &str = "mesh=2x2 place=S(0),R";
const DST: &str = "mesh=3 ranks=2..5 place=S(1)";

fn layout(spec: &str, dtype: DType) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(&SHAPE, dtype, 0)
        .unwrap()
}

/// Global row-major element indices of `region`, in its own row-major order.
fn indices(region: &Region) -> Vec<u64> {
    let mut out = Vec::new();
    let n = region.volume();
    for i in 0..n {
        let (mut rest, mut global, mut stride) = (i, 0u64, 1u64);
        let mut coords = vec![0u64; region.ndim()];
        for d in (0..region.ndim()).rev() {
            coords[d] = region.offset[d] + rest % region.extent[d];
            rest /= region.extent[d];
        }
        for d in (0..region.ndim()).rev() {
            global += coords[d] * stride;
            stride *= SHAPE[d];
        }
        out.push(global);
    }
    out
}

/// Rebuilds the global source tensor from `DIR/src<R>.bin`, casts it element by element, and
/// compares every destination dump `DIR/rank<R>.bin` with its box of the result.
fn check_against_reference(dir: &Path, from: DType, to: DType, what: &str) {
    let src = layout(SRC, from);
    let dst = layout(DST, to);
    let total: u64 = SHAPE.iter().product();
    let (se, de) = (from.size(), to.size());
    let mut global = vec![0u8; total as usize * se];
    for &r in src.mesh().ranks() {
        let bytes = std::fs::read(dir.join(format!("src{r}.bin"))).unwrap();
        let region = src.local_region(r).unwrap();
        assert_eq!(bytes.len() as u64, region.volume() * se as u64, "{what}");
        for (k, g) in indices(&region).into_iter().enumerate() {
            let g = g as usize;
            global[g * se..(g + 1) * se].copy_from_slice(&bytes[k * se..(k + 1) * se]);
        }
    }
    // the fill gives the special values the casts must carry: NaN or infinity, subnormals
    let (nonfinite, subnormal) = specials(from, &global);
    assert!(
        nonfinite > 0 && subnormal > 0,
        "{what}: {nonfinite} {subnormal}"
    );
    let mut cast = vec![0u8; total as usize * de];
    reshard::convert::cast(from, to, &global, &mut cast).unwrap();
    for &r in dst.mesh().ranks() {
        let got = std::fs::read(dir.join(format!("rank{r}.bin"))).unwrap();
        let region = dst.local_region(r).unwrap();
        let mut want = Vec::new();
        for g in indices(&region) {
            let g = g as usize;
            want.extend_from_slice(&cast[g * de..(g + 1) * de]);
        }
        assert!(
            got == want,
            "{what}: rank {r}'s {from} -> {to} shard differs from the reference"
        );
    }
}

/// How many elements of `bytes` (of `dtype`) are NaN or infinite, and how many subnormal.
fn specials(dtype: DType, bytes: &[u8]) -> (usize, usize) {
    let (exp_bits, man_bits) = match dtype {
        DType::F64 => (11, 52),
        DType::F32 => (8, 23),
        DType::Bf16 => (8, 7),
        DType::F16 => (5, 10),
        other => panic!("{other} is not a float"),
    };
    let (mut nonfinite, mut subnormal) = (0, 0);
    for e in bytes.chunks_exact(dtype.size()) {
        let mut le = [0u8; 8];
        le[..e.len()].copy_from_slice(e);
        let bits = u64::from_le_bytes(le);
        let exp = (bits >> man_bits) & ((1 << exp_bits) - 1);
        let man = bits & ((1 << man_bits) - 1);
        if exp == (1 << exp_bits) - 1 {
            nonfinite += 1;
        } else if exp == 0 && man != 0 {
            subnormal += 1;
        }
    }
    (nonfinite, subnormal)
}

fn run_job(transport: &str, from: &str, to: &str, dir: &Path, extra: &[&str]) {
    // destinations dump rank<R>.bin, sources src<R>.bin: one folder holds both
    let dump = dir.to_str().unwrap();
    let args = [
        "run",
        "--shape",
        "64,41",
        "--dtype",
        from,
        "--dst-dtype",
        to,
        "--src",
        SRC,
        "--dst",
        DST,
        "--fill",
        "hash:7",
        "--verify",
        "--chunk-bytes",
        "20",
        "--transport",
        transport,
        "--timeout",
        "60",
        "--json",
        "--dump",
        dump,
        "--dump-src",
        dump,
    ];
    let mut c = Command::new(EXE);
    if transport != "local" {
        // ranks 0..5: four sources, three destinations, rank 2 and 3 in both
        c.args(["launch", "--nproc", "5", "--"]);
    }
    let child = c
        .args(args)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let what = format!("{from} -> {to} over {transport}");
    let out = wait_bounded(child, Duration::from_secs(180), &what);
    assert!(out.status.success(), "{what}: {}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["verified"], true, "{what}: {j}");
    assert_eq!(j["dst_dtype"], to, "{what}: {j}");
    // the wire carries destination bytes
    let to_size = to.parse::<DType>().unwrap().size() as u64;
    let remote_and_local = j["bytes_remote"].as_u64().unwrap() + j["bytes_local"].as_u64().unwrap();
    assert_eq!(remote_and_local, 64 * 41 * to_size, "{what}: {j}");
    check_against_reference(dir, from.parse().unwrap(), to.parse().unwrap(), &what);
}

/// Every ordered pair of float dtypes, `--fill hash` giving arbitrary bit patterns (NaNs,
/// infinities, subnormals, values that overflow the narrower type).
fn every_pair_over(transport: &str, extra: &[&str]) {
    for from in FLOATS {
        for to in FLOATS.iter().filter(|&&to| to != from) {
            let scratch = temp_dir(&format!("cast-{transport}-{from}-{to}"));
            run_job(transport, from, to, scratch.path(), extra);
        }
    }
}

#[test]
fn every_float_cast_is_exact_in_one_process() {
    every_pair_over("local", &[]);
}

#[test]
fn every_float_cast_is_exact_over_tcp() {
    every_pair_over("tcp", &[]);
}

#[test]
fn every_float_cast_is_exact_over_shm() {
    every_pair_over("shm", &[]);
}

/// With `--checksum` (local, tcp, shm), whose sums are over the converted bytes the wire
/// carries, and through the shm rings alone (senders kept out of receivers' shards).
#[test]
fn casts_over_shm_rings_and_with_checksums() {
    for (transport, from, to) in [
        ("local", "f64", "f16"),
        ("tcp", "f32", "bf16"),
        ("shm", "bf16", "f64"),
    ] {
        let scratch = temp_dir(&format!("cast-sums-{transport}"));
        run_job(transport, from, to, scratch.path(), &["--checksum"]);
    }
    let scratch = temp_dir("cast-rings");
    let child = Command::new(EXE)
        .args(["launch", "--nproc", "5", "--"])
        .args([
            "run",
            "--shape",
            "13,11",
            "--dtype",
            "f16",
            "--dst-dtype",
            "f32",
            "--src",
            SRC,
            "--dst",
            DST,
            "--verify",
            "--transport",
            "shm",
            "--json",
        ])
        .env("RESHARD_SHM_DIRECT", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(180), "shm rings");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _ = scratch;
}

/// Integer, bool and unscaled fp8 destinations are refused before any byte moves, rc 2,
/// naming `--dst-dtype` and both dtypes, on every command that takes it.
#[test]
fn conversions_that_are_not_float_casts_are_refused() {
    for (from, to) in [
        ("f32", "i32"),
        ("i32", "f32"),
        ("bf16", "bool"),
        ("u8", "i8"),
        ("bf16", "fp8e4m3"),
    ] {
        for cmd in ["plan", "run", "bench"] {
            let out = Command::new(EXE)
                .args([
                    cmd,
                    "--shape",
                    "8,8",
                    "--dtype",
                    from,
                    "--dst-dtype",
                    to,
                    "--src",
                    "mesh=2 place=S(0)",
                    "--dst",
                    "mesh=4 place=S(1)",
                ])
                .output()
                .unwrap();
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd} {from} -> {to}: {err}");
            assert!(
                err.contains("--dst-dtype") && err.contains(from) && err.contains(to),
                "{cmd} {from} -> {to}: {err}"
            );
            assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
        }
    }
    let out = Command::new(EXE)
        .args([
            "plan",
            "--shape",
            "8,8",
            "--dst-dtype",
            "f33",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=4 place=S(1)",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--dst-dtype"),
        "{}",
        text(&out.stderr)
    );
}

/// Plan JSON counts wire bytes, the destination's: f32 -> bf16 moves half of f32.
#[test]
fn plan_json_counts_destination_bytes() {
    let plan = |dst_dtype: &str| {
        let out = Command::new(EXE)
            .args([
                "plan",
                "--shape",
                "8,8",
                "--dtype",
                "f32",
                "--dst-dtype",
                dst_dtype,
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4 place=S(1)",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let text_plan = Command::new(EXE)
        .args([
            "plan",
            "--shape",
            "8,8",
            "--dtype",
            "f32",
            "--dst-dtype",
            "bf16",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=4 place=S(1)",
        ])
        .output()
        .unwrap();
    assert!(
        text(&text_plan.stdout).contains("convert f32 -> bf16"),
        "{}",
        text(&text_plan.stdout)
    );
    let (same, half) = (plan("f32"), plan("bf16"));
    assert_eq!(half["dtype"], "f32");
    assert_eq!(half["elem_bytes"], 4);
    assert_eq!(half["dst_dtype"], "bf16");
    assert_eq!(half["dst_elem_bytes"], 2);
    let total = |j: &serde_json::Value| -> u64 {
        j["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["bytes"].as_u64().unwrap())
            .sum()
    };
    assert_eq!(total(&same), 8 * 8 * 4);
    assert_eq!(total(&half), 8 * 8 * 2);
    assert_eq!(
        half["totals"]["bytes_remote"].as_u64().unwrap() * 2,
        same["totals"]["bytes_remote"].as_u64().unwrap()
    );
}

/// `bench --dst-dtype`: the reshard converts in flight (its wire bytes are the destination's),
/// gather+broadcast moves the source's dtype and converts as each rank keeps its box (also a
/// rank that keeps the whole tensor, and a fully replicated source); every repetition of both
/// verifies, in one process and over tcp and shm.
#[test]
fn bench_converts_both_methods() {
    for (transport, src, dst) in [
        ("local", "mesh=4 place=S(0)", "mesh=2 ranks=4..6 place=R"),
        ("local", "mesh=2 place=R", "mesh=3 ranks=1..4 place=S(1)"),
        ("tcp", "mesh=4 place=S(0)", "mesh=2 ranks=3..5 place=R"),
        ("shm", "mesh=2 place=R", "mesh=3 ranks=1..4 place=S(1)"),
    ] {
        let mut c = Command::new(EXE);
        if transport != "local" {
            c.args(["launch", "--nproc", "5", "--"]);
        }
        let child = c
            .args([
                "bench",
                "--shape",
                "24,20",
                "--dtype",
                "f32",
                "--dst-dtype",
                "bf16",
                "--src",
                src,
                "--dst",
                dst,
                "--iters",
                "2",
                "--transport",
                transport,
                "--timeout",
                "60",
                "--json",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let what = format!("bench {src} -> {dst} over {transport}");
        let out = wait_bounded(child, Duration::from_secs(180), &what);
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["verified"], true, "{what}: {j}");
        assert_eq!(j["dst_dtype"], "bf16", "{what}: {j}");
        let dst_layout = layout_of(dst, DType::Bf16, &[24, 20]);
        assert_eq!(
            j["dst_bytes"].as_u64().unwrap(),
            dst_layout.shard_bytes(),
            "{what}"
        );
        let src_layout = layout_of(src, DType::F32, &[24, 20]);
        let plan = reshard::Plan::new(src_layout, dst_layout).unwrap();
        assert_eq!(
            j["reshard"]["wire_bytes"].as_u64().unwrap(),
            plan.totals().bytes_remote,
            "{what}: {j}"
        );
    }
}

fn layout_of(spec: &str, dtype: DType, shape: &[u64]) -> Layout {
    LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, dtype, 0)
        .unwrap()
}
