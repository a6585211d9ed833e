//! Already-quantized tensors on both sides (`plan::QuantizedMove`): fp8 values and their
//! scales reshard as two coupled tensors. Checked on random layouts against the naive
//! reference (the whole tensor quantized block by block, then each side's boxes sliced out of
//! its values and its scales): a move is either planned and delivers exactly the
//! destination's boxes of both, or refused because a shard boundary cuts a block, which is
//! checked independently from the layouts. Both tensors move in one exchange
//! (`World::run_quantized_move`).

mod common;

use std::collections::BTreeMap;

use common::{Lcg, random_spec};
use reshard::convert::reference::{QuantizedTensor, quantize_tensor, slice};
use reshard::convert::{BlockGrid, ConvertError, Quant, QuantScheme};
use reshard::exec;
use reshard::layout::{Layout, LayoutSpec};
use reshard::plan::{QuantRequest, QuantizedMove};
use reshard::runtime::{JoinOptions, RunOptions, World};
use reshard::{DType, Error, PlanOptions, Rank};

/// The first shard boundary of `layout` (dim, boundary) that falls inside a block.
fn cut(layout: &Layout, block: &[u64]) -> Option<(usize, u64)> {
    let shape = layout.shape();
    for &r in layout.mesh().ranks() {
        let Some(b) = layout.local_region(r) else {
            continue;
        };
        if b.volume() == 0 {
            continue;
        }
        for d in 0..shape.len() {
            for edge in [b.offset[d], b.offset[d] + b.extent[d]] {
                if edge % block[d] != 0 && edge != shape[d] {
                    return Some((d, edge));
                }
            }
        }
    }
    None
}

fn shards(layout: &Layout, whole: &[u8], elem: usize) -> BTreeMap<Rank, Vec<u8>> {
    layout
        .mesh()
        .ranks()
        .iter()
        .filter_map(|&r| {
            let b = layout.local_region(r)?;
            Some((r, slice(whole, layout.shape(), elem, &b)))
        })
        .collect()
}

/// One random case: returns whether it was planned (false: refused for a cut block).
fn check(seed: u64) -> bool {
    let mut rng = Lcg(seed);
    let (br, bc) = (1 << rng.below(3), 2 << rng.below(3));
    let shape = [
        br * (1 + rng.below(6)) - rng.below(br.min(2)),
        bc * (1 + rng.below(6)) - rng.below(2),
    ];
    let scheme = QuantScheme::parse(&format!("block:{br}x{bc}")).unwrap();
    let fp8 = [DType::Fp8E4M3, DType::Fp8E5M2][rng.below(2) as usize];
    let resolve = |spec: &str, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&shape, fp8, first)
            .unwrap()
    };
    let src = resolve(&random_spec(&mut rng, 2, 6), 0);
    let dst = resolve(&random_spec(&mut rng, 2, 6), 0);
    let what = format!("seed {seed}: {shape:?} block {br}x{bc} {src:?} -> {dst:?}");
    let request = QuantRequest {
        scheme,
        scale_dtype: None,
    };
    let block = [br, bc];
    let planned = QuantizedMove::new(src.clone(), dst.clone(), PlanOptions::default(), request);
    let expected_cut = cut(&src, &block)
        .map(|c| (reshard::Side::Src, c))
        .or(cut(&dst, &block).map(|c| (reshard::Side::Dst, c)));
    let mv = match (planned, expected_cut) {
        (Ok(mv), None) => mv,
        (
            Err(Error::Convert {
                source:
                    ConvertError::CutBlock {
                        side,
                        dim,
                        boundary,
                        ..
                    },
                ..
            }),
            Some((want_side, _)),
        ) => {
            assert_eq!(side, want_side, "{what}");
            let layout = if side == reshard::Side::Src {
                &src
            } else {
                &dst
            };
            let pieces = layout.dim_pieces(dim);
            assert!(boundary % block[dim] != 0, "{what}");
            assert!(
                pieces
                    .iter()
                    .any(|p| p.start == boundary || p.end == boundary),
                "{what}: boundary {boundary} of dim {dim}"
            );
            return false;
        }
        (other, want) => panic!("{what}: got {other:?}, expected a cut at {want:?}"),
    };
    // the whole tensor, quantized naively
    let n: u64 = shape.iter().product();
    let tensor: Vec<u8> = (0..n)
        .flat_map(|i| {
            let mut x = Lcg(seed ^ (i * 0x9e37_79b9));
            let v = (x.below(2001) as f32 - 1000.0) * (1u32 << x.below(12)) as f32 / 4096.0;
            v.to_le_bytes()
        })
        .collect();
    let quant = Quant::new(scheme, DType::F32, fp8, None).unwrap();
    let grid = BlockGrid::new(scheme, &shape).unwrap();
    let q: QuantizedTensor = quantize_tensor(quant, &grid, DType::F32, &tensor).unwrap();
    // both tensors in one exchange, every rank a thread of this process
    let both = |values: BTreeMap<Rank, Vec<u8>>, scales: &BTreeMap<Rank, Vec<u8>>| {
        values
            .into_iter()
            .map(|(r, v)| (r, vec![v, scales[&r].clone()]))
            .collect::<BTreeMap<Rank, Vec<Vec<u8>>>>()
    };
    let sources = both(
        shards(&src, &q.values, 1),
        &shards(mv.scales.src(), &q.scales, 4),
    );
    let mut landed = both(
        exec::zeroed_shards(&dst).unwrap(),
        &exec::zeroed_shards(mv.scales.dst()).unwrap(),
    );
    let world = World::join_env(None, JoinOptions::default()).unwrap();
    let stats = world
        .run_quantized_move(&mv, &sources, &mut landed, &RunOptions::default())
        .unwrap();
    for (&r, got) in &landed {
        let b = dst.local_region(r).unwrap();
        assert!(
            got[QuantizedMove::VALUES] == q.values_of(&b),
            "{what}: values of rank {r}"
        );
        let blocks = grid.scale_region(&b);
        assert!(
            got[QuantizedMove::SCALES] == q.scales_of(&blocks),
            "{what}: scales of rank {r}"
        );
    }
    // the wire carries the two plans' bytes exactly
    let t = mv.totals();
    let scale_bytes = t.quant.map_or(0, |q| q.scale_bytes);
    assert_eq!(stats.bytes_remote(), t.bytes_remote + scale_bytes, "{what}");
    true
}

