//! Helpers shared by the multi-process tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::time::{Duration, Instant};

pub const EXE: &str = env!("CARGO_BIN_EXE_reshard");

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("reshard-proc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
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
