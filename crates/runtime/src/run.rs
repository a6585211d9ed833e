//! Running this process's rank(s) of a plan or a batch: one call each, over the links the
//! world opens.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{AnyTransport, Links, RunOptions, World};
use crate::batch::{Batch, RankBatch, run_local_batch, run_rank_batch};
use crate::exec::baseline::{self, BaselineJob};
use crate::exec::{self, RankJob, RankStats, RunStats};
use reshard_core::dtype::DType;
use reshard_core::error::{Dims, Error, Field, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{GatherBroadcast, Plan, QuantizedMove, RankPlan};
use reshard_core::region::Region;
use reshard_transport::Job;
use reshard_transport::segment::SharedBuffer;

/// This process's rank of a plan between processes, and its part of it.
struct Own<'a> {
    plan: &'a Plan,
    mine: &'a RankPlan,
    rank: Rank,
}

impl Own<'_> {
    /// Runs the rank's part over `transport` (quantizing with `quant`), from its source shard
    /// in `sources` into its destination shard in `destinations`.
    fn run<T>(
        &self,
        sources: &BTreeMap<Rank, Vec<u8>>,
        destinations: &mut BTreeMap<Rank, Vec<u8>>,
        quant: Option<crate::exec::QuantJob<'_, '_>>,
        transport: &T,
        options: &crate::exec::ExecOptions,
    ) -> Result<RunStats>
    where
        T: for<'b> reshard_transport::Transport<'b> + ?Sized,
    {
        let (plan, rank) = (self.plan, self.rank);
        let (src_box, dst_box) = (plan.src().local_region(rank), plan.dst().local_region(rank));
        let started = Instant::now();
        let work = RankJob {
            quant,
            plan: self.mine,
            src_layout: plan.src(),
            dst_dtype: plan.dst().dtype(),
            src: src_box.as_ref().zip(sources.get(&rank).map(Vec::as_slice)),
            dst: dst_box
                .as_ref()
                .zip(destinations.get_mut(&rank).map(Vec::as_mut_slice)),
        };
        let stats = exec::run_rank_any(work, transport, options)?;
        Ok(RunStats {
            elapsed: started.elapsed(),
            ranks: vec![stats],
        })
    }
}

impl Links {
    /// The peers of one rank's part of a plan.
    pub fn of_plan(plan: &RankPlan) -> Links {
        Links {
            senders: plan.senders(),
            receivers: plan.receivers(),
        }
    }

    /// The peers of one rank's parts of several plans run on the same links (the phases of
    /// gather+broadcast).
    pub fn of_plans<'a>(plans: impl IntoIterator<Item = &'a RankPlan>) -> Links {
        let mut links = Links::default();
        for p in plans {
            links.senders.extend(p.senders());
            links.receivers.extend(p.receivers());
        }
        links
    }

    /// The peers of one rank's part of a batch: its moves' and its partial amax exchanges'.
    pub fn of_batch(rb: &RankBatch) -> Links {
        let mut links = Links::default();
        for m in rb.moves.iter().chain(&rb.amax).filter(|m| m.from != m.to) {
            if m.to == rb.rank {
                links.senders.insert(m.from);
            } else {
                links.receivers.insert(m.to);
            }
        }
        links
    }
}

impl World {
    /// Runs `plan` for this process's ranks: `sources` and `destinations` hold the shards of
    /// the ranks it runs ([`World::ranks`]: every rank's between threads, its own between
    /// processes), checked before any byte moves; the destinations are written in place.
    /// Every rank of the job calls it alike. Returns the stats of this process's ranks.
    pub fn run(
        &self,
        plan: &Plan,
        sources: &BTreeMap<Rank, Vec<u8>>,
        destinations: &mut BTreeMap<Rank, Vec<u8>>,
        options: &RunOptions,
    ) -> Result<RunStats> {
        let exec_options = self.exec_options(options);
        if let Some(q) = plan.quant() {
            return Err(Error::InvalidOption {
                field: Field::Quant,
                value: q.quant.scheme.to_string(),
                reason: "a quantizing plan writes scales too: run it with World::run_quantized"
                    .into(),
            });
        }
        let Some(job) = self.job() else {
            return exec::run_local(plan, sources, destinations, &exec_options);
        };
        exec_options.validate()?;
        let rank = job.rank();
        check_own(plan.src(), Side::Src, rank, sources)?;
        check_own(plan.dst(), Side::Dst, rank, destinations)?;
        let mine = plan.rank_part(rank);
        let transport = self.connect(&Links::of_plan(&mine), [plan.src()], None)?;
        let own = Own {
            plan,
            mine: &mine,
            rank,
        };
        own.run(sources, destinations, None, &*transport, &exec_options)
    }

