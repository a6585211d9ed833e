//! The driver of the control protocol: one thread per process owns the control links, polls
//! them together with a wake-up socket for the rank's own calls, feeds every message, lost
//! link and passing deadline to the [`Machine`], and does what it answers.
//!
//! A thread rather than work done inside each call, because rank 0 must answer its waiting
//! members ([`Msg::Working`]) while its own code is busy moving data, between two calls.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::frame::{self, FrameError, HEADER_BYTES, MAX_CONTROL_BYTES};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

use super::{Action, Call, Decision, Event, Lost, Machine, Msg, Settled, later};

/// The most bytes read from a control link at a time.
const READ_BYTES: usize = 64 << 10;

/// The rank's handle on its control thread.
#[derive(Debug)]
pub struct ControlLinks {
    rank: Rank,
    /// The first rank the control thread knows to be lost ([`Machine::lost`]), for waits
    /// outside the protocol's calls.
    lost: std::sync::Arc<Mutex<Option<(Rank, String)>>>,
    /// One call at a time: the sender of calls, the receiver of their outcomes, and the
    /// socket that wakes the thread (closed to stop it).
    handle: Mutex<Handle>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Handle {
    calls: Sender<Call>,
    outcomes: Receiver<Settled>,
    wake: UnixStream,
}

impl ControlLinks {
    /// Starts the control thread of `rank` over `streams` (index = rank: every member's link
    /// on rank 0, the link to rank 0 on a member).
    pub fn start(
        rank: Rank,
        world: usize,
        timeout: Duration,
        streams: Vec<Option<TcpStream>>,
    ) -> Result<ControlLinks> {
        let io = |e: std::io::Error| Error::Io {
            path: "the control links".into(),
            source: e,
        };
        let (wake, waker) = UnixStream::pair().map_err(io)?;
        waker.set_nonblocking(true).map_err(io)?;
        let mut links = Vec::with_capacity(streams.len());
        for s in streams {
            links.push(match s {
                Some(stream) => {
                    stream.set_nonblocking(true).map_err(io)?;
                    Some(Link {
                        stream,
                        buf: Vec::new(),
                    })
                }
                None => None,
            });
        }
        let (calls, call_rx) = channel();
        let (outcome_tx, outcomes) = channel();
        let lost = std::sync::Arc::new(Mutex::new(None));
        let driver = Driver {
            lost: lost.clone(),
            machine: Machine::new(rank, world, timeout),
            timeout,
            links,
            calls: call_rx,
            outcomes: outcome_tx,
            waker,
        };
        let thread = std::thread::Builder::new()
            .name(format!("reshard-control-{rank}"))
            .spawn(move || driver.run())
            .map_err(io)?;
        Ok(ControlLinks {
            rank,
            lost,
            handle: Mutex::new(Handle {
                calls,
                outcomes,
                wake,
            }),
            thread: Some(thread),
        })
    }

    /// The first rank known to be lost, and how, at once (no call): rank 0 sees its
    /// members' control links close, and tells the others.
    pub fn lost(&self) -> Option<(Rank, String)> {
        self.lost.lock().ok().and_then(|l| l.clone())
    }

    /// Makes `call` (not a decision) and waits until the protocol settles it.
    pub fn call(&self, call: Call) -> Result<Vec<serde_json::Value>> {
        self.settle(call)?.done(self.rank)
    }

    /// Votes (`Ok`: this rank holds its whole next version, staged and checked) and waits
    /// for the decision.
    pub fn decide(&self, vote: std::result::Result<(), String>) -> Result<Decision> {
        self.settle(Call::Decide(vote))?.decided(self.rank)
    }

