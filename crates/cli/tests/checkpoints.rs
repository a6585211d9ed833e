//! `refit --model DIR` on checkpoint folders that try to make the loader read outside the
//! folder or block for ever: each is refused with a message naming the file (exit 2), promptly.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Far more than reading a few headers takes, even on a loaded machine: reaching it means the
/// command hung.
const BOUND: Duration = Duration::from_secs(120);

/// A fresh folder, removed again when the test ends (pass or fail).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("reshard-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file with one 2-element bf16 tensor `name` (zero data).
fn write_one(path: &Path, name: &str) {
    let header =
        format!(r#"{{"{name}": {{"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 4]);
    std::fs::write(path, bytes).unwrap();
}

/// `reshard refit --model DIR ...`, killed (and the test failed) if it outlives [`BOUND`].
fn refit(dir: &Path) -> (ExitStatus, String) {
    let err = dir.with_extension("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(["refit", "--model", dir.to_str().unwrap()])
        .args(["--train", "dp=2", "--infer", "tp=2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_file(&err);
            panic!("refit of {} hung", dir.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&err).unwrap();
    let _ = std::fs::remove_file(&err);
    (status, text)
}

#[test]
fn an_index_cannot_name_files_outside_the_folder() {
    let root = TempDir::new("escape");
    let dir = root.0.join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    write_one(&root.0.join("secret.safetensors"), "w");
    for target in ["../secret.safetensors", "../../../../../../etc/passwd"] {
        let index = serde_json::json!({"weight_map": {"w": target}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let (status, err) = refit(&dir);
        assert_eq!(status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!(
                "tensor w is mapped to `{target}`, outside the checkpoint folder"
            )),
            "{err}"
        );
    }
}

#[test]
fn a_fifo_in_the_folder_is_refused_not_waited_on() {
    let dir = TempDir::new("fifo");
    let fifo = dir.0.join("model.safetensors");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let (status, err) = refit(&dir.0);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("model.safetensors: a FIFO, not a regular file"),
        "{err}"
    );
}

#[test]
fn overlapping_tensors_are_refused() {
    let dir = TempDir::new("overlap");
    let header = r#"{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [3, 7]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 7]);
    std::fs::write(dir.0.join("model.safetensors"), bytes).unwrap();
    let (status, err) = refit(&dir.0);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("tensor b: data_offsets 3..7 overlap those of tensor a (0..4)"),
        "{err}"
    );
}
