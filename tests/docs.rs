//! The documentation's links hold: every relative link of README.md, BENCHMARKS.md and the
//! book (docs/src) names a file that exists and, with `#anchor`, one of its headings; every
//! page of the book is in its SUMMARY.md.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files checked.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md"), root().join("BENCHMARKS.md")];
    let mut book: Vec<PathBuf> = std::fs::read_dir(root().join("docs/src"))
        .expect("docs/src")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    book.sort();
    out.extend(book);
    out
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// A heading's anchor as GitHub and mdBook make it: lower case, spaces to dashes, other
/// punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim_start_matches('#')
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut seen = BTreeSet::new();
    for line in prose(&text) {
        if line.starts_with('#') {
            let base = slug(line);
            let mut anchor = base.clone();
            let mut n = 0;
            while seen.contains(&anchor) {
                n += 1;
                anchor = format!("{base}-{n}");
            }
            seen.insert(anchor);
        }
    }
    seen
}

/// The `[label](target)` targets of a line, inline code spans left out.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut code = false;
    let bytes: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            '`' => code = !code,
            ']' if !code && bytes.get(i + 1) == Some(&'(') => {
                let rest: String = bytes[i + 2..].iter().collect();
                if let Some(end) = rest.find(')') {
                    let target = &rest[..end];
                    if !target.contains(' ') {
                        out.push(target.to_owned());
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[test]
fn every_relative_link_names_a_file_and_a_heading_that_exist() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        for line in prose(&text) {
            for target in links(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let file = if file.is_empty() {
                    page.clone()
                } else {
                    page.parent().expect("a folder").join(file)
                };
                if !file.exists() {
                    broken.push(format!("{}: {target}: no such file", page.display()));
                } else if !anchor.is_empty() && !anchors(&file).contains(anchor) {
                    broken.push(format!("{}: {target}: no such heading", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_page_of_the_book_is_in_its_summary() {
    let summary = std::fs::read_to_string(root().join("docs/src/SUMMARY.md")).expect("SUMMARY.md");
    let listed: BTreeSet<String> = prose(&summary).iter().flat_map(|l| links(l)).collect();
    for page in pages().iter().skip(2) {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        if name != "SUMMARY.md" {
            assert!(
                listed.contains(&name),
                "{name} is not in docs/src/SUMMARY.md"
            );
        }
    }
}