    fn settle(&self, call: Call) -> Result<Settled> {
        let lost = || Error::Internal {
            rank: self.rank,
            detail: "the control thread is gone".into(),
        };
        let mut handle = self.handle.lock().map_err(|_| lost())?;
        handle.calls.send(call).map_err(|_| lost())?;
        handle.wake.write_all(&[1]).map_err(|_| lost())?;
        handle.outcomes.recv().map_err(|_| lost())
    }
}

impl Drop for ControlLinks {
    fn drop(&mut self) {
        if let Ok(handle) = self.handle.lock() {
            // the thread reads the end of the wake-up socket and returns
            let _ = handle.wake.shutdown(Shutdown::Write);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A control link and the bytes of the frame it is sending.
struct Link {
    stream: TcpStream,
    /// The header, then the body, of the next frame, as far as it has arrived.
    buf: Vec<u8>,
}

impl Link {
    /// Every whole message that has arrived, and the link's end if it came; `chunk` is room
    /// to read into.
    fn read(&mut self, chunk: &mut [u8]) -> (Vec<Msg>, Option<Lost>) {
        let mut msgs = Vec::new();
        loop {
            let want = if self.buf.len() < HEADER_BYTES {
                HEADER_BYTES
            } else {
                match frame::control_length(&self.buf[..HEADER_BYTES], MAX_CONTROL_BYTES) {
                    Ok(len) => HEADER_BYTES + len as usize,
                    Err(e) => return (msgs, Some(broken(e))),
                }
            };
            if self.buf.len() >= HEADER_BYTES && self.buf.len() == want {
                match frame::decode_control::<Msg>(&self.buf[HEADER_BYTES..]) {
                    Ok(msg) => msgs.push(msg),
                    Err(e) => return (msgs, Some(broken(e))),
                }
                self.buf.clear();
                continue;
            }
            // the body grows as its bytes arrive, never to more than the header claims
            let room = (want - self.buf.len()).min(chunk.len());
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) => return (msgs, Some(Lost::Closed)),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return (msgs, None),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return (msgs, Some(lost(e))),
            }
        }
    }

    /// Writes a whole frame, waiting at most `timeout` for the peer to make room.
    fn write(&mut self, mut bytes: &[u8], timeout: Duration) -> std::result::Result<(), Lost> {
        let deadline = later(Instant::now(), timeout);
        while !bytes.is_empty() {
            match self.stream.write(bytes) {
                Ok(0) => return Err(Lost::Closed),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Lost::Stalled);
                    }
                    let mut fds = [libc::pollfd {
                        fd: self.stream.as_raw_fd(),
                        events: libc::POLLOUT,
                        revents: 0,
                    }];
                    // SAFETY: one initialized entry, a descriptor this link owns.
                    unsafe { libc::poll(fds.as_mut_ptr(), 1, millis_until(now, deadline)) };
                }
                Err(e) => return Err(lost(e)),
            }
        }
        Ok(())
    }
}

fn broken(e: FrameError) -> Lost {
    Lost::Broken(format!("sent a malformed control message: {e}"))
}

fn lost(e: std::io::Error) -> Lost {
    match FrameError::from(e) {
        FrameError::Closed => Lost::Closed,
        e => Lost::Broken(format!("control link failed: {e}")),
    }
}

/// Milliseconds from `now` to `at` for `poll`, rounded up so that a wait of 0.4 ms does not
/// spin with a zero timeout.
fn millis_until(now: Instant, at: Instant) -> libc::c_int {
    let wait = at.saturating_duration_since(now) + Duration::from_micros(999);
    libc::c_int::try_from(wait.as_millis()).unwrap_or(libc::c_int::MAX)
}

/// The control thread's state.
struct Driver {
    machine: Machine,
    timeout: Duration,
    /// Index = rank; `None` for this rank, ranks it has no link to, and lost links.
    links: Vec<Option<Link>>,
    calls: Receiver<Call>,
    outcomes: Sender<Settled>,
    waker: UnixStream,
    lost: std::sync::Arc<Mutex<Option<(Rank, String)>>>,
}