    /// [`World::run`] of a quantizing plan ([`Plan::quantized`]): `destinations` receive the
    /// fp8 values and `scales` the scale shards of the destination ranks this process runs
    /// ([`exec::zeroed_scale_shards`] between threads; between processes, this rank's of
    /// [`reshard_core::plan::QuantPlan::dst_scale_bytes`]), row-major in the scale dtype. The source
    /// ranks that share a block exchange their partial amax first, on the same links. Every
    /// rank of the job calls it alike. A plan that does not quantize is refused.
    pub fn run_quantized(
        &self,
        plan: &Plan,
        sources: &BTreeMap<Rank, Vec<u8>>,
        destinations: &mut BTreeMap<Rank, Vec<u8>>,
        scales: &mut BTreeMap<Rank, Vec<u8>>,
        options: &RunOptions,
    ) -> Result<RunStats> {
        let exec_options = self.exec_options(options);
        let Some(q) = plan.quant() else {
            return Err(Error::InvalidOption {
                field: Field::Quant,
                value: "none".into(),
                reason: "the plan does not quantize: run it with World::run".into(),
            });
        };
        let Some(job) = self.job() else {
            return exec::run_local_quantized(plan, sources, destinations, scales, &exec_options);
        };
        exec_options.validate()?;
        let rank = job.rank();
        check_own(plan.src(), Side::Src, rank, sources)?;
        check_own(plan.dst(), Side::Dst, rank, destinations)?;
        check_own_scales(plan, q, rank, scales)?;
        let mine = plan.rank_part(rank);
        let part = q.for_rank(plan.src(), plan.dst(), &mine);
        let mut stage = vec![0u8; part.stage_bytes(q.scale_bytes())];
        let mut links = Links::of_plan(&mine);
        links.senders.extend(part.amax_peers());
        links.receivers.extend(part.amax_peers());
        // the scales travel as transfers of their own: same-host senders use rings
        let transport = self.connect(&links, [plan.src()], None)?;
        let quant = crate::exec::QuantJob {
            tensor: "tensor",
            plan: q,
            rank: &part,
            stage: &mut stage,
            scales: scales.get_mut(&rank).map(Vec::as_mut_slice),
        };
        let own = Own {
            plan,
            mine: &mine,
            rank,
        };
        own.run(
            sources,
            destinations,
            Some(quant),
            &*transport,
            &exec_options,
        )
    }

    /// Runs `batch` (a whole-model refit) for this process's ranks: `sources` and
    /// `destinations` hold their buffers in the order of [`Batch::buffers`]. Every rank of
    /// the job calls it alike. Returns the stats of this process's ranks. A batch that
    /// quantizes writes scales too, and is refused: [`World::run_batch_quantized`] runs it.
    pub fn run_batch(
        &self,
        batch: &Batch,
        sources: &BTreeMap<Rank, Vec<Vec<u8>>>,
        destinations: &mut BTreeMap<Rank, Vec<Vec<u8>>>,
        options: &RunOptions,
    ) -> Result<RunStats> {
        let quantized = batch
            .tensors()
            .iter()
            .find_map(|t| Some((t, t.quant.as_ref()?)));
        if let Some((t, q)) = quantized {
            return Err(Error::InvalidOption {
                field: Field::Quant,
                value: q.quant.scheme.to_string(),
                reason: format!(
                    "the batch quantizes `{}`, which writes scales too: run it with World::run_batch_quantized",
                    t.name
                ),
            });
        }
        self.run_batch_quantized(batch, sources, destinations, &mut BTreeMap::new(), options)
    }

