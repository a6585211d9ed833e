//! Every command that README.md and the book (docs/src) show is run here as shown, with small
//! sizes where the page shows large ones, and must succeed.
//!
//! The pages mark their blocks: in a ```` ```sh ```` block every line is a command, in a
//! ```` ```console ```` block the lines after `$ ` are (the rest is what they print, and must
//! appear in their output, in order; `...` stands for lines left out); ```` ```text ````,
//! ```` ```json ````, Python and Rust blocks are not commands. A command is one of:
//! - `reshard ARGS` (also `cargo run --release -- ARGS`, `sudo reshard ARGS`): run once;
//! - `RANK=r WORLD_SIZE=n ... reshard ARGS`, one rank of a job started by hand: the whole job
//!   is run, n processes on loopback;
//! - `mpirun -n N reshard ARGS`: run under mpirun by [`documented_mpi_commands`], which needs
//!   `--features mpi`;
//! - with `launch --hosts`: run on emulated hosts by [`documented_commands_on_emulated_hosts`],
//!   which needs root and iproute2 (ignored by default, as the tests of hosts.rs);
//! - run by another test, which this one names: Python commands (`python/tests/test_docs.py`
//!   runs them), the library example's (`example.rs`), the set-up and test commands that
//!   `.ci/run` itself runs.
//!
//! A command in a runnable block that none of these covers fails the test, as does a
//! placeholder there (`...`, `<N>`, `[--json]`): synopses go in ```` ```text ```` blocks.
//!
//! Small sizes: every dimension of `--shape` at most 1024, `--iters 1`, `--warmup 0`, `--steps`
//! at most 2, `--suite-bytes 1MiB`, and a model that `--run` moves is its config with small
//! sizes (same architecture, same divisibility), written to a scratch folder.

mod common;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use common::{EXE, free_port, text, wait_bounded};

/// How long one documented command (a whole job) may take at small sizes before it counts as
/// hung.
const LIMIT: Duration = Duration::from_secs(300);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Markdown pages whose commands are run (the generated reference is the help itself).
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

/// A fenced block of a page: its language and its lines, continuations (`\`) joined.
struct Block {
    lang: String,
    lines: Vec<String>,
}

fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut current: Option<Block> = None;
    let mut pending = String::new();
    for line in text.lines() {
        if let Some(fence) = line.trim_start().strip_prefix("```") {
            match current.take() {
                Some(mut block) => {
                    if !pending.is_empty() {
                        block.lines.push(std::mem::take(&mut pending));
                    }
                    out.push(block)
                }
                None => {
                    current = Some(Block {
                        lang: fence.trim().to_string(),
                        lines: Vec::new(),
                    })
                }
            }
            continue;
        }
        let Some(block) = current.as_mut() else {
            continue;
        };
        if let Some(head) = line.trim_end().strip_suffix('\\') {
            pending.push_str(head.trim_start());
            pending.push(' ');
            continue;
        }
        pending.push_str(line.trim());
        let command = match block.lang.as_str() {
            "console" => pending.starts_with("$ "),
            _ => !pending.starts_with('#'),
        };
        if command && open_quote(&pending) {
            pending.push(' '); // a quoted string goes on on the next line
            continue;
        }
        block.lines.push(std::mem::take(&mut pending));
    }
    out
}

/// Whether a shell line ends inside quotes.
fn open_quote(line: &str) -> bool {
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"') => quote = Some(c),
            _ => {}
        }
    }
    quote.is_some()
}

/// A shell line's words: quotes grouped, a `#` comment cut; None where the line uses the
/// shell's syntax (`|`, `;`, `&`, `$`, `>`, `(`).
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
            (None, '|' | ';' | '&' | '$' | '>' | '(') => return None,
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

