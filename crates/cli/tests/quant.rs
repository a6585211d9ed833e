//! Quantizing reshards (`--quant`) checked bit for bit against a naive reference written
//! here, from the formulas alone: the global tensor materialized, every block's amax and
//! scale computed over the whole block, every element scaled in f32 and rounded to the
//! nearest fp8 code by a search over the code table, and each destination's box (values)
//! and scale box (scales) sliced out. Nothing of the library's quantizer is called.
//!
//! In process, through the library, on thousands of random layouts (uneven and unaligned
//! source shards, several shard axes, overlapping rank sets, blocks straddling source shards,
//! all-zero blocks, subnormals, values that saturate); and from the command line over tcp,
//! shm (and mpi in `tests/mpi.rs`'s way, with `--features mpi`) on a handful.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use proptest::prelude::*;

use common::{EXE, Lcg, temp_dir, text, wait_bounded};
use reshard::exec::{self, ExecOptions};
use reshard::layout::{Layout, LayoutSpec};
use reshard::plan::QuantRequest;
use reshard::region::Region;
use reshard::{DType, Error, Plan, PlanOptions, Rank};

// ---------------------------------------------------------------------------------------
// The reference.

/// A scheme as the reference understands it.
#[derive(Clone, Copy, Debug)]
enum Scheme {
    Block { r: u64, c: u64, ue8m0: bool },
    Mx,
    Channel,
    Tensor,
}

impl Scheme {
    fn text(self) -> String {
        match self {
            Scheme::Block { r, c, ue8m0 } => {
                format!("block:{r}x{c}{}", if ue8m0 { ":ue8m0" } else { "" })
            }
            Scheme::Mx => "mx:32".into(),
            Scheme::Channel => "channel".into(),
            Scheme::Tensor => "tensor".into(),
        }
    }

    fn block(self, shape: &[u64]) -> Vec<u64> {
        let n = shape.len();
        let mut b = vec![1; n];
        match self {
            Scheme::Block { r, c, .. } => {
                b[n - 2] = r;
                b[n - 1] = c;
            }
            Scheme::Mx => b[n - 1] = 32,
            Scheme::Channel => b[n - 1] = shape[n - 1].max(1),
            Scheme::Tensor => b = shape.iter().map(|&d| d.max(1)).collect(),
        }
        b
    }
}

/// Every finite non-negative value of the fp8 format, by code.
fn fp8_table(e4m3: bool) -> Vec<f64> {
    let (mbits, bias, last) = if e4m3 { (3, 7, 0x7e) } else { (2, 15, 0x7b) };
    (0..=last)
        .map(|c: u32| {
            let e = (c >> mbits) as i32;
            let m = f64::from(c & ((1 << mbits) - 1));
            let frac = m / f64::from(1u32 << mbits);
            if e == 0 {
                frac * 2f64.powi(1 - bias)
            } else {
                (1.0 + frac) * 2f64.powi(e - bias)
            }
        })
        .collect()
}

/// The nearest code to `y` (ties to the even code), saturating at the largest.
fn encode(table: &[f64], y: f32) -> u8 {
    let sign = if y.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(y.abs());
    let top = table.len() - 1;
    let code = if a >= table[top] {
        top
    } else {
        let hi = table.iter().position(|&v| v >= a).unwrap();
        if table[hi] == a || hi == 0 {
            hi
        } else {
            let lo = hi - 1;
            let (dl, dh) = (a - table[lo], table[hi] - a);
            if dl < dh || (dl == dh && lo % 2 == 0) {
                lo
            } else {
                hi
            }
        }
    };
    code as u8 | sign
}

fn pow2(e: i32) -> f32 {
    2f64.powi(e) as f32
}

/// The scale of a block of largest magnitude `amax`: (multiplier, scale as f32, e8m0 byte).
fn scale_of(scheme: Scheme, e4m3: bool, amax: f32) -> (f32, f32, u8) {
    let fmax: f32 = if e4m3 { 448.0 } else { 57344.0 };
    match scheme {
        Scheme::Block { ue8m0: false, .. } | Scheme::Channel | Scheme::Tensor => {
            let a = amax.max(1e-4);
            (fmax / a, a / fmax, 0)
        }
        Scheme::Block { ue8m0: true, .. } => {
            let v = f64::from(amax.max(1e-4) / fmax);
            let e = (-200..200).find(|&e| 2f64.powi(e) >= v).unwrap();
            (pow2(-e), pow2(e), (e + 127) as u8)
        }
        Scheme::Mx => {
            let emax = if e4m3 { 8 } else { 15 };
            let e = if amax == 0.0 {
                -127
            } else {
                let fl = (-200..200)
                    .rev()
                    .find(|&e| 2f64.powi(e) <= f64::from(amax))
                    .unwrap();
                (fl - emax).clamp(-127, 127)
            };
            (pow2(-e), pow2(e), (e + 127) as u8)
        }
    }
}

