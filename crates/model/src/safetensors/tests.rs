//! Checkpoint headers and folders, honest and hostile.

use super::*;

/// Writes a safetensors file with the given tensors (zero-filled data).
pub fn write(path: &Path, tensors: &[(&str, &str, &[u64])]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0u64;
    for (name, dt, shape) in tensors {
        let bytes = shape.iter().product::<u64>() * dtype(dt).unwrap().size() as u64;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.resize(out.len() + at as usize, 0);
    std::fs::write(path, out).unwrap();
}

/// A fresh, empty folder, removed with all it holds when the guard drops (also when a
/// test fails half-way).
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("reshard-model-{name}-"))
        .tempdir()
        .expect("a temp dir")
}

#[test]
fn headers_give_names_dtypes_shapes() {
    let scratch_dir = temp_dir("header");
    let dir = scratch_dir.path();
    let file = dir.join("model.safetensors");
    write(
        &file,
        &[
            ("w", "BF16", &[4, 3]),
            ("b", "F32", &[3]),
            ("s", "F8_E4M3", &[2, 2]),
        ],
    );
    let got = read_header(&file).unwrap();
    assert_eq!(
        got,
        vec![
            Param::new("b", &[3], DType::F32),
            Param::new("s", &[2, 2], DType::Fp8E4M3),
            Param::new("w", &[4, 3], DType::Bf16),
        ]
    );
    assert_eq!(read_checkpoint(dir).unwrap().unwrap().len(), 3);
}

#[test]
fn index_names_the_files_and_must_agree() {
    let scratch_dir = temp_dir("index");
    let dir = scratch_dir.path();
    write(&dir.join("a.safetensors"), &[("x", "BF16", &[2])]);
    write(&dir.join("b.safetensors"), &[("y", "BF16", &[2])]);
    write(&dir.join("stray.safetensors"), &[("z", "BF16", &[2])]);
    let index = serde_json::json!({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}});
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string()).unwrap();
    let names: Vec<String> = read_checkpoint(dir)
        .unwrap()
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(
        names,
        ["x", "y"],
        "the stray file is not part of the checkpoint"
    );
    let index = serde_json::json!({"weight_map": {"x": "b.safetensors", "y": "b.safetensors"}});
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = read_checkpoint(dir).unwrap_err().to_string();
    assert!(
        err.ends_with("tensor x is mapped to b.safetensors, which does not hold it"),
        "{err}"
    );
    let scratch_empty = temp_dir("empty");
    let empty = scratch_empty.path();
    assert!(read_checkpoint(empty).unwrap().is_none());
}

#[test]
fn bad_headers_are_named() {
    let scratch_dir = temp_dir("bad");
    let dir = scratch_dir.path();
    let file = dir.join("m.safetensors");
    std::fs::write(&file, [0xff; 8]).unwrap();
    assert!(
        read_header(&file)
            .unwrap_err()
            .to_string()
            .contains("header length")
    );
    let text = br#"{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]}}"#;
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text);
    std::fs::write(&file, &bytes).unwrap();
    let err = read_header(&file).unwrap_err().to_string();
    assert!(
        err.ends_with("tensor w: data_offsets 0..6 do not hold a [4] BF16"),
        "{err}"
    );
    std::fs::write(&file, [1, 0, 0]).unwrap();
    assert!(read_header(&file).is_err());
}

/// A header written by hand: `entries` is the JSON object's inside, `data` the bytes after.
fn write_raw(path: &Path, entries: &str, data: usize) {
    let text = format!("{{{entries}}}");
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.resize(bytes.len() + data, 0);
    std::fs::write(path, bytes).unwrap();
}

fn checkpoint_error(dir: &Path) -> String {
    read_checkpoint(dir).unwrap_err().to_string()
}

#[test]
fn index_paths_stay_inside_the_folder() {
    let scratch_root = temp_dir("confined");
    let root = scratch_root.path();
    let dir = root.join("ckpt");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    write(&root.join("outside.safetensors"), &[("x", "BF16", &[2])]);
    write(&dir.join("sub/a.safetensors"), &[("x", "BF16", &[2])]);
    let index_path = dir.join("model.safetensors.index.json");
    let set_index = |file: &str| {
        let index = serde_json::json!({"weight_map": {"x": file}});
        std::fs::write(&index_path, index.to_string()).unwrap();
    };
    for escape in [
        "../outside.safetensors",
        "sub/../../outside.safetensors",
        "/etc/passwd",
    ] {
        set_index(escape);
        let err = checkpoint_error(&dir);
        assert!(
            err.contains(&format!(
                "tensor x is mapped to `{escape}`, outside the checkpoint folder"
            )),
            "{err}"
        );
    }
    // a path relative to the folder, `.` included, is fine
    set_index("./sub/a.safetensors");
    assert_eq!(read_checkpoint(&dir).unwrap().unwrap().len(), 1);

    // links the folder holds are followed, out of it too (the Hugging Face cache's
    // snapshots link to its blobs), and must lead to regular files
    std::os::unix::fs::symlink(
        root.join("outside.safetensors"),
        dir.join("link.safetensors"),
    )
    .unwrap();
    set_index("link.safetensors");
    assert_eq!(read_checkpoint(&dir).unwrap().unwrap().len(), 1);
    std::fs::remove_file(dir.join("link.safetensors")).unwrap();
    std::os::unix::fs::symlink(root, dir.join("link.safetensors")).unwrap();
    let err = checkpoint_error(&dir);
    assert!(err.contains("not a regular file"), "{err}");
    std::fs::remove_file(dir.join("link.safetensors")).unwrap();
    std::fs::remove_file(&index_path).unwrap();
    std::os::unix::fs::symlink("sub/a.safetensors", dir.join("inner.safetensors")).unwrap();
    assert_eq!(read_checkpoint(&dir).unwrap().unwrap().len(), 1);
}