#[test]
fn already_quantized_moves_match_the_reference_or_are_refused_for_cut_blocks() {
    let (mut planned, mut refused) = (0, 0);
    for seed in 0..1500 {
        match check(seed) {
            true => planned += 1,
            false => refused += 1,
        }
    }
    // both outcomes are exercised
    assert!(
        planned > 100 && refused > 100,
        "{planned} planned, {refused} refused"
    );
}

/// The error names the side, the dim, the boundary and the block, before any byte moves.
#[test]
fn a_cut_block_is_named() {
    let layout = |spec: &str| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(&[256, 256], DType::Fp8E4M3, 0)
            .unwrap()
    };
    let request = QuantRequest {
        scheme: QuantScheme::parse("block:128x128").unwrap(),
        scale_dtype: None,
    };
    let err = QuantizedMove::new(
        layout("mesh=2 place=S(0)"),
        layout("mesh=4 place=S(1)"),
        PlanOptions::default(),
        request,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("dst: ")
            && err.contains("boundary at 64 along dim 1")
            && err.contains("128x128"),
        "{err}"
    );
    let err = QuantizedMove::new(
        layout("mesh=2 place=S(0)"),
        layout("mesh=2 place=S(1)"),
        PlanOptions::default(),
        QuantRequest {
            scheme: QuantScheme::parse("block:96x128").unwrap(),
            scale_dtype: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("src: ") && err.contains("boundary at 128 along dim 0"),
        "{err}"
    );
}

