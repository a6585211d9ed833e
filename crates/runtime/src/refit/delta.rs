//! A refit as a stream of versions ([`RefitRun::run_delta`]): every tensor evolves by a
//! synthetic training step between versions ([`reshard_core::evolve`]), and each version is
//! moved twice on the same links, by the batch as a delta refit ([`crate::exec::delta`]) and
//! by the batch dense, in turn, each into destinations of its own. Every version of the delta
//! is checked: its unquantized tensors against the evolution, element by element, and every
//! byte and scale against the dense refit of the same version.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::RefitRun;
use super::check::QuantCheck;
use crate::batch::run_rank_batch;
use crate::exec::delta::{DeltaOptions, DeltaRefit, DeltaSession};
use crate::{Links, RunOptions, World};
use reshard_core::Rank;
use reshard_core::error::Error;
use reshard_core::evolve::{Evolution, Update};
use reshard_core::fill::Fill;

/// What a stream of versions is: how many, how the tensors evolve, and the delta's options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaStream {
    /// Versions in the stream; the first moves dense for want of a base.
    pub steps: u64,
    /// How the tensors change from one version to the next.
    pub update: Update,
    /// How the delta refit runs.
    pub options: DeltaOptions,
}

/// One version of a stream, on one rank or (combined) on all.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VersionReport {
    /// The version moved.
    pub version: u64,
    /// The slowest rank's seconds for the delta refit.
    pub delta_s: f64,
    /// The slowest rank's seconds for the dense refit.
    pub dense_s: f64,
    /// Bytes on the wire of the delta refit: its values, fences and headers.
    pub delta_wire_bytes: u64,
    /// Bytes on the wire of the dense refit: its values.
    pub dense_wire_bytes: u64,
    /// Elements of the transfers sent as deltas.
    pub elems: u64,
    /// Of those elements, the ones that changed.
    pub changed: u64,
    /// Destination ranks sent something dense, and why.
    pub dense_to: Vec<(Rank, String)>,
}

/// What `refit --run --delta` reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeltaRefitReport {
    /// The transport the ranks moved over.
    pub transport: String,
    /// Versions in the stream.
    pub steps: u64,
    /// How the tensors evolved, as [`Update`] prints it.
    pub update: String,
    /// Every version checked on every rank.
    pub verified: bool,
    /// Each version, every rank's report combined.
    pub versions: Vec<VersionReport>,
    /// The most bytes one rank keeps between versions for the delta (its bases).
    pub base_bytes_per_rank: u64,
    /// After the first version: the dense refits' total time over the deltas'.
    pub speedup: f64,
    /// After the first version: the dense refits' wire bytes over the deltas'.
    pub wire_ratio: f64,
}

impl RefitRun {
    /// Runs a stream of versions ([`DeltaStream`]) on this rank, then hands its report to
    /// rank 0, which returns the job's. Every rank of the job calls it alike.
    pub fn run_delta(
        &self,
        world: &World,
        stream: &DeltaStream,
        options: &RunOptions,
    ) -> Result<Option<DeltaRefitReport>, Error> {
        let outcome = self.run_delta_rank(world, stream, options);
        let reports = world.finish(outcome)?;
        Ok(reports.map(|ranks| self.delta_report(stream, &ranks)))
    }

    /// Every tensor's evolution: the refit's own fill under `update` (a training-like update
    /// steps f32 masters drawn from normal values).
    pub(super) fn evolutions(&self, update: Update) -> Result<Vec<Evolution>, Error> {
        let mut out = Vec::new();
        for (i, &fill) in self.fills.iter().enumerate() {
            let fill = match update {
                Update::Training { .. } => Fill::Normal { seed: i as u64 },
                Update::Density(_) => fill,
            };
            let dtype = self
                .batch
                .tensors()
                .iter()
                .zip(&self.ids)
                .find(|(_, id)| **id == i)
                .map_or(reshard_core::DType::F32, |(t, _)| t.src.dtype());
            out.push(Evolution::new(fill, update, 0x5eed ^ i as u64, dtype)?);
        }
        Ok(out)
    }

