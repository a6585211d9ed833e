//! The library's surface stays deliberate: the facade (`src/lib.rs`) exports the scaffolding
//! of benchmarks and tests (fills, evolutions, the comparison harness, the measured refit,
//! refits while serving, the serving stand-in, the cost model's testbeds) only with the
//! `bench` feature, and what it exports by default has at most eight public entry points
//! that run something (`run`, `run_*`).
//!
//! Both are read from the sources rather than compiled: the tests, benchmarks and the command
//! line of this workspace enable `bench`, so a build of them always has it.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The most public `run*` entry points the default surface may have.
const MAX_RUN_ENTRY_POINTS: usize = 8;

/// The default surface's entry points that run something, as `file: name`.
const RUN_ENTRY_POINTS: [&str; 7] = [
    "crates/runtime/src/prepared.rs: run", // PlanRank::run
    "crates/runtime/src/run.rs: run",      // World::run
    "crates/runtime/src/run.rs: run_batch",
    "crates/runtime/src/run.rs: run_batch_quantized",
    "crates/runtime/src/run.rs: run_gather_broadcast",
    "crates/runtime/src/run.rs: run_quantized",
    "crates/runtime/src/run.rs: run_quantized_move",
];

/// Public functions named `run_*` that run nothing (a length).
const NOT_ENTRY_POINTS: [&str; 1] = ["crates/core/src/copy/mod.rs: run_bytes"];

/// The layer crates' modules and files that are scaffolding: the facade exports them only
/// with `bench`, so their functions are not part of the default surface.
const SCAFFOLDING_FILES: [&str; 8] = [
    "crates/core/src/fill.rs",
    "crates/core/src/evolve.rs",
    "crates/core/src/testing.rs",
    "crates/core/src/sim/testbed",
    "crates/runtime/src/harness.rs",
    "crates/runtime/src/refit",
    "crates/runtime/src/rollout",
    "crates/runtime/src/serve.rs",
];

/// Names the facade may export only under `#[cfg(feature = "bench")]`.
const SCAFFOLDING_NAMES: [&str; 12] = [
    "fill",
    "evolve",
    "testing",
    "harness",
    "rollout",
    "serve",
    "RefitRun",
    "Testbed",
    "TestbedCost",
    "is_testbed",
    "price_on_testbed",
    "price_baseline_on",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `text` without its `//` comments (doc comments included).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| l.split_once("//").map_or(l, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `pub use ...;` of the facade, whitespace collapsed, with whether the attribute
/// right before it is `#[cfg(feature = "bench")]`.
fn facade_exports() -> Vec<(String, bool)> {
    let text = fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let code = strip_comments(&text);
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("pub use ") {
        let before = rest[..at].trim_end();
        let gated = before.ends_with("#[cfg(feature = \"bench\")]");
        let end = at + rest[at..].find(';').expect("a `pub use` ends with `;`");
        let item = rest[at..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        out.push((item, gated));
        rest = &rest[end + 1..];
    }
    out
}

fn names(item: &str) -> BTreeSet<String> {
    item.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '*'))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn scaffolding_is_exported_only_with_the_bench_feature() {
    let exports = facade_exports();
    assert!(
        exports.len() > 5,
        "the facade's exports were not found: {exports:?}"
    );
    for (item, gated) in &exports {
        if *gated {
            continue;
        }
        let words = names(item);
        for name in SCAFFOLDING_NAMES {
            assert!(
                !words.contains(name),
                "src/lib.rs exports the scaffolding `{name}` without the `bench` feature: {item}"
            );
        }
        // a glob, or a whole runtime or core crate, would bring the scaffolding along
        assert!(
            !item.contains('*'),
            "src/lib.rs exports a glob without the `bench` feature: {item}"
        );
        for krate in ["reshard_core", "reshard_runtime"] {
            assert!(
                !item.ends_with(krate) && !item.contains(&format!("{krate} as")),
                "src/lib.rs exports the whole of {krate} without the `bench` feature: {item}"
            );
        }
    }
    // and the feature does export them, for the command line and the benchmarks
    let gated: BTreeSet<String> = exports
        .iter()
        .filter(|(_, g)| *g)
        .flat_map(|(item, _)| names(item))
        .collect();
    for name in ["fill", "evolve", "harness", "rollout", "serve", "Testbed"] {
        assert!(gated.contains(name), "`bench` does not export `{name}`");
    }
}

/// The `.rs` files under `dir`, but tests and scaffolding.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let rel = path
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let name = path.file_name().unwrap().to_string_lossy();
        if SCAFFOLDING_FILES.iter().any(|s| rel.starts_with(s))
            || name == "tests"
            || name == "tests.rs"
        {
            continue;
        }
        if path.is_dir() {
            sources(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn at_most_eight_run_entry_points_by_default() {
    let mut files = Vec::new();
    for krate in ["core", "model", "transport", "runtime"] {
        sources(&root().join("crates").join(krate).join("src"), &mut files);
    }
    let mut found = BTreeSet::new();
    for path in files {
        let rel = path
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let code = strip_comments(&fs::read_to_string(&path).unwrap());
        for line in code.lines() {
            // `pub(crate) fn` and the drivers `bench_pub!` declares (`fn` alone) do not count
            let Some(rest) = line.trim_start().strip_prefix("pub fn ") else {
                continue;
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name == "run" || name.starts_with("run_") {
                let key = format!("{rel}: {name}");
                if !NOT_ENTRY_POINTS.contains(&key.as_str()) {
                    found.insert(key);
                }
            }
        }
    }
    assert!(
        found.len() <= MAX_RUN_ENTRY_POINTS,
        "{} public run* entry points by default (at most {MAX_RUN_ENTRY_POINTS}): {found:#?}",
        found.len()
    );
    let expected: BTreeSet<String> = RUN_ENTRY_POINTS.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        found, expected,
        "the default surface's run* entry points changed: update RUN_ENTRY_POINTS (at most \
         {MAX_RUN_ENTRY_POINTS}), or make the new one crate-private or `bench_pub!`"
    );
}