/// `run --dtype fp8e4m3 --quant SCHEME`: the source is already quantized (the normal fill
/// quantized); every destination's dumped values and scales are its boxes of the tensor the
/// source ranks' dumps make up, in threads and over tcp and shm.
#[test]
fn run_moves_an_already_quantized_source_with_its_scales() {
    use reshard::region::Region;
    use std::process::Command;
    let shape = [512u64, 256];
    let (src_spec, dst_spec) = ("mesh=2 place=S(0)", "mesh=2x2 ranks=2..6 place=S(0),S(1)");
    let grid = BlockGrid::new(QuantScheme::parse("block:128x128").unwrap(), &shape).unwrap();
    let layout = |spec: &str, shape: &[u64], dtype, first| {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, dtype, first)
            .unwrap()
    };
    let gshape = grid.grid_shape();
    let (src, dst) = (
        layout(src_spec, &shape, DType::Fp8E4M3, 0),
        layout(dst_spec, &shape, DType::Fp8E4M3, 2),
    );
    for transport in ["local", "tcp", "shm"] {
        let dir = common::temp_dir("prequant");
        let mut c = Command::new(common::EXE);
        if transport != "local" {
            c.args(["launch", "--nproc", "6", "--"]);
        }
        let out = c
            .args(["run", "--shape", "512,256", "--dtype", "fp8e4m3"])
            .args(["--quant", "block:128x128", "--fill", "normal:9", "--verify"])
            .args([
                "--src",
                src_spec,
                "--dst",
                dst_spec,
                "--transport",
                transport,
            ])
            .arg("--dump")
            .arg(dir.path().join("dst"))
            .arg("--dump-src")
            .arg(dir.path().join("src"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{transport}: {}",
            common::text(&out.stderr)
        );
        // the whole values and scales, put together from the source dumps
        let mut values = vec![0u8; 512 * 256];
        let mut scales = vec![0u8; (gshape[0] * gshape[1] * 4) as usize];
        let put = |whole: &mut [u8], wshape: &[u64], elem: usize, b: &Region, part: &[u8]| {
            let row = b.extent[1] as usize * elem;
            for i in 0..b.extent[0] as usize {
                let at =
                    ((b.offset[0] as usize + i) * wshape[1] as usize + b.offset[1] as usize) * elem;
                whole[at..at + row].copy_from_slice(&part[i * row..(i + 1) * row]);
            }
        };
        for r in 0..2 {
            let b = src.local_region(r).unwrap();
            let read = |name: String| std::fs::read(dir.path().join("src").join(name)).unwrap();
            put(&mut values, &shape, 1, &b, &read(format!("src{r}.bin")));
            let sb = grid.scale_region(&b);
            put(
                &mut scales,
                &gshape,
                4,
                &sb,
                &read(format!("src{r}.scale.bin")),
            );
        }
        for r in 2..6 {
            let b = dst.local_region(r).unwrap();
            let read = |name: String| std::fs::read(dir.path().join("dst").join(name)).unwrap();
            assert_eq!(
                read(format!("rank{r}.bin")),
                slice(&values, &shape, 1, &b),
                "{transport}: rank {r}"
            );
            let sb = grid.scale_region(&b);
            assert_eq!(
                read(format!("rank{r}.scale.bin")),
                slice(&scales, &gshape, 4, &sb),
                "{transport}: scales of rank {r}"
            );
        }
        // and a source cut inside a block is refused before any byte moves
        let out = Command::new(common::EXE)
            .args(["run", "--shape", "512,256", "--dtype", "fp8e4m3"])
            .args(["--quant", "block:128x128", "--fill", "normal"])
            .args(["--src", "mesh=3 place=S(0)", "--dst", dst_spec])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = common::text(&out.stderr);
        assert!(
            err.contains("--src") && err.contains("at 171 along dim 0"),
            "{err}"
        );
    }
}

/// `reshard` with `args`, run to its end (bounded generously: a hang fails, load does not).
fn reshard(args: &[&str]) -> std::process::Output {
    use std::process::{Command, Stdio};
    let child = Command::new(common::EXE)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_bounded(child, std::time::Duration::from_secs(600), "reshard")
}

/// The hand-checked case: 512x512 fp8e4m3 in 128x128 blocks (a 4x4 grid of f32 scales),
/// TP4 S(0) -> TP2 S(1).
const TP4_TO_TP2: [&str; 10] = [
    "--shape",
    "512,512",
    "--dtype",
    "fp8e4m3",
    "--quant",
    "block:128x128",
    "--src",
    "mesh=4 place=S(0)",
    "--dst",
    "mesh=2 place=S(1)",
];

