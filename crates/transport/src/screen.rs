//! Screening of new connections on a listening port, all at once: the rendezvous port of
//! rank 0 and every rank's data-link port are open to anyone who can reach them, so a stranger
//! that connects and says nothing, trickles its first message a byte at a time, announces a
//! huge one or opens connections by the hundred must cost the job neither time nor memory.
//!
//! One thread polls the listener and every connection that has not yet said hello. Each such
//! connection has [`HELLO_WAIT`] to send a complete hello of at most [`MAX_HELLO_BYTES`]; at
//! most [`MAX_PENDING`] of them wait at once, the oldest dropped first to make room. A real
//! rank sends its hello as soon as it connects, so it is read at once, whatever the strangers
//! around it do; the caller's deadline bounds the whole wait.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use reshard_core::layout::Rank;

use super::frame::{self, HEADER_BYTES};

/// Largest hello: a token of up to [`super::group::MAX_TOKEN_BYTES`] (even with every byte
/// escaped in JSON) and a few numbers fit.
pub const MAX_HELLO_BYTES: u64 = 4 << 10;

/// How long a new connection has to send its whole hello. A rank writes it right after
/// connecting; the margin is for a loaded machine.
pub const HELLO_WAIT: Duration = Duration::from_secs(10);

/// Most connections waiting for their hello at once: bounds the file descriptors and memory
/// strangers can hold.
pub const MAX_PENDING: usize = 32;

/// How long to stop accepting after the process ran out of file descriptors.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// A connection that has not yet sent its whole hello.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    /// When its hello must be complete.
    until: Instant,
    /// The bytes read so far: the header, then the body.
    buf: Vec<u8>,
}

/// What reading from a pending connection came to.
enum Step {
    /// Not all of the hello has arrived.
    Waiting,
    /// The hello's JSON body is complete.
    Complete(Vec<u8>),
    /// Closed, failed, or not a hello this job accepts: the reason, for the log.
    Drop(String),
}

impl Pending {
    /// Reads what has arrived, never past the end of the hello (the peer waits for an answer
    /// before it sends more, and what it sends next belongs to the caller).
    fn step(&mut self) -> Step {
        loop {
            let want = if self.buf.len() < HEADER_BYTES {
                HEADER_BYTES
            } else {
                match frame::control_length(&self.buf[..HEADER_BYTES], MAX_HELLO_BYTES) {
                    Ok(len) => HEADER_BYTES + len as usize,
                    Err(e) => return Step::Drop(e.to_string()),
                }
            };
            if self.buf.len() == want {
                return Step::Complete(self.buf.split_off(HEADER_BYTES));
            }
            let start = self.buf.len();
            self.buf.resize(want, 0);
            match self.stream.read(&mut self.buf[start..]) {
                Ok(0) => return Step::Drop("closed before its hello".into()),
                Ok(n) => self.buf.truncate(start + n),
                Err(e) => {
                    self.buf.truncate(start);
                    match e.kind() {
                        ErrorKind::WouldBlock => return Step::Waiting,
                        ErrorKind::Interrupted => {}
                        _ => return Step::Drop(e.to_string()),
                    }
                }
            }
        }
    }
}

/// The connections to one listener that still owe their hello.
pub struct Screen<'l> {
    listener: &'l TcpListener,
    /// The rank that listens, for the log.
    rank: Rank,
    hello_wait: Duration,
    /// Oldest first.
    pending: VecDeque<Pending>,
    /// No accepting until then (the process ran out of file descriptors).
    paused_until: Option<Instant>,
    /// Connections dropped so far: logged once, as a count, so that a flood of strangers
    /// cannot flood the log too.
    dropped: usize,
}