    /// [`World::run_batch`] of a batch with quantized tensors: `scales` holds the scale
    /// buffers of this process's ranks in the order of [`Batch::scale_buffers`] (fused like
    /// their weights), written in place like the destinations. The quantized tensors' source
    /// ranks exchange partial amax first, on the same links, then every value and scale moves
    /// in one schedule ([`crate::batch::quant`]).
    pub fn run_batch_quantized(
        &self,
        batch: &Batch,
        sources: &BTreeMap<Rank, Vec<Vec<u8>>>,
        destinations: &mut BTreeMap<Rank, Vec<Vec<u8>>>,
        scales: &mut BTreeMap<Rank, Vec<Vec<u8>>>,
        options: &RunOptions,
    ) -> Result<RunStats> {
        let exec_options = self.exec_options(options);
        let Some(job) = self.job() else {
            return run_local_batch(batch, sources, destinations, scales, &exec_options);
        };
        exec_options.validate()?;
        let rank = job.rank();
        self.check_size(batch.world().saturating_sub(1))?;
        let rb = batch.rank_batch(rank)?;
        let layouts = batch.tensors().iter().map(|t| &t.src);
        let transport = self.connect(&Links::of_batch(&rb), layouts, None)?;
        let started = Instant::now();
        fn mine(m: &mut BTreeMap<Rank, Vec<Vec<u8>>>, rank: Rank) -> Vec<&mut [u8]> {
            m.get_mut(&rank)
                .map(|b| b.iter_mut().map(Vec::as_mut_slice).collect())
                .unwrap_or_default()
        }
        let src: Vec<&[u8]> = sources
            .get(&rank)
            .map(|b| b.iter().map(Vec::as_slice).collect())
            .unwrap_or_default();
        let (mut dst, mut scale) = (mine(destinations, rank), mine(scales, rank));
        let stats = run_rank_batch(
            batch,
            &rb,
            &src,
            &mut dst,
            &mut scale,
            &*transport,
            &exec_options,
        )?;
        Ok(RunStats {
            elapsed: started.elapsed(),
            ranks: vec![stats],
        })
    }

    /// Moves an already-quantized tensor ([`QuantizedMove`]): its fp8 values and its scales
    /// in one exchange, as the batch [`QuantizedMove::batch`] (one schedule, one stream per
    /// peer pair, the scales right behind the values), not as two reshards one after the
    /// other. `sources` and `destinations` hold, for each rank this process runs that holds a
    /// shard ([`World::ranks`]), its buffers `[values, scales]` (indices
    /// [`QuantizedMove::VALUES`] and [`QuantizedMove::SCALES`]), each of its shard's exact
    /// size, checked before any byte moves, naming the buffer; between processes, buffers of
    /// other ranks are refused. Every rank of the job calls it alike. Returns the stats of
    /// this process's ranks: the bytes of both tensors.
    ///
    /// ```no_run
    /// use std::collections::BTreeMap;
    /// use reshard_core::layout::LayoutSpec;
    /// use reshard_core::plan::{QuantRequest, QuantizedMove};
    /// use reshard_runtime::{JoinOptions, RunOptions, World};
    /// use reshard_core::{DType, PlanOptions, Rank};
    /// let layout = |spec: &str, first| {
    ///     LayoutSpec::parse(spec).unwrap().resolve(&[256, 256], DType::Fp8E4M3, first).unwrap()
    /// };
    /// let request = QuantRequest { scheme: "block:128x128".parse().unwrap(), scale_dtype: None };
    /// let mv = QuantizedMove::new(
    ///     layout("mesh=2 place=S(0)", 0),
    ///     layout("mesh=2 place=S(1)", 2),
    ///     PlanOptions::default(),
    ///     request,
    /// )
    /// .unwrap();
    /// let world = World::join(JoinOptions::default()).unwrap();
    /// // [values, scales] of each rank this process runs: the source's to send, zeros to fill
    /// let buffers = |values: &reshard_core::Layout, scales: &reshard_core::Layout| -> BTreeMap<Rank, Vec<Vec<u8>>> {
    ///     world
    ///         .ranks(values)
    ///         .map(|r| {
    ///             let zeroed = |l: &reshard_core::Layout| vec![0u8; l.local_bytes(r) as usize];
    ///             (r, vec![zeroed(values), zeroed(scales)])
    ///         })
    ///         .collect()
    /// };
    /// let sources = buffers(mv.values.src(), mv.scales.src());
    /// let mut dests = buffers(mv.values.dst(), mv.scales.dst());
    /// world.run_quantized_move(&mv, &sources, &mut dests, &RunOptions::default()).unwrap();
    /// ```
    pub fn run_quantized_move(
        &self,
        mv: &QuantizedMove,
        sources: &BTreeMap<Rank, Vec<Vec<u8>>>,
        destinations: &mut BTreeMap<Rank, Vec<Vec<u8>>>,
        options: &RunOptions,
    ) -> Result<RunStats> {
        if let Some(rank) = self.rank() {
            for (side, buffers) in [(Side::Src, sources), (Side::Dst, &*destinations)] {
                if let Some(&other) = buffers.keys().find(|&&r| r != rank) {
                    return Err(Error::UnexpectedBuffer { side, rank: other });
                }
            }
        }
        self.run_batch(&Batch::quantized(mv)?, sources, destinations, options)
    }