/// `plan --json` of an already-quantized source, every number checked by hand: source `i`
/// (rows 128i..128i+128) sends destination `4 + j` (columns 256j..256j+256) a 128x256 box
/// (32768 bytes) and, in scale grid coordinates, block row `i` of block columns 2j..2j+2
/// (two f32 scales, 8 bytes). Gather+broadcast: 3 x 256 KiB gathered and 256 KiB to each
/// destination; of the 64-byte scale tensor, 3 x 64 + 2 x 64.
#[test]
fn plan_json_of_an_already_quantized_source_by_hand() {
    let out = reshard(&[&["plan", "--json"][..], &TP4_TO_TP2].concat());
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["dtype"], "fp8e4m3");
    assert_eq!(j["dst_dtype"], "fp8e4m3");
    let transfers = j["transfers"].as_array().unwrap();
    assert_eq!(transfers.len(), 8);
    let scales = j["quant"]["scales"].as_array().unwrap();
    assert_eq!(scales.len(), 8);
    for i in 0..4u64 {
        for jj in 0..2u64 {
            let (src, dst) = (i, 4 + jj);
            let find = |list: &[serde_json::Value]| {
                list.iter()
                    .find(|t| t["src"] == src && t["dst"] == dst)
                    .cloned()
                    .unwrap_or_else(|| panic!("no transfer {src} -> {dst}"))
            };
            let t = find(transfers);
            assert_eq!(t["offset"], serde_json::json!([128 * i, 256 * jj]));
            assert_eq!(t["extent"], serde_json::json!([128, 256]));
            assert_eq!(t["bytes"], 32768);
            let s = find(scales);
            assert_eq!(s["offset"], serde_json::json!([i, 2 * jj]));
            assert_eq!(s["extent"], serde_json::json!([1, 2]));
            assert_eq!(s["bytes"], 8);
        }
    }
    let q = &j["quant"];
    assert_eq!(q["source"], "quantized");
    assert_eq!(q["scheme"], "block:128x128");
    assert_eq!(q["scale_dtype"], "f32");
    assert_eq!(q["scale_elem_bytes"], 4);
    assert_eq!(q["block"], serde_json::json!([128, 128]));
    assert_eq!(q["scale_shape"], serde_json::json!([4, 4]));
    assert_eq!(q["amax"], serde_json::json!([]));
    assert_eq!(
        j["totals"],
        serde_json::json!({
            "bytes_remote": 262144, "bytes_local": 0, "messages": 8,
            "max_rank_send_bytes": 65536, "max_rank_recv_bytes": 131072,
            "gather_broadcast_bytes": 3 * 262144 + 2 * 262144,
            "amax_bytes": 0, "amax_messages": 0,
            "scale_bytes": 64, "scale_bytes_local": 0, "scale_messages": 8,
            "scale_gather_broadcast_bytes": 320,
        })
    );

    // the text says what moves, and lists the scale transfers after the values'
    let out = reshard(&[&["plan"][..], &TP4_TO_TP2].concat());
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let text = common::text(&out.stdout);
    for want in [
        "already quantized by block:128x128 (scales f32, grid 4x4)",
        "scales  64 B in 8 messages after the values",
        "gather+broadcast of the scales would move 320 B",
        "8 scale transfers (regions of the 4x4 scale grid)",
        "[3:4, 2:4]",
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }

    // --simulate prices both tensors, on a cluster and on a testbed of hosts: more than the
    // values alone
    let testbed = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/testbeds/testbed-2x4.json"
    );
    for on in ["h100", testbed] {
        let sim = |args: &[&str]| -> f64 {
            let out = reshard(&[args, &["--json", "--simulate", on]].concat());
            assert!(out.status.success(), "{on}: {}", common::text(&out.stderr));
            let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            j["simulation"]["reshard_s"].as_f64().unwrap()
        };
        let values_alone = [&["plan"][..], &TP4_TO_TP2[..4], &TP4_TO_TP2[6..]].concat();
        let both = sim(&[&["plan"][..], &TP4_TO_TP2].concat());
        assert!(both > sim(&values_alone), "{on}");
    }
}

