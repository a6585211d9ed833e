//! docs/src/cli-reference.md is the command line's own help, so the reference cannot drift
//! from the clap definitions: this test regenerates it and compares.
//! `RESHARD_BLESS=1 cargo test -p reshard-cli --test reference` writes it afresh.

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_reshard");

fn help(args: &[&str]) -> String {
    let out = Command::new(EXE)
        .args(args)
        .env("COLUMNS", "100")
        .output()
        .expect("the reshard binary runs");
    assert!(out.status.success(), "{args:?}");
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The subcommands `reshard --help` lists, but `help`.
fn subcommands(top: &str) -> Vec<String> {
    top.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .filter(|c| c != "help")
        .collect()
}

fn reference() -> String {
    let top = help(&["--help"]);
    let mut out = String::from(
        "# Command-line reference\n\nGenerated from the command line's own help \
         (`reshard <command> --help`) by `crates/cli/tests/reference.rs`; the guide is \
         [The command line](cli.md).\n\n## reshard\n\n```text\n",
    );
    out.push_str(&top);
    out.push_str("```\n");
    for command in subcommands(&top) {
        out.push_str(&format!("\n## reshard {command}\n\n```text\n"));
        out.push_str(&help(&[&command, "--help"]));
        out.push_str("```\n");
    }
    out
}

#[test]
fn the_reference_is_the_help() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/src/cli-reference.md"
    );
    let want = reference();
    if std::env::var_os("RESHARD_BLESS").is_some() {
        std::fs::write(path, &want).expect("docs/src/cli-reference.md is writable");
        return;
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        have == want,
        "docs/src/cli-reference.md is not the command line's help: run \
         `RESHARD_BLESS=1 cargo test -p reshard-cli --test reference` and commit it"
    );
}
