//! The comparison harness: one loop that runs several methods of moving the same data, in
//! turn, on the same buffers, repetition after repetition, and measures each. `refit --run`
//! ([`crate::refit::RefitRun`]), `reshard run` and `reshard bench` (every variant) all measure with it,
//! ranks as threads of one process or as processes of a job alike.
//!
//! A subject ([`Compare`]) says what each of its methods needs: its links
//! ([`Compare::connect`], opened once, before any repetition, every rank in the same order),
//! the poison written over what it writes ([`Compare::poison`]), one run
//! ([`Compare::run`]), the check of every destination byte ([`Compare::verify`]) and the
//! memory it holds besides its transport's staging ([`Compare::extra_bytes`]). The loop
//! ([`compare`]) owns the rest, the same for every subject:
//!
//! - the order: each method goes first in turn ([`in_turn`]), so that none always runs on the
//!   caches the one before left;
//! - the poison is written before the barrier, so that every rank's clock starts together,
//!   after the barrier, and no rank's poisoning is timed;
//! - only the run is timed, never a check; a method whose ranks are threads reports the time
//!   its executor measured, from when every thread runs ([`Sample::seconds`]);
//! - `verified` is true only when every repetition of every method was checked and each check
//!   covered every byte the method's destinations hold ([`Checked::complete`]).

use std::time::Instant;

use serde::Serialize;

use crate::exec::{RankStats, RunStats};
use reshard_core::error::Result;
use reshard_transport::Job;

/// What one run of a method did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// The seconds the method measured itself, when its ranks are threads of this process (the
    /// executor's clock starts once every thread is up); `None`: the harness's clock around
    /// [`Compare::run`], from the barrier.
    pub seconds: Option<f64>,
    /// Bytes received from other ranks.
    pub wire_bytes: u64,
    /// Bytes copied within a rank.
    pub bytes_local: u64,
    /// Of `wire_bytes`, those same-host senders wrote straight into the receivers' shards.
    pub bytes_direct: u64,
    /// The most staging memory of one rank.
    pub peak_staging: u64,
}

impl Sample {
    /// A run of every rank as a thread of this process, timed by its executor.
    pub fn of_run(stats: &RunStats) -> Sample {
        Sample {
            seconds: Some(stats.elapsed.as_secs_f64()),
            wire_bytes: stats.bytes_remote(),
            bytes_local: stats.bytes_local(),
            bytes_direct: stats.bytes_direct(),
            peak_staging: stats.peak_staging_bytes(),
        }
    }

    /// One rank's run, timed by the harness.
    pub fn of_rank(stats: &RankStats) -> Sample {
        Sample {
            seconds: None,
            wire_bytes: stats.bytes_received,
            bytes_local: stats.bytes_local,
            bytes_direct: stats.bytes_direct,
            peak_staging: stats.peak_staging_bytes,
        }
    }

    /// Two runs one after the other (the values, then the scales): their times and bytes
    /// add up, the peak is the larger.
    pub fn then(self, other: Sample) -> Sample {
        Sample {
            seconds: match (self.seconds, other.seconds) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
            wire_bytes: self.wire_bytes + other.wire_bytes,
            bytes_local: self.bytes_local + other.bytes_local,
            bytes_direct: self.bytes_direct + other.bytes_direct,
            peak_staging: self.peak_staging.max(other.peak_staging),
        }
    }
}

/// What one check covered: `bytes` checked of the `of` bytes the method's destinations hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    /// Destination bytes the check covered.
    pub bytes: u64,
    /// Bytes the method's destinations hold.
    pub of: u64,
}

impl Checked {
    /// A check of `bytes` of `of` destination bytes.
    pub fn new(bytes: u64, of: u64) -> Checked {
        Checked { bytes, of }
    }

    /// Whether every destination byte was checked.
    pub fn complete(&self) -> bool {
        self.bytes == self.of
    }
}

impl std::ops::Add for Checked {
    type Output = Checked;
    fn add(self, other: Checked) -> Checked {
        Checked {
            bytes: self.bytes + other.bytes,
            of: self.of + other.of,
        }
    }
}

/// What is compared: the methods of moving one subject's data, on its buffers.
pub trait Compare {
    /// Names a method (a small enum).
    type Method: Copy + Eq;