#[test]
fn only_regular_files_are_read() {
    let scratch_dir = temp_dir("fifo");
    let dir = scratch_dir.path();
    let fifo = dir.join("model.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // without a writer, reading a FIFO would wait for ever
    let err = checkpoint_error(dir);
    assert!(
        err.ends_with("model.safetensors: a FIFO, not a regular file"),
        "{err}"
    );
    std::fs::remove_file(&fifo).unwrap();
    // a device is no regular file either (and /dev/zero would never end)
    let err = read_header(Path::new("/dev/zero")).unwrap_err().to_string();
    assert_eq!(err, "/dev/zero: a device, not a regular file");
    std::fs::create_dir(&fifo).unwrap();
    let err = checkpoint_error(dir);
    assert!(
        err.ends_with("model.safetensors: a folder, not a regular file"),
        "{err}"
    );
    std::fs::remove_dir(&fifo).unwrap();
    // an index that is a FIFO, too
    write(&fifo, &[("x", "BF16", &[2])]);
    let index = dir.join("model.safetensors.index.json");
    let c = std::ffi::CString::new(index.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let err = checkpoint_error(dir);
    assert!(err.ends_with("a FIFO, not a regular file"), "{err}");
    // nor an index larger than any real one (sparse: no disk is used)
    std::fs::remove_file(&index).unwrap();
    let big = std::fs::File::create(&index).unwrap();
    big.set_len(MAX_HEADER + 1).unwrap();
    let err = checkpoint_error(dir);
    assert!(
        err.ends_with("104857601 bytes is over the 104857600 bytes an index may have"),
        "{err}"
    );
}

#[test]
fn a_tensor_named_twice_is_refused() {
    let scratch_dir = temp_dir("twice");
    let dir = scratch_dir.path();
    let file = dir.join("model.safetensors");
    let w = r#""w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}"#;
    let w2 = r#""w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}"#;
    write_raw(&file, &format!("{w}, {w2}"), 4);
    let err = read_header(&file).unwrap_err().to_string();
    assert!(
        err.contains("malformed header: tensor w appears twice"),
        "{err}"
    );
    // twice in the index
    write_raw(&file, w, 2);
    let index = r#"{"weight_map": {"w": "model.safetensors", "w": "other.safetensors"}}"#;
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
    let err = checkpoint_error(dir);
    assert!(
        err.contains("malformed index: tensor w appears twice"),
        "{err}"
    );
}

#[test]
fn tensor_bytes_lie_inside_the_file_without_overlap() {
    let scratch_dir = temp_dir("offsets");
    let dir = scratch_dir.path();
    let file = dir.join("m.safetensors");
    let a = r#""a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}"#;
    let b = r#""b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}"#;
    let empty = r#""e": {"dtype": "U8", "shape": [0], "data_offsets": [3, 3]}"#;
    write_raw(&file, &format!("{a}, {b}"), 6);
    let err = read_header(&file).unwrap_err().to_string();
    assert!(
        err.ends_with("tensor b: data_offsets 2..6 overlap those of tensor a (0..4)"),
        "{err}"
    );
    // side by side, with an empty tensor anywhere, is fine
    let c = r#""c": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}"#;
    write_raw(&file, &format!("{a}, {c}, {empty}"), 6);
    assert_eq!(read_header(&file).unwrap().len(), 3);
    // one byte short of the data
    write_raw(&file, &format!("{a}, {c}"), 5);
    let err = read_header(&file).unwrap_err().to_string();
    assert!(
        err.ends_with("tensor c: data_offsets 4..6 end beyond the file's 5 bytes of data"),
        "{err}"
    );
}

#[test]
fn a_header_longer_than_its_file_is_refused_before_reading_it() {
    let scratch_dir = temp_dir("long");
    let dir = scratch_dir.path();
    let file = dir.join("m.safetensors");
    // claims 50 MiB of header (under the bound) in a 19-byte file
    let mut bytes = (50u64 << 20).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"a\": 1}   ");
    std::fs::write(&file, bytes).unwrap();
    let err = read_header(&file).unwrap_err().to_string();
    assert!(
        err.ends_with("header length 52428800 is more than the file's 19 bytes hold"),
        "{err}"
    );
}

#[test]
fn experts_are_stacked() {
    let p = |n: &str, s: &[u64]| Param::new(n, s, DType::Bf16);
    let params = vec![
        p("model.layers.1.mlp.experts.1.up_proj.weight", &[4, 8]),
        p("model.layers.1.mlp.gate.weight", &[2, 8]),
        p("model.layers.1.mlp.experts.0.up_proj.weight", &[4, 8]),
    ];
    let got = stack_experts(params, Path::new("x")).unwrap();
    assert_eq!(
        got,
        vec![
            p("model.layers.1.mlp.experts.up_proj.weight", &[2, 4, 8]),
            p("model.layers.1.mlp.gate.weight", &[2, 8]),
        ]
    );
    let gap = vec![p("a.experts.0.w", &[1]), p("a.experts.2.w", &[1])];
    let err = stack_experts(gap, Path::new("x")).unwrap_err().to_string();
    assert_eq!(
        err,
        "x: a.experts.w: experts are not numbered 0..2 without gaps"
    );
}
