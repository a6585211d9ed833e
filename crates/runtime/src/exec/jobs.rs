//! A rank's part of one plan as the caller holds it ([`RankJob`]: the plan, the shards, the
//! quantization), checked and lowered to its program ([`RankJob::program`]), and the thin
//! entry points that run it on a transport.

use super::executor::run_program;
use super::lower::{PlanJob, QuantParts, Slot, lower_plan};
use super::options::ExecOptions;
use super::program::{Buf, Program};
use super::quant::{self, QuantJob};
use super::stats::RankStats;
use super::steps::check_job;
use reshard_core::error::{Error, Result};
use reshard_core::layout::Layout;
use reshard_core::plan::RankPlan;
use reshard_core::region::Region;
use reshard_transport::Transport;

/// One rank's share of a run: its plan and its shards.
pub struct RankJob<'buf, 'dst> {
    /// The rank's part of the plan.
    pub plan: &'buf RankPlan,
    /// The source layout: where every sender's shard lies.
    pub src_layout: &'buf Layout,
    /// The rank's source box and shard, if it is a source.
    pub src: Option<(&'buf Region, &'buf [u8])>,
    /// The rank's destination box and shard, if it is a destination.
    pub dst: Option<(&'buf Region, &'dst mut [u8])>,
    /// The destination's dtype (`--dst-dtype`): when it differs from the source layout's,
    /// this rank converts what it sends and copies locally, and its destination shard holds
    /// elements of this dtype.
    pub dst_dtype: reshard_core::DType,
    /// With `--quant`: the amax exchange before the values, the scales beside them.
    pub quant: Option<QuantJob<'buf, 'dst>>,
}

impl<'buf> RankJob<'buf, '_> {
    /// Checks the job's shards against its plan before any byte moves, then lowers it:
    /// the program reads the source shard as `Buf::Src(0)` and writes the destination shard
    /// as `Buf::Dst(0)` and the scale shard as `Buf::Dst(1)`.
    pub fn program(&self, options: &ExecOptions) -> Result<Program<'buf>> {
        let plan = self.plan;
        let src_elem = self.src_layout.dtype().size();
        let dst_elem = self.dst_dtype.size();
        let dst = self.dst.as_ref().map(|(b, d)| (*b, d.len()));
        if plan.relays() {
            // the transfers it forwards lie outside its shards: the checks are of its own
            let own = RankPlan {
                sends: plan
                    .sends
                    .iter()
                    .filter(|t| t.via.is_none())
                    .cloned()
                    .collect(),
                recvs: plan
                    .recvs
                    .iter()
                    .filter(|t| t.via.is_none())
                    .cloned()
                    .collect(),
                ..plan.clone()
            };
            check_job(&own, src_elem, dst_elem, self.src, dst)?;
        } else {
            check_job(plan, src_elem, dst_elem, self.src, dst)?;
        }
        if let Some(q) = &self.quant {
            quant::check(q, plan.rank, self.src.is_some())?;
        }
        let slot = |(region, len): (&'buf Region, usize), buf| Slot {
            region: std::borrow::Cow::Borrowed(region),
            buf,
            bytes: 0..len,
        };
        let job = PlanJob {
            plan,
            src_layout: self.src_layout,
            dst_dtype: self.dst_dtype,
            src: self.src.map(|(b, s)| slot((b, s.len()), Buf::Src(0))),
            dst: dst.map(|d| slot(d, Buf::Dst(0))),
            quant: self.quant.as_ref().map(|q| QuantParts {
                tensor: q.tensor,
                plan: q.plan,
                rank: q.rank,
                scales: q.scales.as_ref().map(|_| Buf::Dst(1)),
            }),
        };
        lower_plan(&job, options)
    }
}

bench_pub! {
/// Runs one rank's part of a plan over `transport`: lowers it and runs its program. A plan
/// that relays is refused ([`run_rank_any`] runs every plan).
fn run_rank<T>(job: RankJob<'_, '_>, transport: &T, options: &ExecOptions) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    if job.plan.relays() {
        return Err(Error::Internal {
            rank: job.plan.rank,
            detail: "a relay plan runs round by round (exec::run_rank_any)".into(),
        });
    }
    run_rank_any(job, transport, options)
}
}

bench_pub! {
/// Runs one rank's part of any plan over `transport`: round by round when it relays, in one
/// go otherwise, as its program says.
fn run_rank_any<T>(
    job: RankJob<'_, '_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let program = job.program(options)?;
    let src: Vec<&[u8]> = job.src.map(|s| s.1).into_iter().collect();
    let mut dst: Vec<&mut [u8]> = vec![job.dst.map_or(&mut [][..], |d| d.1)];
    if let Some(s) = job.quant.and_then(|q| q.scales) {
        dst.push(s);
    }
    run_program(&program, &src, &mut dst, transport, options)
}
}
