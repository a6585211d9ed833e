//! Buffers that other processes of this host can map: unnamed files (`memfd`), so that nothing
//! is ever left behind, however the process ends. A peer maps one through
//! `/proc/<pid>/fd/<fd>` while its owner lives and keeps the mapping if the owner dies.

use std::ffi::CString;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use reshard_core::error::{Error, Result};

fn map(fd: RawFd, len: usize, prot: libc::c_int) -> std::io::Result<*mut u8> {
    // SAFETY: maps `len` bytes of a file this process holds open; checked below.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if ptr == libc::MAP_FAILED {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ptr.cast())
    }
}

/// A new, zero-filled memfd of `len` bytes (not 0), mapped read-write: (descriptor, address).
pub fn create_shared(name: &str, len: usize) -> std::io::Result<(OwnedFd, *mut u8)> {
    let name = CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: a valid C string; the descriptor is owned below.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just created, owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: a valid descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let ptr = map(fd.as_raw_fd(), len, libc::PROT_READ | libc::PROT_WRITE)?;
    Ok((fd, ptr))
}

/// Opens descriptor `fd` of process `pid` and maps all of it read-write: (address, length).
pub fn map_peer(pid: u32, fd: RawFd) -> std::io::Result<(*mut u8, usize)> {
    if pid == 0 {
        return Err(std::io::Error::other("no process id"));
    }
    let path = CString::new(format!("/proc/{pid}/fd/{fd}")).expect("no NUL");
    // SAFETY: a valid C string; the descriptor closes after mapping.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just opened, owned here.
    let file = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: a valid descriptor and room for one stat.
    if unsafe { libc::fstat(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded.
    let len = unsafe { st.assume_init() }.st_size as usize;
    if len == 0 {
        return Err(std::io::Error::other("an empty shared buffer"));
    }
    let ptr = map(file.as_raw_fd(), len, libc::PROT_READ | libc::PROT_WRITE)?;
    Ok((ptr, len))
}

/// A zero-filled buffer in a memfd, mapped read-write here, that peers may map too.
#[derive(Debug)]
pub struct SharedBuffer {
    /// `None` for an empty buffer: nothing to map.
    map: Option<(OwnedFd, *mut u8)>,
    len: usize,
}

// SAFETY: the buffer owns its mapping, like a Vec<u8> owns its allocation.
unsafe impl Send for SharedBuffer {}
// SAFETY: shared access through `&self` is read-only.
unsafe impl Sync for SharedBuffer {}

impl SharedBuffer {
    /// A buffer of `len` bytes; one of 0 maps nothing.
    pub fn new(len: usize) -> Result<SharedBuffer> {
        if len == 0 {
            return Ok(SharedBuffer { map: None, len });
        }
        let map = create_shared("reshard-shard", len).map_err(|source| {
            // no memory (or address space) for it is a resource failure that names the size
            match source.raw_os_error() {
                Some(libc::ENOMEM | libc::ENOSPC | libc::EFBIG) => Error::OutOfMemory {
                    what: "a shared buffer (memfd)".into(),
                    bytes: len as u64,
                },
                _ => Error::Io {
                    path: "a shared buffer (memfd)".into(),
                    source,
                },
            }
        })?;
        Ok(SharedBuffer {
            map: Some(map),
            len,
        })
    }

    /// The descriptor peers open through `/proc/<pid>/fd/<fd>` (`None` when empty).
    pub fn fd(&self) -> Option<RawFd> {
        self.map.as_ref().map(|(fd, _)| fd.as_raw_fd())
    }
}

impl Deref for SharedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.map {
            // SAFETY: `ptr` maps `len` bytes for the buffer's lifetime.
            Some((_, ptr)) => unsafe { std::slice::from_raw_parts(*ptr, self.len) },
            None => &[],
        }
    }
}

impl DerefMut for SharedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &self.map {
            // SAFETY: as above; `&mut self` makes this process's access exclusive.
            Some((_, ptr)) => unsafe { std::slice::from_raw_parts_mut(*ptr, self.len) },
            None => &mut [],
        }
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if let Some((_, ptr)) = self.map.take() {
            // SAFETY: unmaps what `new` mapped; the descriptor closes when dropped.
            unsafe { libc::munmap(ptr.cast(), self.len) };
        }
    }
}

/// Another process's [`SharedBuffer`], mapped read-write here.
#[derive(Debug)]
pub struct PeerBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a mapping this value owns; writes go through `write`, which needs `&mut self`.
unsafe impl Send for PeerBuffer {}
// SAFETY: no access through `&self`.
unsafe impl Sync for PeerBuffer {}

impl PeerBuffer {
    /// Maps descriptor `fd` of process `pid`, checking that it holds exactly `len` bytes.
    pub fn open(pid: u32, fd: RawFd, len: usize) -> std::io::Result<PeerBuffer> {
        let (ptr, got) = map_peer(pid, fd)?;
        let buffer = PeerBuffer { ptr, len: got };
        if got != len {
            return Err(std::io::Error::other(
                "the shared buffer has another size than announced",
            ));
        }
        Ok(buffer)
    }

    /// The mapped bytes, to write into.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` bytes until drop; the owner does not touch the regions we
        // write until we tell it they are written.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PeerBuffer {
    fn drop(&mut self) {
        // SAFETY: unmaps what `open` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_writes_what_the_owner_reads() {
        let mut buf = SharedBuffer::new(10_000).unwrap();
        buf[5] = 1;
        let mut peer = PeerBuffer::open(std::process::id(), buf.fd().unwrap(), 10_000).unwrap();
        assert_eq!(peer.bytes_mut()[5], 1);
        peer.bytes_mut()[9_999] = 42;
        assert_eq!(buf[9_999], 42);
        assert!(PeerBuffer::open(std::process::id(), buf.fd().unwrap(), 5).is_err());
        assert!(SharedBuffer::new(0).unwrap().is_empty());
    }

    #[test]
    fn a_buffer_larger_than_the_address_space_is_out_of_memory() {
        // ftruncate accepts it (sparse); the mapping cannot exist
        match SharedBuffer::new(usize::MAX / 4) {
            Err(Error::OutOfMemory { bytes, what }) => {
                assert_eq!(bytes, (usize::MAX / 4) as u64);
                assert!(what.contains("shared buffer"));
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
    }
}