    /// The methods, in the order of the first repetition.
    fn methods(&self) -> Vec<Self::Method>;

    /// Opens `method`'s links: called once for every method, in [`Compare::methods`] order,
    /// each after a barrier, before the first repetition.
    fn connect(&mut self, method: Self::Method) -> Result<()> {
        let _ = method;
        Ok(())
    }

    /// Overwrites every buffer `method` writes with a pattern no fill produces everywhere, so
    /// that a byte it did not write fails the check (called only when checking).
    fn poison(&mut self, method: Self::Method);

    /// Runs `method` once.
    fn run(&mut self, method: Self::Method) -> Result<Sample>;

    /// Checks what `method` wrote: an error at the first wrong byte, else what it covered.
    fn verify(&mut self, method: Self::Method) -> Result<Checked>;

    /// Bytes `method` holds besides its transport's staging (full-tensor buffers).
    fn extra_bytes(&self, method: Self::Method) -> u64 {
        let _ = method;
        0
    }
}

/// How many times to run each method, and whether to check every run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repeat {
    /// Untimed repetitions first.
    pub warmup: u32,
    /// Timed repetitions.
    pub iters: u32,
    /// Poison before and check after every repetition of every method.
    pub verify: bool,
}

impl Repeat {
    /// Every repetition, untimed and timed.
    pub fn total(&self) -> u32 {
        self.warmup + self.iters
    }
}

/// Timings and counts of one method over the timed repetitions: one rank's, or the job's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// Seconds of every timed repetition (between processes, the slowest rank's).
    pub times: Vec<f64>,
    /// Bytes received from other ranks in one repetition (the job's: every rank's, summed).
    pub wire_bytes: u64,
    /// Bytes copied within a rank in one repetition (the job's: every rank's, summed).
    pub bytes_local: u64,
    /// The most memory of one rank besides its shards: staging and [`Compare::extra_bytes`].
    pub peak_extra: u64,
    /// Of `wire_bytes`, those same-host senders wrote straight into the receivers' shards
    /// (shm direct writes), counted by the senders.
    pub bytes_direct: u64,
}

impl Measured {
    fn record(&mut self, seconds: f64, sample: &Sample, extra: u64) {
        self.times.push(seconds);
        self.wire_bytes = sample.wire_bytes;
        self.bytes_local = sample.bytes_local;
        self.peak_extra = sample.peak_staging.saturating_add(extra);
        self.bytes_direct = sample.bytes_direct;
    }

    /// This rank's measurements, for rank 0 ([`Measured::combine`]).
    pub fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "times": self.times,
            "wire_bytes": self.wire_bytes,
            "bytes_local": self.bytes_local,
            "peak_extra": self.peak_extra,
            "bytes_direct": self.bytes_direct,
        })
    }

    /// The job's measurements from every rank's [`Measured::report`]: per repetition the
    /// slowest rank's time, the bytes every rank moved, the largest extra memory.
    pub fn combine(per_rank: &[&serde_json::Value]) -> Measured {
        let repetitions = per_rank
            .first()
            .and_then(|v| v["times"].as_array())
            .map_or(0, Vec::len);
        let u = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
        let sum = |k: &str| per_rank.iter().map(|v| u(v, k)).sum();
        Measured {
            times: (0..repetitions)
                .map(|i| {
                    per_rank
                        .iter()
                        .map(|v| v["times"][i].as_f64().unwrap_or(0.0))
                        .fold(0.0, f64::max)
                })
                .collect(),
            wire_bytes: sum("wire_bytes"),
            bytes_local: sum("bytes_local"),
            peak_extra: per_rank
                .iter()
                .map(|v| u(v, "peak_extra"))
                .max()
                .unwrap_or(0),
            bytes_direct: sum("bytes_direct"),
        }
    }
}

/// What [`compare`] found: every method's measurements, in [`Compare::methods`] order.
#[derive(Clone, Debug)]
pub struct Comparison<M> {
    /// Each method and its measurements.
    pub measured: Vec<(M, Measured)>,
    /// Every repetition of every method checked, each check covering every destination byte.
    pub verified: bool,
}