    /// Moves `plan`'s tensor the way [`World::run`] does, by the baseline instead: the source
    /// gathered whole on one replica's ranks, then broadcast whole to every destination rank,
    /// each keeping its box ([`GatherBroadcast`]). `sources` are lent to the gather between
    /// threads, and back in place on return, also on error. For comparisons: it moves far
    /// more bytes than the plan.
    pub fn run_gather_broadcast(
        &self,
        plan: &Plan,
        sources: &mut BTreeMap<Rank, Vec<u8>>,
        destinations: &mut BTreeMap<Rank, Vec<u8>>,
        options: &RunOptions,
    ) -> Result<RunStats> {
        let exec_options = self.exec_options(options);
        let gb = GatherBroadcast::on_hosts(plan.src(), plan.dst(), plan.topology())?;
        let Some(job) = self.job() else {
            let mut full = baseline::full_buffers(&gb)?;
            return baseline::run_local_gather_broadcast(
                &gb,
                sources,
                destinations,
                &mut full,
                &exec_options,
            );
        };
        exec_options.validate()?;
        let rank = job.rank();
        check_own(plan.src(), Side::Src, rank, sources)?;
        check_own(plan.dst(), Side::Dst, rank, destinations)?;
        let (gather, broadcast) = gb.rank_parts(rank);
        let links = Links::of_plans([&gather, &broadcast].into_iter().flatten());
        let transport = self.connect(&links, [plan.src()], None)?;
        let mut full = match gb.needs_full_buffer(rank) {
            true => Some(reshard_core::memory::zeroed(
                gb.dst().total_bytes(),
                || format!("rank {rank}'s full tensor"),
            )?),
            false => None,
        };
        let (src_box, dst_box) = (plan.src().local_region(rank), plan.dst().local_region(rank));
        let started = Instant::now();
        let work = BaselineJob {
            baseline: &gb,
            gather: gather.as_ref(),
            broadcast: broadcast.as_ref(),
            src: src_box.as_ref().zip(sources.get(&rank).map(Vec::as_slice)),
            full: full.as_deref_mut(),
            dst: dst_box
                .as_ref()
                .zip(destinations.get_mut(&rank).map(Vec::as_mut_slice)),
        };
        let stats = baseline::run_rank_gather_broadcast(rank, work, &*transport, &exec_options)?;
        Ok(RunStats {
            elapsed: started.elapsed(),
            ranks: vec![stats],
        })
    }