/// What a documented command is, and so how it is run.
#[derive(Clone, Debug)]
enum Documented {
    /// `reshard ARGS`, with the environment the line sets.
    Reshard {
        env: Vec<(String, String)>,
        args: Vec<String>,
    },
    /// One rank's command of a job started by hand (`RANK`, `WORLD_SIZE` set): the whole job.
    Job {
        world: usize,
        env: Vec<(String, String)>,
        args: Vec<String>,
    },
    /// `mpirun -n N reshard ARGS`.
    Mpi { n: u64, args: Vec<String> },
    /// Sets variables only.
    Assignments,
    /// Run by another test, named here.
    Elsewhere(&'static str),
}

/// Reads one line of a runnable block; an error says why no test runs it.
fn classify(line: &str) -> Result<Documented, String> {
    let trimmed = line.trim();
    // the library's example: a shell loop starting its ranks by hand, and its build
    if trimmed.contains("examples/multiprocess")
        || trimmed.contains("--example multiprocess")
        || trimmed.starts_with("for ")
        || trimmed.starts_with("done")
    {
        return Ok(Documented::Elsewhere(
            "crates/cli/tests/example.rs (the example over tcp and under mpirun)",
        ));
    }
    if trimmed.starts_with("pip install") {
        return Ok(Documented::Elsewhere(
            ".ci/run (installs the package with maturin develop)",
        ));
    }
    let words = words(line).ok_or("shell syntax that no test runs")?;
    let placeholder = |w: &String| w.contains("...") || w.starts_with('<') || w.starts_with('[');
    if words.iter().any(placeholder) {
        return Err("a placeholder in a runnable block (a synopsis goes in a text block)".into());
    }
    let mut rest: &[String] = &words;
    if rest.first().is_some_and(|w| w == "sudo") {
        rest = &rest[1..];
    }
    let mut env = Vec::new();
    while let Some((key, value)) = rest.first().and_then(|w| w.split_once('=')) {
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
            break;
        }
        env.push((key.to_string(), value.to_string()));
        rest = &rest[1..];
    }
    let owned = |s: &[String]| s.to_vec();
    match rest {
        [] if !env.is_empty() => Ok(Documented::Assignments),
        [] => Err("an empty command".into()),
        [program, args @ ..] if program == "reshard" => {
            let var = |k: &str| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
            match var("WORLD_SIZE") {
                Some(world) if var("RANK").is_some() => Ok(Documented::Job {
                    world: world.parse().map_err(|_| "WORLD_SIZE is no number")?,
                    env,
                    args: owned(args),
                }),
                _ => Ok(Documented::Reshard {
                    env,
                    args: owned(args),
                }),
            }
        }
        [cargo, run, release, dashes, args @ ..]
            if [cargo, run, release, dashes] == ["cargo", "run", "--release", "--"] =>
        {
            Ok(Documented::Reshard {
                env,
                args: owned(args),
            })
        }
        [cargo, test, ..] if cargo == "cargo" && test == "test" => {
            Ok(Documented::Elsewhere(".ci/run (the test command itself)"))
        }
        [mpirun, dash_n, n, program, args @ ..]
            if mpirun == "mpirun" && dash_n == "-n" && program == "reshard" =>
        {
            Ok(Documented::Mpi {
                n: n.parse().map_err(|_| "mpirun -n takes a number")?,
                args: owned(args),
            })
        }
        [python, m, pytest, ..] if python == "python" && m == "-m" && pytest == "pytest" => {
            Ok(Documented::Elsewhere(".ci/run (the Python suite itself)"))
        }
        [python, ..] if python == "python" => Ok(Documented::Elsewhere(
            "python/tests/test_docs.py (runs the pages' Python commands)",
        )),
        [program, ..] => Err(format!("no test knows how to run `{program}`")),
    }
}

/// A command of a page, with what its page says it prints (console blocks).
#[derive(Clone)]
struct Case {
    page: String,
    line: String,
    command: Documented,
    /// The lines a console block shows after the command, `...` included.
    shown: Vec<String>,
}

