//! What `run`, `bench` and `refit --run` measure and report alike: the timings of repeated
//! runs of a method, their combination over the ranks of a job, and the end of a job (every
//! rank's report to rank 0's verdict).

use reshard::Error;
use reshard::runtime::World;
use reshard::transport::Job;

use super::Failure;

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

/// Timings and counts of one method over the repetitions: one rank's, or the job's.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub times: Vec<f64>,
    pub wire_bytes: u64,
    pub peak_extra: u64,
    /// Of `wire_bytes`, those same-host senders wrote straight into the receivers' shards
    /// (shm direct writes), counted by the senders.
    pub bytes_direct: u64,
}

impl Measured {
    /// Runs one repetition of a method from a barrier, so that every rank starts together,
    /// and keeps its time and counts when `timed`; `extra` is memory the method holds besides
    /// its transport's staging.
    pub fn repeat<J: Job + ?Sized>(
        &mut self,
        job: &J,
        timed: bool,
        extra: u64,
        run: impl FnOnce() -> Result<reshard::exec::RankStats, Error>,
    ) -> Result<(), Error> {
        job.barrier()?;
        let started = std::time::Instant::now();
        let stats = run()?;
        if timed {
            self.times.push(started.elapsed().as_secs_f64());
            self.wire_bytes = stats.bytes_received;
            self.peak_extra = stats.peak_staging_bytes.saturating_add(extra);
            self.bytes_direct = stats.bytes_direct;
        }
        Ok(())
    }

    /// This rank's measurements, for rank 0.
    pub fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "times": self.times,
            "wire_bytes": self.wire_bytes,
            "peak_extra": self.peak_extra,
            "bytes_direct": self.bytes_direct,
        })
    }

    /// The job's measurements from every rank's [`Measured::report`]: per repetition the
    /// slowest rank's time, the bytes every rank received, the largest extra memory.
    pub fn combine(per_rank: &[&serde_json::Value]) -> Measured {
        let repetitions = per_rank
            .first()
            .and_then(|v| v["times"].as_array())
            .map_or(0, Vec::len);
        let u = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
        Measured {
            times: (0..repetitions)
                .map(|i| {
                    per_rank
                        .iter()
                        .map(|v| v["times"][i].as_f64().unwrap_or(0.0))
                        .fold(0.0, f64::max)
                })
                .collect(),
            wire_bytes: per_rank.iter().map(|v| u(v, "wire_bytes")).sum(),
            peak_extra: per_rank
                .iter()
                .map(|v| u(v, "peak_extra"))
                .max()
                .unwrap_or(0),
            bytes_direct: per_rank.iter().map(|v| u(v, "bytes_direct")).sum(),
        }
    }
}

/// The two methods `bench` and `refit --run` compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Reshard,
    GatherBroadcast,
}

impl Method {
    /// The order of the two in repetition `i`: each goes first every other time, so that
    /// neither always inherits the machine from the other.
    pub fn order(i: u32) -> [Method; 2] {
        in_turn([Method::Reshard, Method::GatherBroadcast], i)
    }
}

/// The methods of a comparison in the order of repetition `i`: each goes first in turn
/// (rotated by `i`), so that none always runs on the caches the one before left.
pub fn in_turn<T, const N: usize>(mut methods: [T; N], i: u32) -> [T; N] {
    methods.rotate_left(i as usize % N);
    methods
}

/// One method's line of a bench or refit report.
#[derive(Debug, serde::Serialize)]
pub struct MethodJson {
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    pub wire_bytes: u64,
    pub gbps: f64,
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

/// What rank 0 hears from every rank at the end of a job.
pub struct Reports {
    /// Every rank's report, indexed by rank.
    pub ranks: Vec<serde_json::Value>,
}

impl Reports {
    /// The transport the ranks name in their reports' `transport` field.
    pub fn transport(&self) -> String {
        self.ranks
            .first()
            .and_then(|r| r["transport"].as_str())
            .unwrap_or("?")
            .to_string()
    }
}

/// Ends this rank's part of a job: prints its own failure, hands its report (or the failure)
/// to rank 0's verdict ([`World::finish`]), and returns every rank's report on rank 0, `None`
/// on the others.
pub fn conclude(
    world: &World,
    outcome: Result<serde_json::Value, Error>,
) -> Result<Option<Reports>, Failure> {
    if let Err(e) = &outcome {
        eprintln!("error: {e}");
    }
    let ranks = world.finish(outcome)?;
    Ok(ranks.map(|ranks| Reports { ranks }))
}

#[cfg(test)]
mod tests {
    use super::in_turn;

    /// Over N repetitions every method goes first once, and each order keeps the cycle.
    #[test]
    fn every_method_goes_first_in_turn() {
        let orders: Vec<[char; 3]> = (0..4).map(|i| in_turn(['a', 'b', 'c'], i)).collect();
        assert_eq!(
            orders,
            [
                ['a', 'b', 'c'],
                ['b', 'c', 'a'],
                ['c', 'a', 'b'],
                ['a', 'b', 'c']
            ]
        );
        assert_eq!(in_turn([1, 2], 1), [2, 1]);
    }
}
