//! A whole-model refit moved for real ([`RefitRun`]): what `reshard refit --run` does, as a
//! library. From a [`Refit`] (every tensor's training and inference layout, the fused buffers
//! of each side, the fp8 tensors of a refit into an fp8 engine) it builds the batch
//! ([`batch_of`]: one schedule for every tensor, the fp8 weights quantized in flight, their
//! scales fused like their weights), fills every tensor, moves it by the batched reshard and by
//! per-tensor gather+broadcast in turn on the same buffers ([`crate::harness`]), checks every
//! destination byte and scale of every repetition against the fill ([`check`]), and reports
//! both methods ([`RefitReport`], serializable).
//!
//! One rank per process: every rank of the job calls [`RefitRun::run`] alike, and rank 0 gets
//! the report. The ranks may be threads that each joined the job on their own (as here, over
//! TCP on this host):
//!
//! ```
//! use reshard_core::layout::LayoutSpec;
//! use reshard_core::{DType, PlanOptions};
//! use reshard_model::{Refit, RefitTensor};
//! use reshard_runtime::harness::Repeat;
//! use reshard_runtime::refit::RefitRun;
//! use reshard_runtime::{JoinOptions, RunOptions, TransportKind, World};
//! use reshard_transport::group::GroupEnv;
//!
//! let layout = |spec: &str, first| LayoutSpec::parse(spec).unwrap().resolve(&[64, 32], DType::Bf16, first).unwrap();
//! // one weight, from TP2 on ranks 0-1 into TP2 by columns on ranks 2-3
//! let refit = Refit {
//!     model: "tiny".into(),
//!     tensors: vec![RefitTensor { name: "w".into(), src: layout("mesh=2 place=S(0)", 0), dst: layout("mesh=2 place=S(1)", 2) }],
//!     src_fused: vec![],
//!     dst_fused: vec![],
//!     train_ranks: 2,
//!     infer_ranks: 2,
//!     infer_base: 2,
//!     infer_engines: vec![vec![2, 3]],
//!     quant: None,
//! };
//! let run = RefitRun::new(&refit, PlanOptions::default(), 0).unwrap();
//! let repeat = Repeat { warmup: 0, iters: 2, verify: true };
//! let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
//! let reports: Vec<_> = std::thread::scope(|s| {
//!     let ranks: Vec<_> = (0..4).map(|rank| {
//!         let run = &run;
//!         s.spawn(move || {
//!             let env = GroupEnv { rank, world: 4, master_addr: "127.0.0.1".into(), master_port: port, token: "doc".into(), host: "here".into() };
//!             let options = JoinOptions { transport: TransportKind::Tcp, ..JoinOptions::default() };
//!             let world = World::join_env(Some(env), options).unwrap();
//!             run.run(&world, repeat, &RunOptions::default()).unwrap()
//!         })
//!     }).collect();
//!     ranks.into_iter().map(|r| r.join().unwrap()).collect()
//! });
//! // rank 0 has the report, the others none
//! let report = reports[0].as_ref().unwrap();
//! assert!(report.verified && reports[1..].iter().all(Option::is_none));
//! assert_eq!(report.dst_bytes, 64 * 32 * 2);
//! assert_eq!(report.reshard.wire_bytes, 64 * 32 * 2);
//! ```

pub mod check;
pub mod delta;
mod rank;
pub mod stage;
#[cfg(test)]
mod tests;

use serde::Serialize;

use crate::batch::baseline::BatchBaseline;
use crate::batch::{Batch, BatchOptions, Fusion, RankBatch, Tensor};
use crate::harness::{Measured, MethodJson, Repeat, compare};
use crate::{RunOptions, World};
use rank::{Method, RankRefit, zeroed_buffers};
use reshard_core::agreement::Fingerprint;
use reshard_core::error::{Error, Field};
use reshard_core::fill::Fill;
use reshard_core::{Layout, PlanOptions, Rank, Side};
use reshard_model::Refit;

