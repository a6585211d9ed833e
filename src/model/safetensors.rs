//! Checkpoint folders: tensor names, dtypes and shapes from `*.safetensors` headers.
//!
//! A safetensors file starts with an 8-byte little-endian header length and a JSON header
//! (`{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [a, b]}, "__metadata__": ..}`).
//! Only the header is read, never the tensor data, so a folder of terabytes is described in
//! milliseconds. `model.safetensors.index.json` (`weight_map`: name -> file), when present,
//! says which files make up the checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::dtype::DType;

use super::error::ModelError;
use super::params::Param;

/// Headers larger than this are refused (the format's reference reader uses the same bound).
const MAX_HEADER: u64 = 100 << 20;

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn bad(path: &Path, reason: String) -> ModelError {
    ModelError::Checkpoint {
        path: path.display().to_string(),
        reason,
    }
}

/// The dtype of a safetensors dtype name (`BF16`, `F8_E4M3`, ...).
fn dtype(name: &str) -> Option<DType> {
    Some(match name {
        "BOOL" => DType::Bool,
        "U8" => DType::U8,
        "I8" => DType::I8,
        "F8_E4M3" => DType::Fp8E4M3,
        "F8_E5M2" => DType::Fp8E5M2,
        "BF16" => DType::Bf16,
        "F16" => DType::F16,
        "I16" => DType::I16,
        "U16" => DType::U16,
        "F32" => DType::F32,
        "I32" => DType::I32,
        "U32" => DType::U32,
        "F64" => DType::F64,
        "I64" => DType::I64,
        "U64" => DType::U64,
        _ => return None,
    })
}

/// The tensors of one `.safetensors` file, in name order, read from its header alone.
pub fn read_header(path: &Path) -> Result<Vec<Param>, ModelError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io(path))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(bad(
            path,
            format!("header length {len} is over {MAX_HEADER} bytes"),
        ));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(io(path))?;
    let mut entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(path, format!("malformed header: {e}")))?;
    entries.remove("__metadata__");
    let mut out = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        let entry: Entry =
            serde_json::from_value(value).map_err(|e| bad(path, format!("tensor {name}: {e}")))?;
        let dt = dtype(&entry.dtype).ok_or_else(|| {
            bad(
                path,
                format!("tensor {name}: unsupported dtype `{}`", entry.dtype),
            )
        })?;
        let bytes = entry
            .shape
            .iter()
            .try_fold(dt.size() as u64, |acc, &d| acc.checked_mul(d));
        let [begin, end] = entry.data_offsets;
        if bytes != end.checked_sub(begin) {
            return Err(bad(
                path,
                format!(
                    "tensor {name}: data_offsets {begin}..{end} do not hold a {:?} {}",
                    entry.shape, entry.dtype
                ),
            ));
        }
        out.push(Param::new(name, &entry.shape, dt));
    }
    Ok(out)
}

/// Every tensor of a checkpoint folder: the files its index names, or else every
/// `*.safetensors` file in it. `None` if the folder holds neither.
pub fn read_checkpoint(dir: &Path) -> Result<Option<Vec<Param>>, ModelError> {
    let index_path = dir.join("model.safetensors.index.json");
    let index: Option<Index> = if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
        Some(
            serde_json::from_str(&text)
                .map_err(|e| bad(&index_path, format!("malformed index: {e}")))?,
        )
    } else {
        None
    };
    let files: Vec<PathBuf> = match &index {
        Some(index) => {
            let names: BTreeSet<&String> = index.weight_map.values().collect();
            names.into_iter().map(|f| dir.join(f)).collect()
        }
        None => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(io(dir))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            files.sort();
            files
        }
    };
    if files.is_empty() {
        return Ok(None);
    }
    let mut params = Vec::new();
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    for file in files {
        for p in read_header(&file)? {
            if let Some(other) = seen.insert(p.name.clone(), file.clone()) {
                return Err(bad(
                    &file,
                    format!("tensor {} is also in {}", p.name, other.display()),
                ));
            }
            params.push(p);
        }
    }
    if let Some(index) = index {
        for (name, file) in &index.weight_map {
            let found = seen.get(name);
            if found != Some(&dir.join(file)) {
                return Err(bad(
                    &index_path,
                    format!("tensor {name} is mapped to {file}, which does not hold it"),
                ));
            }
        }
    }
    Ok(Some(params))
}

/// Stacks per-expert tensors (`...experts.<k>.<rest>`, k = 0..E) into one `[E, ...]` tensor
/// per projection (`...experts.<rest>`), the way [`super::Model::from_config`] names them.
/// Other tensors pass through; the order follows the first occurrence of each name.
pub fn stack_experts(params: Vec<Param>, path: &Path) -> Result<Vec<Param>, ModelError> {
    struct Group {
        shape: Vec<u64>,
        dtype: DType,
        experts: BTreeSet<u64>,
    }
    let mut order: Vec<String> = Vec::new();
    let mut plain: BTreeMap<String, Param> = BTreeMap::new();
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    for p in params {
        let Some((stacked, expert)) = split_expert(&p.name) else {
            order.push(p.name.clone());
            plain.insert(p.name.clone(), p);
            continue;
        };
        match groups.get_mut(&stacked) {
            None => {
                order.push(stacked.clone());
                groups.insert(
                    stacked,
                    Group {
                        shape: p.shape,
                        dtype: p.dtype,
                        experts: BTreeSet::from([expert]),
                    },
                );
            }
            Some(g) => {
                if g.shape != p.shape || g.dtype != p.dtype {
                    return Err(bad(
                        path,
                        format!(
                            "expert tensor {} is {:?} {}, its siblings {:?} {}",
                            p.name, p.shape, p.dtype, g.shape, g.dtype
                        ),
                    ));
                }
                g.experts.insert(expert);
            }
        }
    }
    order
        .into_iter()
        .map(|name| {
            if let Some(p) = plain.remove(&name) {
                return Ok(p);
            }
            let g = &groups[&name];
            let count = g.experts.len() as u64;
            if g.experts.last() != Some(&(count - 1)) {
                return Err(bad(
                    path,
                    format!("{name}: experts are not numbered 0..{count} without gaps"),
                ));
            }
            let shape: Vec<u64> = std::iter::once(count)
                .chain(g.shape.iter().copied())
                .collect();
            Ok(Param::new(name, &shape, g.dtype))
        })
        .collect()
}

/// `a.experts.7.b` -> (`a.experts.b`, 7).
fn split_expert(name: &str) -> Option<(String, u64)> {
    let at = name.find(".experts.")?;
    let rest = &name[at + ".experts.".len()..];
    let (number, tail) = rest.split_once('.')?;
    let expert = number.parse().ok()?;
    Some((format!("{}.experts.{tail}", &name[..at]), expert))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes a safetensors file with the given tensors (zero-filled data).
    pub(crate) fn write(path: &Path, tensors: &[(&str, &str, &[u64])]) {
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
    pub(crate) fn temp_dir(name: &str) -> tempfile::TempDir {
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
}