    /// Opens this rank's links for `plan` and its destination shard in shared memory (so
    /// that same-host senders write straight into it), for running the plan again and again
    /// on the same links ([`PlanRank::run`]). For processes only: between threads it is an
    /// error, as [`World::connect`] says. Every rank of the job calls it alike.
    pub fn prepare(&self, plan: &Plan) -> Result<PlanRank<'_>> {
        let job = self.job();
        let rank = job.map_or(0, Job::rank);
        let mine = plan.rank_part(rank);
        let src_box = plan.src().local_region(rank);
        let dst_box = plan.dst().local_region(rank);
        let shard = match &dst_box {
            Some(_) => Some(SharedBuffer::new(plan.dst().local_bytes(rank) as usize)?),
            None => None,
        };
        let quant = plan.quant().map(|q| {
            let part = q.for_rank(plan.src(), plan.dst(), &mine);
            RankQuant {
                stage: vec![0u8; part.stage_bytes(q.scale_bytes())],
                scales: dst_box
                    .as_ref()
                    .map(|_| vec![0u8; q.dst_scale_bytes(plan.dst(), rank) as usize]),
                plan: q.clone(),
                part,
            }
        });
        let mut links = Links::of_plan(&mine);
        if let Some(q) = &quant {
            links.senders.extend(q.part.amax_peers());
            links.receivers.extend(q.part.amax_peers());
        }
        // same-host senders write the values straight into the shard, quantizing as they
        // write; what lands beside it (partial amax, scales) takes the rings, each chunk
        // marked by the executor ([`reshard_transport::Lands`]). A rank whose part relays keeps
        // rings, as before: its rounds mix hops into its staging with legs into its shard,
        // a mix checked over rings only.
        let destination = dst_box
            .as_ref()
            .and_then(|b| shard.as_ref().map(|s| (s, b)))
            .filter(|_| !mine.relays());
        let transport = self.connect(&links, [plan.src()], destination)?;
        Ok(PlanRank {
            world: self,
            rank,
            plan: mine,
            src_layout: plan.src().clone(),
            dst_dtype: plan.dst().dtype(),
            src_box,
            dst_box,
            shard,
            transport,
            quant,
        })
    }
}

/// A prepared rank's quantization: its part of the plan, its staging, its scale shard.
struct RankQuant {
    plan: reshard_core::plan::QuantPlan,
    part: reshard_core::plan::QuantRankPlan,
    stage: Vec<u8>,
    scales: Option<Vec<u8>>,
}

/// One rank's part of a plan with its links open and its destination shard in shared memory
/// ([`World::prepare`]), to run as many times as wanted.
pub struct PlanRank<'w> {
    world: &'w World,
    rank: Rank,
    plan: RankPlan,
    /// Where every sender's shard lies.
    src_layout: Layout,
    /// What the destination holds: the senders convert to it.
    dst_dtype: DType,
    src_box: Option<Region>,
    dst_box: Option<Region>,
    shard: Option<SharedBuffer>,
    transport: AnyTransport<'w>,
    quant: Option<RankQuant>,
}