/// Every command of every page; the lines no test runs, as failures.
fn cases() -> (Vec<Case>, Vec<String>) {
    let mut cases = Vec::new();
    let mut failures = Vec::new();
    for page in pages() {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&page).expect("a page");
        for block in blocks(&text) {
            let mut commands: Vec<(String, Vec<String>)> = Vec::new();
            match block.lang.as_str() {
                "sh" | "bash" | "shell" => {
                    for line in block.lines {
                        let bare = line.trim();
                        if !bare.is_empty() && !bare.starts_with('#') {
                            commands.push((line, Vec::new()));
                        }
                    }
                }
                "console" => {
                    for line in block.lines {
                        match line.trim().strip_prefix("$ ") {
                            Some(command) => commands.push((command.to_string(), Vec::new())),
                            None => match commands.last_mut() {
                                Some((_, shown)) => shown.push(line),
                                None => failures.push(format!(
                                    "{name}: a console block must start with `$ ` (a command)"
                                )),
                            },
                        }
                    }
                }
                "" => failures.push(format!(
                    "{name}: a block without a language (sh, console, text, json, ...)"
                )),
                _ => continue,
            }
            for (line, shown) in commands {
                match classify(&line) {
                    Ok(command) => cases.push(Case {
                        page: name.clone(),
                        line,
                        command,
                        shown,
                    }),
                    Err(why) => failures.push(format!("{name}: `{line}`: {why}")),
                }
            }
        }
    }
    (cases, failures)
}

/// The largest dimension of a `--shape` that a documented command runs with: small enough for
/// a debug build, large enough for 128x128 quantization blocks on 4 ranks.
const SMALL_DIM: u64 = 1024;

/// The dimensions of a `--shape` value, each at most [`SMALL_DIM`], the separators kept.
fn small_shape(shape: &str) -> String {
    let mut out = String::new();
    let mut number = String::new();
    let flush = |number: &mut String, out: &mut String| {
        if !number.is_empty() {
            let n: u64 = number.parse().unwrap_or(0);
            out.push_str(&n.min(SMALL_DIM).to_string());
            number.clear();
        }
    };
    for c in shape.chars() {
        if c.is_ascii_digit() {
            number.push(c);
        } else {
            flush(&mut number, &mut out);
            out.push(c);
        }
    }
    flush(&mut number, &mut out);
    out
}

/// A shipped model config (`models/NAME.config.json`) with small sizes: the same architecture,
/// every size a small multiple of what the parallelism of the docs divides. None where NAME is
/// no shipped config.
fn small_model(name: &str, dir: &Path) -> Option<PathBuf> {
    let path = root().join("models").join(format!("{name}.config.json"));
    let text = std::fs::read_to_string(path).ok()?;
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("a shipped config");
    let small = [
        ("vocab_size", 1024),
        ("hidden_size", 128),
        ("intermediate_size", 512),
        ("moe_intermediate_size", 64),
        ("num_hidden_layers", 4),
        ("head_dim", 32),
        ("num_experts", 16),
        ("n_routed_experts", 16),
        ("first_k_dense_replace", 1),
        ("q_lora_rank", 64),
        ("kv_lora_rank", 32),
        ("qk_nope_head_dim", 16),
        ("qk_rope_head_dim", 16),
        ("v_head_dim", 16),
    ];
    let object = config.as_object_mut().expect("a config is an object");
    for (key, value) in small {
        if object.get(key).is_some_and(|v| v.is_u64()) {
            let was = object[key].as_u64().unwrap();
            object.insert(key.into(), value.min(was).into());
        }
    }
    let out = dir.join(format!("{name}-small.json"));
    std::fs::write(&out, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    Some(out)
}

/// `args` at small sizes, scratch paths under `dir`.
fn small(args: &[String], dir: &Path) -> Vec<String> {
    let runs = args.iter().any(|a| a == "--run");
    let mut out = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let value = args.get(i + 1);
        let replaced = match (flag, value) {
            ("--shape", Some(v)) => Some(small_shape(v)),
            ("--iters", Some(_)) => Some("1".into()),
            ("--warmup", Some(_)) => Some("0".into()),
            ("--steps", Some(v)) => {
                Some(v.parse::<u64>().map_or(v.clone(), |n| n.min(2).to_string()))
            }
            ("--suite-bytes", Some(_)) => Some("1MiB".into()),
            ("--dump" | "--dump-src", Some(v)) => Some(dir.join(v).to_string_lossy().into_owned()),
            ("--model", Some(v)) if runs => {
                small_model(v, dir).map(|p| p.to_string_lossy().into_owned())
            }
            _ => None,
        };
        out.push(args[i].clone());
        if let Some(value) = replaced {
            out.push(value);
            i += 1;
        }
        i += 1;
    }
    out
}