/// The batch of a refit's tensors that `keep` takes, with the fused buffers whose members it
/// all takes, and the refit index of each of its tensors. The fp8 weights of a refit into an
/// fp8 engine are quantized in flight, their scales fused like their weights; with
/// `source_dtype`, their destinations hold the source's dtype instead (what
/// gather+broadcast moves when the refit quantizes). Tensors cast into another float dtype
/// keep it either way: the batch's senders cast them as they pack, gather+broadcast's
/// receivers as they keep them.
pub fn batch_of(
    refit: &Refit,
    plan: PlanOptions,
    pack_below: u64,
    keep: impl Fn(usize) -> bool,
    source_dtype: bool,
) -> Result<(Batch, Vec<usize>), Error> {
    let ids: Vec<usize> = (0..refit.tensors.len()).filter(|&i| keep(i)).collect();
    let mut index = vec![None; refit.tensors.len()];
    ids.iter()
        .enumerate()
        .for_each(|(k, &i)| index[i] = Some(k));
    let tensors = ids
        .iter()
        .map(|&i| {
            let t = &refit.tensors[i];
            let dst = match source_dtype && refit.quant_plan(i).is_some() {
                true => Layout::new(
                    t.dst.shape().to_vec(),
                    t.src.dtype(),
                    t.dst.mesh().clone(),
                    t.dst.placements().to_vec(),
                )?,
                false => t.dst.clone(),
            };
            let quant = match source_dtype {
                true => None,
                false => refit.quant_plan(i).cloned(),
            };
            Ok(Tensor {
                quant,
                ..Tensor::new(t.name.clone(), t.src.clone(), dst)
            })
        })
        .collect::<Result<Vec<_>, reshard_core::error::LayoutError>>()
        .map_err(|source| Error::Layout {
            side: Side::Dst,
            source,
        })?;
    let fusion = |side| {
        let index = &index;
        move |f: &reshard_model::Fused| {
            let members: Option<Vec<usize>> = f.members.iter().map(|&m| index[m]).collect();
            members.map(|members| Fusion {
                name: f.name.clone(),
                side,
                dim: f.dim,
                members,
            })
        }
    };
    let fusions = refit
        .src_fused
        .iter()
        .filter_map(fusion(Side::Src))
        .chain(refit.dst_fused.iter().filter_map(fusion(Side::Dst)))
        .collect();
    let batch = Batch::new(
        tensors,
        fusions,
        BatchOptions {
            plan,
            pack_below,
            direct: None,
        },
    )?;
    Ok((batch, ids))
}

/// Every tensor's contents: a hash of the element index, seeded by the tensor's position, so
/// that a block landing in the wrong place, in its own tensor or in another, does not verify.
/// A tensor quantized to fp8 gets finite values of varied magnitude instead (`normal`, also
/// seeded by its position), as the quantizer refuses NaN and infinities.
pub fn fill_of(tensor: usize, quantized: bool) -> Fill {
    let seed = tensor as u64;
    match quantized {
        true => Fill::Normal { seed },
        false => Fill::Hash { seed },
    }
}

/// What `refit --run` reports (the `run` object of the refit JSON).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RefitReport {
    /// The transport the ranks moved over.
    pub transport: String,
    /// Timed repetitions of each method.
    pub iters: u32,
    /// Every repetition of both methods checked on every rank, each check covering every
    /// destination byte and scale.
    pub verified: bool,
    /// Tensors smaller than this many bytes went in packed broadcasts
    /// ([`crate::batch::BatchOptions::pack_below`]).
    pub pack_below: u64,
    /// Bytes of every destination shard, all ranks: what GB/s counts.
    pub dst_bytes: u64,
    /// Into an fp8 engine: bytes of the destinations' scale shards.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_bytes: Option<u64>,
    /// The batched reshard's measurements.
    pub reshard: MethodJson,
    /// Per-tensor gather+broadcast's measurements.
    pub gather_broadcast: MethodJson,
    /// gather+broadcast's median over the reshard's.
    pub speedup: f64,
}

