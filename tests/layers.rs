//! The crates are the layers, and they point one way: the pure core depends on no other
//! crate of the workspace; the model rules and the transports on the core alone; the runtime
//! (executor and runtime) on those three; the command line and the Python package on top, the
//! Python package without the transports or the runtime. Cargo refuses a cycle between crates,
//! but not a new edge that skips or inverts a layer, so the graph is checked here, read from
//! each crate's manifest.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The workspace's crates, by package name, and the manifest each lives in.
const CRATES: [(&str, &str); 7] = [
    ("reshard-core", "crates/core/Cargo.toml"),
    ("reshard-model", "crates/model/Cargo.toml"),
    ("reshard-transport", "crates/transport/Cargo.toml"),
    ("reshard-runtime", "crates/runtime/Cargo.toml"),
    ("reshard", "Cargo.toml"),
    ("reshard-cli", "crates/cli/Cargo.toml"),
    ("reshard-python", "python/Cargo.toml"),
];

/// What each crate may depend on (its `[dependencies]`, among the workspace's crates).
fn allowed() -> BTreeMap<&'static str, BTreeSet<&'static str>> {
    let set = |names: &[&'static str]| names.iter().copied().collect::<BTreeSet<_>>();
    BTreeMap::from([
        ("reshard-core", set(&[])),
        ("reshard-model", set(&["reshard-core"])),
        ("reshard-transport", set(&["reshard-core"])),
        (
            "reshard-runtime",
            set(&["reshard-core", "reshard-model", "reshard-transport"]),
        ),
        (
            "reshard",
            set(&[
                "reshard-core",
                "reshard-model",
                "reshard-transport",
                "reshard-runtime",
            ]),
        ),
        ("reshard-cli", set(&["reshard"])),
        ("reshard-python", set(&["reshard-core", "reshard-model"])),
    ])
}

/// The names in the `[dependencies]` table of `manifest` (not the dev-dependencies: tests
/// and benchmarks may use any layer below or beside them).
fn dependency_names(manifest: &str) -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text =
        fs::read_to_string(root.join(manifest)).unwrap_or_else(|e| panic!("{manifest}: {e}"));
    let mut in_deps = false;
    let mut found = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if !in_deps || line.starts_with('#') {
            continue;
        }
        if let Some((name, _)) = line.split_once('=') {
            found.insert(name.trim().to_string());
        }
    }
    found
}

/// The workspace crates among the dependencies of `manifest`.
fn dependencies(manifest: &str) -> BTreeSet<String> {
    dependency_names(manifest)
        .into_iter()
        .filter(|name| CRATES.iter().any(|(c, _)| c == name))
        .collect()
}

#[test]
fn every_crate_depends_only_on_the_layers_below_it() {
    let allowed = allowed();
    let mut wrong = Vec::new();
    for (name, manifest) in CRATES {
        for dep in dependencies(manifest) {
            if !allowed[name].contains(dep.as_str()) {
                wrong.push(format!("{name} ({manifest}) depends on {dep}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "edges against the layers:\n{}",
        wrong.join("\n")
    );
}

/// The command line's dependencies (argument parsing, progress bars, the log subscriber, the
/// allocator) stay out of the library crates, so a program that depends on `reshard` does not
/// compile them.
#[test]
fn only_the_command_line_carries_the_binary_dependencies() {
    let binary_only = ["clap", "indicatif", "tracing-subscriber", "mimalloc"];
    for (name, manifest) in CRATES {
        if name == "reshard-cli" {
            continue;
        }
        let names = dependency_names(manifest);
        for dep in binary_only {
            assert!(!names.contains(dep), "{name} ({manifest}) depends on {dep}");
        }
    }
}

/// The workspace lists every crate, so none is left out of `cargo test`.
#[test]
fn the_workspace_holds_every_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = fs::read_to_string(root.join("Cargo.toml")).unwrap();
    for (name, manifest) in CRATES {
        let dir = manifest
            .trim_end_matches("Cargo.toml")
            .trim_end_matches('/');
        if dir.is_empty() {
            continue;
        }
        assert!(
            text.contains(&format!("\"{dir}\"")),
            "{name} ({dir}) is not a workspace member"
        );
    }
}
