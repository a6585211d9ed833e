//! `--dump` and `--dump-src` of `reshard run`: every shard written raw, whole or not at all,
//! into a directory checked before any byte moves.

use std::io::Write;
use std::path::Path;

use reshard::error::Field;
use reshard::{Error, Rank};

/// Makes sure `--dump DIR` can take the files before any byte moves: creates DIR when it is
/// missing, and refuses a path that is not a directory or one where no file can be created
/// (checked by creating one: permission bits alone miss read-only mounts and root).
pub(in crate::cli) fn check_dump_dir(dir: &Path) -> Result<(), Error> {
    let refuse = |reason: String| Error::InvalidOption {
        field: Field::Flag("--dump"),
        value: dir.display().to_string(),
        reason,
    };
    match std::fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => {
            return Err(refuse("it exists and is not a directory".into()));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(dir)
            .map_err(|e| refuse(format!("the directory cannot be created: {e}")))?,
        Err(e) => return Err(refuse(format!("it cannot be read: {e}"))),
    }
    // removed again when dropped
    tempfile::Builder::new()
        .prefix(".reshard-probe-")
        .tempfile_in(dir)
        .map_err(|e| refuse(format!("no file can be created in it: {e}")))?;
    Ok(())
}

/// Writes `DIR/rank<R>.bin` for every shard (DIR checked by [`check_dump_dir`]).
pub(in crate::cli) fn dump<'a>(
    dir: &Path,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
    dump_named(dir, "rank", shards)
}

/// Writes `DIR/rank<R>.scale.bin` for every scale shard (row-major, in the scale dtype).
pub(in crate::cli) fn dump_scales<'a>(
    dir: &Path,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
    for (rank, buf) in shards {
        write_whole(dir, &format!("rank{rank}.scale.bin"), |file| {
            file.write_all(buf)
        })?;
    }
    Ok(())
}

/// Writes `DIR/<prefix><R>.bin` for every shard: `rank` for destinations, `src` for sources.
pub(in crate::cli) fn dump_named<'a>(
    dir: &Path,
    prefix: &str,
    shards: impl IntoIterator<Item = (Rank, &'a [u8])>,
) -> Result<(), Error> {
    for (rank, buf) in shards {
        write_whole(dir, &format!("{prefix}{rank}.bin"), |file| {
            file.write_all(buf)
        })?;
    }
    Ok(())
}

/// Writes `DIR/name` whole or not at all: `write` fills a temporary file in the same directory
/// (so that the rename cannot cross file systems), which is flushed to disk and then renamed
/// over `name`. On any error (a full disk), the temporary is removed and `name` is untouched.
pub(in crate::cli) fn write_whole(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), Error> {
    let path = dir.join(name);
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let mut temp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io)?;
    // a write error, or one the file system only reports on flushing, drops (removes) `temp`
    write(temp.as_file_mut())
        .and_then(|()| temp.as_file().sync_all())
        .map_err(io)?;
    temp.persist(&path).map_err(|e| io(e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("reshard-{name}-"))
            .tempdir()
            .unwrap()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn dumps_leave_whole_files_and_no_temporaries() {
        let dir = scratch("dump");
        dump(dir.path(), [(2, &[1u8, 2][..]), (3, &[3u8][..])]).unwrap();
        assert_eq!(names(dir.path()), ["rank2.bin", "rank3.bin"]);
        assert_eq!(std::fs::read(dir.path().join("rank2.bin")).unwrap(), [1, 2]);
        // a second dump replaces the first
        dump(dir.path(), [(2, &[9u8][..])]).unwrap();
        assert_eq!(std::fs::read(dir.path().join("rank2.bin")).unwrap(), [9]);
    }

    /// A write that fails half-way (as on a full disk) leaves neither the file nor its
    /// temporary, and an older file of that name untouched.
    #[test]
    fn a_failed_write_leaves_nothing_partial() {
        let dir = scratch("full");
        std::fs::write(dir.path().join("rank5.bin"), b"old").unwrap();
        for name in ["rank4.bin", "rank5.bin"] {
            let err = write_whole(dir.path(), name, |file| {
                file.write_all(&[7; 4096])?;
                Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
            })
            .unwrap_err();
            assert!(
                matches!(&err, Error::Io { path, .. } if path.ends_with(name)),
                "{err}"
            );
        }
        assert_eq!(names(dir.path()), ["rank5.bin"]);
        assert_eq!(std::fs::read(dir.path().join("rank5.bin")).unwrap(), b"old");
    }

    #[test]
    fn the_dump_dir_is_created_or_refused_by_name() {
        let dir = scratch("check");
        let nested = dir.path().join("a/b");
        check_dump_dir(&nested).unwrap();
        assert!(nested.is_dir());
        assert!(names(&nested).is_empty(), "the probe is removed");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        for bad in [file.clone(), file.join("below")] {
            let err = check_dump_dir(&bad).unwrap_err();
            let text = err.to_string();
            assert!(
                text.starts_with(&format!("--dump: {} is invalid", bad.display())),
                "{text}"
            );
        }
    }
}
