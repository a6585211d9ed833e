//! Helpers shared by the multi-process tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::time::{Duration, Instant};

pub const EXE: &str = env!("CARGO_BIN_EXE_reshard");

/// A loopback port free a moment ago, for a job's rendezvous.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh, empty folder under the system temp dir, removed with all it holds when the guard
/// drops, also when a test fails half-way.
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("reshard-proc-{name}-"))
        .tempdir()
        .expect("a temp dir")
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Waits for a child, killing it (and failing) if it runs past `limit`: a hang.
pub fn wait_bounded(mut child: Child, limit: Duration, what: &str) -> Output {
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("{what} hung for {limit:?}; stderr: {}", text(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A tiny deterministic generator, so that every run tests the same layouts.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// A random layout spec over ranks drawn from `0..world`.
pub fn random_spec(rng: &mut Lcg, ndim: usize, world: u64) -> String {
    loop {
        let axes = 1 + rng.below(2) as usize;
        let dims: Vec<u64> = (0..axes).map(|_| 1 + rng.below(3)).collect();
        let size: u64 = dims.iter().product();
        if size > world {
            continue;
        }
        let mut pool: Vec<u64> = (0..world).collect();
        let ranks: Vec<String> = (0..size)
            .map(|_| {
                pool.remove(rng.below(pool.len() as u64) as usize)
                    .to_string()
            })
            .collect();
        let place: Vec<String> = (0..axes)
            .map(|_| match rng.below(4) {
                0 => "R".to_string(),
                _ => format!("S({})", rng.below(ndim as u64)),
            })
            .collect();
        let mesh: Vec<String> = dims.iter().map(u64::to_string).collect();
        return format!(
            "mesh={} ranks={} place={}",
            mesh.join("x"),
            ranks.join(","),
            place.join(",")
        );
    }
}

pub fn read_dumps(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

/// A random reshard, run in one process and by a launcher, compared byte for byte.
pub struct RandomRun {
    pub case: u64,
    pub shape: String,
    pub dtype: &'static str,
    pub src: String,
    pub dst: String,
    pub world: u64,
    chunk: &'static str,
    /// Holds `dirs`, and removes them when the run drops.
    _scratch: tempfile::TempDir,
    /// Where the local and the multi-process run dump (not created: `--dump` makes them).
    dirs: (PathBuf, PathBuf),
    /// What rank 0 printed in the last multi-process run.
    pub report: std::cell::RefCell<String>,
    /// More arguments for both runs (such as `--hosts`).
    pub extra: Vec<String>,
}

impl RandomRun {
    /// Up to 3-D, uneven and empty shards, 2 to 5 processes, several dtypes and chunk sizes.
    pub fn new(rng: &mut Lcg, case: u64, tag: &str) -> RandomRun {
        let ndim = 1 + rng.below(3) as usize;
        let shape: Vec<String> = (0..ndim).map(|_| rng.below(10).to_string()).collect();
        let world = 2 + rng.below(4);
        let src = random_spec(rng, ndim, world);
        let dst = random_spec(rng, ndim, world);
        let dtype = ["u8", "bf16", "f32", "f64"][rng.below(4) as usize];
        let chunk = ["3", "64", "4MiB"][rng.below(3) as usize];
        let scratch = temp_dir(&format!("{tag}-{case}"));
        let dirs = (scratch.path().join("local"), scratch.path().join("other"));
        RandomRun {
            case,
            shape: shape.join(","),
            dtype,
            src,
            dst,
            world,
            chunk,
            _scratch: scratch,
            dirs,
            report: std::cell::RefCell::new(String::new()),
            extra: Vec::new(),
        }
    }

    /// The ranks of the run, `0..world`, spread over `hosts` hosts in consecutive runs
    /// (`--hosts` list form).
    pub fn host_list(&self, hosts: u64) -> String {
        (0..self.world)
            .map(|r| (r * hosts / self.world).to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn args(&self) -> Vec<String> {
        let fill = format!("hash:{}", self.case);
        [
            "run",
            "--shape",
            &self.shape,
            "--dtype",
            self.dtype,
            "--src",
            &self.src,
            "--dst",
            &self.dst,
            "--fill",
            &fill,
            "--verify",
            "--chunk-bytes",
            self.chunk,
            "--staging-bytes",
            "8MiB",
            "--timeout",
            "20",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(self.extra.iter().cloned())
        .collect()
    }

    /// Runs it with `--transport local`, then with `transport` through the command `launcher`
    /// builds (given the run's arguments and world size); both must verify and dump the same.
    pub fn check_against_local(
        &self,
        transport: &str,
        launcher: impl FnOnce(&[String], u64) -> std::process::Command,
    ) {
        let (local_dir, other_dir) = &self.dirs;
        let what = format!(
            "case {} ({} {} {} -> {})",
            self.case, self.shape, self.dtype, self.src, self.dst
        );
        let local = std::process::Command::new(EXE)
            .args(self.args())
            .args([
                "--transport",
                "local",
                "--dump",
                local_dir.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(
            local.status.success(),
            "{what} local: {}",
            text(&local.stderr)
        );
        let mut args = self.args();
        args.extend(
            [
                "--transport",
                transport,
                "--dump",
                other_dir.to_str().unwrap(),
            ]
            .map(String::from),
        );
        let child = launcher(&args, self.world)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(120), "a multi-process run");
        assert!(
            out.status.success(),
            "{what} over {transport}: {}",
            text(&out.stderr)
        );
        let report = text(&out.stdout);
        assert!(
            report.contains(&format!("over {transport}")) && report.contains("verify"),
            "{report}"
        );
        assert_eq!(read_dumps(other_dir), read_dumps(local_dir), "{what}");
        *self.report.borrow_mut() = report;
    }
}

/// A small Qwen3-MoE config (real structure: stacked experts, router, qk norms; small sizes)
/// written into `dir`; returns its path.
pub fn tiny_moe_config(dir: &Path) -> PathBuf {
    let path = dir.join("moe.json");
    std::fs::write(
        &path,
        r#"{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    path
}

/// `mpirun -n N --oversubscribe`, allowed as root, with a session folder of its own: OpenMPI
/// keeps one per user under `TMPDIR`, and mpiruns that start or end at once race to create
/// and remove it ("mkdir /tmp/ompi.HOST.UID: File exists"). The folders lie under Cargo's
/// scratch folder for tests (`target/tmp`), not in the system's temp folder.
pub fn mpirun(n: u64) -> std::process::Command {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let session = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "mpirun-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&session).unwrap();
    let mut c = std::process::Command::new("mpirun");
    c.args(["-n", &n.to_string(), "--oversubscribe"])
        .env("TMPDIR", &session)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c
}

/// A dense qwen3 config of 2 small layers, written into `dir`: a whole model that refits in
/// a blink.
pub fn tiny_qwen3(dir: &Path) -> PathBuf {
    let path = dir.join("dense.json");
    std::fs::write(
        &path,
        r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    path
}

/// Whether this kernel has netem (the links' delay line); many small VM kernels do not.
pub fn netem_available() -> bool {
    std::process::Command::new("unshare")
        .args([
            "-n", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