impl Driver {
    fn run(mut self) {
        let mut events = std::collections::VecDeque::new();
        let mut chunk = vec![0u8; READ_BYTES];
        loop {
            let now = Instant::now();
            let timeout_ms = self.machine.wakeup().map_or(-1, |at| millis_until(now, at));
            let ranks: Vec<Rank> = (0..self.links.len())
                .filter(|&r| self.links[r].is_some())
                .collect();
            let mut fds: Vec<libc::pollfd> = std::iter::once(self.waker.as_raw_fd())
                .chain(
                    ranks
                        .iter()
                        .filter_map(|&r| self.links[r].as_ref().map(|l| l.stream.as_raw_fd())),
                )
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // SAFETY: `fds` holds `fds.len()` initialized entries for the whole call, each a
            // descriptor this thread owns.
            let ready =
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if ready < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != ErrorKind::Interrupted {
                    tracing::warn!(error = %err, "polling the control links failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            if fds[0].revents != 0 {
                let mut bytes = [0u8; 64];
                match (&self.waker).read(&mut bytes) {
                    // the rank dropped its group: the job is over for this process
                    Ok(0) => return,
                    Ok(_) => {}
                    Err(e)
                        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                    Err(_) => return,
                }
                while let Ok(call) = self.calls.try_recv() {
                    events.push_back(Event::Call(call));
                }
            }
            for (i, &peer) in ranks.iter().enumerate() {
                if fds[i + 1].revents == 0 {
                    continue;
                }
                let Some(link) = self.links[peer].as_mut() else {
                    continue;
                };
                let (msgs, end) = link.read(&mut chunk);
                events.extend(
                    msgs.into_iter()
                        .map(|msg| Event::Message { from: peer, msg }),
                );
                if let Some(lost) = end {
                    self.links[peer] = None;
                    events.push_back(Event::Gone { peer, lost });
                }
            }
            events.push_back(Event::Tick);
            while let Some(event) = events.pop_front() {
                for action in self.machine.handle(Instant::now(), event) {
                    self.perform(action, &mut events);
                }
            }
            if let Some(lost) = self.machine.lost()
                && let Ok(mut shared) = self.lost.lock()
                && shared.is_none()
            {
                *shared = Some(lost.clone());
            }
        }
    }

    fn perform(&mut self, action: Action, events: &mut std::collections::VecDeque<Event>) {
        match action {
            Action::Send { to, msg } => {
                let encoded = match frame::encode_control(&msg) {
                    Ok(e) => e,
                    Err(e) => {
                        // every message is plain data; should one not encode, its receivers
                        // hear nothing and their deadlines say so
                        tracing::error!(error = %e, "a control message did not encode");
                        return;
                    }
                };
                for peer in to {
                    let Some(link) = self.links.get_mut(peer).and_then(Option::as_mut) else {
                        continue;
                    };
                    if let Err(lost) = link.write(&encoded, self.timeout) {
                        self.links[peer] = None;
                        events.push_back(Event::Gone { peer, lost });
                    }
                }
            }
            // the caller waits for it; if it is gone, so is the process's interest
            Action::Done(outcome) => {
                let _ = self.outcomes.send(Settled::Done(outcome));
            }
            Action::Decided(outcome) => {
                let _ = self.outcomes.send(Settled::Decided(outcome));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use serde_json::json;

    use super::*;

    /// Rank 0's and rank 1's control threads over a loopback connection.
    fn pair(timeout: Duration) -> (ControlLinks, ControlLinks) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let member = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (root, _) = listener.accept().unwrap();
        let root = ControlLinks::start(0, 2, timeout, vec![None, Some(root)]).unwrap();
        let member = ControlLinks::start(1, 2, timeout, vec![Some(member), None]).unwrap();
        (root, member)
    }

    /// Rank 0 reaches its finish long after its member's patience would have run out without
    /// heartbeats; both succeed.
    #[test]
    fn a_member_outwaits_rank_0s_long_part() {
        let timeout = Duration::from_millis(300);
        let (root, member) = pair(timeout);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| member.call(Call::Finish(Ok(json!("one")))));
            std::thread::sleep(timeout * super::super::MEMBER_PATIENCE * 2);
            let reports = root.call(Call::Finish(Ok(json!("zero")))).unwrap();
            assert_eq!(reports, vec![json!("zero"), json!("one")]);
            assert!(waiting.join().unwrap().unwrap().is_empty());
        });
    }

    /// Rank 0's thread ends with its group: a waiting member hears the link close at once.
    #[test]
    fn a_member_hears_that_rank_0_is_gone() {
        let (root, member) = pair(Duration::from_secs(600));
        std::thread::scope(|s| {
            let waiting = s.spawn(|| member.call(Call::Barrier));
            drop(root);
            match waiting.join().unwrap() {
                Err(Error::PeerGone {
                    rank: 1, peer: 0, ..
                }) => {}
                other => panic!("expected rank 0 gone, got {other:?}"),
            }
        });
    }

    /// A member that sends rank 0 something that is not a control frame is named for it.
    #[test]
    fn a_malformed_frame_fails_its_sender() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut member = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (stream, _) = listener.accept().unwrap();
        let root =
            ControlLinks::start(0, 2, Duration::from_secs(600), vec![None, Some(stream)]).unwrap();
        member.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        match root.call(Call::Barrier) {
            Err(Error::JobFailed { failures, .. }) => {
                assert_eq!(failures.len(), 1);
                assert_eq!(failures[0].0, 1);
                assert!(failures[0].1.contains("malformed"), "{failures:?}");
            }
            other => panic!("expected the job to fail, got {other:?}"),
        }
    }
}
