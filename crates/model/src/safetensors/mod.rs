//! Checkpoint folders: tensor names, dtypes and shapes from `*.safetensors` headers.
//!
//! A safetensors file starts with an 8-byte little-endian header length and a JSON header
//! (`{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [a, b]}, "__metadata__": ..}`).
//! Only the header is read, never the tensor data, so a folder of terabytes is described in
//! milliseconds. `model.safetensors.index.json` (`weight_map`: name -> file), when present,
//! says which files make up the checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};

use reshard_core::dtype::DType;

use super::params::Param;
use crate::error::ModelError;
use crate::file::open_regular;

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
    weight_map: UniqueMap<String>,
}

/// A JSON object whose keys must be distinct, in file order. Plain maps keep the last of two
/// equal keys silently, so a header or an index naming a tensor twice would describe a
/// different checkpoint than the one a stricter reader (or the training framework) sees.
struct UniqueMap<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Unique<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Unique<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object with distinct keys")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut seen = BTreeSet::new();
                let mut out = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, V>()? {
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "tensor {key} appears twice"
                        )));
                    }
                    out.push((key, value));
                }
                Ok(UniqueMap(out))
            }
        }
        deserializer.deserialize_map(Unique(std::marker::PhantomData))
    }
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

/// The file `name` that the index maps `tensor` to, as a path inside `dir`: relative, with no
/// `..` (an index must not make the loader read `../../etc/passwd`). A symbolic link in the
/// folder is followed: whoever made the folder put it there (the Hugging Face cache links every
/// file of `snapshots/<rev>/` to `../../blobs/`), and it must still lead to a regular file.
fn index_file(
    dir: &Path,
    index_path: &Path,
    tensor: &str,
    name: &str,
) -> Result<PathBuf, ModelError> {
    let mut rel = PathBuf::new();
    for c in Path::new(name).components() {
        match c {
            Component::Normal(part) => rel.push(part),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(bad(
                    index_path,
                    format!(
                        "tensor {tensor} is mapped to `{name}`, outside the checkpoint folder \
                         (files are named relative to it, without `..`)"
                    ),
                ));
            }
        }
    }
    if rel.as_os_str().is_empty() {
        return Err(bad(
            index_path,
            format!("tensor {tensor} is mapped to `{name}`, which names no file"),
        ));
    }
    Ok(dir.join(rel))
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
///
/// The header is checked as a whole before it is believed: its length must fit in the file
/// (and under `MAX_HEADER`, 100 MiB) before anything is allocated for it, every tensor name appears
/// once, and every tensor's bytes lie inside the file's data without overlapping another's.
pub fn read_header(path: &Path) -> Result<Vec<Param>, ModelError> {
    let (mut file, file_len) = open_regular(path)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io(path))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(bad(
            path,
            format!("header length {len} is over {MAX_HEADER} bytes"),
        ));
    }
    // the file holds the length, the header, then the data
    let Some(data_len) = file_len.checked_sub(8 + len) else {
        return Err(bad(
            path,
            format!("header length {len} is more than the file's {file_len} bytes hold"),
        ));
    };
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(io(path))?;
    let UniqueMap(mut entries) = serde_json::from_slice::<UniqueMap<serde_json::Value>>(&header)
        .map_err(|e| bad(path, format!("malformed header: {e}")))?;
    entries.retain(|(name, _)| name != "__metadata__");
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(entries.len());
    let mut spans: Vec<(u64, u64, String)> = Vec::with_capacity(entries.len());
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
        if end > data_len {
            return Err(bad(
                path,
                format!(
                    "tensor {name}: data_offsets {begin}..{end} end beyond the file's \
                     {data_len} bytes of data"
                ),
            ));
        }
        spans.push((begin, end, name.clone()));
        out.push(Param::new(name, &entry.shape, dt));
    }
    check_disjoint(path, spans)?;
    Ok(out)
}

/// Refuses two tensors whose bytes overlap (empty tensors overlap nothing).
fn check_disjoint(path: &Path, mut spans: Vec<(u64, u64, String)>) -> Result<(), ModelError> {
    spans.retain(|(begin, end, _)| begin < end);
    spans.sort();
    for pair in spans.windows(2) {
        let ((b0, e0, n0), (b1, e1, n1)) = (&pair[0], &pair[1]);
        if b1 < e0 {
            return Err(bad(
                path,
                format!(
                    "tensor {n1}: data_offsets {b1}..{e1} overlap those of tensor {n0} \
                     ({b0}..{e0})"
                ),
            ));
        }
    }
    Ok(())
}

/// Every tensor of a checkpoint folder: the files its index names, or else every
/// `*.safetensors` file in it. `None` if the folder holds neither.
///
/// The folder may come from anywhere, so nothing in it is trusted: the index may only name
/// files inside the folder (by name: symbolic links the folder holds are followed), every file
/// must be a regular file, and a tensor may appear in one file only, once.
pub fn read_checkpoint(dir: &Path) -> Result<Option<Vec<Param>>, ModelError> {
    let index_path = dir.join("model.safetensors.index.json");
    let index: Option<Index> = if index_path.exists() {
        let (mut file, len) = open_regular(&index_path)?;
        // the largest models' indices are a few MiB; the bound of a header is plenty
        if len > MAX_HEADER {
            return Err(bad(
                &index_path,
                format!("{len} bytes is over the {MAX_HEADER} bytes an index may have"),
            ));
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(io(&index_path))?;
        Some(
            serde_json::from_str(&text)
                .map_err(|e| bad(&index_path, format!("malformed index: {e}")))?,
        )
    } else {
        None
    };
    // every file once, in order
    let files: std::collections::BTreeSet<PathBuf> = match &index {
        Some(index) => index
            .weight_map
            .0
            .iter()
            .map(|(tensor, name)| index_file(dir, &index_path, tensor, name))
            .collect::<Result<_, _>>()?,
        None => std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect(),
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
        for (name, file) in &index.weight_map.0 {
            let found = seen.get(name);
            if found != Some(&index_file(dir, &index_path, name, file)?) {
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
pub mod tests;
