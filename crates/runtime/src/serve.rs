//! A stand-in for an inference engine that serves from a destination rank's live shards while
//! a refit runs.
//!
//! An engine does not stop serving while a staged refit prepares its next version: it keeps
//! reading the version it serves, pass after pass, and the refit only pauses it where it must
//! take the live buffers for itself (to swap or write them). That pause is what the engine's
//! users see, so it is what a refit must keep short; and every pass must see one version
//! whole, never some buffers (or some regions) of one and the rest of the next.
//!
//! [`Server::start`] runs such an engine as a thread: each pass takes a read lock of the live
//! buffers ([`Live`]), sums a fixed sample of their bytes (CRC-32C) and lets the lock go,
//! then waits as an engine waits between steps. [`Server::stop`] says what it saw
//! ([`Served`]): how many passes, under which mark of the refit ([`Server::mark`]), the longest
//! gap between two passes (the pause), and the distinct digests, which
//! [`Served::only`] checks against the digests of the versions ([`Served::digest`]).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A rank's live buffers, which the engine serves from and a refit replaces.
pub type Live = Arc<RwLock<Vec<Vec<u8>>>>;

/// The size of the pieces a sample is cut into.
const PIECE: usize = 4 << 10;

/// The bytes at the start of every non-empty buffer that every sample holds.
const HEAD: usize = 64;

/// The mark of passes before any [`Server::mark`].
const BEFORE: &str = "before";

/// How the stand-in serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Bytes read per pass, spread over all buffers (every byte when they hold fewer).
    pub sample_bytes: usize,
    /// The wait between passes, as an engine's gap between steps.
    pub idle: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            sample_bytes: 4 << 20,
            idle: Duration::from_millis(1),
        }
    }
}

/// What the server thread and its handle share.
#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    /// Passes done so far.
    passes: AtomicU64,
    /// The marks, in order (the first is [`BEFORE`]), and the one in effect.
    marks: Mutex<(Vec<String>, usize)>,
}

impl Shared {
    /// The mark in effect now.
    fn mark(&self) -> usize {
        self.marks.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

/// The serving thread, running until [`Server::stop`].
#[derive(Debug)]
pub struct Server {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Served>>,
}

impl Server {
    /// Starts serving from `live`: pass after pass, each under a read lock of `live`, a
    /// CRC-32C digest of a fixed sample of its bytes, then `idle`.
    pub fn start(live: Live, options: ServeOptions) -> reshard_core::error::Result<Server> {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            passes: AtomicU64::new(0),
            marks: Mutex::new((vec![BEFORE.to_string()], 0)),
        });
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("reshard-serve".into())
            .spawn(move || serve(&live, &options, &theirs))
            .map_err(|source| reshard_core::error::Error::ThreadStart {
                what: "the serving thread".into(),
                source,
            })?;
        Ok(Server {
            shared,
            thread: Some(thread),
        })
    }

    /// Marks the part of the refit from now on (e.g. "prepare", "decide", "commit"), so that
    /// passes are counted per mark; passes before any mark count under "before". A pass
    /// counts under the mark in effect when it starts; a name marked again counts on.
    pub fn mark(&self, name: &str) {
        let mut marks = self.shared.marks.lock().unwrap_or_else(|e| e.into_inner());
        let at = match marks.0.iter().position(|s| s == name) {
            Some(at) => at,
            None => {
                marks.0.push(name.to_string());
                marks.0.len() - 1
            }
        };
        marks.1 = at;
    }

    /// The passes done so far.
    pub fn passes(&self) -> u64 {
        self.shared.passes.load(Ordering::Acquire)
    }

    /// Stops the thread and returns what it saw.
    pub fn stop(mut self) -> Served {
        self.halt().unwrap_or_default()
    }

