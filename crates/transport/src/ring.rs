//! A single-producer, single-consumer ring of slots in memory shared by two processes of one
//! host: the sender packs chunks into slots, the receiver unpacks them, each at full memory
//! speed and on its own core. The segment is an unnamed file (`memfd`): the receiver maps it
//! through `/proc/<pid>/fd/<fd>`, and the kernel frees it when both are gone, however they end,
//! so no segment is ever left behind. Waits sleep on futexes, and check every
//! [`WAIT_SLICE`] that the peer still lives and the deadline has not passed.

use super::segment::{create_shared, map_peer};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Slots per ring.
pub const SLOTS: u32 = 8;
/// How long one futex wait lasts before the liveness and deadline checks.
pub const WAIT_SLICE: Duration = Duration::from_millis(50);

const MAGIC: u64 = 0x7265_7368_6172_6431; // "reshard1"

/// The shared header: counters on their own cache lines.
#[repr(C, align(64))]
struct Header {
    magic: u64,
    slot_bytes: u64,
    _pad0: [u8; 48],
    /// Slots written by the sender (wraps).
    head: AtomicU32,
    _pad1: [u8; 60],
    /// Slots read by the receiver (wraps).
    tail: AtomicU32,
    _pad2: [u8; 60],
    /// Set by either side when it gives up: the other stops waiting at once.
    aborted: AtomicU32,
    _pad3: [u8; 60],
}

/// Bounds on the slot size a ring may declare.
pub const SLOT_BYTES: std::ops::RangeInclusive<usize> = 4096..=(64 << 20);

/// Why a wait on the ring ended without its slot.
#[derive(Debug)]
pub enum RingError {
    /// The other process exited.
    PeerGone,
    /// The deadline passed.
    TimedOut,
    /// One side gave up ([`Ring::abort`]).
    Aborted,
    /// A call to the operating system failed.
    Os(std::io::Error),
}

/// One mapping of a ring, on either side.
#[derive(Debug)]
pub struct Ring {
    base: *mut u8,
    len: usize,
    slot_bytes: usize,
    /// Kept open by the creator, so that the peer can open it through /proc.
    fd: Option<OwnedFd>,
    /// Serializes the users of one side, so that two threads never take the same slot.
    side: std::sync::Mutex<()>,
}

// SAFETY: the mapping is shared memory accessed through atomics (counters) and through slots
// whose ownership the counters hand back and forth between exactly two parties.
unsafe impl Send for Ring {}
// SAFETY: as above; `side` serializes the users of each side, and `abort` only touches atomics.
unsafe impl Sync for Ring {}

