//! A rank's part of a plan prepared once and run many times ([`World::prepare`],
//! [`PlanRank::run`]): its links open, its destination shard in shared memory, so that
//! same-host senders write straight into it; each run lowers the part and runs its program.

use reshard_core::dtype::DType;
use reshard_core::error::{Dims, Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{Plan, RankPlan};
use reshard_core::region::Region;
use reshard_transport::Job;
use reshard_transport::segment::SharedBuffer;

use super::{AnyTransport, Links, RunOptions, World};
use crate::exec::{self, RankJob, RankStats};

impl World {
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
    /// The rank it runs.
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
