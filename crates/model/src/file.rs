//! Opening the files a user names (a `config.json`, checkpoint headers, an index) for
//! reading: below the config and checkpoint readers, which both open them so.

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::ModelError;

/// Opens `path` for reading if it is a regular file, with its length. A FIFO, a device or a
/// folder is refused: reading one would block for ever or never end. The file is opened
/// without blocking (opening a FIFO otherwise waits for a writer) and checked once open, so
/// that swapping the path between a check and the open changes nothing.
pub fn open_regular(path: &Path) -> Result<(File, u64), ModelError> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| io(path, source))?;
    let meta = file.metadata().map_err(|source| io(path, source))?;
    let kind = meta.file_type();
    let what = if kind.is_file() {
        return Ok((file, meta.len()));
    } else if kind.is_dir() {
        "a folder"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a special file"
    };
    Err(ModelError::Checkpoint {
        path: path.display().to_string(),
        reason: format!("{what}, not a regular file"),
    })
}

fn io(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}