/// Whether the command builds emulated hosts (`launch --hosts`, before the launched command).
fn on_hosts(args: &[String]) -> bool {
    args.first().is_some_and(|a| a == "launch")
        && args
            .iter()
            .take_while(|a| *a != "--")
            .any(|a| a == "--hosts")
}

fn describe(out: &Output) -> String {
    format!("{}\n{}", text(&out.stdout), text(&out.stderr))
}

/// Runs one case; its failure, as text.
fn run(case: &Case) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let fail = |what: String| Err(format!("{}: `{}`: {what}", case.page, case.line));
    match &case.command {
        Documented::Reshard { env, args } => {
            // a console block shows what the command prints: it runs at the page's sizes
            let args = if case.shown.is_empty() {
                small(args, dir.path())
            } else {
                args.clone()
            };
            let child = Command::new(EXE)
                .args(&args)
                .envs(env.iter().cloned())
                .current_dir(root())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("reshard starts");
            let out = wait_bounded(child, LIMIT, &case.line);
            if !out.status.success() {
                return fail(format!("failed ({}):\n{}", out.status, describe(&out)));
            }
            if let Some(missing) = shown_missing(&case.shown, &text(&out.stdout)) {
                return fail(format!(
                    "the page shows `{missing}`, which it did not print (in this order):\n{}",
                    text(&out.stdout)
                ));
            }
            Ok(())
        }
        Documented::Job { world, env, args } => {
            let args = small(args, dir.path());
            let port = free_port().to_string();
            let children: Vec<_> = (0..*world)
                .map(|rank| {
                    Command::new(EXE)
                        .args(&args)
                        .envs(env.iter().cloned())
                        // the job on loopback: the page's host is another machine's address
                        .env("RANK", rank.to_string())
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", &port)
                        .current_dir(root())
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .expect("reshard starts")
                })
                .collect();
            let outputs: Vec<_> = children
                .into_iter()
                .map(|c| wait_bounded(c, LIMIT, &case.line))
                .collect();
            for (rank, out) in outputs.iter().enumerate() {
                if !out.status.success() {
                    return fail(format!("rank {rank} failed:\n{}", describe(out)));
                }
            }
            Ok(())
        }
        Documented::Mpi { n, args } => {
            let args = small(args, dir.path());
            let child = common::mpirun(*n)
                .arg(EXE)
                .args(&args)
                .current_dir(root())
                .spawn()
                .expect("mpirun starts");
            let out = wait_bounded(child, LIMIT, &case.line);
            if !out.status.success() {
                return fail(format!("failed ({}):\n{}", out.status, describe(&out)));
            }
            Ok(())
        }
        Documented::Assignments | Documented::Elsewhere(_) => Ok(()),
    }
}

/// The first line a console block shows that the output lacks (in order); None if all are
/// there. `...` matches any run of lines.
fn shown_missing(shown: &[String], printed: &str) -> Option<String> {
    let mut printed = printed.lines().map(str::trim);
    for line in shown.iter().map(|l| l.trim()) {
        if line == "..." || line.is_empty() {
            continue;
        }
        if !printed.any(|p| p == line) {
            return Some(line.to_string());
        }
    }
    None
}

/// Runs `cases` on as many threads as the machine has cores; the failures.
fn run_all(cases: Vec<&Case>) -> Vec<String> {
    let queue = Mutex::new(cases.into_iter().collect::<VecDeque<_>>());
    let failures = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let Some(case) = queue.lock().unwrap().pop_front() else {
                        break;
                    };
                    if let Err(e) = run(case) {
                        failures.lock().unwrap().push(e);
                    }
                }
            });
        }
    });
    failures.into_inner().unwrap()
}