    fn halt(&mut self) -> Option<Served> {
        let thread = self.thread.take()?;
        self.shared.stop.store(true, Ordering::Release);
        thread.thread().unpark();
        thread.join().ok()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The serving loop: passes until told to stop.
fn serve(live: &Live, options: &ServeOptions, shared: &Shared) -> Served {
    let mut counts: Vec<u64> = Vec::new();
    let mut served = Served::default();
    let mut longest_gap: Option<(Duration, usize)> = None;
    let mut busy = Duration::ZERO;
    let mut last_end: Option<Instant> = None;
    // the sample of the buffers' lengths, worked out again only if they change
    let mut sampled: (Vec<usize>, Vec<(usize, Range<usize>)>) = (Vec::new(), Vec::new());
    while !shared.stop.load(Ordering::Acquire) {
        let buffers = live.read().unwrap_or_else(|e| e.into_inner());
        let start = Instant::now();
        let mark = shared.mark();
        if !buffers.iter().map(Vec::len).eq(sampled.0.iter().copied()) {
            let lens: Vec<usize> = buffers.iter().map(Vec::len).collect();
            sampled = (lens.clone(), sample(&lens, options.sample_bytes));
        }
        let digest = digest_of(&buffers, &sampled.1);
        drop(buffers);
        let end = Instant::now();
        busy += end - start;
        if let Some(prev) = last_end {
            let gap = start - prev;
            if longest_gap.is_none_or(|(g, _)| gap > g) {
                longest_gap = Some((gap, mark));
            }
        }
        last_end = Some(end);
        if counts.len() <= mark {
            counts.resize(mark + 1, 0);
        }
        counts[mark] += 1;
        served.passes += 1;
        if !served.digests.contains(&digest) {
            served.digests.push(digest);
        }
        shared.passes.fetch_add(1, Ordering::Release);
        idle(options.idle, &shared.stop);
    }
    let names = shared
        .marks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .0
        .clone();
    counts.resize(names.len(), 0);
    if let Some((gap, mark)) = longest_gap {
        served.longest_gap_s = gap.as_secs_f64();
        served.longest_gap_mark = names[mark].clone();
    }
    if served.passes > 0 {
        served.pass_s = busy.as_secs_f64() / served.passes as f64;
    }
    served.passes_by_mark = names.into_iter().zip(counts).collect();
    served
}

/// Waits `d`, or less when `stop` is set (the stopping handle unparks this thread).
fn idle(d: Duration, stop: &AtomicBool) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        if now >= until {
            return;
        }
        std::thread::park_timeout(until - now);
    }
}

/// What the server saw, from its start to its stop.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Served {
    /// Passes served in all.
    pub passes: u64,
    /// Passes per mark, in the order marked, "before" first.
    pub passes_by_mark: Vec<(String, u64)>,
    /// The longest time from the end of one pass to the start of the next: it includes
    /// the idle wait, and any wait for the lock.
    pub longest_gap_s: f64,
    /// The mark under which that gap ended.
    pub longest_gap_mark: String,
    /// The distinct digests the passes saw, in the order first seen.
    pub digests: Vec<u32>,
    /// Mean seconds per pass (under the lock, the idle wait not counted).
    pub pass_s: f64,
}

impl Served {
    /// The digest a pass over `buffers` computes, the same fixed sample: the digests of
    /// versions v and v+1, computed outside the server.
    pub fn digest(buffers: &[Vec<u8>], sample_bytes: usize) -> u32 {
        let lens: Vec<usize> = buffers.iter().map(Vec::len).collect();
        digest_of(buffers, &sample(&lens, sample_bytes))
    }

    /// Whether every pass saw one of `versions`' digests whole (no mix): every entry of
    /// `digests` is among them.
    pub fn only(&self, versions: &[u32]) -> bool {
        self.digests.iter().all(|d| versions.contains(d))
    }
}

/// The CRC-32C of the `sample` of `buffers`, in order.
fn digest_of(buffers: &[Vec<u8>], sample: &[(usize, Range<usize>)]) -> u32 {
    sample.iter().fold(0, |sum, (i, range)| {
        reshard_core::crc::append(sum, &buffers[*i][range.clone()])
    })
}