impl PlanRank<'_> {
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The transport the links run over (`tcp`, `shm`, `mpi`).
    pub fn transport_name(&self) -> &'static str {
        self.transport.name()
    }

    /// This rank's box of the destination, if it is a destination.
    pub fn destination_box(&self) -> Option<&Region> {
        self.dst_box.as_ref()
    }

    /// This rank's destination shard, if it is a destination.
    pub fn destination(&self) -> Option<&[u8]> {
        self.shard.as_deref()
    }

    /// This rank's scale shard, if the plan quantizes and it is a destination.
    pub fn scales(&self) -> Option<&[u8]> {
        self.quant.as_ref().and_then(|q| q.scales.as_deref())
    }

    /// This rank's scale shard, to write before a run.
    pub fn scales_mut(&mut self) -> Option<&mut [u8]> {
        self.quant.as_mut().and_then(|q| q.scales.as_deref_mut())
    }

    /// This rank's destination shard, to write before a run (a pattern, to see what the run
    /// moved).
    pub fn destination_mut(&mut self) -> Option<&mut [u8]> {
        self.shard.as_deref_mut()
    }

    /// Runs the rank's part once with `source`, this rank's source shard if it is a source.
    /// It does not wait for the other ranks first: a
    /// caller that times runs calls [`World::barrier`] before, so that every rank starts
    /// together.
    pub fn run(&mut self, source: Option<&[u8]>, options: &RunOptions) -> Result<RankStats> {
        let exec_options = self.world.exec_options(options);
        exec_options.validate()?;
        let expected = self.src_layout.local_bytes(self.rank);
        match (&self.src_box, source) {
            (Some(_), None) => {
                return Err(Error::MissingBuffer {
                    side: Side::Src,
                    rank: self.rank,
                });
            }
            (None, Some(_)) => {
                return Err(Error::UnexpectedBuffer {
                    side: Side::Src,
                    rank: self.rank,
                });
            }
            (Some(b), Some(s)) if s.len() as u64 != expected => {
                return Err(Error::BufferSize {
                    side: Side::Src,
                    rank: self.rank,
                    extent: Dims(b.extent.clone()),
                    expected,
                    got: s.len() as u64,
                });
            }
            _ => {}
        }
        let work = RankJob {
            quant: self.quant.as_mut().map(|q| crate::exec::QuantJob {
                tensor: "tensor",
                plan: &q.plan,
                rank: &q.part,
                stage: &mut q.stage,
                scales: q.scales.as_deref_mut(),
            }),
            plan: &self.plan,
            src_layout: &self.src_layout,
            dst_dtype: self.dst_dtype,
            src: self.src_box.as_ref().zip(source),
            dst: self.dst_box.as_ref().zip(self.shard.as_deref_mut()),
        };
        exec::run_rank_any(work, &*self.transport, &exec_options)
    }
}

/// Checks that `rank`, one rank of a job, has a scale shard of exactly its size when it is
/// a destination of the quantizing `plan`, and none otherwise.
fn check_own_scales(
    plan: &Plan,
    q: &reshard_core::plan::QuantPlan,
    rank: Rank,
    scales: &BTreeMap<Rank, Vec<u8>>,
) -> Result<()> {
    if let Some(&other) = scales.keys().find(|&&r| r != rank) {
        return Err(Error::UnexpectedBuffer {
            side: Side::Dst,
            rank: other,
        });
    }
    match (q.dst_scale_box(plan.dst(), rank), scales.get(&rank)) {
        (Some(blocks), Some(buf)) => {
            let expected = q.dst_scale_bytes(plan.dst(), rank);
            if buf.len() as u64 != expected {
                return Err(Error::BufferSize {
                    side: Side::Dst,
                    rank,
                    extent: Dims(blocks.extent),
                    expected,
                    got: buf.len() as u64,
                });
            }
            Ok(())
        }
        (Some(_), None) => Err(Error::MissingBuffer {
            side: Side::Dst,
            rank,
        }),
        (None, Some(_)) => Err(Error::UnexpectedBuffer {
            side: Side::Dst,
            rank,
        }),
        (None, None) => Ok(()),
    }
}

/// Checks that `rank`, one rank of a job, has a buffer of exactly its shard's size when
/// `layout` holds it, and none otherwise; buffers of other ranks are not this process's.
pub(super) fn check_own(
    layout: &Layout,
    side: Side,
    rank: Rank,
    buffers: &BTreeMap<Rank, Vec<u8>>,
) -> Result<()> {
    if let Some(&other) = buffers.keys().find(|&&r| r != rank) {
        return Err(Error::UnexpectedBuffer { side, rank: other });
    }
    match (layout.local_region(rank), buffers.get(&rank)) {
        (Some(region), Some(buf)) => {
            let expected = layout.local_bytes(rank);
            if buf.len() as u64 != expected {
                return Err(Error::BufferSize {
                    side,
                    rank,
                    extent: Dims(region.extent),
                    expected,
                    got: buf.len() as u64,
                });
            }
            Ok(())
        }
        (Some(_), None) => Err(Error::MissingBuffer { side, rank }),
        (None, Some(_)) => Err(Error::UnexpectedBuffer { side, rank }),
        (None, None) => Ok(()),
    }
}