fn read(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(b[..4].try_into().unwrap()),
        DType::Bf16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        _ => unreachable!("the tests use f32 and bf16 sources"),
    }
}

fn coords(shape: &[u64], mut i: u64) -> Vec<u64> {
    let mut c = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        c[d] = i % shape[d];
        i /= shape[d];
    }
    c
}

fn index(shape: &[u64], c: &[u64]) -> u64 {
    c.iter().zip(shape).fold(0, |acc, (&x, &n)| acc * n + x)
}

/// The row-major bytes of `region` of a row-major tensor of `shape`.
fn slice(whole: &[u8], shape: &[u64], elem: usize, region: &Region) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..region.volume() {
        let c: Vec<u64> = coords(&region.extent, i)
            .iter()
            .zip(&region.offset)
            .map(|(a, b)| a + b)
            .collect();
        let at = index(shape, &c) as usize * elem;
        out.extend_from_slice(&whole[at..at + elem]);
    }
    out
}

/// What each destination rank must hold: (fp8 values, scales).
struct Expected {
    shards: BTreeMap<Rank, (Vec<u8>, Vec<u8>)>,
}

/// The naive quantizer: `Err((block, element))` for a non-finite element.
#[allow(clippy::type_complexity)]
fn reference(
    scheme: Scheme,
    e4m3: bool,
    f32_scales: bool,
    dtype: DType,
    shape: &[u64],
    global: &[u8],
    dst: &Layout,
) -> Result<Expected, (Vec<u64>, Vec<u64>)> {
    let block = scheme.block(shape);
    let grid: Vec<u64> = shape
        .iter()
        .zip(&block)
        .map(|(&n, &b)| n.div_ceil(b))
        .collect();
    let n: u64 = shape.iter().product();
    let elem = dtype.size();
    let block_of = |c: &[u64]| -> Vec<u64> { c.iter().zip(&block).map(|(&x, &b)| x / b).collect() };
    let mut amax = vec![0f32; grid.iter().product::<u64>() as usize];
    for i in 0..n {
        let x = read(dtype, &global[i as usize * elem..]);
        let c = coords(shape, i);
        if !x.is_finite() {
            return Err((block_of(&c), c));
        }
        let k = index(&grid, &block_of(&c)) as usize;
        amax[k] = amax[k].max(x.abs());
    }
    let table = fp8_table(e4m3);
    let scales: Vec<(f32, f32, u8)> = amax.iter().map(|&a| scale_of(scheme, e4m3, a)).collect();
    let mut values = vec![0u8; n as usize];
    for (i, v) in values.iter_mut().enumerate() {
        let x = read(dtype, &global[i * elem..]);
        let k = index(&grid, &block_of(&coords(shape, i as u64))) as usize;
        *v = encode(&table, x * scales[k].0);
    }
    let scale_bytes: Vec<u8> = scales
        .iter()
        .flat_map(|&(_, s, e)| match f32_scales {
            true => s.to_le_bytes().to_vec(),
            false => vec![e],
        })
        .collect();
    let size = if f32_scales { 4 } else { 1 };
    let mut shards = BTreeMap::new();
    for &r in dst.mesh().ranks() {
        let b = dst.local_region(r).unwrap();
        let blocks = if b.is_empty() {
            Region {
                offset: vec![0; b.ndim()],
                extent: vec![0; b.ndim()],
            }
        } else {
            Region::from_ranges(
                &(0..b.ndim())
                    .map(|d| {
                        let r = b.range(d);
                        r.start / block[d]..r.end.div_ceil(block[d])
                    })
                    .collect::<Vec<_>>(),
            )
        };
        shards.insert(
            r,
            (
                slice(&values, shape, 1, &b),
                slice(&scale_bytes, &grid, size, &blocks),
            ),
        );
    }
    Ok(Expected { shards })
}

