//! Every `reshard` command that README.md and the book (docs/src) show is one the command line
//! takes: its subcommand exists and every flag it gives, with its value, parses (each command
//! is run with `--help` after its flags, which clap reaches only when all before it parsed).
//! Commands with a placeholder (`...`, `<N>`) are left out; what they run is tested elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_reshard");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Markdown pages whose commands are checked (the generated reference is the help itself).
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md")];
    let mut book: Vec<PathBuf> = std::fs::read_dir(root().join("docs/src"))
        .expect("docs/src")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .filter(|p| !p.ends_with("cli-reference.md"))
        .collect();
    book.sort();
    out.extend(book);
    out
}

/// The lines of fenced code blocks, continuations (`\`) joined.
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut pending = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            continue;
        }
        let line = line.trim();
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        out.push(std::mem::take(&mut pending));
    }
    out
}

/// A shell line's words: quotes grouped, a `#` comment cut; None past `|`, `;`, `&&`, `$(`.
fn words(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut started = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, '#') if !started => break,
            (None, c) if c.is_whitespace() => {
                if started {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, '|' | ';' | '$' | '>') => return None,
            (None, c) => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        out.push(word);
    }
    Some(out)
}

/// The arguments after the program of a documented `reshard` command, or None.
fn reshard_args(line: &str) -> Option<Vec<String>> {
    let words = words(line)?;
    let start = if words.first().is_some_and(|w| w == "reshard") {
        1
    } else if words.len() > 3 && words[..4] == ["cargo", "run", "--release", "--"] {
        4
    } else {
        return None;
    };
    let args = words[start..].to_vec();
    let placeholder = |w: &String| w.contains("...") || w.starts_with('<') || w.starts_with('[');
    (!args.is_empty() && !args.iter().any(placeholder)).then_some(args)
}

/// Runs `args` with `--help` after its own flags (for `launch`, after the launcher's and
/// after the command it launches); the failures, as text.
fn check(args: &[String]) -> Vec<String> {
    let mut runs = Vec::new();
    match args.iter().position(|a| a == "--") {
        Some(split) if args[0] == "launch" => {
            runs.push(args[..split].to_vec());
            let inner = &args[split + 1..];
            if inner.first().is_some_and(|c| !c.starts_with('-'))
                && !args.contains(&"--exec".into())
            {
                runs.push(inner.to_vec());
            }
        }
        _ => runs.push(args.to_vec()),
    }
    let mut failures = Vec::new();
    for mut run in runs {
        if run.first().is_some_and(|c| c == "demo") {
            continue; // runs in tests/cli.rs as it is
        }
        run.push("--help".into());
        let out = Command::new(EXE).args(&run).output().expect("reshard runs");
        if !out.status.success() {
            failures.push(format!(
                "reshard {}: {}",
                run.join(" "),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .next()
                    .unwrap_or("")
            ));
        }
    }
    failures
}

#[test]
fn every_documented_command_parses() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        for line in code_lines(&text) {
            if let Some(args) = reshard_args(&line) {
                checked += 1;
                for f in check(&args) {
                    failures.push(format!(
                        "{}: {f}",
                        page.file_name().unwrap().to_string_lossy()
                    ));
                }
            }
        }
    }
    assert!(checked >= 15, "only {checked} documented commands found");
    assert!(
        failures.is_empty(),
        "{} of {checked}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
