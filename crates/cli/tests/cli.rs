//! The command-line contract of the design notes: commands, plan JSON, fill and dump formats,
//! and errors that name the field and the value.

use std::process::{Command, Output};

use serde_json::Value;

fn reshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(args)
        .output()
        .expect("the reshard binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const SEED: [&str; 8] = [
    "--shape",
    "8,8",
    "--dtype",
    "bf16",
    "--src",
    "mesh=2 place=S(0)",
    "--dst",
    "mesh=4 place=S(1)",
];

/// A fresh, empty folder under the system temp dir, removed with all it holds when the guard
/// drops, also when a test fails half-way.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("reshard-cli-{name}-"))
        .tempdir()
        .expect("a temp dir")
}

#[test]
fn plan_json_of_the_seed_example() {
    let out = reshard(&[&["plan"], &SEED[..], &["--json"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["shape"], serde_json::json!([8, 8]));
    assert_eq!(json["dtype"], "bf16");
    assert_eq!(json["elem_bytes"], 2);
    let transfers = json["transfers"].as_array().unwrap();
    assert_eq!(transfers.len(), 8);
    for src in 0..2u64 {
        for dst in 2..6u64 {
            let t = transfers
                .iter()
                .find(|t| t["src"] == src && t["dst"] == dst)
                .unwrap_or_else(|| panic!("no transfer {src} -> {dst}"));
            assert_eq!(t["offset"], serde_json::json!([src * 4, (dst - 2) * 2]));
            assert_eq!(t["extent"], serde_json::json!([4, 2]));
            assert_eq!(t["bytes"], 16);
        }
    }
    let totals = &json["totals"];
    assert_eq!(totals["bytes_remote"], 128);
    assert_eq!(totals["bytes_local"], 0);
    assert_eq!(totals["messages"], 8);
    assert_eq!(totals["max_rank_send_bytes"], 64);
    assert_eq!(totals["max_rank_recv_bytes"], 32);
    assert_eq!(totals["gather_broadcast_bytes"], 640);
}

#[test]
fn plan_json_marks_local_copies() {
    let out = reshard(&[
        "plan",
        "--shape",
        "8,8",
        "--dtype",
        "f32",
        "--src",
        "mesh=4 place=S(0)",
        "--dst",
        "mesh=2 ranks=0..2 place=S(1)",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let local: Vec<&Value> = json["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["src"] == t["dst"])
        .collect();
    assert_eq!(local.len(), 2);
    assert_eq!(json["totals"]["bytes_local"], 64);
}

#[test]
fn plan_text_draws_the_picture() {
    let out = reshard(&[&["plan"], &SEED[..]].concat());
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.contains("source shards"), "{text}");
    assert!(text.contains(" 2 2 3 3 4 4 5 5"), "{text}");
    assert!(text.contains("a: 0 -> 2"), "{text}");
    assert!(
        text.contains("gather+broadcast would move 640 B (5.0x"),
        "{text}"
    );
}

#[test]
fn run_dumps_index_filled_shards() {
    let scratch = temp_dir("dump");
    let dir = scratch.path().join("dump");
    let out = reshard(
        &[
            &["run"],
            &SEED[..],
            &[
                "--fill",
                "index",
                "--verify",
                "--transport",
                "local",
                "--dump",
                dir.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    for k in 0..4u16 {
        let bytes = std::fs::read(dir.join(format!("rank{}.bin", k + 2))).unwrap();
        // column shard k of the 8x8 tensor whose element (r, c) holds r * 8 + c
        let want: Vec<u8> = (0..8u16)
            .flat_map(|r| (0..2u16).map(move |c| r * 8 + 2 * k + c))
            .flat_map(u16::to_le_bytes)
            .collect();
        assert_eq!(bytes, want, "rank {}", k + 2);
    }
    assert_eq!(
        file_names(&dir),
        ["rank2.bin", "rank3.bin", "rank4.bin", "rank5.bin"],
        "whole files only, no temporaries"
    );
}

fn file_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// `--dump` at a path that is a regular file: refused by name before any byte moves (exit 2,
/// no report, the file untouched); a missing directory is created.
#[test]
fn run_checks_the_dump_dir_before_moving() {
    let scratch = temp_dir("dump-check");
    let dir = scratch.path();
    let file = dir.join("not-a-dir");
    std::fs::write(&file, b"keep").unwrap();
    for transport in ["local", "auto"] {
        let out = reshard(
            &[
                &["run"],
                &SEED[..],
                &["--verify", "--json", "--transport", transport, "--dump"],
                &[file.to_str().unwrap()],
            ]
            .concat(),
        );
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!(
                "--dump: {} is invalid: it exists and is not a directory",
                file.display()
            )),
            "{}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    let missing = dir.join("new/deeper");
    let out = reshard(
        &[
            &["run"],
            &SEED[..],
            &["--transport", "local", "--dump", missing.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(file_names(&missing).len(), 4);
}

/// The default fill tells apart rows r and r + 8 of an 8192-column bf16 tensor, which `index`
/// fills alike (so that `--verify` under `index` cannot see them swapped): `--verify` with
/// the default fill sees where bytes land.
#[test]
fn the_default_fill_tells_apart_what_index_fills_alike() {
    let rows_of = |fill: Option<&str>| {
        let scratch = temp_dir(&format!("fill-{}", fill.unwrap_or("default")));
        let dir = scratch.path();
        let mut args = vec![
            "run",
            "--shape",
            "16,8192",
            "--dtype",
            "bf16",
            "--src",
            "mesh=2 place=S(0)",
            "--dst",
            "mesh=1 place=R",
            "--transport",
            "local",
            "--verify",
            "--dump",
            dir.to_str().unwrap(),
        ];
        if let Some(fill) = fill {
            args.extend(["--fill", fill]);
        }
        let out = reshard(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let bytes = std::fs::read(dir.join("rank2.bin")).unwrap();
        let row = 8192 * 2;
        (0..16)
            .map(|r| bytes[r * row..(r + 1) * row].to_vec())
            .collect::<Vec<_>>()
    };
    let index = rows_of(Some("index"));
    assert!((0..8).all(|r| index[r] == index[r + 8]));
    let default = rows_of(None);
    assert_eq!(default, rows_of(Some("hash")));
    for r in 0..16 {
        for s in r + 1..16 {
            assert_ne!(default[r], default[s], "rows {r} and {s}");
        }
    }
}

/// `verified` is what the check found: true after `--verify`, false without it.
#[test]
fn run_json_reports_whether_it_verified() {
    for (flag, verified) in [(Some("--verify"), true), (None, false)] {
        let mut args = [&["run"], &SEED[..], &["--transport", "local", "--json"]].concat();
        args.extend(flag);
        let out = reshard(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(json["verified"], verified, "{json}");
    }
}

#[test]
fn run_verifies_uneven_nested_n_d_layouts() {
    let out = reshard(&[
        "run",
        "--shape",
        "7,5,3,2",
        "--dtype",
        "fp8e4m3",
        "--src",
        "mesh=2x3 place=S(0),S(0)",
        "--dst",
        "mesh=2x2 ranks=4,0,9,2 place=S(1),R",
        "--fill",
        "hash:11",
        "--verify",
        "--chunk-bytes",
        "3",
        "--staging-bytes",
        "6",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["verified"], true);
    assert_eq!(json["dst_bytes"], 2 * 7 * 5 * 3 * 2);
}

/// `--checksum` in one process: uneven shards, tiny chunks, local copies (which need no sums)
/// beside transfers; the run verifies and says every chunk was checked. Bench checksums both
/// methods and says so.
#[test]
fn run_and_bench_with_checksums_pass_over_local() {
    let out = reshard(&[
        "run",
        "--shape",
        "7,5,3,2",
        "--dtype",
        "bf16",
        "--src",
        "mesh=2x3 place=S(0),S(1)",
        "--dst",
        "mesh=2x2 ranks=4,0,9,2 place=S(1),R",
        "--fill",
        "hash:5",
        "--verify",
        "--chunk-bytes",
        "6",
        "--staging-bytes",
        "12",
        "--transport",
        "local",
        "--checksum",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("checksum every chunk landed as its sender summed it (crc32c)"),
        "{text}"
    );
    let out = reshard(
        &[
            &["bench"][..],
            &SEED,
            &[
                "--transport",
                "local",
                "--iters",
                "2",
                "--json",
                "--checksum",
            ],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let j: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["verified"], true);
    assert_eq!(j["checksummed"], true);
}

#[test]
fn demo_runs_and_verifies() {
    let out = reshard(&["demo"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("verified"), "{text}");
    assert!(text.contains("5.0x fewer bytes"), "{text}");
}

/// Bad input: exit code 2, a message naming the field and the value, no panic.
#[test]
fn bad_input_names_the_field_and_the_value() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 place=S(2)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "--src: Shard(2) is out of range for a 2-D tensor",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4 place=S(-3)",
            ],
            "--dst: Shard(-3) is out of range",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2x2 ranks=0..3 place=R,S(0)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "--src: mesh 2x2 has 4 positions but ranks lists 3",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 ranks=5,5 place=S(0)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "--src: rank 5 appears more than once",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4x0 place=S(1),R",
            ],
            "--dst: mesh axis 1 has size 0",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--dtype",
                "bf17",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "--dtype: unknown dtype `bf17`",
        ),
        (
            &[
                "--shape",
                "8,x",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "--shape: malformed shape `8,x`",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4 place=S(1) extra",
            ],
            "--dst: malformed layout spec `mesh=4 place=S(1) extra`",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 place=S(0),R",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "--src: 2 placements for a 1-D mesh",
        ),
        (
            &[
                "--shape",
                "8,8",
                "--src",
                "mesh=2 place=Sh(0)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "unknown placement `Sh(0)`",
        ),
        (
            &[
                "--shape",
                "99999999999,99999999999,99999",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=4 place=S(1)",
            ],
            "has more than 2^64 bytes",
        ),
    ];
    for (args, message) in cases {
        for command in ["plan", "run"] {
            let out = reshard(&[&[command], *args].concat());
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(2), "{command} {args:?}: {err}");
            assert!(
                err.contains(message),
                "{command} {args:?}: expected `{message}` in `{err}`"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    let out = reshard(&[&["run"], &SEED[..], &["--chunk-bytes", "lots"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--chunk-bytes: lots is invalid"),
        "{}",
        stderr(&out)
    );
    let out = reshard(&[
        "plan",
        "--shape",
        "8",
        "--src",
        "mesh=1 ranks=18446744073709551615 place=R",
        "--dst",
        "mesh=2 place=R",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--src: rank 18446744073709551615 is too large"),
        "{}",
        stderr(&out)
    );
    // sizes near 2^64 bytes plan without overflow
    for args in [
        [
            "--shape",
            "4611686018427387904",
            "--dtype",
            "u8",
            "--src",
            "mesh=4 place=R",
            "--dst",
            "mesh=1 place=R",
        ],
        [
            "--shape",
            "4611686018427387904",
            "--dtype",
            "u8",
            "--src",
            "mesh=1 place=R",
            "--dst",
            "mesh=4 place=R",
        ],
        [
            "--shape",
            "2305843009213693952,2",
            "--dtype",
            "u8",
            "--src",
            "mesh=1 place=R",
            "--dst",
            "mesh=1 place=S(1)",
        ],
    ] {
        let out = reshard(&[&["plan"], &args[..]].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    // a plan this machine cannot hold is refused before anything is allocated
    let huge = [
        "--shape",
        "1048576,1048576",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=4 place=S(1)",
    ];
    let out = reshard(&[&["run"], &huge[..]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--shape: 1048576,1048576 is invalid: running it here needs"),
        "{}",
        stderr(&out)
    );
    assert!(reshard(&[&["plan"], &huge[..]].concat()).status.success());
    let out = reshard(&[&["run"], &SEED[..], &["--fill", "zeros"]].concat());
    assert!(
        stderr(&out).contains("--fill: zeros is invalid"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn plan_simulate_prices_the_plan_on_a_cluster() {
    let plain = reshard(&[&["plan"], &SEED[..], &["--json"]].concat());
    let plain: Value = serde_json::from_str(&stdout(&plain)).unwrap();
    assert!(plain.get("simulation").is_none());

    let out = reshard(&[&["plan"], &SEED[..], &["--json", "--simulate", "h100"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["totals"], plain["totals"]);
    let sim = &json["simulation"];
    assert_eq!(sim["cluster"], "h100");
    let num = |k: &str| sim[k].as_f64().unwrap_or_else(|| panic!("{k}: {sim}"));
    assert!(num("lower_bound_s") > 0.0 && num("lower_bound_s") <= num("reshard_s"));
    assert!((num("speedup") - num("gather_broadcast_s") / num("reshard_s")).abs() < 1e-9);

    let text = reshard(&[&["plan"], &SEED[..], &["--simulate", "gb200"]].concat());
    assert!(text.status.success(), "{}", stderr(&text));
    assert!(
        stdout(&text).contains("simulated on gb200"),
        "{}",
        stdout(&text)
    );

    // a cluster file: the same hardware with a tenth of the NIC bandwidth is slower
    let scratch = temp_dir("simulate");
    let dir = scratch.path();
    let file = dir.join("slow.json");
    std::fs::write(
        &file,
        r#"{"base": "h100", "nvlink_domain": 1, "gpus_per_node": 1, "nic_gb_s": 5}"#,
    )
    .unwrap();
    let slow = reshard(
        &[
            &["plan"],
            &SEED[..],
            &["--json", "--simulate", file.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(slow.status.success(), "{}", stderr(&slow));
    let slow: Value = serde_json::from_str(&stdout(&slow)).unwrap();
    assert_eq!(slow["simulation"]["cluster"], "slow");
    assert!(slow["simulation"]["reshard_s"].as_f64().unwrap() > num("reshard_s"));

    std::fs::write(&file, r#"{"base": "h100", "nic_gbs": 5}"#).unwrap();
    let bad = reshard(
        &[
            &["plan"],
            &SEED[..],
            &["--simulate", file.to_str().unwrap()],
        ]
        .concat(),
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("--simulate") && stderr(&bad).contains("nic_gbs"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn bench_reports_both_methods_verified() {
    let out = reshard(
        &[
            &["bench"][..],
            &SEED,
            &["--transport", "local", "--iters", "3", "--json"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let j: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["shape"], serde_json::json!([8, 8]));
    assert_eq!(j["transport"], "local");
    assert_eq!(j["iters"], 3);
    assert_eq!(j["verified"], true);
    assert_eq!(j["dst_bytes"], 128);
    assert_eq!(j["reshard"]["wire_bytes"], 128);
    // the all-gather moves one row shard each way, then four full copies
    assert_eq!(j["gather_broadcast"]["wire_bytes"], 640);
    assert_eq!(j["byte_ratio"], 5.0);
    for method in ["reshard", "gather_broadcast"] {
        let m = &j[method];
        let (lo, mid, hi) = (
            m["min_s"].as_f64().unwrap(),
            m["median_s"].as_f64().unwrap(),
            m["max_s"].as_f64().unwrap(),
        );
        assert!(0.0 < lo && lo <= mid && mid <= hi, "{m}");
        let gbps = m["gbps"].as_f64().unwrap();
        assert!(
            (gbps - 128.0 / mid / 1e9).abs() <= 1e-9 * gbps.max(1.0),
            "{m}"
        );
    }
    // the baseline holds the whole tensor on every rank that gathers or receives it
    assert_eq!(j["gather_broadcast"]["peak_extra_bytes_per_rank"], 128);
    let speedup = j["speedup"].as_f64().unwrap();
    let ratio = j["gather_broadcast"]["median_s"].as_f64().unwrap()
        / j["reshard"]["median_s"].as_f64().unwrap();
    assert!(
        (speedup - ratio).abs() < 1e-9 * ratio,
        "{speedup} vs {ratio}"
    );
}

#[test]
fn bench_suite_covers_the_refit_layouts() {
    let out = reshard(&[
        "bench",
        "--suite",
        "refit",
        "--suite-bytes",
        "64KiB",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["suite"], "refit");
    let cases = j["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for c in cases {
        assert_eq!(c["verified"], true, "{c}");
        let ratio = c["byte_ratio"].as_f64().unwrap();
        let wire = |m: &str| c[m]["wire_bytes"].as_f64().unwrap();
        assert_eq!(ratio, wire("gather_broadcast") / wire("reshard"), "{c}");
    }
    let by_name = |n: &str| cases.iter().find(|c| c["name"] == n).unwrap();
    assert_eq!(by_name("tp4-s0-to-tp4-s1")["byte_ratio"], 7.0);
    assert_eq!(by_name("replicated-2-to-4")["byte_ratio"], 1.0);
    // text output names every case
    let out = reshard(&[
        "bench",
        "--suite",
        "refit",
        "--suite-bytes",
        "16KiB",
        "--iters",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    for c in cases {
        assert!(stdout(&out).contains(c["name"].as_str().unwrap()));
    }
}

#[test]
fn bench_rejects_bad_input_by_name() {
    let cases: [(&[&str], &str); 4] = [
        (&["bench", "--suite", "refit", "--shape", "8,8"], "--shape"),
        (
            &["bench", "--shape", "8,8", "--src", "mesh=2 place=S(0)"],
            "--dst",
        ),
        (
            &["bench", "--suite", "refit", "--suite-bytes", "lots"],
            "--suite-bytes",
        ),
        (
            &[&["bench"][..], &SEED, &["--iters", "0"]].concat(),
            "--iters",
        ),
    ];
    for (args, field) in cases {
        let out = reshard(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(field), "{args:?}: {}", stderr(&out));
    }
}

/// Input past the limits (see `reshard::limits`) or with a typo is refused with exit code 2,
/// naming the option and the value, before any process starts or memory is spent.
#[test]
fn absurd_input_is_refused_naming_the_field_and_value() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["launch", "--nproc", "100000", "--", "plan"],
            "--nproc: 100000 is invalid: more than the 1024 processes",
        ),
        (
            &["launch", "--nproc", "2", "--master-port", "0", "--", "plan"],
            "--master-port: 0 is invalid",
        ),
        (
            &[
                "plan",
                "--shape",
                "8,x",
                "--src",
                "mesh=2 place=S(0)",
                "--dst",
                "mesh=2 place=R",
            ],
            "--shape: malformed shape `8,x`: `x` is not a valid dimension size",
        ),
        (
            &[
                "plan",
                "--shape",
                "8",
                "--src",
                "mesh=2 ranks=2147483646,2147483647 place=R",
                "--dst",
                "mesh=2 place=R",
            ],
            "--dst: the default ranks 2147483648..2147483650 reach 2^31",
        ),
        (
            &[
                "plan",
                "--shape",
                "8",
                "--src",
                "mesh=4097x4096 place=R,R",
                "--dst",
                "mesh=1 place=R",
            ],
            "--src: mesh 4097x4096 has 16781312 positions, more than the 16777216 ranks",
        ),
        (
            &["bench", "--suite", "refit", "--suite-bytes", "1024GiB"],
            "--suite-bytes: 1024GiB is invalid: case tp4-to-tp2",
        ),
        (
            &["bench", "--suite", "refit", "--suite-bytes", "20000000TiB"],
            "--suite-bytes: 20000000TiB is invalid: more than 2^64-1 bytes",
        ),
    ];
    for (args, message) in cases {
        let out = reshard(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(message),
            "{args:?}: expected `{message}` in `{err}`"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn absurd_model_configs_are_refused() {
    let scratch = temp_dir("deep");
    let config = scratch.path().join("deep.json");
    std::fs::write(
        &config,
        r#"{"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 256, "num_hidden_layers": 100000000, "num_attention_heads": 4}"#,
    )
    .unwrap();
    let out = reshard(&[
        "refit",
        "--model",
        config.to_str().unwrap(),
        "--train",
        "tp=1",
        "--infer",
        "tp=1",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`num_hidden_layers` is 100000000: more than the 16384 layers"),
        "{err}"
    );
}

/// A total past 2^64 - 1 bytes is shown as an overflow, never as 18446744073709551615.
#[test]
fn plan_totals_that_overflow_are_marked() {
    let args = [
        "plan",
        "--shape",
        "4611686018427387904",
        "--dtype",
        "u8",
        "--src",
        "mesh=1 place=R",
        "--dst",
        "mesh=4 place=R",
    ];
    let out = reshard(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains("16.0 EiB in"), "{text}");
    assert!(
        text.contains("remote  more than 16.0 EiB (overflows 64 bits) in 4 messages"),
        "{text}"
    );
    let out = reshard(&[&args[..], &["--json"]].concat());
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let totals = &json["totals"];
    assert!(totals["bytes_remote"].is_null(), "{totals}");
    assert!(!stdout(&out).contains("18446744073709551615"));
    assert_eq!(
        totals["overflow"],
        serde_json::json!([
            "bytes_remote",
            "max_rank_send_bytes",
            "gather_broadcast_bytes"
        ])
    );
}

/// Both sides fully replicated over a 1000x1000 mesh: a million destinations, planned in
/// linear time (it did not finish when each looked through a million holders).
#[test]
fn plan_of_a_million_replicas_finishes() {
    let out = reshard(&[
        "plan",
        "--shape",
        "8,8",
        "--src",
        "mesh=1000x1000 place=R,R",
        "--dst",
        "mesh=1000x1000 place=R,R",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("1000000 transfers:"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn launch_exec_runs_a_program_with_the_rendezvous_environment() {
    let script = "echo \"rank $RANK of $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT\"";
    let out = reshard(&["launch", "--nproc", "3", "--exec", "--", "sh", "-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for rank in 0..3 {
        assert!(
            text.contains(&format!("rank {rank} of 3 at 127.0.0.1:")),
            "{text}"
        );
    }
    // a program that is not there is named, and the launcher fails
    let out = reshard(&["launch", "--nproc", "1", "--exec", "--", "/no/such/program"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("/no/such/program"),
        "{}",
        stderr(&out)
    );
}