/// The bytes a pass sums, as (buffer, range) in order, given the buffers' lengths: every byte
/// when they hold at most `sample_bytes`; otherwise each buffer's share in proportion to its
/// size (at least its first [`HEAD`] bytes), in pieces of [`PIECE`] bytes at even strides
/// from its first byte to its last.
fn sample(lens: &[usize], sample_bytes: usize) -> Vec<(usize, Range<usize>)> {
    let total: u128 = lens.iter().map(|&l| l as u128).sum();
    let mut ranges = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        if len == 0 {
            continue;
        }
        if total <= sample_bytes as u128 {
            ranges.push((i, 0..len));
            continue;
        }
        // below `len`, since the buffers hold more than the sample
        let share = (sample_bytes as u128 * len as u128 / total) as usize;
        let share = share.max(len.min(HEAD));
        if share >= len {
            ranges.push((i, 0..len));
            continue;
        }
        let piece = share.min(PIECE);
        let pieces = share.div_ceil(piece);
        if pieces * piece >= len {
            ranges.push((i, 0..len));
            continue;
        }
        if pieces == 1 {
            ranges.push((i, 0..piece));
            continue;
        }
        let span = (len - piece) as u128;
        let last = (pieces - 1) as u128;
        for k in 0..pieces {
            let at = (span * k as u128 / last) as usize;
            ranges.push((i, at..at + piece));
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(buffers: Vec<Vec<u8>>) -> Live {
        Arc::new(RwLock::new(buffers))
    }

    fn version(v: u8, buffers: usize, len: usize) -> Vec<Vec<u8>> {
        (0..buffers)
            .map(|b| {
                (0..len)
                    .map(|i| (i as u8).wrapping_mul(31) ^ (b as u8) ^ v.wrapping_mul(97))
                    .collect()
            })
            .collect()
    }

    /// Waits until the server has done `n` more passes than `since`.
    fn passes_after(server: &Server, since: u64, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while server.passes() < since + n {
            assert!(Instant::now() < deadline, "the server made no passes");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    #[test]
    fn a_held_write_lock_is_the_longest_gap() {
        let live = live(version(0, 4, 16 << 10));
        let server = Server::start(Arc::clone(&live), ServeOptions::default()).unwrap();
        passes_after(&server, 0, 2);
        server.mark("commit");
        {
            let _held = live.write().unwrap();
            std::thread::sleep(Duration::from_millis(50));
        }
        let after = server.passes();
        passes_after(&server, after, 2);
        let served = server.stop();
        assert!(served.longest_gap_s >= 0.045, "{served:?}");
        assert!(served.pass_s > 0.0);
    }

    #[test]
    fn whole_swaps_show_only_the_two_versions() {
        let (v0, v1) = (version(0, 4, 16 << 10), version(1, 4, 16 << 10));
        let opts = ServeOptions::default();
        let (d0, d1) = (
            Served::digest(&v0, opts.sample_bytes),
            Served::digest(&v1, opts.sample_bytes),
        );
        assert_ne!(d0, d1);
        let live = live(v0.clone());
        let server = Server::start(Arc::clone(&live), opts).unwrap();
        for i in 0..40 {
            let next = if i % 2 == 0 { &v1 } else { &v0 };
            live.write().unwrap().clone_from(next);
            let seen = server.passes();
            passes_after(&server, seen, 1);
        }
        let served = server.stop();
        assert!(served.passes >= 40);
        assert!(served.only(&[d0, d1]), "{served:?}");
        assert_eq!(served.digests.len(), 2, "{served:?}");
    }

    #[test]
    fn a_write_in_two_halves_is_seen_mixed() {
        let (v0, v1) = (version(0, 4, 16 << 10), version(1, 4, 16 << 10));
        let sample = ServeOptions::default().sample_bytes;
        let mut mixed = v0.clone();
        mixed[..2].clone_from_slice(&v1[..2]);
        let (d0, d1, dm) = (
            Served::digest(&v0, sample),
            Served::digest(&v1, sample),
            Served::digest(&mixed, sample),
        );
        let live = live(v0.clone());
        let server = Server::start(Arc::clone(&live), ServeOptions::default()).unwrap();
        let seen = {
            let mut buffers = live.write().unwrap();
            buffers[..2].clone_from_slice(&v1[..2]);
            server.passes()
        };
        std::thread::sleep(Duration::from_millis(20));
        // a pass that let go of the lock just before the write may count after `seen`; the
        // one after it saw the first half alone
        passes_after(&server, seen, 2);
        live.write().unwrap()[2..].clone_from_slice(&v1[2..]);
        let seen = server.passes();
        passes_after(&server, seen, 2);
        let served = server.stop();
        assert!(served.digests.contains(&dm), "{served:?}");
        assert!(!served.only(&[d0, d1]), "{served:?}");
        assert!(served.digests.contains(&d1), "{served:?}");
    }

    #[test]
    fn passes_count_per_mark() {
        let live = live(version(0, 2, 4 << 10));
        let server = Server::start(live, ServeOptions::default()).unwrap();
        passes_after(&server, 0, 1);
        for name in ["prepare", "decide", "commit"] {
            server.mark(name);
            // a pass in progress at the mark counts under the mark before
            let seen = server.passes();
            passes_after(&server, seen, 2);
        }
        let served = server.stop();
        let names: Vec<&str> = served
            .passes_by_mark
            .iter()
            .map(|(s, _)| s.as_str())
            .collect();
        assert_eq!(names, ["before", "prepare", "decide", "commit"]);
        assert!(
            served.passes_by_mark.iter().all(|&(_, n)| n >= 1),
            "{served:?}"
        );
        let total: u64 = served.passes_by_mark.iter().map(|&(_, n)| n).sum();
        assert_eq!(total, served.passes);
    }

    #[test]
    fn a_server_stops_promptly_with_a_long_idle() {
        let options = ServeOptions {
            idle: Duration::from_secs(3600),
            ..ServeOptions::default()
        };
        let server = Server::start(live(version(0, 1, 64)), options).unwrap();
        passes_after(&server, 0, 1);
        let served = server.stop();
        assert_eq!(served.passes, 1);
        assert_eq!(served.passes_by_mark, vec![("before".to_string(), 1)]);
    }

    #[test]
    fn a_poisoned_lock_is_still_served() {
        let live = live(version(0, 2, 256));
        let poisoner = Arc::clone(&live);
        let _ = std::thread::spawn(move || {
            let _held = poisoner.write().unwrap();
            panic!("a writer died holding the lock");
        })
        .join();
        assert!(live.is_poisoned());
        let server = Server::start(Arc::clone(&live), ServeOptions::default()).unwrap();
        passes_after(&server, 0, 2);
        let served = server.stop();
        let expected = Served::digest(&version(0, 2, 256), 4 << 20);
        assert_eq!(served.digests, vec![expected]);
    }

    #[test]
    fn the_digest_sums_every_byte_of_small_buffers() {
        let buffers = vec![vec![1u8; 100], Vec::new(), vec![2u8; 5000]];
        let whole: Vec<u8> = buffers.concat();
        let d = Served::digest(&buffers, 1 << 20);
        assert_eq!(d, reshard_core::crc::bytes_sum(&whole));
        assert_eq!(d, Served::digest(&buffers, 1 << 20));
        // any byte of them
        for (b, at) in [(0, 99), (2, 0), (2, 2500), (2, 4999)] {
            let mut changed = buffers.clone();
            changed[b][at] ^= 1;
            assert_ne!(Served::digest(&changed, 1 << 20), d, "buffer {b} byte {at}");
        }
    }

    #[test]
    fn a_large_sample_is_spread_over_every_buffer() {
        let lens = [1 << 20, 100, 8 << 20, 10];
        let sample_bytes = 256 << 10;
        let ranges = sample(&lens, sample_bytes);
        assert_eq!(ranges, sample(&lens, sample_bytes), "not deterministic");
        for (i, &len) in lens.iter().enumerate() {
            let mine: Vec<_> = ranges.iter().filter(|(b, _)| *b == i).collect();
            assert_eq!(mine[0].1.start, 0, "buffer {i} misses its head");
            assert!(mine[0].1.end >= len.min(HEAD), "buffer {i}");
            assert!(mine.iter().all(|(_, r)| r.end <= len));
            assert!(mine.windows(2).all(|w| w[0].1.end <= w[1].1.start));
        }
        // the last piece of a large buffer ends at its last byte
        let big: Vec<_> = ranges.iter().filter(|(b, _)| *b == 2).collect();
        assert_eq!(big.last().unwrap().1.end, 8 << 20);
        let summed: usize = ranges.iter().map(|(_, r)| r.len()).sum();
        assert!(summed >= sample_bytes / 2 && summed <= sample_bytes + 4 * PIECE + 200);
        // in proportion to the sizes: the 8 MiB buffer gets about 8 times the 1 MiB one's
        let share = |b: usize| -> usize {
            ranges
                .iter()
                .filter(|(i, _)| *i == b)
                .map(|(_, r)| r.len())
                .sum()
        };
        assert!(share(2) >= 7 * share(0) && share(2) <= 9 * share(0));
        // a change in any piece of a sampled region changes the digest
        let buffers: Vec<Vec<u8>> = lens.iter().map(|&l| vec![7u8; l]).collect();
        let d = Served::digest(&buffers, sample_bytes);
        for (b, r) in ranges.iter().step_by(17) {
            let mut changed = buffers.clone();
            changed[*b][r.start] = 8;
            assert_ne!(Served::digest(&changed, sample_bytes), d);
        }
    }
}