impl<M: Copy + Eq> Comparison<M> {
    /// `method`'s measurements (empty for a method the subject does not have).
    pub fn of(&self, method: M) -> Measured {
        self.measured
            .iter()
            .find(|(m, _)| *m == method)
            .map(|(_, measured)| measured.clone())
            .unwrap_or_default()
    }
}

/// Written over every buffer a method writes (destination shards, scales, the baseline's full
/// tensor) before each repetition, so that no repetition can verify on the bytes of the one
/// before; written around the caches, so that none starts with the poison dirty in them.
pub fn poison(buf: &mut [u8]) {
    reshard_core::memory::fill_around_caches(buf, 0xA5);
}

/// The methods of a comparison in the order of repetition `i`: each goes first in turn
/// (rotated by `i`), so that none always runs on the caches the one before left.
pub fn in_turn<T>(mut methods: Vec<T>, i: u32) -> Vec<T> {
    if !methods.is_empty() {
        let n = methods.len();
        methods.rotate_left(i as usize % n);
    }
    methods
}

/// Runs every method of `subject` `repeat` times in turn and measures it. With `job` (this
/// process one rank of it), every rank calls it alike and every run starts from a barrier;
/// without, the ranks are threads of this process. `tick` is called after every run (a
/// progress bar).
pub fn compare<C: Compare, J: Job + ?Sized>(
    subject: &mut C,
    repeat: Repeat,
    job: Option<&J>,
    tick: &mut dyn FnMut(),
) -> Result<Comparison<C::Method>> {
    let sync = || job.map_or(Ok(()), |j| j.barrier());
    let methods = subject.methods();
    for &m in &methods {
        sync()?;
        subject.connect(m)?;
    }
    let mut measured: Vec<(C::Method, Measured)> =
        methods.iter().map(|&m| (m, Measured::default())).collect();
    let mut checked_all = repeat.verify;
    for i in 0..repeat.total() {
        let timed = i >= repeat.warmup;
        for m in in_turn(methods.clone(), i) {
            if repeat.verify {
                subject.poison(m);
            }
            // after the poison: every rank's clock starts together
            sync()?;
            let started = Instant::now();
            let sample = subject.run(m)?;
            let seconds = sample
                .seconds
                .unwrap_or_else(|| started.elapsed().as_secs_f64());
            tick();
            if repeat.verify {
                checked_all &= subject.verify(m)?.complete();
            }
            if timed {
                let extra = subject.extra_bytes(m);
                if let Some((_, entry)) = measured.iter_mut().find(|(k, _)| *k == m) {
                    entry.record(seconds, &sample, extra);
                }
            }
        }
    }
    Ok(Comparison {
        measured,
        verified: checked_all,
    })
}

/// Seconds of `times`: (median, min, max).
pub fn spread(times: &[f64]) -> (f64, f64, f64) {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    (
        sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
        sorted.first().copied().unwrap_or(0.0),
        sorted.last().copied().unwrap_or(0.0),
    )
}

/// One method's line of a bench or refit report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MethodJson {
    /// Median seconds of the timed repetitions.
    pub median_s: f64,
    /// Seconds of the fastest timed repetition.
    pub min_s: f64,
    /// Seconds of the slowest timed repetition.
    pub max_s: f64,
    /// Bytes received from other ranks in one repetition, all ranks together.
    pub wire_bytes: u64,
    /// Destination bytes per median second, in GB/s (10^9 bytes a second).
    pub gbps: f64,
    /// The most memory one rank held besides its shards, in bytes: staging and full-tensor
    /// buffers ([`Measured::peak_extra`]).
    pub peak_extra_bytes_per_rank: u64,
    /// Of `wire_bytes`, those written straight into the receivers' shards by same-host
    /// senders (shm), when any: absent when every byte went through rings or sockets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_direct: Option<u64>,
    /// Across hosts (`--hosts`): the most bytes into or out of one host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busiest_link_bytes: Option<u64>,
    /// With `--simulate FILE`: the seconds the testbed's cost model predicts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_s: Option<f64>,
}

impl MethodJson {
    /// The summary of `m`, with GB/s of `dst_bytes` of destination data.
    pub fn of(m: &Measured, dst_bytes: u64) -> MethodJson {
        let (median_s, min_s, max_s) = spread(&m.times);
        MethodJson {
            median_s,
            min_s,
            max_s,
            wire_bytes: m.wire_bytes,
            gbps: dst_bytes as f64 / median_s.max(1e-12) / 1e9,
            peak_extra_bytes_per_rank: m.peak_extra,
            bytes_direct: (m.bytes_direct > 0).then_some(m.bytes_direct),
            busiest_link_bytes: None,
            predicted_s: None,
        }
    }
}