// ---------------------------------------------------------------------------------------
// Random cases.

/// Random element bits of varied magnitude: whole rows of zeros, rows of tiny values (f32
/// subnormals among them), rows spread over 2^-30..2^30, and ordinary ones.
fn random_tensor(rng: &mut Lcg, dtype: DType, shape: &[u64]) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let row = *shape.last().unwrap();
    let mut out = Vec::with_capacity(n as usize * dtype.size());
    let mut kind = 0;
    for i in 0..n {
        if i % row == 0 {
            kind = rng.below(6);
        }
        let x: f32 = match kind {
            0 => 0.0,
            1 => {
                let m = 1.0 + rng.below(1000) as f32 / 1000.0;
                m * pow2(-(rng.below(30) as i32) - 120)
            }
            2 => {
                let m = 1.0 + rng.below(1000) as f32 / 1000.0;
                m * pow2(rng.below(60) as i32 - 30)
            }
            _ => (rng.below(20001) as f32 - 10000.0) / 997.0,
        };
        let x = if rng.below(2) == 0 { -x } else { x };
        match dtype {
            DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    out
}

fn resolve(spec: &str, shape: &[u64], dtype: DType) -> Option<Layout> {
    LayoutSpec::parse(spec).ok()?.resolve(shape, dtype, 0).ok()
}

fn random_spec(rng: &mut Lcg, ndim: usize, world: u64) -> String {
    common::random_spec(rng, ndim, world)
}

struct Case {
    scheme: Scheme,
    e4m3: bool,
    f32_scales: bool,
    dtype: DType,
    shape: Vec<u64>,
    plan: Plan,
}

/// A random quantizing case whose destination holds whole blocks (drawn again until it
/// does); the source is anything.
fn random_case(rng: &mut Lcg) -> Case {
    loop {
        let ndim = 2 + rng.below(2) as usize;
        let scheme = match rng.below(6) {
            0 | 1 => Scheme::Block {
                r: 1 + rng.below(4),
                c: 1 + rng.below(6),
                ue8m0: false,
            },
            2 => Scheme::Block {
                r: 1 + rng.below(3),
                c: 1 + rng.below(5),
                ue8m0: true,
            },
            3 => Scheme::Mx,
            4 => Scheme::Channel,
            _ => Scheme::Tensor,
        };
        let probe = scheme.block(&vec![1; ndim]);
        let shape: Vec<u64> = (0..ndim)
            .map(|d| {
                let b = if d + 1 == ndim && matches!(scheme, Scheme::Mx) {
                    32
                } else {
                    probe[d].max(1)
                };
                // whole blocks mostly, a short last block sometimes
                (b * (1 + rng.below(4)) + if rng.below(3) == 0 { rng.below(b) } else { 0 }).max(1)
            })
            .map(|n| n.min(96))
            .collect();
        let dtype = if rng.below(2) == 0 {
            DType::Bf16
        } else {
            DType::F32
        };
        let e4m3 = rng.below(3) != 0;
        let pow2_scales = matches!(scheme, Scheme::Mx | Scheme::Block { ue8m0: true, .. });
        let f32_scales = match scheme {
            Scheme::Mx => rng.below(3) == 0,
            _ => !pow2_scales || rng.below(2) == 0,
        };
        let world = 1 + rng.below(8);
        let src_spec = random_spec(rng, ndim, world);
        let dst_spec = random_spec(rng, ndim, world);
        let fp8 = if e4m3 { DType::Fp8E4M3 } else { DType::Fp8E5M2 };
        let (Some(src), Some(dst)) = (
            resolve(&src_spec, &shape, dtype),
            resolve(&dst_spec, &shape, fp8),
        ) else {
            continue;
        };
        let request = QuantRequest {
            scheme: scheme.text().parse().unwrap(),
            scale_dtype: Some(if f32_scales { "f32" } else { "e8m0" }.parse().unwrap()),
        };
        let options = PlanOptions {
            min_split_bytes: rng.below(2) * 64,
        };
        match Plan::with_quant(src, dst, options, Some(request)) {
            Ok(plan) => {
                return Case {
                    scheme,
                    e4m3,
                    f32_scales,
                    dtype,
                    shape,
                    plan,
                };
            }
            // a destination boundary inside a block: refused, as it must be; draw again
            Err(Error::Convert { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

/// The source shards of `layout` cut from the global tensor.
fn shards_of(layout: &Layout, global: &[u8]) -> BTreeMap<Rank, Vec<u8>> {
    let elem = layout.dtype().size();
    layout
        .mesh()
        .ranks()
        .iter()
        .map(|&r| {
            let b = layout.local_region(r).unwrap();
            (r, slice(global, layout.shape(), elem, &b))
        })
        .collect()
}

fn describe(case: &Case) -> String {
    format!(
        "{} {} -> {} scales {} shape {:?} src {:?} dst {:?}",
        case.scheme.text(),
        case.dtype,
        case.plan.dst().dtype(),
        if case.f32_scales { "f32" } else { "e8m0" },
        case.shape,
        case.plan.src(),
        case.plan.dst()
    )
}

fn check_case(seed: u64) {
    let mut rng = Lcg(seed);
    let case = random_case(&mut rng);
    let global = random_tensor(&mut rng, case.dtype, &case.shape);
    let want = reference(
        case.scheme,
        case.e4m3,
        case.f32_scales,
        case.dtype,
        &case.shape,
        &global,
        case.plan.dst(),
    )
    .unwrap();
    let src = shards_of(case.plan.src(), &global);
    let mut dst = exec::zeroed_shards(case.plan.dst()).unwrap();
    let mut scales = exec::zeroed_scale_shards(&case.plan).unwrap();
    let options = ExecOptions {
        chunk_bytes: [8, 24, 64 << 10][rng.below(3) as usize],
        ..ExecOptions::default()
    };
    exec::run_local_quantized(&case.plan, &src, &mut dst, &mut scales, &options)
        .unwrap_or_else(|e| panic!("{}: {e}", describe(&case)));
    for (r, (values, s)) in &want.shards {
        assert!(dst[r] == *values, "values of rank {r}: {}", describe(&case));
        assert!(scales[r] == *s, "scales of rank {r}: {}", describe(&case));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    /// Thousands of random layouts in process, bit for bit.
    #[test]
    fn quantized_reshards_match_the_naive_reference(seed in any::<u64>()) {
        check_case(seed);
    }
}

/// The reference itself: the code table ends at FMAX, rounds ties to even, saturates.
#[test]
fn the_reference_encoder_rounds_and_saturates() {
    let t = fp8_table(true);
    assert_eq!(t[0x7e], 448.0);
    assert_eq!(encode(&t, 1000.0), 0x7e);
    assert_eq!(encode(&t, -1000.0), 0xfe);
    // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): the even code
    assert_eq!(encode(&t, 1.0625), 0x38);
    assert_eq!(encode(&t, 2f32.powi(-10)), 0x00); // half the smallest subnormal: even
    assert_eq!(fp8_table(false)[0x7b], 57344.0);
}

/// A NaN or an infinity in the source of a quantized tensor is an error naming the tensor and
/// its block, found on the rank that holds it, and no rank completes.
#[test]
fn non_finite_sources_are_refused_naming_the_block() {
    let shape = [8u64, 8];
    let src = resolve("mesh=2 place=S(0)", &shape, DType::F32).unwrap();
    let dst = LayoutSpec::parse("mesh=2 place=S(1)")
        .unwrap()
        .resolve(&shape, DType::Fp8E4M3, 2)
        .unwrap();
    let request = QuantRequest {
        scheme: "block:4x4".parse().unwrap(),
        scale_dtype: None,
    };
    let plan = Plan::with_quant(src, dst, PlanOptions::default(), Some(request)).unwrap();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut global: Vec<u8> = (0..64).flat_map(|i| (i as f32).to_le_bytes()).collect();
        // element [5, 6]: block [1, 1], held by rank 1
        global[(5 * 8 + 6) * 4..][..4].copy_from_slice(&bad.to_le_bytes());
        let src = shards_of(plan.src(), &global);
        let mut dst = exec::zeroed_shards(plan.dst()).unwrap();
        let mut scales = exec::zeroed_scale_shards(&plan).unwrap();
        let err =
            exec::run_local_quantized(&plan, &src, &mut dst, &mut scales, &ExecOptions::default())
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("tensor: block [1, 1] holds a non-finite value")
                && err.contains("at element [5, 6]"),
            "{err}"
        );
        // the destination ranks report what did not arrive
        assert!(err.contains("rank 2:") && err.contains("rank 3:"), "{err}");
    }
}

// ---------------------------------------------------------------------------------------
// From the command line, over processes.

/// A handful of fixed cases run by `reshard run --dump --dump-src`, checked against the
/// reference built from the dumped source shards.
const CLI_CASES: [(&str, &str, &str, &str, &str, &str); 5] = [
    // blocks straddle the three source shards (86 rows each); two shard axes on the source
    (
        "256,256",
        "bf16",
        "fp8e4m3",
        "block:128x128",
        "mesh=3 place=S(0)",
        "mesh=2 ranks=2..4 place=S(1)",
    ),
    (
        "64,96",
        "f32",
        "fp8e5m2",
        "block:16x32:ue8m0",
        "mesh=2x2 place=S(0),S(1)",
        "mesh=2 ranks=3..5 place=S(0)",
    ),
    (
        "6,100",
        "bf16",
        "fp8e4m3",
        "mx:32",
        "mesh=2x2 place=S(1),R",
        "mesh=2 ranks=1..3 place=S(0)",
    ),
    (
        "12,30",
        "f32",
        "fp8e4m3",
        "channel",
        "mesh=4 place=S(1)",
        "mesh=3 ranks=2..5 place=S(1)",
    ),
    (
        "10,9",
        "bf16",
        "fp8e4m3",
        "tensor",
        "mesh=2x2 place=S(0),S(1)",
        "mesh=2x2 ranks=1..5 place=S(1),S(0)",
    ),
];

fn scheme_of(text: &str) -> Scheme {
    match text {
        "mx:32" => Scheme::Mx,
        "channel" => Scheme::Channel,
        "tensor" => Scheme::Tensor,
        _ => {
            let rest = text.strip_prefix("block:").unwrap();
            let (dims, ue8m0) = match rest.strip_suffix(":ue8m0") {
                Some(d) => (d, true),
                None => (rest, false),
            };
            let (r, c) = dims.split_once('x').unwrap();
            Scheme::Block {
                r: r.parse().unwrap(),
                c: c.parse().unwrap(),
                ue8m0,
            }
        }
    }
}

/// Runs every CLI case with `launch` (`transport` tcp or shm), or with `wrap` (mpirun);
/// returns each case's `run --json` report, in order.
pub fn cli_cases_over(transport: &str, wrap: impl Fn(u64) -> Command) -> Vec<serde_json::Value> {
    let mut reports = Vec::new();
    for (shape, from, to, scheme, src, dst) in CLI_CASES {
        let dir = temp_dir("quant");
        let d = dir.path().to_str().unwrap();
        let mut c = wrap(6);
        c.args([
            "run",
            "--transport",
            transport,
            "--shape",
            shape,
            "--dtype",
            from,
            "--dst-dtype",
            to,
            "--quant",
            scheme,
            "--src",
            src,
            "--dst",
            dst,
            "--fill",
            "normal:7",
            "--chunk-bytes",
            "24",
            "--verify",
            "--json",
            "--dump",
            d,
            "--dump-src",
            d,
        ]);
        let what = format!("{scheme} {shape} over {transport}");
        let child = c
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(180), &what);
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["verified"], true, "{what}: {j}");
        check_dumps(dir.path(), shape, from, to, scheme, src, dst, &what);
        reports.push(j);
    }
    reports
}

/// The remote bytes of each CLI case's values (fp8, one byte each), from `plan --json`.
fn planned_remote_value_bytes() -> Vec<u64> {
    CLI_CASES
        .iter()
        .map(|(shape, from, to, scheme, src, dst)| {
            let out = Command::new(EXE)
                .args([
                    "plan",
                    "--json",
                    "--shape",
                    shape,
                    "--dtype",
                    from,
                    "--dst-dtype",
                    to,
                    "--quant",
                    scheme,
                    "--src",
                    src,
                    "--dst",
                    dst,
                ])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", text(&out.stderr));
            let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            j["totals"]["bytes_remote"].as_u64().unwrap()
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn check_dumps(
    dir: &Path,
    shape: &str,
    from: &str,
    to: &str,
    scheme: &str,
    src: &str,
    dst: &str,
    what: &str,
) {
    let shape: Vec<u64> = shape.split(',').map(|s| s.parse().unwrap()).collect();
    let (from, to): (DType, DType) = (from.parse().unwrap(), to.parse().unwrap());
    let src = resolve(src, &shape, from).unwrap();
    let dst = LayoutSpec::parse(dst)
        .unwrap()
        .resolve(&shape, to, 0)
        .unwrap();
    let n: u64 = shape.iter().product();
    let elem = from.size();
    let mut global = vec![0u8; n as usize * elem];
    for &r in src.mesh().ranks() {
        let bytes = std::fs::read(dir.join(format!("src{r}.bin"))).unwrap();
        let b = src.local_region(r).unwrap();
        for i in 0..b.volume() {
            let c: Vec<u64> = coords(&b.extent, i)
                .iter()
                .zip(&b.offset)
                .map(|(a, o)| a + o)
                .collect();
            let g = index(&shape, &c) as usize;
            global[g * elem..(g + 1) * elem]
                .copy_from_slice(&bytes[i as usize * elem..(i as usize + 1) * elem]);
        }
    }
    let scheme = scheme_of(scheme);
    let f32_scales = !matches!(scheme, Scheme::Mx);
    let want = reference(
        scheme,
        to == DType::Fp8E4M3,
        f32_scales,
        from,
        &shape,
        &global,
        &dst,
    )
    .unwrap();
    for (r, (values, scales)) in &want.shards {
        let got = std::fs::read(dir.join(format!("rank{r}.bin"))).unwrap();
        assert!(got == *values, "{what}: values of rank {r}");
        let got = std::fs::read(dir.join(format!("rank{r}.scale.bin"))).unwrap();
        assert!(got == *scales, "{what}: scales of rank {r}");
    }
}

fn launch(n: u64) -> Command {
    let mut c = Command::new(EXE);
    c.args(["launch", "--nproc", &n.to_string(), "--"]);
    c
}

#[test]
fn quantized_runs_over_tcp_match_the_reference() {
    cli_cases_over("tcp", launch);
}

/// Over shm the senders quantize as they write straight into the receivers' destination
/// shards: every remote value byte goes that way (`bytes_direct`), the partial amax and the
/// scales through the rings.
#[test]
fn quantized_runs_over_shm_match_the_reference() {
    let reports = cli_cases_over("shm", launch);
    for ((report, planned), case) in reports
        .iter()
        .zip(planned_remote_value_bytes())
        .zip(CLI_CASES)
    {
        assert!(planned > 0, "{case:?}");
        assert_eq!(
            report["bytes_direct"].as_u64(),
            Some(planned),
            "{case:?}: {report}"
        );
    }
}

/// The same through the rings alone (`RESHARD_SHM_DIRECT=0`): nothing written directly, the
/// same bytes landed.
#[test]
fn quantized_runs_over_shm_rings_match_the_reference() {
    let reports = cli_cases_over("shm", |n| {
        let mut c = launch(n);
        c.env("RESHARD_SHM_DIRECT", "0");
        c
    });
    for (report, case) in reports.iter().zip(CLI_CASES) {
        assert_eq!(
            report["bytes_direct"].as_u64(),
            Some(0),
            "{case:?}: {report}"
        );
    }
}

#[test]
fn quantized_runs_in_threads_match_the_reference() {
    cli_cases_over("local", |_| Command::new(EXE));
}

/// Bad combinations fail with exit code 2 before any byte moves, naming what is wrong.
#[test]
fn bad_quantization_options_are_refused_up_front() {
    let base = ["plan", "--shape", "256,256", "--src", "mesh=2 place=S(0)"];
    for (extra, says) in [
        (
            &["--dst", "mesh=2 place=S(1)", "--quant", "block:128x128"][..],
            "the destination dtype is bf16",
        ),
        (
            &["--dst", "mesh=2 place=S(1)", "--dst-dtype", "fp8e4m3"][..],
            "an fp8 destination needs scales",
        ),
        (
            &[
                "--dst",
                "mesh=3 place=S(1)",
                "--dst-dtype",
                "fp8e4m3",
                "--quant",
                "block:128x128",
            ][..],
            "a shard boundary at 86 along dim 1 cuts a quantization block of 128x128",
        ),
        (
            &[
                "--dst",
                "mesh=2 place=S(1)",
                "--dst-dtype",
                "fp8e4m3",
                "--quant",
                "block:128x128",
                "--scale-dtype",
                "e8m0",
            ][..],
            "--scale-dtype e8m0: --quant block:128x128 has scales that are not powers of two",
        ),
        (
            &["--dst", "mesh=2 place=S(1)", "--scale-dtype", "e8m0"][..],
            "give --quant SCHEME too",
        ),
        (
            &[
                "--dst",
                "mesh=2 place=S(1)",
                "--dst-dtype",
                "fp8e4m3",
                "--quant",
                "block:12",
            ][..],
            "--quant: block:12 is invalid",
        ),
    ] {
        let out = Command::new(EXE).args(base).args(extra).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

/// The plan JSON counts fp8 wire bytes, lists the amax and scale traffic in scale grid
/// coordinates, and totals them: every destination's scale transfers tile its scale shard.
#[test]
fn the_plan_json_lists_amax_and_scales() {
    let out = Command::new(EXE)
        .args([
            "plan",
            "--json",
            "--shape",
            "256,384",
            "--dtype",
            "bf16",
            "--dst-dtype",
            "fp8e4m3",
            "--quant",
            "block:128x128",
            "--src",
            "mesh=3 place=S(0)",
            "--dst",
            "mesh=3 place=S(1)",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let volume = |t: &serde_json::Value| -> u64 {
        t["extent"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_u64().unwrap())
            .product()
    };
    for t in j["transfers"].as_array().unwrap() {
        assert_eq!(
            t["bytes"].as_u64().unwrap(),
            volume(t),
            "one byte per fp8 value"
        );
    }
    let q = &j["quant"];
    assert_eq!(q["scale_shape"], serde_json::json!([2, 3]));
    // 86-row source shards cut both block rows: 0<->1 (block row 0), 1<->2 (block row 1)
    let amax: Vec<(u64, u64)> = q["amax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["src"].as_u64().unwrap(), t["dst"].as_u64().unwrap()))
        .collect();
    assert_eq!(amax, [(0, 1), (1, 0), (1, 2), (2, 1)]);
    let amax_bytes: u64 = q["amax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(j["totals"]["amax_bytes"].as_u64().unwrap(), amax_bytes);
    // every destination (ranks 3..6) holds a 2x1 column of scales: 8 bytes
    for r in 3..6u64 {
        let got: u64 = q["scales"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["dst"] == r)
            .map(|t| t["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(got, 8, "rank {r}");
    }
    assert_eq!(j["totals"]["scale_bytes"], 24);
}

/// Over mpi under `mpirun` (built with `--features mpi`): the same cases, checked alike.
#[cfg(feature = "mpi")]
#[test]
fn quantized_runs_over_mpi_match_the_reference() {
    cli_cases_over("mpi", |n| {
        let mut c = common::mpirun(n);
        c.arg(EXE);
        c
    });
}

/// `shm` under `mpirun`: the notices go as MPI messages, the values straight into the
/// destination shards, the partial amax and scales through the rings.
#[cfg(feature = "mpi")]
#[test]
fn quantized_runs_over_shm_under_mpi_match_the_reference() {
    let reports = cli_cases_over("shm", |n| {
        let mut c = common::mpirun(n);
        c.arg(EXE).env_remove("MASTER_PORT");
        c
    });
    for ((report, planned), case) in reports
        .iter()
        .zip(planned_remote_value_bytes())
        .zip(CLI_CASES)
    {
        assert_eq!(
            report["bytes_direct"].as_u64(),
            Some(planned),
            "{case:?}: {report}"
        );
    }
}

/// A quantizing `run` reports `verified` only after checking every value and scale: false
/// without `--verify`, in threads and over tcp alike.
#[test]
fn a_quantizing_run_is_verified_only_when_checked() {
    for transport in ["local", "tcp"] {
        for verify in [true, false] {
            let mut c = match transport {
                "local" => Command::new(EXE),
                _ => {
                    let mut c = Command::new(EXE);
                    c.args(["launch", "--nproc", "4", "--"]);
                    c
                }
            };
            c.args(["run", "--transport", transport, "--shape", "64,64"])
                .args(["--dtype", "bf16", "--dst-dtype", "fp8e4m3"])
                .args(["--quant", "block:32x32", "--fill", "normal:3", "--json"])
                .args(["--src", "mesh=2 place=S(0)", "--dst", "mesh=2 place=S(1)"]);
            if verify {
                c.arg("--verify");
            }
            let what = format!("{transport}, verify {verify}");
            let child = c
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let out = wait_bounded(child, Duration::from_secs(180), &what);
            assert!(out.status.success(), "{what}: {}", text(&out.stderr));
            let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(j["verified"], verify, "{what}: {j}");
        }
    }
}