/// A refit ready to run: the batch of every tensor (the fp8 weights quantized in flight),
/// gather+broadcast's (every tensor in its source dtype: the same batch when nothing is
/// quantized), and every tensor's fill.
pub struct RefitRun {
    batch: Batch,
    /// Refit index of each of the batch's tensors.
    ids: Vec<usize>,
    /// Gather+broadcast's own batch, when the refit quantizes.
    full: Option<(Batch, Vec<usize>)>,
    baseline: BatchBaseline,
    /// Every tensor's fill, by refit index.
    fills: Vec<Fill>,
    pack_below: u64,
    /// The inference replicas ([`Refit::replicas`]): what a rolling commit's groups hold.
    replicas: Vec<Vec<Rank>>,
}

impl RefitRun {
    /// Builds both batches of `refit`, planned with `plan`; tensors below `pack_below` bytes
    /// whose source is fully replicated go in one packed broadcast per source rank.
    pub fn new(refit: &Refit, plan: PlanOptions, pack_below: u64) -> Result<RefitRun, Error> {
        let (batch, ids) = batch_of(refit, plan, pack_below, |_| true, false)?;
        let full = match refit.quant.is_some() {
            true => Some(batch_of(refit, plan, pack_below, |_| true, true)?),
            false => None,
        };
        let baseline = BatchBaseline::new(full.as_ref().map_or(&batch, |f| &f.0))?;
        let fills = (0..refit.tensors.len())
            .map(|i| fill_of(i, refit.quant_plan(i).is_some()))
            .collect();
        Ok(RefitRun {
            batch,
            ids,
            full,
            baseline,
            fills,
            pack_below,
            replicas: refit.replicas(),
        })
    }

    /// The commit groups of a rolling commit in `count` groups, each of whole inference
    /// replicas ([`Refit::rolling_groups`]); refused, before any byte moves, naming a
    /// replica that `count` would cut.
    pub fn rolling_groups(&self, count: usize) -> Result<Vec<Vec<Rank>>, Error> {
        reshard_core::rolling::rolling_groups(&self.replicas, count)
    }

    /// The batch the reshard runs.
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Gather+broadcast's batch, and the refit index of each of its tensors.
    fn baseline_batch(&self) -> (&Batch, &[usize]) {
        match &self.full {
            Some((b, ids)) => (b, ids),
            None => (&self.batch, &self.ids),
        }
    }

    /// `fingerprint` with what every rank must run alike: the batch (every tensor's name,
    /// shape, dtype, both layouts and quantization, and the fused buffers, as one digest) and
    /// `--pack-below`.
    pub fn fingerprint(&self, fingerprint: Fingerprint) -> Fingerprint {
        let batch = &self.batch;
        let tensors = batch.tensors().iter().map(|t| {
            let shape: Vec<String> = t.src.shape().iter().map(u64::to_string).collect();
            let scheme = t.quant.as_ref().map(|q| q.quant.scheme.to_string());
            format!(
                "{} {} {} src {} dst {} {} {}",
                t.name,
                shape.join(","),
                t.src.dtype(),
                t.src,
                t.dst,
                t.dst.dtype(),
                scheme.unwrap_or_default()
            )
        });
        let fusions = batch
            .fusions()
            .iter()
            .map(|f| format!("{} {:?} {} {:?}", f.name, f.side, f.dim, f.members));
        fingerprint
            .with("tensors", batch.tensors().len())
            .with_digest("tensor layouts", tensors.chain(fusions))
            .with("--pack-below", self.pack_below)
    }

