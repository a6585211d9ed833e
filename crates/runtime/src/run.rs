//! Running this process's rank(s) of a plan or a batch: one call each, over the links the
//! world opens. Every call lowers its job to the programs of this process's ranks and runs
//! them with [`World::run_programs`].

use std::collections::BTreeMap;
use std::time::Instant;

use std::borrow::Cow;

use super::{Links, RunOptions, World};
use crate::batch::lower::lower_batch;
use crate::batch::{Batch, RankBatch, check_all, run_local_batch};
use crate::exec::baseline;
use crate::exec::driver::RankRun;
use crate::exec::lower::{BaselineParts, Slot, lower_gather_broadcast};
use crate::exec::program::{Buf, Program};
use crate::exec::{self, ExecOptions, RankJob, RunStats};
use reshard_core::error::{Dims, Error, Field, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{GatherBroadcast, Plan, QuantizedMove, RankPlan};
use reshard_core::region::Region;

impl Links {
    /// The peers of one rank's program: every rank it sends to or receives from in any
    /// phase.
    pub fn of_program(program: &Program<'_>) -> Links {
        let (senders, receivers) = program.peers();
        Links { senders, receivers }
    }

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
    /// Runs this process's ranks' programs (every kind of move takes this path): between
    /// threads, every rank's, by the one driver ([`exec::driver::run_threads`]); between
    /// processes, this rank's own, over links opened to the peers its program names
    /// ([`Links::of_program`]). `layouts` are every tensor the links will move. Every rank of
    /// the job calls it alike. Returns the stats of this process's ranks.
    pub(crate) fn run_programs<'l>(
        &self,
        runs: Vec<RankRun<'_, '_>>,
        layouts: impl IntoIterator<Item = &'l Layout>,
        options: &ExecOptions,
    ) -> Result<RunStats> {
        let Some(rank) = self.rank() else {
            return exec::driver::run_threads(runs, options, &[]);
        };
        let mut runs = runs.into_iter();
        let (Some(mut own), None) = (runs.next(), runs.next()) else {
            return Err(Error::Internal {
                rank,
                detail: "a rank of a job between processes runs one program: its own".into(),
            });
        };
        if own.program.rank != rank {
            return Err(Error::Internal {
                rank,
                detail: format!("given the program of rank {}", own.program.rank),
            });
        }
        let transport = self.connect(&Links::of_program(&own.program), layouts, None)?;
        let started = Instant::now();
        let stats = exec::run_program(&own.program, &own.src, &mut own.dst, &*transport, options)?;
        Ok(RunStats {
            elapsed: started.elapsed(),
            ranks: vec![stats],
        })
    }

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
        self.run_own(plan, &mine, sources, destinations, None, &exec_options)
    }

    /// Runs this rank's part `mine` of `plan` between processes: lowered, then run over the
    /// links its program names.
    fn run_own(
        &self,
        plan: &Plan,
        mine: &RankPlan,
        sources: &BTreeMap<Rank, Vec<u8>>,
        destinations: &mut BTreeMap<Rank, Vec<u8>>,
        quant: Option<crate::exec::QuantJob<'_, '_>>,
        options: &ExecOptions,
    ) -> Result<RunStats> {
        let rank = mine.rank;
        let (src_box, dst_box) = (plan.src().local_region(rank), plan.dst().local_region(rank));
        let job = RankJob {
            quant,
            plan: mine,
            src_layout: plan.src(),
            dst_dtype: plan.dst().dtype(),
            src: src_box.as_ref().zip(sources.get(&rank).map(Vec::as_slice)),
            dst: dst_box
                .as_ref()
                .zip(destinations.get_mut(&rank).map(Vec::as_mut_slice)),
        };
        let program = job.program(options)?;
        let mut dst = vec![job.dst.map_or(&mut [][..], |d| d.1)];
        dst.extend(job.quant.and_then(|q| q.scales));
        let run = RankRun {
            program,
            src: job.src.map(|s| s.1).into_iter().collect(),
            dst,
        };
        // the scales travel as transfers of their own: same-host senders use rings
        self.run_programs(vec![run], [plan.src()], options)
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
        let quant = crate::exec::QuantJob {
            tensor: "tensor",
            plan: q,
            rank: &part,
            stage: &mut stage,
            scales: scales.get_mut(&rank).map(Vec::as_mut_slice),
        };
        self.run_own(
            plan,
            &mine,
            sources,
            destinations,
            Some(quant),
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
        fn mine(m: &mut BTreeMap<Rank, Vec<Vec<u8>>>, rank: Rank) -> Vec<&mut [u8]> {
            m.get_mut(&rank)
                .map(|b| b.iter_mut().map(Vec::as_mut_slice).collect())
                .unwrap_or_default()
        }
        let src: Vec<&[u8]> = sources
            .get(&rank)
            .map(|b| b.iter().map(Vec::as_slice).collect())
            .unwrap_or_default();
        let (mut dst, scale) = (mine(destinations, rank), mine(scales, rank));
        let lens = |b: &[&mut [u8]]| b.iter().map(|b| b.len()).collect::<Vec<_>>();
        let src_lens: Vec<usize> = src.iter().map(|b| b.len()).collect();
        check_all(&rb, &src_lens, &lens(&dst), &lens(&scale))?;
        // a rank's destination buffers, then its scale buffers
        dst.extend(scale);
        let run = RankRun {
            program: lower_batch(batch, &rb, &exec_options)?,
            src,
            dst,
        };
        self.run_programs(vec![run], layouts, &exec_options)
    }

    /// Moves an already-quantized tensor ([`QuantizedMove`]): its fp8 values and its scales
    /// in one exchange, as the batch [`Batch::quantized`] (one schedule, one stream per
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
        // as a delta, the baseline is verl's: the changes gathered to one rank, broadcast
        // from it to every destination rank, minding no hosts
        let gb = match exec_options.delta {
            Some(_) => GatherBroadcast::new(plan.src(), plan.dst())?,
            None => GatherBroadcast::on_hosts(plan.src(), plan.dst(), plan.topology())?,
        };
        // a delta refit keeps the full tensors: they hold the last version
        const FULL: &str = "full tensor";
        let session = exec_options.delta.as_ref().map(|d| d.session.clone());
        let Some(job) = self.job() else {
            let mut full = baseline::full_buffers(&gb)?;
            if let Some(s) = &session {
                for (&r, f) in full.iter_mut() {
                    *f = s.with_rank(r, |d| d.take_kept(FULL, f.len(), r))?;
                }
            }
            let outcome = baseline::run_local_gather_broadcast(
                &gb,
                sources,
                destinations,
                &mut full,
                &exec_options,
            );
            if let Some(s) = &session {
                for (r, f) in full {
                    s.with_rank(r, |d| d.give_kept(FULL, f));
                }
            }
            return outcome;
        };
        exec_options.validate()?;
        let rank = job.rank();
        check_own(plan.src(), Side::Src, rank, sources)?;
        check_own(plan.dst(), Side::Dst, rank, destinations)?;
        let (gather, broadcast) = gb.rank_parts(rank);
        let len = gb.dst().total_bytes();
        let mut full = match (gb.needs_full_buffer(rank), &session) {
            (true, Some(s)) => Some(s.with_rank(rank, |d| d.take_kept(FULL, len as usize, rank))?),
            (true, None) => Some(reshard_core::memory::zeroed(len, || {
                format!("rank {rank}'s full tensor")
            })?),
            (false, _) => None,
        };
        let (src_box, dst_box) = (plan.src().local_region(rank), plan.dst().local_region(rank));
        let whole = Region::full(gb.dst().shape());
        let src = src_box.as_ref().zip(sources.get(&rank).map(Vec::as_slice));
        let dst = dst_box
            .as_ref()
            .zip(destinations.get_mut(&rank).map(Vec::as_mut_slice));
        fn slot((region, len): (&Region, usize), buf: Buf) -> Slot<'_> {
            Slot {
                region: Cow::Borrowed(region),
                buf,
                bytes: 0..len,
            }
        }
        let parts = BaselineParts {
            rank,
            baseline: &gb,
            gather: gather.as_ref(),
            broadcast: broadcast.as_ref(),
            src: src.map(|(b, s)| slot((b, s.len()), Buf::Src(0))),
            full: full.as_ref().map(|f| (Buf::Dst(1), 0..f.len())),
            dst: dst.as_ref().map(|(b, d)| slot((b, d.len()), Buf::Dst(0))),
            whole: Cow::Borrowed(&whole),
        };
        let run = RankRun {
            program: lower_gather_broadcast(parts, &exec_options)?,
            src: src.map(|s| s.1).into_iter().collect(),
            dst: vec![
                dst.map_or(&mut [][..], |d| d.1),
                full.as_deref_mut().unwrap_or_default(),
            ],
        };
        let outcome = self.run_programs(vec![run], [plan.src()], &exec_options);
        if let (Some(s), Some(f)) = (&session, full) {
            s.with_rank(rank, |d| d.give_kept(FULL, f));
        }
        outcome
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