/// `plan` and `bench` refuse, with exit 2 before any byte moves, an already-quantized move
/// whose shard boundary cuts a block (naming the side, the dim, the boundary and the block)
/// and a host map, which such a move is not planned with (`run` used to ignore it).
#[test]
fn plan_and_bench_refuse_cut_blocks_and_host_maps() {
    let cut_dst = [&TP4_TO_TP2[..9], &["mesh=3 place=S(1)"]].concat();
    let cut_src = [&TP4_TO_TP2[..7], &["mesh=3 place=S(0)"], &TP4_TO_TP2[8..]].concat();
    for command in ["plan", "bench"] {
        for (args, want) in [
            (&cut_dst, "--dst: a shard boundary at 171 along dim 1"),
            (&cut_src, "--src: a shard boundary at 171 along dim 0"),
        ] {
            let out = reshard(&[&[command][..], args].concat());
            assert_eq!(out.status.code(), Some(2), "{command} {args:?}");
            let err = common::text(&out.stderr);
            assert!(
                err.contains("tensor: ") && err.contains(want) && err.contains("128x128"),
                "{command}: {err}"
            );
        }
    }
    for command in ["plan", "run", "bench"] {
        // a fill they take, so that nothing but the host map is wrong
        let fill: &[&str] = match command {
            "plan" => &[],
            _ => &["--fill", "normal"],
        };
        let out = reshard(&[&[command][..], &TP4_TO_TP2, fill, &["--hosts", "2x3"]].concat());
        assert_eq!(out.status.code(), Some(2), "{command}");
        let err = common::text(&out.stderr);
        assert!(
            err.contains("--hosts") && err.contains("2x3"),
            "{command}: {err}"
        );
    }
    // the source is the normal fill quantized: no other fill
    let out = reshard(&[&["bench"][..], &TP4_TO_TP2, &["--fill", "index"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(common::text(&out.stderr).contains("--fill"));
}

/// `run --json` of the hand-checked case with `--checksum` and tiny chunks, in threads and
/// over tcp and shm: values and scales move in one exchange whose every chunk is summed and
/// checked, both land verified, and the wire carries exactly the values' 256 KiB and the
/// scales' 64 bytes.
#[test]
fn run_of_an_already_quantized_source_checksums_both_tensors_and_counts_their_bytes() {
    let run = [
        &["run", "--json", "--verify", "--checksum", "--iters", "2"][..],
        &["--chunk-bytes", "4096"],
        &TP4_TO_TP2,
        &["--fill", "normal:4"],
    ]
    .concat();
    for transport in ["local", "tcp", "shm"] {
        let args = match transport {
            "local" => run.clone(),
            _ => [
                &["launch", "--nproc", "6", "--"][..],
                &run,
                &["--transport", transport],
            ]
            .concat(),
        };
        let out = reshard(&args);
        assert!(
            out.status.success(),
            "{transport}: {}",
            common::text(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["transport"], transport, "{j}");
        assert_eq!(j["verified"], true, "{j}");
        assert_eq!(j["bytes_remote"], 262144 + 64, "{j}");
        assert_eq!(j["bytes_local"], 0, "{j}");
    }
}

/// The same under mpirun, over MPI and over shared memory with MPI as the carrier (`auto`).
#[cfg(feature = "mpi")]
#[test]
fn run_of_an_already_quantized_source_under_mpirun_checksums_both_tensors() {
    for transport in ["mpi", "auto"] {
        let child = common::mpirun(6)
            .arg(common::EXE)
            .args(["run", "--json", "--verify", "--checksum", "--iters", "2"])
            .args(["--chunk-bytes", "4096", "--transport", transport])
            .args(TP4_TO_TP2)
            .args(["--fill", "normal:4"])
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = common::wait_bounded(
            child,
            std::time::Duration::from_secs(600),
            "run under mpirun",
        );
        assert!(
            out.status.success(),
            "{transport}: {}",
            common::text(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["verified"], true, "{j}");
        assert_eq!(j["bytes_remote"], 262144 + 64, "{j}");
    }
}

/// Checks one `bench --json` report of the hand-checked case: verified, and the bytes exact
/// (values and scales: 256 KiB + 64 B at the destinations and on the reshard's wire,
/// 1.25 MiB + 320 B for gather+broadcast of both, 256 KiB for the values alone). Over shared
/// memory, the reshard's values are written straight into the receivers' shards, every byte
/// of them, and its scales are not (`bytes_direct`); elsewhere nothing is.
fn check_bench(out: &std::process::Output, transport: &str) {
    assert!(
        out.status.success(),
        "{transport}: {}",
        common::text(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["transport"], transport, "{j}");
    assert_eq!(j["verified"], true, "{j}");
    assert_eq!(j["source"], "quantized", "{j}");
    assert_eq!(j["quant"], "block:128x128", "{j}");
    assert_eq!(j["dst_scale_bytes"], 64, "{j}");
    assert_eq!(j["dst_bytes"], 262144 + 64, "{j}");
    assert_eq!(j["reshard"]["wire_bytes"], 262144 + 64, "{j}");
    assert_eq!(j["gather_broadcast"]["wire_bytes"], 1310720 + 320, "{j}");
    assert_eq!(j["values_only"]["wire_bytes"], 262144, "{j}");
    assert!(j["reshard_vs_values_only"].as_f64().unwrap() > 0.0, "{j}");
    let direct = (transport == "shm").then_some(262144);
    assert_eq!(j["reshard"]["bytes_direct"].as_u64(), direct, "{j}");
}

/// `bench` of an already-quantized source, in threads and over tcp, shm and auto (the last
/// two writing the values directly), checksummed: the three methods run, every repetition verified, the
/// report counting the scales.
#[test]
fn bench_moves_an_already_quantized_source_with_its_scales() {
    let bench = [
        &["bench", "--iters", "2", "--json", "--checksum"][..],
        &TP4_TO_TP2,
    ]
    .concat();
    check_bench(&reshard(&bench), "local");
    // auto: every rank on this host, so shared memory
    for (transport, name) in [("tcp", "tcp"), ("shm", "shm"), ("auto", "shm")] {
        let launched = [
            &["launch", "--nproc", "6", "--"][..],
            &bench,
            &["--transport", transport],
        ]
        .concat();
        check_bench(&reshard(&launched), name);
    }
}

/// The same under mpirun, over MPI, and over shared memory with MPI as the carrier (`auto`,
/// whose coupled reshard writes the values directly and carries the scales beside them).
#[cfg(feature = "mpi")]
#[test]
fn bench_moves_an_already_quantized_source_under_mpirun() {
    for (transport, name) in [("mpi", "mpi"), ("auto", "shm")] {
        let child = common::mpirun(6)
            .arg(common::EXE)
            .args(["bench", "--iters", "2", "--json", "--checksum"])
            .args(["--transport", transport])
            .args(TP4_TO_TP2)
            .env_remove("MASTER_PORT")
            .spawn()
            .unwrap();
        let out = common::wait_bounded(
            child,
            std::time::Duration::from_secs(600),
            "bench under mpirun",
        );
        check_bench(&out, name);
    }
}

/// Ranks of one `bench` job given different scale dtypes for the already-quantized source
/// are refused at rendezvous, every one with exit 2 naming the field and both values, before
/// any byte moves (the values' plans alone are the same on both).
#[test]
fn bench_ranks_that_disagree_on_the_scales_are_refused() {
    use std::process::{Command, Stdio};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let children: Vec<_> = ["f32", "e8m0"]
        .iter()
        .enumerate()
        .map(|(rank, scale_dtype)| {
            Command::new(common::EXE)
                .args(["bench", "--shape", "256,256", "--dtype", "fp8e4m3"])
                .args([
                    "--quant",
                    "block:128x128:ue8m0",
                    "--scale-dtype",
                    scale_dtype,
                ])
                .args(["--src", "mesh=1 place=R", "--dst", "mesh=1 place=R"])
                .args(["--transport", "tcp", "--timeout", "120"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RESHARD_TOKEN", "prequant-test")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let out = common::wait_bounded(child, std::time::Duration::from_secs(100), "bench");
        let err = common::text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {rank}: {err}");
        assert!(
            err.contains("--scale-dtype (source)") && err.contains("f32") && err.contains("e8m0"),
            "rank {rank}: {err}"
        );
    }
}

/// `verified` of an already-quantized source is what the checks found: true with `--verify`,
/// false without, in threads and over tcp (where every rank reports its own), and the text
/// says it verified only when it did.
#[test]
fn run_of_an_already_quantized_source_is_verified_only_when_checked() {
    let run = [&["run", "--fill", "normal:4"][..], &TP4_TO_TP2].concat();
    for transport in ["local", "tcp"] {
        for (verify, json) in [(true, true), (false, true), (true, false), (false, false)] {
            let mut args = match transport {
                "local" => run.clone(),
                _ => [
                    &["launch", "--nproc", "6", "--"][..],
                    &run,
                    &["--transport", transport],
                ]
                .concat(),
            };
            if verify {
                args.push("--verify");
            }
            if json {
                args.push("--json");
            }
            let out = reshard(&args);
            assert!(
                out.status.success(),
                "{transport}: {}",
                common::text(&out.stderr)
            );
            let stdout = common::text(&out.stdout);
            if json {
                let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                assert_eq!(j["verified"], verify, "{transport}: {j}");
            } else {
                assert_eq!(stdout.contains("verify  every"), verify, "{stdout}");
            }
        }
    }
}