    /// The bytes of every buffer `rank` holds while running: both batches' and the baseline's
    /// full-tensor buffer (what to check against the memory available first).
    pub fn rank_bytes(&self, rank: Rank) -> Result<u64, Error> {
        let sizes = |rb: &RankBatch| -> u64 {
            let buffers = rb.src.iter().chain(&rb.dst).chain(&rb.scales);
            buffers.map(|b| b.len as u64).sum()
        };
        let mut bytes = sizes(&self.batch.rank_batch(rank)?);
        if let Some((b, _)) = &self.full {
            bytes += sizes(&b.rank_batch(rank)?);
        }
        Ok(bytes + self.baseline.full_bytes(rank) as u64)
    }

    /// Runs this rank's part ([`RefitRun::run_rank`]), then hands its report to rank 0, which
    /// returns the job's ([`RefitRun::report`]); `None` on the other ranks. Every rank of the
    /// job calls it alike; a rank that fails fails them all ([`World::finish`]).
    pub fn run(
        &self,
        world: &World,
        repeat: Repeat,
        options: &RunOptions,
    ) -> Result<Option<RefitReport>, Error> {
        let outcome = self.run_rank(world, repeat, options);
        let reports = world.finish(outcome)?;
        Ok(reports.map(|ranks| self.report(repeat, &ranks)))
    }

    /// This rank's buffers, links and both methods in turn ([`crate::harness::compare`]); returns
    /// the report for rank 0. One rank per process: a world of threads is refused.
    pub fn run_rank(
        &self,
        world: &World,
        repeat: Repeat,
        options: &RunOptions,
    ) -> Result<serde_json::Value, Error> {
        let job = self.job_of(world)?;
        let mut rank = RankRefit::new(self, world, job.rank(), world.exec_options(options))?;
        let found = compare(&mut rank, repeat, Some(job), &mut || {})?;
        let total = |b: &[crate::batch::Buffer]| b.iter().map(|b| b.len as u64).sum::<u64>();
        Ok(serde_json::json!({
            "transport": rank.reshard.as_ref().map_or("?", |t| t.name()),
            "verified": found.verified,
            "dst_bytes": total(&rank.rb.dst),
            "scale_bytes": total(&rank.rb.scales),
            "reshard": found.of(Method::Reshard).report(),
            "gather_broadcast": found.of(Method::GatherBroadcast).report(),
        }))
    }

    /// The job `world` runs this refit in, one rank per process, with ranks enough for it; a
    /// world of threads is refused.
    fn job_of<'w>(&self, world: &'w World) -> Result<&'w dyn reshard_transport::Job, Error> {
        let Some(job) = world.job() else {
            return Err(Error::InvalidOption {
                field: Field::Transport,
                value: world.options().transport.name().into(),
                reason: "a refit runs one rank per process".into(),
            });
        };
        world.check_size(self.batch.world().saturating_sub(1))?;
        Ok(job)
    }

    /// The job's report from every rank's ([`RefitRun::run_rank`]).
    pub fn report(&self, repeat: Repeat, ranks: &[serde_json::Value]) -> RefitReport {
        let sum = |key: &str| -> u64 { ranks.iter().map(|r| r[key].as_u64().unwrap_or(0)).sum() };
        let dst_bytes = sum("dst_bytes");
        let method = |key: &str| {
            let per_rank: Vec<&serde_json::Value> = ranks.iter().map(|r| &r[key]).collect();
            MethodJson::of(&Measured::combine(&per_rank), dst_bytes)
        };
        let (reshard, gather_broadcast) = (method("reshard"), method("gather_broadcast"));
        RefitReport {
            transport: crate::harness::reported_transport(ranks),
            iters: repeat.iters,
            // what every rank's checks covered (a failed one fails the job before this)
            verified: crate::harness::all_verified(ranks),
            pack_below: self.pack_below,
            dst_bytes,
            scale_bytes: self.full.as_ref().map(|_| sum("scale_bytes")),
            speedup: gather_broadcast.median_s / reshard.median_s.max(1e-12),
            reshard,
            gather_broadcast,
        }
    }
}
