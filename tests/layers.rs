//! The crate's layers point one way: the bottom (ranks, regions, copy kernels, checksums,
//! errors, layouts) never imports the executor, transports or the model, the transports never
//! import the executor that drives them, so that each can be read, tested and reused without
//! the layers above it. Checked on the source text, since the compiler accepts a cycle between
//! modules of one crate without complaint.

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file of `path` (a file, or a folder searched recursively).
fn sources(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) {
        let entry = entry.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let p = entry.path();
        if p.is_dir() {
            files.extend(sources(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
    files
}

/// The lines of `module` (relative to `src/`) outside comments that name any of `forbidden`.
fn offending_lines(module: &str, forbidden: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in sources(&root.join(module)) {
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            if let Some(path) = forbidden.iter().find(|p| line.contains(*p)) {
                found.push(format!("{}:{}: imports {path}", file.display(), n + 1));
            }
        }
    }
    found
}

#[test]
fn the_bottom_modules_import_nothing_above_them() {
    let above = [
        "crate::exec",
        "crate::transport",
        "crate::runtime",
        "crate::model",
    ];
    let rules: [(&str, &[&str]); 11] = [
        ("rank.rs", &["crate::"]),
        ("region.rs", &above),
        ("copy.rs", &above),
        ("checksum.rs", &above),
        ("memory.rs", &above),
        ("convert", &above),
        // the executor drives the transports, never the other way around
        (
            "transport",
            &["crate::exec", "crate::runtime", "crate::model"],
        ),
        ("layout", &above),
        ("fill.rs", &above),
        // errors sit below layouts and models: both return them
        (
            "error.rs",
            &[
                "crate::layout",
                "crate::model",
                "crate::plan",
                "crate::exec",
            ],
        ),
        (
            "error",
            &[
                "crate::layout",
                "crate::model",
                "crate::plan",
                "crate::exec",
            ],
        ),
    ];
    let found: Vec<String> = rules
        .iter()
        .flat_map(|(module, forbidden)| offending_lines(module, forbidden))
        .collect();
    assert!(
        found.is_empty(),
        "imports against the layers:\n{}",
        found.join("\n")
    );
}