    /// This rank's part of the stream; returns its report for rank 0.
    pub fn run_delta_rank(
        &self,
        world: &World,
        stream: &DeltaStream,
        options: &RunOptions,
    ) -> Result<serde_json::Value, Error> {
        let job = self.job_of(world)?;
        stream.options.validate()?;
        let rank = job.rank();
        let batch = &self.batch;
        let rb = batch.rank_batch(rank)?;
        let evolutions = self.evolutions(stream.update)?;
        let zeroed = |bufs: &[crate::batch::Buffer]| super::zeroed_buffers(rank, bufs);
        let mut src = zeroed(&rb.src)?;
        let (mut delta_dst, mut dense_dst) = (zeroed(&rb.dst)?, zeroed(&rb.dst)?);
        let mut delta_scales = QuantCheck::scale_buffers(&rb)?;
        let mut dense_scales = QuantCheck::scale_buffers(&rb)?;
        let layouts = batch.tensors().iter().map(|t| &t.src);
        let transport = world.connect(&Links::of_batch(&rb), layouts, None)?;
        let session = DeltaSession::new();
        let mut versions = Vec::new();
        for version in 1..=stream.steps {
            self.fill_version(&rb, &mut src, &evolutions, version);
            let mut report = VersionReport {
                version,
                ..VersionReport::default()
            };
            // the two methods in turn, their order alternating
            for delta in [version % 2 == 0, version % 2 == 1] {
                let mut run = world.exec_options(options);
                run.delta = delta.then(|| DeltaRefit {
                    session: session.clone(),
                    version,
                    options: stream.options,
                });
                let (dst, scales) = match delta {
                    true => (&mut delta_dst, &mut delta_scales),
                    false => (&mut dense_dst, &mut dense_scales),
                };
                let srcs: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
                let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
                let mut scales: Vec<&mut [u8]> = scales.iter_mut().map(Vec::as_mut_slice).collect();
                world.barrier()?;
                let started = Instant::now();
                let stats =
                    run_rank_batch(batch, &rb, &srcs, &mut dsts, &mut scales, &*transport, &run)?;
                let seconds = started.elapsed().as_secs_f64();
                match delta {
                    true => report.delta_s = seconds,
                    false => {
                        report.dense_s = seconds;
                        report.dense_wire_bytes = stats.bytes_sent;
                    }
                }
            }
            for r in session.take_reports() {
                report.delta_wire_bytes += r.wire_bytes();
                report.elems += r.sent.elems;
                report.changed += r.sent.changed;
                for &(to, d) in &r.dense_to {
                    report.dense_to.push((to, d.to_string()));
                }
            }
            // every byte and scale as the dense refit left them, and the values as they evolve
            if delta_dst != dense_dst || delta_scales != dense_scales {
                return Err(Error::Internal {
                    rank,
                    detail: format!(
                        "version {version}: the delta refit left other bytes than the dense one"
                    ),
                });
            }
            self.verify_version(&rb, &delta_dst, &evolutions, version)?;
            versions.push(report);
        }
        Ok(serde_json::json!({
            "transport": transport.name(),
            // every version was checked: a difference fails the rank
            "verified": true,
            "versions": versions,
            "base_bytes": session.base_bytes(),
        }))
    }

    /// Fills this rank's source buffers `src` with `version` of every tensor.
    pub(super) fn fill_version(
        &self,
        rb: &crate::batch::RankBatch,
        src: &mut [Vec<u8>],
        evolutions: &[Evolution],
        version: u64,
    ) {
        for (buffer, bytes) in rb.src.iter().zip(src) {
            for p in &buffer.pieces {
                let layout = &self.batch.tensors()[p.tensor].src;
                let piece = &mut bytes[p.bytes.clone()];
                evolutions[self.ids[p.tensor]].fill_region(layout, &p.region, piece, version);
            }
        }
    }

    /// Checks this rank's destination buffers `dst` against `version` of every unquantized
    /// tensor, element by element.
    pub(super) fn verify_version(
        &self,
        rb: &crate::batch::RankBatch,
        dst: &[Vec<u8>],
        evolutions: &[Evolution],
        version: u64,
    ) -> Result<(), Error> {
        for (buffer, bytes) in rb.dst.iter().zip(dst) {
            for p in &buffer.pieces {
                let t = &self.batch.tensors()[p.tensor];
                if t.quant.is_some() {
                    continue;
                }
                let piece = bytes.get(p.bytes.clone()).unwrap_or_default();
                evolutions[self.ids[p.tensor]].verify_region_from(
                    t.src.dtype(),
                    &t.dst,
                    &p.region,
                    piece,
                    (rb.rank, p.bytes.start as u64),
                    version,
                )?;
            }
        }
        Ok(())
    }

    /// The job's report from every rank's ([`RefitRun::run_delta_rank`]).
    pub fn delta_report(
        &self,
        stream: &DeltaStream,
        ranks: &[serde_json::Value],
    ) -> DeltaRefitReport {
        let per_rank: Vec<Vec<VersionReport>> = ranks
            .iter()
            .map(|r| serde_json::from_value(r["versions"].clone()).unwrap_or_default())
            .collect();
        let mut versions: Vec<VersionReport> = Vec::new();
        for v in 0..stream.steps as usize {
            let mut all = VersionReport {
                version: v as u64 + 1,
                ..VersionReport::default()
            };
            for r in per_rank.iter().filter_map(|p| p.get(v)) {
                all.delta_s = all.delta_s.max(r.delta_s);
                all.dense_s = all.dense_s.max(r.dense_s);
                all.delta_wire_bytes += r.delta_wire_bytes;
                all.dense_wire_bytes += r.dense_wire_bytes;
                all.elems += r.elems;
                all.changed += r.changed;
                all.dense_to.extend(r.dense_to.iter().cloned());
            }
            all.dense_to.sort();
            all.dense_to.dedup();
            versions.push(all);
        }
        let later = versions.iter().skip(1);
        let (delta_s, dense_s): (f64, f64) = later
            .clone()
            .map(|v| (v.delta_s, v.dense_s))
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
        let (delta_b, dense_b): (u64, u64) = later
            .map(|v| (v.delta_wire_bytes, v.dense_wire_bytes))
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y));
        DeltaRefitReport {
            transport: crate::harness::reported_transport(ranks),
            steps: stream.steps,
            update: stream.update.to_string(),
            verified: crate::harness::all_verified(ranks),
            versions,
            base_bytes_per_rank: ranks
                .iter()
                .map(|r| r["base_bytes"].as_u64().unwrap_or(0))
                .max()
                .unwrap_or(0),
            speedup: dense_s / delta_s.max(1e-12),
            wire_ratio: dense_b as f64 / delta_b.max(1) as f64,
        }
    }
}