impl<'l> Screen<'l> {
    /// Screens the newcomers to `listener`, the port of `rank` (which names it in logs),
    /// allowing each [`HELLO_WAIT`] for its hello.
    pub fn new(listener: &'l TcpListener, rank: Rank) -> Screen<'l> {
        Screen::with_hello_wait(listener, rank, HELLO_WAIT)
    }

    /// With another time allowed for each hello (tests use a short one).
    pub fn with_hello_wait(listener: &'l TcpListener, rank: Rank, wait: Duration) -> Screen<'l> {
        Screen {
            listener,
            rank,
            hello_wait: wait,
            pending: VecDeque::new(),
            paused_until: None,
            dropped: 0,
        }
    }

    /// The next connection that sent a well-formed hello, before `deadline`: the hello, the
    /// stream (blocking, at the byte after the hello) and the address it came from. `None` when
    /// the deadline passes first. Whether the hello fits the job is the caller's to judge;
    /// connections still waiting stay here for the next call.
    pub fn next<T: DeserializeOwned>(
        &mut self,
        deadline: Instant,
    ) -> Option<(T, TcpStream, SocketAddr)> {
        if self.listener.set_nonblocking(true).is_err() {
            // cannot happen on a valid socket; without it accept would block past the deadline
            tracing::warn!(rank = self.rank, "cannot make the listener non-blocking");
            return None;
        }
        loop {
            let now = Instant::now();
            self.drop_late(now);
            if now >= deadline {
                return None;
            }
            if self.paused_until.is_some_and(|t| t <= now) {
                self.paused_until = None;
            }
            let accepting = self.paused_until.is_none();
            let wake = self
                .pending
                .iter()
                .map(|p| p.until)
                .chain(self.paused_until)
                .fold(deadline, Instant::min);
            let mut fds: Vec<libc::pollfd> = accepting
                .then_some(self.listener.as_raw_fd())
                .into_iter()
                .chain(self.pending.iter().map(|p| p.stream.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // round up, so that a wait of 0.4 ms does not spin with a zero timeout
            let wait = wake.saturating_duration_since(now) + Duration::from_micros(999);
            let timeout_ms = libc::c_int::try_from(wait.as_millis()).unwrap_or(libc::c_int::MAX);
            // SAFETY: `fds` holds `fds.len()` initialized entries for the whole call, and every
            // descriptor belongs to the listener or a stream this screen owns.
            let ready =
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if ready < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != ErrorKind::Interrupted {
                    tracing::warn!(rank = self.rank, error = %err, "poll failed");
                    std::thread::sleep(ACCEPT_PAUSE);
                }
                continue;
            }
            if ready == 0 {
                continue;
            }
            let listener_ready = accepting && fds[0].revents != 0;
            let streams = &fds[usize::from(accepting)..];
            // the connections that have bytes waiting, newest first so that removing one does
            // not move the others
            let ready: Vec<usize> = (0..streams.len())
                .rev()
                .filter(|&i| streams[i].revents != 0)
                .collect();
            for i in ready {
                if let Some(done) = self.advance(i) {
                    return Some(done);
                }
            }
            if listener_ready && let Some(done) = self.accept_all() {
                return Some(done);
            }
        }
    }

    /// Reads what pending connection `i` sent; the connection, if its hello is complete.
    fn advance<T: DeserializeOwned>(&mut self, i: usize) -> Option<(T, TcpStream, SocketAddr)> {
        match self.pending[i].step() {
            Step::Waiting => None,
            Step::Drop(reason) => {
                let p = self.pending.remove(i)?;
                self.drop_one(p.from, &reason);
                None
            }
            Step::Complete(body) => {
                let p = self.pending.remove(i)?;
                self.finish(p, &body)
            }
        }
    }

    /// Decodes a complete hello and hands the stream back blocking.
    fn finish<T: DeserializeOwned>(
        &mut self,
        p: Pending,
        body: &[u8],
    ) -> Option<(T, TcpStream, SocketAddr)> {
        match frame::decode_control(body) {
            Ok(hello) if p.stream.set_nonblocking(false).is_ok() => Some((hello, p.stream, p.from)),
            Ok(_) => {
                self.drop_one(p.from, "cannot make the connection blocking");
                None
            }
            Err(e) => {
                self.drop_one(p.from, &e.to_string());
                None
            }
        }
    }

    /// Accepts every connection waiting on the listener, reading each one's hello at once if
    /// it is there; returns the first complete one.
    fn accept_all<T: DeserializeOwned>(&mut self) -> Option<(T, TcpStream, SocketAddr)> {
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let until = Instant::now() + self.hello_wait;
                    let mut p = Pending {
                        stream,
                        from,
                        until,
                        buf: Vec::new(),
                    };
                    match p.step() {
                        Step::Complete(body) => {
                            if let Some(done) = self.finish(p, &body) {
                                return Some(done);
                            }
                        }
                        Step::Drop(reason) => self.drop_one(from, &reason),
                        Step::Waiting => {
                            if self.pending.len() == MAX_PENDING
                                && let Some(old) = self.pending.pop_front()
                            {
                                self.drop_one(old.from, "the oldest waiting, to make room");
                            }
                            self.pending.push_back(p);
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
                Err(e)
                    if e.kind() == ErrorKind::Interrupted
                        || e.kind() == ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // out of file descriptors, most likely: free one and try again shortly
                    tracing::warn!(rank = self.rank, error = %e, "cannot accept a connection");
                    if let Some(old) = self.pending.pop_front() {
                        self.drop_one(old.from, "the oldest waiting, to free a file descriptor");
                    }
                    self.paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    return None;
                }
            }
        }
    }

    /// Drops the connections whose time for a hello is up.
    fn drop_late(&mut self, now: Instant) {
        let (rank, before) = (self.rank, self.pending.len());
        self.pending.retain(|p| {
            let late = p.until <= now;
            if late {
                tracing::debug!(rank, from = %p.from, received = p.buf.len(), "dropped a connection that did not finish its hello in time");
            }
            !late
        });
        self.dropped += before - self.pending.len();
    }

    /// Counts (and, at debug level, logs) a connection dropped for `reason`.
    fn drop_one(&mut self, from: SocketAddr, reason: &str) {
        tracing::debug!(rank = self.rank, %from, %reason, "dropped a connection that did not say hello");
        self.dropped += 1;
    }

    /// How many connections still owe their hello.
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }
}

impl Drop for Screen<'_> {
    /// One line for all the strangers, those still waiting included (they are closed now).
    fn drop(&mut self) {
        let dropped = self.dropped + self.pending.len();
        if dropped > 0 {
            tracing::warn!(
                rank = self.rank,
                dropped,
                "dropped connections that sent no valid hello in time (RESHARD_LOG=debug names them)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use serde_json::{Value, json};

    use super::*;

    /// Every wait here is bounded generously; none asserts how fast anything happens.
    const LONG: Duration = Duration::from_secs(30);

    fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        (l, addr)
    }

    /// Whether the other end closed `s` (a read sees the end, or a reset) within `LONG`.
    fn closed_by_peer(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(LONG)).unwrap();
        let mut byte = [0u8; 1];
        match s.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == ErrorKind::ConnectionReset,
        }
    }