/// The transport every rank's report names (its `transport` field), `?` when none does.
pub fn reported_transport(ranks: &[serde_json::Value]) -> String {
    ranks
        .first()
        .and_then(|r| r["transport"].as_str())
        .unwrap_or("?")
        .to_string()
}

/// Whether every rank's report says it checked everything (its `verified` field).
pub fn all_verified(ranks: &[serde_json::Value]) -> bool {
    !ranks.is_empty() && ranks.iter().all(|r| r["verified"].as_bool() == Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over N repetitions every method goes first once, and each order keeps the cycle.
    #[test]
    fn every_method_goes_first_in_turn() {
        let orders: Vec<Vec<char>> = (0..4).map(|i| in_turn(vec!['a', 'b', 'c'], i)).collect();
        assert_eq!(
            orders,
            [
                ['a', 'b', 'c'],
                ['b', 'c', 'a'],
                ['c', 'a', 'b'],
                ['a', 'b', 'c']
            ]
        );
        assert_eq!(in_turn(vec![1, 2], 1), [2, 1]);
    }

    /// A subject that records what the loop asks of it, and checks `covered` of 4 bytes.
    struct Log {
        calls: Vec<String>,
        covered: u64,
    }

    impl Compare for Log {
        type Method = char;
        fn methods(&self) -> Vec<char> {
            vec!['a', 'b']
        }
        fn connect(&mut self, m: char) -> Result<()> {
            self.calls.push(format!("connect {m}"));
            Ok(())
        }
        fn poison(&mut self, m: char) {
            self.calls.push(format!("poison {m}"));
        }
        fn run(&mut self, m: char) -> Result<Sample> {
            self.calls.push(format!("run {m}"));
            Ok(Sample {
                seconds: Some(if m == 'a' { 1.0 } else { 2.0 }),
                wire_bytes: 7,
                peak_staging: 3,
                ..Sample::default()
            })
        }
        fn verify(&mut self, m: char) -> Result<Checked> {
            self.calls.push(format!("verify {m}"));
            Ok(Checked::new(self.covered, 4))
        }
        fn extra_bytes(&self, m: char) -> u64 {
            if m == 'b' { 10 } else { 0 }
        }
    }

    fn run(covered: u64, verify: bool) -> (Log, Comparison<char>) {
        let mut log = Log {
            calls: Vec::new(),
            covered,
        };
        let repeat = Repeat {
            warmup: 1,
            iters: 2,
            verify,
        };
        let mut ticks = 0;
        let c = compare(&mut log, repeat, None::<&dyn Job>, &mut || ticks += 1).unwrap();
        assert_eq!(ticks, 6);
        (log, c)
    }

    /// Links first, then each repetition poisons, runs and checks every method in turn; only
    /// the timed repetitions count, with the method's own extra memory.
    #[test]
    fn the_loop_connects_once_then_poisons_runs_and_checks_in_turn() {
        let (log, c) = run(4, true);
        assert_eq!(log.calls[..2], ["connect a", "connect b"]);
        assert_eq!(
            log.calls[2..8],
            [
                "poison a", "run a", "verify a", "poison b", "run b", "verify b"
            ]
        );
        // the second repetition starts with b
        assert_eq!(log.calls[8], "poison b");
        assert!(c.verified);
        assert_eq!(c.of('a').times, [1.0, 1.0]);
        assert_eq!(c.of('b').peak_extra, 13);
        assert_eq!(c.of('a').wire_bytes, 7);
    }

    /// Verified only when every check covered every byte, and never without checking.
    #[test]
    fn verified_is_false_unless_every_byte_was_checked() {
        let (_, partial) = run(3, true);
        assert!(!partial.verified);
        let (log, unchecked) = run(4, false);
        assert!(!unchecked.verified);
        assert!(log.calls.iter().all(|c| !c.starts_with("poison")));
        assert!(log.calls.iter().all(|c| !c.starts_with("verify")));
    }
}