fn futex_wait(word: &AtomicU32, expected: u32, slice: Duration) {
    let ts = libc::timespec {
        tv_sec: slice.as_secs() as libc::time_t,
        tv_nsec: slice.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a valid, aligned u32 in shared memory; the kernel only reads it. A shared (not
    // private) futex, since the waker is another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

/// Whether process `pid` still exists.
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 || *libc::__errno_location() != libc::ESRCH }
}

impl Ring {
    /// A new ring of [`SLOTS`] slots of `slot_bytes`, owned by this process.
    pub fn create(slot_bytes: usize) -> std::io::Result<Ring> {
        if !SLOT_BYTES.contains(&slot_bytes) {
            return Err(std::io::Error::other(format!(
                "slot size {slot_bytes} out of range"
            )));
        }
        let len = std::mem::size_of::<Header>() + SLOTS as usize * slot_bytes;
        let (fd, base) = create_shared("reshard-ring", len)?;
        let ring = Ring {
            base,
            len,
            slot_bytes,
            fd: Some(fd),
            side: std::sync::Mutex::new(()),
        };
        // SAFETY: the fresh mapping is zeroed and large enough for the header.
        unsafe {
            let h = base.cast::<Header>();
            (*h).slot_bytes = slot_bytes as u64;
            (*h).magic = MAGIC;
        }
        Ok(ring)
    }

    /// The descriptor the peer opens through `/proc/<pid>/fd/<fd>`.
    pub fn fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// Maps the ring that process `pid` created as descriptor `fd`, checking that it is one.
    pub fn open(pid: u32, fd: RawFd) -> std::io::Result<Ring> {
        let (base, len) = map_peer(pid, fd)?;
        let mut ring = Ring {
            base,
            len,
            slot_bytes: 0,
            fd: None,
            side: std::sync::Mutex::new(()),
        };
        if len < std::mem::size_of::<Header>() {
            return Err(std::io::Error::other("not a reshard ring"));
        }
        let (magic, slot_bytes) = (ring.header().magic, ring.header().slot_bytes as usize);
        let fits = (SLOTS as usize)
            .checked_mul(slot_bytes)
            .and_then(|n| n.checked_add(std::mem::size_of::<Header>()))
            == Some(len);
        if magic != MAGIC || !SLOT_BYTES.contains(&slot_bytes) || !fits {
            return Err(std::io::Error::other("not a reshard ring"));
        }
        ring.slot_bytes = slot_bytes;
        Ok(ring)
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header, for the ring's lifetime.
        unsafe { &*self.base.cast::<Header>() }
    }

    /// Bytes per slot, as the ring declares them: the most one slot carries.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot(&self, n: u32) -> *mut u8 {
        let i = (n % SLOTS) as usize;
        // SAFETY: in bounds: the header, then SLOTS slots.
        unsafe {
            self.base
                .add(std::mem::size_of::<Header>() + i * self.slot_bytes)
        }
    }

    /// Waits until `ready()` holds on the counter `word`, sleeping on it.
    fn wait(
        &self,
        word: &AtomicU32,
        ready: impl Fn(u32) -> bool,
        peer: u32,
        deadline: Instant,
    ) -> Result<u32, RingError> {
        loop {
            let v = word.load(Ordering::Acquire);
            if ready(v) {
                return Ok(v);
            }
            if self.header().aborted.load(Ordering::Acquire) != 0 {
                return Err(RingError::Aborted);
            }
            if !alive(peer) {
                return Err(RingError::PeerGone);
            }
            if Instant::now() >= deadline {
                return Err(RingError::TimedOut);
            }
            futex_wait(word, v, WAIT_SLICE);
        }
    }

    /// Sender: waits for a free slot, lets `fill` write at most `slot_bytes` into it, and
    /// hands it to the receiver.
    pub fn push(
        &self,
        fill: impl FnOnce(&mut [u8]),
        peer: u32,
        deadline: Instant,
    ) -> Result<(), RingError> {
        let _side = self.side.lock().unwrap_or_else(|p| p.into_inner());
        let h = self.header();
        let head = h.head.load(Ordering::Relaxed);
        self.wait(
            &h.tail,
            |tail| head.wrapping_sub(tail) < SLOTS,
            peer,
            deadline,
        )?;
        // SAFETY: the slot is ours until `head` moves past it.
        fill(unsafe { std::slice::from_raw_parts_mut(self.slot(head), self.slot_bytes) });
        h.head.store(head.wrapping_add(1), Ordering::Release);
        futex_wake(&h.head);
        Ok(())
    }

    /// Receiver: waits for a full slot, lets `drain` read it, and hands it back.
    pub fn pull(
        &self,
        drain: impl FnOnce(&[u8]),
        peer: u32,
        deadline: Instant,
    ) -> Result<(), RingError> {
        let _side = self.side.lock().unwrap_or_else(|p| p.into_inner());
        let h = self.header();
        let tail = h.tail.load(Ordering::Relaxed);
        self.wait(&h.head, |head| head != tail, peer, deadline)?;
        // SAFETY: the slot is ours until `tail` moves past it.
        drain(unsafe { std::slice::from_raw_parts(self.slot(tail), self.slot_bytes) });
        h.tail.store(tail.wrapping_add(1), Ordering::Release);
        futex_wake(&h.tail);
        Ok(())
    }
}

impl Ring {
    /// Gives up: both sides' waits end at once with [`RingError::Aborted`].
    pub fn abort(&self) {
        let h = self.header();
        h.aborted.store(1, Ordering::Release);
        futex_wake(&h.head);
        futex_wake(&h.tail);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what was mapped.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pass_through_in_order() {
        let me = std::process::id();
        let sender = Ring::create(4096).unwrap();
        let receiver = Ring::open(me, sender.fd()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let t = std::thread::spawn(move || {
            for i in 0..100u8 {
                sender.push(|slot| slot.fill(i), me, deadline).unwrap();
            }
            sender
        });
        for i in 0..100u8 {
            receiver
                .pull(|slot| assert!(slot.iter().all(|&b| b == i)), me, deadline)
                .unwrap();
        }
        let sender = t.join().unwrap();
        // nothing left: a further pull times out rather than hanging
        let soon = Instant::now() + Duration::from_millis(100);
        assert!(matches!(
            receiver.pull(|_| (), me, soon),
            Err(RingError::TimedOut)
        ));
        drop(sender);
    }

    #[test]
    fn abort_ends_the_other_sides_wait() {
        let me = std::process::id();
        let sender = Ring::create(4096).unwrap();
        let receiver = std::sync::Arc::new(Ring::open(me, sender.fd()).unwrap());
        let waiting = receiver.clone();
        let t = std::thread::spawn(move || {
            waiting.pull(|_| (), me, Instant::now() + Duration::from_secs(60))
        });
        std::thread::sleep(Duration::from_millis(20));
        sender.abort();
        assert!(matches!(t.join().unwrap(), Err(RingError::Aborted)));
    }

    #[test]
    fn only_real_rings_open() {
        let me = std::process::id();
        assert!(Ring::create(1).is_err());
        let ring = Ring::create(4096).unwrap();
        // a lying header: a slot size that does not match the segment
        // SAFETY: the header is ours to scribble on in this test.
        unsafe { (*ring.base.cast::<Header>()).slot_bytes = u64::MAX / 4 };
        assert!(Ring::open(me, ring.fd()).is_err());
        assert!(Ring::open(0, ring.fd()).is_err());
        assert!(Ring::open(me, -1).is_err());
    }
}