    /// A frame header that announces a control body of `len` bytes.
    fn hello_header(len: u64) -> Vec<u8> {
        let frame = frame::encode_control(&0u8).unwrap();
        let mut h = frame[..HEADER_BYTES].to_vec();
        h[8..].copy_from_slice(&len.to_le_bytes());
        h
    }

    #[test]
    fn a_real_hello_gets_through_silent_trickling_oversized_and_flooding_strangers() {
        let (l, addr) = listener();
        // no more than the listen backlog (128) holds before the screen starts accepting
        let mut strangers: Vec<TcpStream> =
            (0..80).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut trickler = TcpStream::connect(addr).unwrap();
        trickler.write_all(&hello_header(100)[..3]).unwrap();
        let mut oversized = TcpStream::connect(addr).unwrap();
        oversized
            .write_all(&hello_header(MAX_HELLO_BYTES + 1))
            .unwrap();
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut real = TcpStream::connect(addr).unwrap();
        real.write_all(&frame::encode_control(&json!({"rank": 1})).unwrap())
            .unwrap();
        // more strangers after it, and one that keeps trickling from another thread
        strangers.extend((0..20).map(|_| TcpStream::connect(addr).unwrap()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let dripping = {
            let stop = stop.clone();
            let mut s = TcpStream::connect(addr).unwrap();
            std::thread::spawn(move || {
                for &b in hello_header(1000).iter().cycle() {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[b]).is_err()
                    {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };

        let mut screen = Screen::new(&l, 0);
        let (hello, mut stream, _) = screen
            .next::<Value>(Instant::now() + LONG)
            .expect("the real hello is admitted");
        assert_eq!(hello, json!({"rank": 1}));
        assert!(screen.waiting() <= MAX_PENDING, "{}", screen.waiting());
        // the admitted stream is blocking and positioned right after the hello
        stream.write_all(b"ok").unwrap();
        let mut answer = [0u8; 2];
        real.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"ok");

        // those that broke the protocol were dropped at once
        assert!(closed_by_peer(&mut oversized));
        assert!(closed_by_peer(&mut garbage));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        dripping.join().unwrap();
        drop(trickler);
    }

    #[test]
    fn a_hello_not_finished_in_time_is_dropped() {
        let (l, addr) = listener();
        let mut trickler = TcpStream::connect(addr).unwrap();
        trickler.write_all(&hello_header(100)).unwrap();
        trickler.write_all(b"{").unwrap();
        let mut silent = TcpStream::connect(addr).unwrap();
        let mut screen = Screen::with_hello_wait(&l, 0, Duration::from_millis(200));
        // nobody completes a hello: the screen waits out its deadline, the hellos' wait
        // (shorter) has passed by then, and both connections are gone
        let got = screen.next::<Value>(Instant::now() + Duration::from_secs(2));
        assert!(got.is_none());
        assert_eq!(screen.waiting(), 0);
        assert!(closed_by_peer(&mut trickler));
        assert!(closed_by_peer(&mut silent));
    }

    #[test]
    fn a_flood_holds_at_most_max_pending_connections() {
        let (l, addr) = listener();
        let strangers: Vec<TcpStream> = (0..3 * MAX_PENDING + 1)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut screen = Screen::new(&l, 0);
        assert!(
            screen
                .next::<Value>(Instant::now() + Duration::from_millis(500))
                .is_none()
        );
        assert_eq!(screen.waiting(), MAX_PENDING);
        // the newest are kept: the oldest were dropped to make room
        let mut oldest = strangers.into_iter().next().unwrap();
        assert!(closed_by_peer(&mut oldest));
    }

    #[test]
    fn a_malformed_or_empty_hello_is_dropped_and_the_next_one_admitted() {
        let (l, addr) = listener();
        let mut empty = TcpStream::connect(addr).unwrap();
        empty.write_all(&hello_header(0)).unwrap();
        let mut bad_json = TcpStream::connect(addr).unwrap();
        bad_json.write_all(&hello_header(3)).unwrap();
        bad_json.write_all(b"{{{").unwrap();
        let mut real = TcpStream::connect(addr).unwrap();
        real.write_all(&frame::encode_control(&7u32).unwrap())
            .unwrap();
        let mut screen = Screen::new(&l, 0);
        let (hello, _, _) = screen.next::<u32>(Instant::now() + LONG).unwrap();
        assert_eq!(hello, 7);
        assert!(closed_by_peer(&mut empty));
        assert!(closed_by_peer(&mut bad_json));
    }
}