fn assert_none(failures: Vec<String>, of: usize) {
    assert!(
        failures.is_empty(),
        "{} of {of} documented commands:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn every_documented_command_is_one_a_test_runs() {
    let (cases, mut failures) = cases();
    // a command run elsewhere names the test or script that runs it, which must exist
    for case in &cases {
        if let Documented::Elsewhere(by) = case.command {
            let path = by.split_whitespace().next().unwrap_or_default();
            if !root().join(path).exists() {
                failures.push(format!(
                    "{}: `{}`: run by {path}, which is not there",
                    case.page, case.line
                ));
            }
        }
    }
    assert!(
        cases.len() >= 30,
        "only {} documented commands found",
        cases.len()
    );
    assert_none(failures, cases.len());
}

#[test]
fn documented_commands_run() {
    let (cases, _) = cases();
    let local: Vec<&Case> = cases
        .iter()
        .filter(|c| match &c.command {
            Documented::Reshard { args, .. } => !on_hosts(args),
            Documented::Job { .. } => true,
            _ => false,
        })
        .collect();
    assert!(local.len() >= 20, "only {} found", local.len());
    let n = local.len();
    assert_none(run_all(local), n);
}

#[test]
#[ignore = "builds emulated hosts: needs root and iproute2 (.ci/run runs it with --include-ignored)"]
fn documented_commands_on_emulated_hosts() {
    // SAFETY: geteuid cannot fail.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "emulated hosts need root (network namespaces)"
    );
    let (cases, _) = cases();
    let hosts: Vec<&Case> = cases
        .iter()
        .filter(|c| matches!(&c.command, Documented::Reshard { args, .. } if on_hosts(args)))
        .collect();
    assert!(hosts.len() >= 4, "only {} found", hosts.len());
    // the pages delay links "where the kernel has netem": elsewhere, without the delay
    let netem = common::netem_available();
    let mut failures = Vec::new();
    for case in &hosts {
        let mut case = (*case).clone();
        if let Documented::Reshard { args, .. } = &mut case.command
            && !netem
            && let Some(i) = args.iter().position(|a| a == "--link-latency")
        {
            eprintln!("no netem here: {} without --link-latency", case.page);
            args.drain(i..(i + 2).min(args.len()));
        }
        // one job of hosts at a time: they share the machine's links and addresses
        if let Err(e) = run(&case) {
            failures.push(e);
        }
    }
    assert_none(failures, hosts.len());
}

#[test]
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs the mpi feature and mpirun (.ci/run runs it with --features mpi)"
)]
fn documented_mpi_commands() {
    if !cfg!(feature = "mpi") {
        panic!("the documented mpirun commands need reshard built with --features mpi");
    }
    let (cases, _) = cases();
    let mpi: Vec<&Case> = cases
        .iter()
        .filter(|c| matches!(c.command, Documented::Mpi { .. }))
        .collect();
    assert!(mpi.len() >= 2, "only {} found", mpi.len());
    let n = mpi.len();
    assert_none(run_all(mpi), n);
}

#[test]
fn small_sizes_keep_the_commands_shape() {
    let dir = Path::new("/scratch");
    let args: Vec<String> = [
        "run",
        "--shape",
        "8192x4096,3",
        "--iters",
        "10",
        "--steps",
        "5",
        "--dump",
        "out",
    ]
    .map(String::from)
    .into();
    assert_eq!(
        small(&args, dir),
        [
            "run",
            "--shape",
            "1024x1024,3",
            "--iters",
            "1",
            "--steps",
            "2",
            "--dump",
            "/scratch/out"
        ]
    );
    assert!(matches!(
        classify("RANK=3 WORLD_SIZE=6 MASTER_ADDR=10.0.0.1 reshard run --shape 8,8"),
        Ok(Documented::Job { world: 6, .. })
    ));
    assert!(classify("reshard run ... --delta").is_err());
    assert!(classify("frobnicate --now").is_err());
    assert_eq!(
        shown_missing(&["a".into(), "...".into(), "c".into()], "a\nb\nc\n"),
        None
    );
    assert_eq!(
        shown_missing(&["c".into(), "a".into()], "a\nb\nc\n"),
        Some("a".into())
    );
}
