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
        (
            "reshard-python",
            set(&[
                "reshard-core",
                "reshard-model",
                "reshard-transport",
                "reshard-runtime",
            ]),
        ),
    ])
}

/// The lines of the `[table]` of `manifest`, trimmed, comments left out.
fn table_lines(manifest: &str, table: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text =
        fs::read_to_string(root.join(manifest)).unwrap_or_else(|e| panic!("{manifest}: {e}"));
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == table;
        } else if inside && !line.starts_with('#') {
            out.push(line.to_string());
        }
    }
    out
}

/// The names in the `[dependencies]` table of `manifest` (not the dev-dependencies: tests
/// and benchmarks may use any layer below or beside them).
fn dependency_names(manifest: &str) -> BTreeSet<String> {
    table_lines(manifest, "[dependencies]")
        .iter()
        .filter_map(|line| line.split_once('='))
        .map(|(name, _)| name.trim().to_string())
        .collect()
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

/// The crates named by the `[features]` of `manifest` (`crate/feature`, `dep:crate`).
fn feature_edges(manifest: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in table_lines(manifest, "[features]") {
        let Some((_, list)) = line.split_once('=') else {
            continue;
        };
        for item in list.split('"').skip(1).step_by(2) {
            let item = item.trim_start_matches("dep:");
            if let Some((krate, _)) = item.split_once('/') {
                found.insert(krate.trim_end_matches('?').to_string());
            } else if line.contains(&format!("dep:{item}")) {
                found.insert(item.to_string());
            }
        }
    }
    found
}

/// A feature turns on features of the crate's own dependencies only (the facade's `bench`
/// turns on the runtime's), so it cannot make a lower layer reach a higher one either.
#[test]
fn features_follow_the_layers() {
    let allowed = allowed();
    let mut wrong = Vec::new();
    for (name, manifest) in CRATES {
        let deps = dependency_names(manifest);
        for krate in feature_edges(manifest) {
            let workspace = CRATES.iter().any(|(c, _)| *c == krate);
            if !deps.contains(&krate) || (workspace && !allowed[name].contains(krate.as_str())) {
                wrong.push(format!("{name} ({manifest}): a feature names {krate}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "features against the layers:\n{}",
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

// ---------------------------------------------------------------------------------------------
// Imports point one way inside a crate too.
//
// Cargo refuses a cycle between crates but not between the modules of one: `copy` may use
// `checksum` while `checksum` uses `copy`, and then neither can be read, tested or moved
// without the other. The checks below read the sources of every crate (and the Python
// package's imports) and fail naming the cycle if sibling modules of one folder, or the
// top-level modules of a crate, import each other in a circle. A module and its own parent
// may name each other (a parent re-exports its children; a child uses its parent's types);
// test modules (`tests.rs`, `tests/`, `#[cfg(test)]` items) may import anything.
// ---------------------------------------------------------------------------------------------

/// The root file of each crate's library or binary, whose module tree is checked.
const CRATE_ROOTS: [(&str, &str); 7] = [
    ("reshard-core", "crates/core/src/lib.rs"),
    ("reshard-model", "crates/model/src/lib.rs"),
    ("reshard-transport", "crates/transport/src/lib.rs"),
    ("reshard-runtime", "crates/runtime/src/lib.rs"),
    ("reshard", "src/lib.rs"),
    ("reshard-cli", "crates/cli/src/main.rs"),
    ("reshard-python", "python/src/lib.rs"),
];

/// The Python package, whose modules' imports are checked the same way.
const PYTHON_PACKAGE: &str = "python/reshard";

/// The most lines a source file outside the tests may have: past it, a file holds more than
/// one concept, and is split by concept.
const MAX_LINES: usize = 600;

/// A token of Rust source: comments, literals and whitespace are dropped, as they name no
/// module.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// The tokens of `src`, each with its line.
fn rust_tokens(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    // Skips a quoted literal opening at `i` (after any prefix), counting its lines.
    let skip_quoted = |i: &mut usize, line: &mut usize, hashes: Option<usize>| {
        *i += 1;
        while *i < c.len() {
            match (c[*i], hashes) {
                ('\n', _) => *line += 1,
                ('\\', None) => *i += 1,
                ('"', None) => break,
                ('"', Some(n)) if (1..=n).all(|k| at(*i + k) == '#') => {
                    *i += n;
                    break;
                }
                _ => {}
            }
            *i += 1;
        }
        *i += 1;
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            skip_quoted(&mut i, &mut line, None);
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label: its name follows as an identifier.
                i += 1;
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && (at(i) == '#' || at(i) == '"') {
                let mut n = 0;
                while at(i + n) == '#' {
                    n += 1;
                }
                if at(i + n) == '"' {
                    i += n;
                    skip_quoted(&mut i, &mut line, Some(n));
                    continue;
                }
                if word == "r" && n == 1 {
                    // A raw identifier, `r#type`.
                    i += 1;
                    continue;
                }
            }
            if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                skip_quoted(&mut i, &mut line, None);
                continue;
            }
            if word == "b" && at(i) == '\'' {
                i += 1;
                if at(i) == '\\' {
                    i += 1;
                }
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
                continue;
            }
            out.push((Tok::Ident(word), line));
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::Sep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

fn is_ident(t: Option<&(Tok, usize)>, name: &str) -> bool {
    matches!(t, Some((Tok::Ident(s), _)) if s == name)
}

fn is_punct(t: Option<&(Tok, usize)>, p: char) -> bool {
    matches!(t, Some((Tok::Punct(q), _)) if *q == p)
}

/// The index just past the bracketed group opening at `i` (`(`, `[` or `{`).
fn group_end(t: &[(Tok, usize)], i: usize) -> usize {
    let mut depth = 0usize;
    let mut j = i;
    while j < t.len() {
        match t[j].0 {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    t.len()
}

/// The index just past the item starting at `i`: its `;` or its body's closing brace (a
/// `use` runs to its `;`, braces and all).
fn item_end(t: &[(Tok, usize)], i: usize) -> usize {
    let is_use = t[i..]
        .iter()
        .take(6)
        .any(|(tok, _)| *tok == Tok::Ident("use".into()));
    let mut j = i;
    while j < t.len() {
        match t[j].0 {
            Tok::Punct(';') => return j + 1,
            Tok::Punct('(' | '[') => j = group_end(t, j),
            Tok::Punct('{') => {
                j = group_end(t, j);
                if !is_use {
                    return j;
                }
            }
            _ => j += 1,
        }
    }
    t.len()
}

/// `t` without its `#[cfg(test)]` items: test code may import anything.
fn without_test_items(t: &[(Tok, usize)]) -> Vec<(Tok, usize)> {
    let cfg_test = [
        Tok::Punct('#'),
        Tok::Punct('['),
        Tok::Ident("cfg".into()),
        Tok::Punct('('),
        Tok::Ident("test".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
    ];
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let here = t[i..].iter().map(|(tok, _)| tok).take(cfg_test.len());
        if t.len() - i >= cfg_test.len() && here.eq(cfg_test.iter()) {
            let mut j = i + cfg_test.len();
            while is_punct(t.get(j), '#') && is_punct(t.get(j + 1), '[') {
                j = group_end(t, j + 1);
            }
            i = item_end(t, j);
        } else {
            out.push(t[i].clone());
            i += 1;
        }
    }
    out
}

/// One name a `use` brings in: the path it names, and the name it binds (`None` for a glob).
#[derive(Clone, Debug)]
struct UseEntry {
    path: Vec<String>,
    bind: Option<String>,
}

/// Reads the use tree at `*i` under `prefix` into `out`.
fn use_tree(t: &[(Tok, usize)], i: &mut usize, prefix: Vec<String>, out: &mut Vec<UseEntry>) {
    let mut path = prefix;
    if matches!(t.get(*i), Some((Tok::Sep, _))) {
        *i += 1;
    }
    loop {
        match t.get(*i).map(|(tok, _)| tok) {
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push(UseEntry { path, bind: None });
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                while *i < t.len() && !is_punct(t.get(*i), '}') {
                    use_tree(t, i, path.clone(), out);
                    if is_punct(t.get(*i), ',') {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            Some(Tok::Ident(seg)) => {
                path.push(seg.clone());
                *i += 1;
                if matches!(t.get(*i), Some((Tok::Sep, _))) {
                    *i += 1;
                    continue;
                }
                if path.last().is_some_and(|s| s == "self") {
                    path.pop();
                }
                let mut bind = path.last().cloned();
                if is_ident(t.get(*i), "as") {
                    if let Some((Tok::Ident(alias), _)) = t.get(*i + 1) {
                        bind = Some(alias.clone());
                    }
                    *i += 2;
                }
                out.push(UseEntry { path, bind });
                return;
            }
            _ => {
                // Not a use tree this reader knows: skip the token so reading goes on.
                *i += 1;
                return;
            }
        }
    }
}

/// A module of a crate, as read from its source.
#[derive(Debug, Default)]
struct Module {
    /// Where it is written, for messages.
    file: String,
    /// Its child modules.
    children: BTreeSet<String>,
    /// The names of the items it defines.
    items: BTreeSet<String>,
    /// Its `use` declarations.
    uses: Vec<UseEntry>,
    /// Every path it names that starts with `crate`, `super` or `self` (its uses too), with
    /// the line.
    paths: Vec<(Vec<String>, usize)>,
    /// Every identifier it mentions, with its first line: a name a glob `use` brought in is
    /// named bare.
    idents: BTreeMap<String, usize>,
}

/// The module tree of one crate, keyed by module path (the root is the empty path).
type Tree = BTreeMap<Vec<String>, Module>;

/// Reads the module at `path` from the tokens `t` of `file` (whose child files live in
/// `dir`), and its children, into `tree`.
fn read_module(tree: &mut Tree, path: Vec<String>, file: &Path, dir: &Path, t: &[(Tok, usize)]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let shown = file
        .strip_prefix(root)
        .unwrap_or(file)
        .display()
        .to_string();
    let mut module = Module {
        file: shown,
        ..Module::default()
    };
    let mut inline = Vec::new();
    let mut files = Vec::new();
    let mut i = 0;
    for (tok, line) in t {
        if let Tok::Ident(word) = tok {
            module.idents.entry(word.clone()).or_insert(*line);
        }
    }
    while i < t.len() {
        let Tok::Ident(word) = &t[i].0 else {
            i += 1;
            continue;
        };
        let name = match t.get(i + 1) {
            Some((Tok::Ident(n), _)) => Some(n.clone()),
            _ => None,
        };
        match word.as_str() {
            "mod" if name.is_some() => {
                let name = name.unwrap();
                module.children.insert(name.clone());
                module.items.insert(name.clone());
                if is_punct(t.get(i + 2), '{') {
                    let end = group_end(t, i + 2);
                    inline.push((name, t[i + 3..end - 1].to_vec()));
                    i = end;
                } else {
                    files.push(name);
                    i += 2;
                }
                continue;
            }
            "use" => {
                let mut j = i + 1;
                let mut entries = Vec::new();
                while j < t.len() && !is_punct(t.get(j), ';') {
                    use_tree(t, &mut j, Vec::new(), &mut entries);
                }
                for entry in entries {
                    if let Some(first) = entry.path.first()
                        && matches!(first.as_str(), "crate" | "super" | "self")
                    {
                        module.paths.push((entry.path.clone(), t[i].1));
                    } else if entry.path.first().is_some_and(|f| f != "std") {
                        // A child module's path, or an extern crate's: resolved later.
                        module.paths.push((entry.path.clone(), t[i].1));
                    }
                    module.uses.push(entry);
                }
                i = j + 1;
                continue;
            }
            "pub" if is_punct(t.get(i + 1), '(') => {
                // A visibility, `pub(in crate::a)`, names a module without using it.
                i = group_end(t, i + 1);
                continue;
            }
            "struct" | "enum" | "union" | "trait" | "type" | "fn" | "const" | "static" => {
                if let Some(n) = name {
                    module.items.insert(n);
                }
            }
            "macro_rules" if is_punct(t.get(i + 1), '!') => {
                if let Some((Tok::Ident(n), _)) = t.get(i + 2) {
                    module.items.insert(n.clone());
                }
            }
            "crate" | "super" | "self" if matches!(t.get(i + 1), Some((Tok::Sep, _))) => {
                let mut segs = vec![word.clone()];
                let mut j = i + 1;
                while matches!(t.get(j), Some((Tok::Sep, _))) {
                    match t.get(j + 1) {
                        Some((Tok::Ident(s), _)) => segs.push(s.clone()),
                        _ => break,
                    }
                    j += 2;
                }
                module.paths.push((segs, t[i].1));
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    for (name, body) in inline {
        let mut child = path.clone();
        child.push(name.clone());
        read_module(tree, child, file, &dir.join(&name), &body);
    }
    for name in files {
        if name == "tests" {
            continue;
        }
        let mut child = path.clone();
        child.push(name.clone());
        let flat = dir.join(format!("{name}.rs"));
        let (child_file, child_dir) = if flat.exists() {
            (flat, dir.join(&name))
        } else {
            (dir.join(&name).join("mod.rs"), dir.join(&name))
        };
        let text = fs::read_to_string(&child_file).unwrap_or_else(|e| {
            panic!(
                "{} (module {}): {e}",
                child_file.display(),
                child.join("::")
            )
        });
        let toks = without_test_items(&rust_tokens(&text));
        read_module(tree, child, &child_file, &child_dir, &toks);
    }
    tree.insert(path, module);
}

/// The module tree of the crate whose root file is `root_file`.
fn read_crate(root_file: &str) -> Tree {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let file = root.join(root_file);
    let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{root_file}: {e}"));
    let mut tree = Tree::new();
    let dir = file.parent().unwrap().to_path_buf();
    read_module(
        &mut tree,
        Vec::new(),
        &file,
        &dir,
        &without_test_items(&rust_tokens(&text)),
    );
    tree
}

/// `raw` as a path from the crate root, seen from module `at`; `None` for a path into another
/// crate (or the standard library).
fn absolute(tree: &Tree, at: &[String], raw: &[String], depth: usize) -> Option<Vec<String>> {
    let first = raw.first()?;
    let mut segs = raw.iter().peekable();
    let mut base: Vec<String> = at.to_vec();
    match first.as_str() {
        "crate" => {
            segs.next();
            base.clear();
        }
        "self" => {
            segs.next();
        }
        "super" => {
            while segs.peek().is_some_and(|s| s.as_str() == "super") {
                segs.next();
                base.pop()?;
            }
        }
        _ => {
            let module = tree.get(at)?;
            if !module.children.contains(first) {
                if depth > 8 {
                    return None;
                }
                // A name a `use` of this module brought in.
                let entry = module
                    .uses
                    .iter()
                    .find(|u| u.bind.as_deref() == Some(first.as_str()) && u.path != raw)?;
                let mut path = absolute(tree, at, &entry.path, depth + 1)?;
                path.extend(raw[1..].iter().cloned());
                return Some(path);
            }
        }
    }
    base.extend(segs.cloned());
    Some(base)
}

/// The module that the absolute path `path` leads into, following the `use`s that re-export
/// an item to where it is defined.
fn target(tree: &Tree, path: &[String], depth: usize) -> Vec<String> {
    let mut k = path.len();
    while !tree.contains_key(&path[..k]) {
        k -= 1;
    }
    let at = path[..k].to_vec();
    if k == path.len() || depth > 8 {
        return at;
    }
    let module = &tree[&at];
    let name = &path[k];
    if module.items.contains(name) {
        return at;
    }
    if let Some(entry) = module
        .uses
        .iter()
        .find(|u| u.bind.as_deref() == Some(name.as_str()))
    {
        return match absolute(tree, &at, &entry.path, 0) {
            Some(mut next) => {
                next.extend(path[k + 1..].iter().cloned());
                target(tree, &next, depth + 1)
            }
            None => at,
        };
    }
    for glob in module.uses.iter().filter(|u| u.bind.is_none()) {
        if let Some(from) = absolute(tree, &at, &glob.path, 0)
            && let Some(source) = tree.get(&from)
            && (source.items.contains(name)
                || source.uses.iter().any(|u| u.bind.as_deref() == Some(name)))
        {
            let mut next = from;
            next.extend(path[k..].iter().cloned());
            return target(tree, &next, depth + 1);
        }
    }
    at
}

/// An import between two siblings: the folder (their parent), the importer and the imported,
/// and where it is written.
type Edges = BTreeMap<(String, String, String), String>;

/// Adds the edge that module `from` naming module `to` makes between two siblings, if it
/// makes one: their first differing modules below the deepest module above both.
fn add_edge(edges: &mut Edges, from: &[String], to: &[String], place: String, shown: &str) {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common == from.len() || common == to.len() {
        return; // a module and its own ancestor
    }
    let parent = if common == 0 {
        shown.to_string()
    } else {
        format!("{shown}::{}", from[..common].join("::"))
    };
    edges
        .entry((parent, from[common].clone(), to[common].clone()))
        .or_insert(place);
}

/// The imports between siblings of the crate `name`, whose root file is `root_file`.
fn rust_edges(name: &str, root_file: &str) -> Edges {
    tree_edges(&read_crate(root_file), name)
}

/// The imports between siblings of the module tree `tree` of crate `name`.
fn tree_edges(tree: &Tree, name: &str) -> Edges {
    let mut edges = Edges::new();
    for (at, module) in tree {
        for (raw, line) in &module.paths {
            let Some(path) = absolute(tree, at, raw, 0) else {
                continue;
            };
            let to = target(tree, &path, 0);
            let place = format!("{}:{line} names {}", module.file, raw.join("::"));
            add_edge(&mut edges, at, &to, place, name);
        }
        // `use super::*`: every name of the glob's module that this one mentions bare.
        for glob in module.uses.iter().filter(|u| u.bind.is_none()) {
            let Some(from) = absolute(tree, at, &glob.path, 0) else {
                continue;
            };
            let Some(source) = tree.get(&from) else {
                continue;
            };
            let names = source
                .items
                .iter()
                .chain(source.uses.iter().filter_map(|u| u.bind.as_ref()));
            for bare in names {
                if let Some(line) = module.idents.get(bare) {
                    let mut path = from.clone();
                    path.push(bare.clone());
                    let to = target(tree, &path, 0);
                    let shown = format!("{}::*", glob.path.join("::"));
                    let place = format!("{}:{line} names {bare} from {shown}", module.file);
                    add_edge(&mut edges, at, &to, place, name);
                }
            }
        }
    }
    edges
}

/// The cycles among the edges: each as its modules in order, closing on the first, with where
/// each import is written.
fn cycles(edges: &Edges) -> Vec<String> {
    let mut by_parent: BTreeMap<&str, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    for (parent, from, to) in edges.keys() {
        by_parent
            .entry(parent)
            .or_default()
            .entry(from)
            .or_default()
            .insert(to);
    }
    let mut found = Vec::new();
    for (parent, graph) in by_parent {
        let mut done: BTreeSet<&str> = BTreeSet::new();
        for &start in graph.keys() {
            if done.contains(start) {
                continue;
            }
            // A shortest way back to `start`, found breadth first.
            let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start]);
            let mut closing = None;
            while let Some(node) = queue.pop_front() {
                for &next in graph.get(node).into_iter().flatten() {
                    if next == start {
                        closing = Some(node);
                        queue.clear();
                        break;
                    }
                    if !came_from.contains_key(next) {
                        came_from.insert(next, node);
                        queue.push_back(next);
                    }
                }
            }
            let Some(mut node) = closing else {
                continue;
            };
            let mut ring = vec![node];
            while node != start {
                node = came_from[node];
                ring.push(node);
            }
            ring.reverse();
            done.extend(ring.iter().copied());
            let mut text = format!("{parent}: {} -> {start}", ring.join(" -> "));
            for (k, from) in ring.iter().enumerate() {
                let to = ring.get(k + 1).copied().unwrap_or(start);
                let key = (parent.to_string(), from.to_string(), to.to_string());
                text.push_str(&format!("\n    {from} -> {to}: {}", edges[&key]));
            }
            found.push(text);
        }
    }
    found
}

/// Python source without its comments and string literals, one logical line per entry
/// (bracketed continuations joined).
fn python_lines(src: &str) -> Vec<(String, usize)> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut lines = Vec::new();
    let (mut current, mut start, mut line, mut depth) = (String::new(), 1, 1, 0i32);
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '#' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '"' || ch == '\'' {
            let triple = at(i + 1) == ch && at(i + 2) == ch;
            i += if triple { 3 } else { 1 };
            while i < c.len() {
                if c[i] == '\\' {
                    i += 2;
                    continue;
                }
                if c[i] == '\n' {
                    line += 1;
                }
                if c[i] == ch && (!triple || (at(i + 1) == ch && at(i + 2) == ch)) {
                    i += if triple { 3 } else { 1 };
                    break;
                }
                i += 1;
            }
            current.push_str("''");
        } else if ch == '\\' && at(i + 1) == '\n' {
            i += 2;
            line += 1;
        } else if ch == '\n' {
            line += 1;
            i += 1;
            if depth == 0 {
                if !current.trim().is_empty() {
                    lines.push((current.trim().to_string(), start));
                }
                current.clear();
                start = line;
            } else {
                current.push(' ');
            }
        } else {
            match ch {
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth -= 1,
                _ => {}
            }
            if current.trim().is_empty() {
                start = line;
            }
            current.push(ch);
            i += 1;
        }
    }
    if !current.trim().is_empty() {
        lines.push((current.trim().to_string(), start));
    }
    lines
}

/// What one Python import names: the module imported from (inside the package: `""` for the
/// package itself), and the names imported from it.
fn python_import(line: &str, package: &str) -> Option<(String, Vec<String>)> {
    let inside = |module: &str| -> Option<String> {
        if let Some(rest) = module.strip_prefix('.') {
            // `.` is the package; `..` leaves it.
            return (!rest.starts_with('.')).then(|| rest.split('.').next().unwrap().to_string());
        }
        let rest = module.strip_prefix(package)?;
        if rest.is_empty() {
            return Some(String::new());
        }
        rest.strip_prefix('.')
            .map(|r| r.split('.').next().unwrap().to_string())
    };
    let names = |list: &str| -> Vec<String> {
        list.trim_matches(|c: char| c == '(' || c == ')' || c.is_whitespace())
            .split(',')
            .filter_map(|n| n.split_whitespace().next())
            .map(str::to_string)
            .collect()
    };
    if let Some(rest) = line.strip_prefix("from ") {
        let (module, list) = rest.split_once(" import ")?;
        return Some((inside(module.trim())?, names(list)));
    }
    let rest = line.strip_prefix("import ")?;
    names(rest)
        .iter()
        .find_map(|n| inside(n))
        .map(|module| (module, Vec::new()))
}

/// The imports between the modules of the Python package at `dir` (its `__init__` is their
/// parent, and may name them).
fn python_edges(dir: &str) -> Edges {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let package = Path::new(dir).file_name().unwrap().to_str().unwrap();
    let mut modules: BTreeMap<String, Vec<(String, usize)>> = BTreeMap::new();
    for entry in fs::read_dir(root.join(dir)).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
        if path.extension().is_some_and(|e| e == "py") {
            let text = fs::read_to_string(&path).unwrap();
            modules.insert(stem, python_lines(&text));
        } else if path.extension().is_some_and(|e| e == "pyi" || e == "so") {
            // An extension module: it imports nothing of the package.
            modules.entry(stem).or_default();
        }
    }
    // What the package's `__init__` imports, name by name, so that `from . import X` leads to
    // the module that defines X.
    let mut init_names: BTreeMap<String, String> = BTreeMap::new();
    for (line, _) in modules.get("__init__").into_iter().flatten() {
        if let Some((from, names)) = python_import(line, package)
            && !from.is_empty()
        {
            for name in names {
                init_names.insert(name, from.clone());
            }
        }
    }
    let mut edges = Edges::new();
    for (module, lines) in &modules {
        if module == "__init__" {
            continue;
        }
        for (line, number) in lines {
            let Some((from, names)) = python_import(line, package) else {
                continue;
            };
            let mut targets = Vec::new();
            if from.is_empty() {
                for name in &names {
                    if modules.contains_key(name) {
                        targets.push(name.clone());
                    } else if let Some(defined) = init_names.get(name) {
                        targets.push(defined.clone());
                    }
                }
            } else {
                targets.push(from);
            }
            for to in targets {
                if &to != module {
                    let place = format!("{dir}/{module}.py:{number}: {line}");
                    edges
                        .entry((format!("python package {package}"), module.clone(), to))
                        .or_insert(place);
                }
            }
        }
    }
    edges
}

/// Every crate under `crates/` has its root in [`CRATE_ROOTS`], so none escapes the checks.
#[test]
fn the_cycle_check_reads_every_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for krate in fs::read_dir(root.join("crates")).unwrap() {
        let dir = krate.unwrap().path();
        let src = dir.strip_prefix(root).unwrap().join("src");
        let listed = CRATE_ROOTS
            .iter()
            .any(|(_, file)| Path::new(file).parent() == Some(src.as_path()));
        assert!(listed, "{}: not in CRATE_ROOTS", dir.display());
    }
}

#[test]
fn no_module_cycles_in_any_crate_or_the_python_package() {
    let mut failures = Vec::new();
    let mut checked = Vec::new();
    for (name, root_file) in CRATE_ROOTS {
        checked.push((name, cycles(&rust_edges(name, root_file))));
    }
    checked.push((
        "python package reshard",
        cycles(&python_edges(PYTHON_PACKAGE)),
    ));
    for (_, found) in checked {
        failures.extend(found);
    }
    assert!(
        failures.is_empty(),
        "module cycles (imports must point one way):\n{}",
        failures.join("\n")
    );
}

/// The cycles the checker finds among toy modules: `(path, source)`, the root's path empty,
/// its children named by their `mod` declarations.
fn toy_cycles(modules: &[(&str, &str)]) -> Vec<String> {
    let mut tree = Tree::new();
    let dir = Path::new("/nonexistent");
    for (name, src) in modules {
        let path: Vec<String> = name
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        // read the one module without following its `mod` declarations to files
        let t: Vec<_> = without_test_items(&rust_tokens(src))
            .into_iter()
            .filter(|(tok, _)| *tok != Tok::Ident("mod".into()))
            .collect();
        read_module(&mut tree, path.clone(), dir, dir, &t);
        tree.get_mut(&path).unwrap().file = format!("{name}.rs");
    }
    for (name, src) in modules {
        let path: Vec<String> = name
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        for child in src.split("mod ").skip(1) {
            let child = child.split(';').next().unwrap().trim().to_string();
            tree.get_mut(&path).unwrap().children.insert(child);
        }
    }
    let edges = tree_edges(&tree, "x");
    cycles(&edges)
}

/// The checker itself, on sources written for it: a cycle through a re-export or a glob
/// import is found, an import of a module's own parent is not a cycle, and test items are
/// left out.
#[test]
fn the_cycle_check_sees_re_exports_and_globs_and_skips_tests() {
    let found = toy_cycles(&[
        ("", "mod a; mod b; mod c; pub use b::Thing;"),
        ("a", "use crate::Thing; pub struct A;"),
        (
            "b",
            "pub struct Thing; use super::a::A; #[cfg(test)] mod tests { use crate::c; }",
        ),
        ("c", "pub struct C; use super::Thing;"),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("x: a -> b -> a"), "{}", found[0]);
    let found = toy_cycles(&[
        ("", "mod p; mod q; pub use q::Q;"),
        ("p", "use super::*; pub struct P; fn f(q: Q) {}"),
        ("q", "pub struct Q; fn g(p: crate::p::P) {}"),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("x: p -> q -> p"), "{}", found[0]);
    assert!(toy_cycles(&[("", "mod p; pub struct R;"), ("p", "use super::R;")]).is_empty());
    let lines = python_lines("from . import (\n  a,\n  b)\nx = 'from .c import d'\n");
    assert_eq!(
        python_import(&lines[0].0, "p"),
        Some((String::new(), vec!["a".into(), "b".into()]))
    );
    assert_eq!(python_import(&lines[1].0, "p"), None);
    assert_eq!(
        python_import("from .q.r import s as t", "p"),
        Some(("q".into(), vec!["s".into()]))
    );
    assert_eq!(python_import("import torch", "p"), None);
    assert_eq!(python_import("from .. import z", "p"), None);
}

/// The source files outside the tests: every crate's `src` and the Python package.
fn source_files() -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap();
            if name == "tests" || name == "tests.rs" {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "py") {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for dir in ["src", "crates", "python/src", PYTHON_PACKAGE] {
        if dir == "crates" {
            for krate in fs::read_dir(root.join(dir)).unwrap() {
                walk(root, &krate.unwrap().path().join("src"), &mut out);
            }
        } else {
            walk(root, &root.join(dir), &mut out);
        }
    }
    out.sort();
    out
}

#[test]
fn no_source_file_is_over_the_size_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    for file in source_files() {
        let lines = fs::read_to_string(root.join(&file))
            .unwrap()
            .lines()
            .count();
        if lines > MAX_LINES {
            over.push(format!("{file}: {lines} lines"));
        }
    }
    assert!(
        over.is_empty(),
        "over {MAX_LINES} lines (split by concept):\n{}",
        over.join("\n")
    );
}
