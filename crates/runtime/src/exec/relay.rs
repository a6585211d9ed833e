//! Runs a rank's part of a relay plan: the bytes that cross into a host once, to a relaying
//! rank, which forwards them to the other ranks of its host, slab by slab.
//!
//! A hop (a transfer to a relaying rank of a region it forwards) is cut into slabs along its
//! outermost splittable dim, each about [`slab_bytes`] ([`slabs`]), and the rank's part runs in
//! rounds ([`Rounds`]): round `j` carries slab `j` of every hop, into a staging buffer of the
//! relaying rank, while the relaying rank forwards slab `j - 1` out of the other staging
//! buffer. So forwarding runs under the next slab's crossing (pipelined), and the staging is
//! two rounds' slabs, however large the hops. After each round the relaying rank copies the
//! slabs it staged into its own shard (it is a destination of them). Everything else (direct
//! transfers and local copies) runs in round 0.
//!
//! Each round is one [`run_steps`]: its sends and receives follow the plan's schedule order,
//! one total order on transfers, and a transfer's slabs fall in the same round on both of its
//! ends, so no round can deadlock, and a rank enters a round only once it has done its part
//! of the one before (the data it forwards has landed). Checksums cover every hop and every
//! forward: each round's senders sum what they send.

use std::collections::BTreeMap;

use super::options::ExecOptions;
use super::run::{RankJob, run_steps};
use super::stats::RankStats;
use super::steps::{Step, Steps, check_job, cut_chunk};
use reshard_core::copy::{Cast, CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;
use reshard_core::plan::{RankPlan, Transfer};
use reshard_core::region::Region;
use reshard_transport::{Lands, Transport};

/// The slab size of a job: an eighth of the staging bound, so that a relaying rank's two
/// staging buffers hold two rounds of a few hops within it. Both ends compute the same.
pub fn slab_bytes(options: &ExecOptions) -> u64 {
    (options.staging_bytes as u64 / 8).max(1)
}

/// `region` cut into slabs of about `slab_bytes` (of `elem_bytes` elements) along its
/// outermost dim that is long enough, in order; one slab when it is small or cannot be cut.
pub fn slabs(region: &Region, elem_bytes: usize, slab_bytes: u64) -> Vec<Region> {
    let bytes = region.volume().saturating_mul(elem_bytes as u64);
    let wanted = bytes.div_ceil(slab_bytes.max(1)).max(1);
    match reshard_core::plan::split_dim(region, wanted) {
        None => vec![region.clone()],
        Some((dim, parts)) => (0..parts)
            .map(|p| reshard_core::plan::split_part(region, dim, parts, p))
            .filter(|r| !r.is_empty())
            .collect(),
    }
}

/// One transfer's slab as a round moves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leg {
    pub from: Rank,
    pub to: Rank,
    pub region: Region,
    /// Where the bytes lie on this rank: `None` in its shard (the source shard for a send,
    /// the destination shard for a receive), `Some(offset)` in a staging buffer (the one
    /// of the round before for a send, this round's for a receive), as a dense box.
    pub staged: Option<usize>,
    /// The sender forwards it out of its staging (a relayed transfer's second leg).
    pub forwarded: bool,
    /// Where it lands on the receiver: a hop's slabs in the relaying rank's staging, every
    /// other leg in the receiver's shard. Both ends set it alike (from [`RankPlan::is_hop`]).
    pub lands: Lands,
}

/// One round of a rank's part.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub sends: Vec<Leg>,
    pub recvs: Vec<Leg>,
    /// Local copies (round 0).
    pub locals: Vec<Transfer>,
    /// Bytes this round stages.
    pub staging_bytes: usize,
}

/// A rank's part of a relay plan, round by round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rounds {
    pub rounds: Vec<Round>,
}

impl Rounds {
    /// The rounds of `plan` (see the module docs), each list in the plan's order.
    pub fn of(plan: &RankPlan, elem_bytes: usize, slab_bytes: u64) -> Result<Rounds> {
        let rank = plan.rank;
        let mut rounds = vec![Round {
            locals: plan.locals.clone(),
            ..Round::default()
        }];
        fn at(rounds: &mut Vec<Round>, j: usize) -> &mut Round {
            if rounds.len() <= j {
                rounds.resize_with(j + 1, Round::default);
            }
            &mut rounds[j]
        }
        let leg = |from, to, region: &Region| Leg {
            from,
            to,
            region: region.clone(),
            staged: None,
            forwarded: false,
            lands: Lands::Shard,
        };
        // where each hop's slabs land here: (sender, region, slab) -> offset
        let mut staged: BTreeMap<(Rank, &Region, usize), usize> = BTreeMap::new();
        for t in &plan.recvs {
            if let Some(via) = t.via {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    at(&mut rounds, j + 1).recvs.push(Leg {
                        forwarded: true,
                        ..leg(via, rank, s)
                    });
                }
            } else if plan.is_hop(t) {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    let round = at(&mut rounds, j);
                    let offset = round.staging_bytes;
                    round.staging_bytes += s.volume() as usize * elem_bytes;
                    round.recvs.push(Leg {
                        staged: Some(offset),
                        lands: Lands::Aside,
                        ..leg(t.src, rank, s)
                    });
                    staged.insert((t.src, &t.region, j), offset);
                }
            } else {
                at(&mut rounds, 0).recvs.push(leg(t.src, rank, &t.region));
            }
        }
        for t in &plan.sends {
            if t.via == Some(rank) {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    let Some(&offset) = staged.get(&(t.src, &t.region, j)) else {
                        return Err(Error::Protocol {
                            rank,
                            peer: t.src,
                            detail: format!(
                                "the plan forwards {} to rank {} without receiving it",
                                t.region, t.dst
                            ),
                        });
                    };
                    at(&mut rounds, j + 1).sends.push(Leg {
                        staged: Some(offset),
                        forwarded: true,
                        ..leg(rank, t.dst, s)
                    });
                }
            } else if plan.is_hop(t) {
                for (j, s) in slabs(&t.region, elem_bytes, slab_bytes).iter().enumerate() {
                    at(&mut rounds, j).sends.push(Leg {
                        lands: Lands::Aside,
                        ..leg(rank, t.dst, s)
                    });
                }
            } else {
                at(&mut rounds, 0).sends.push(leg(rank, t.dst, &t.region));
            }
        }
        Ok(Rounds { rounds })
    }

    /// The larger staging buffer a round needs.
    pub fn staging_bytes(&self) -> usize {
        self.rounds
            .iter()
            .map(|r| r.staging_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// A rank's two staging buffers: round `j` receives into `j % 2` and forwards from the other.
pub type Staging = [Vec<u8>; 2];

/// Allocates the staging of `rounds`; [`Error::OutOfMemory`] when it does not fit.
pub fn staging_for(rounds: &Rounds, rank: Rank) -> Result<Staging> {
    let bytes = rounds.staging_bytes() as u64;
    let buffer = || reshard_core::memory::zeroed(bytes, || format!("rank {rank}'s relay staging"));
    Ok([buffer()?, buffer()?])
}

/// Runs one rank's part of any plan over `transport`: round by round when it relays
/// ([`run_rank_relayed`]), in one go otherwise ([`run_rank`](super::run_rank)).
pub fn run_rank_any<T>(
    job: RankJob<'_, '_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    if job.plan.relays() {
        run_rank_relayed(job, transport, options)
    } else {
        super::run_rank(job, transport, options)
    }
}

/// Round `j`'s halves of a rank's staging: the one it receives into, the one it forwards from.
pub fn halves(staging: &mut Staging, j: usize) -> (&mut [u8], &[u8]) {
    let (first, second) = staging.split_at_mut(1);
    if j.is_multiple_of(2) {
        (&mut first[0], &second[0])
    } else {
        (&mut second[0], &first[0])
    }
}

/// Runs one rank's part of a relay plan over `transport`, round after round.
pub fn run_rank_relayed<T>(
    job: RankJob<'_, '_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: for<'b> Transport<'b> + ?Sized,
{
    let elem_bytes = job.dst_dtype.size();
    let rounds = Rounds::of(job.plan, elem_bytes, slab_bytes(options))?;
    let mut staging = staging_for(&rounds, job.plan.rank)?;
    let mut job = job;
    let mut stats = RankStats {
        rank: job.plan.rank,
        ..RankStats::default()
    };
    for j in 0..rounds.rounds.len() {
        let (recv_into, send_from) = halves(&mut staging, j);
        let this = RankJob {
            plan: job.plan,
            src_layout: job.src_layout,
            src: job.src,
            dst: job.dst.as_mut().map(|(b, d)| (*b, &mut **d)),
            dst_dtype: job.dst_dtype,
            quant: None,
        };
        let s = run_round(this, &rounds, j, send_from, recv_into, transport, options)?;
        stats.absorb(&s);
    }
    stats.peak_staging_bytes += 2 * rounds.staging_bytes() as u64;
    Ok(stats)
}

/// Runs round `j` of a rank's part: its legs out of the shards, out of `send_from` (what the
/// round before staged) and into `recv_into`; then copies what it staged into the shard.
pub fn run_round<'b, T>(
    job: RankJob<'b, '_>,
    rounds: &'b Rounds,
    j: usize,
    send_from: &'b [u8],
    recv_into: &mut [u8],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats>
where
    T: Transport<'b> + ?Sized,
{
    let mut job = job;
    let round = &rounds.rounds[j];
    let rank = job.plan.rank;
    let elem_bytes = job.dst_dtype.size();
    let cast =
        Cast::between(job.src_layout.dtype(), job.dst_dtype).map_err(|source| Error::Convert {
            tensor: "tensor".into(),
            source,
        })?;
    if j == 0 {
        let own: Vec<&Transfer> = job.plan.sends.iter().filter(|t| t.via.is_none()).collect();
        let plain = RankPlan {
            sends: own.into_iter().cloned().collect(),
            recvs: job
                .plan
                .recvs
                .iter()
                .filter(|t| t.via.is_none())
                .cloned()
                .collect(),
            ..job.plan.clone()
        };
        check_job(
            &plain,
            job.src_layout.dtype().size(),
            elem_bytes,
            job.src,
            job.dst.as_ref().map(|(b, d)| (*b, d.len())),
        )?;
    }
    let src_len = job.src.map_or(0, |s| s.1.len());
    let (src_box, dst_box) = (job.src.map(|s| s.0), job.dst.as_ref().map(|d| d.0));
    let missing = |side| Error::MissingBuffer { side, rank };
    // every sender's box, for the receives from its source shard
    let senders: BTreeMap<Rank, Region> = round
        .recvs
        .iter()
        .filter(|l| !l.forwarded)
        .map(|l| {
            let b = job
                .src_layout
                .local_region(l.from)
                .ok_or_else(|| Error::Protocol {
                    rank,
                    peer: l.from,
                    detail: "the plan receives from a rank that is not a source".into(),
                })?;
            Ok((l.from, b))
        })
        .collect::<Result<_>>()?;
    let dst_len = job.dst.as_ref().map_or(0, |d| d.1.len());
    let bytes_of = |r: &Region| r.volume() as usize * elem_bytes;
    let mut steps = Steps {
        rank,
        ..Steps::default()
    };
    for l in &round.sends {
        let step = match l.staged {
            Some(offset) => Step {
                from: l.from,
                to: l.to,
                region: &l.region,
                elem_bytes,
                src_box: &l.region,
                dst_box: &l.region,
                src_at: Some((1, offset..offset + bytes_of(&l.region))),
                dst_at: None,
                cast: None,
                lands: l.lands,
            },
            None => Step {
                from: l.from,
                to: l.to,
                region: &l.region,
                elem_bytes,
                src_box: src_box.ok_or_else(|| missing(reshard_core::Side::Src))?,
                dst_box: &l.region,
                src_at: Some((0, 0..src_len)),
                dst_at: None,
                cast: cast.clone(),
                lands: l.lands,
            },
        };
        steps.sends.push(step);
    }
    for l in &round.recvs {
        let (dst_box, dst_at) = match l.staged {
            Some(offset) => (&l.region, (1, offset..offset + bytes_of(&l.region))),
            None => (
                dst_box.ok_or_else(|| missing(reshard_core::Side::Dst))?,
                (0, 0..dst_len),
            ),
        };
        steps.recvs.push(Step {
            from: l.from,
            to: rank,
            region: &l.region,
            elem_bytes,
            src_box: if l.forwarded {
                &l.region
            } else {
                &senders[&l.from]
            },
            dst_box,
            src_at: None,
            dst_at: Some(dst_at),
            cast: if l.forwarded { None } else { cast.clone() },
            lands: l.lands,
        });
    }
    for t in &round.locals {
        steps.locals.push(Step {
            from: rank,
            to: rank,
            region: &t.region,
            elem_bytes,
            src_box: src_box.ok_or_else(|| missing(reshard_core::Side::Src))?,
            dst_box: dst_box.ok_or_else(|| missing(reshard_core::Side::Dst))?,
            src_at: Some((0, 0..src_len)),
            dst_at: Some((0, 0..dst_len)),
            cast: cast.clone(),
            lands: Lands::Shard,
        });
    }
    // both ends of every transfer cut it alike, whatever this round holds
    let converts = cast.is_some();
    let options = ExecOptions {
        chunk_bytes: cut_chunk(options.chunk_bytes, converts),
        ..options.clone()
    };
    let staged_len = round.staging_bytes;
    let src_bufs: Vec<&'b [u8]> = vec![job.src.map_or(&[][..], |s| s.1), send_from];
    let shard: &mut [u8] = match job.dst.as_mut() {
        Some((_, d)) => d,
        None => &mut [],
    };
    let stats = {
        let mut dst_bufs: Vec<&mut [u8]> = vec![&mut *shard, &mut recv_into[..staged_len]];
        if steps.sends.is_empty() && steps.recvs.is_empty() && steps.locals.is_empty() {
            RankStats {
                rank,
                ..RankStats::default()
            }
        } else {
            run_steps(&steps, &src_bufs, &mut dst_bufs, transport, &options)?
        }
    };
    // the slabs staged here belong in this rank's shard too
    for l in round.recvs.iter().filter(|l| l.staged.is_some()) {
        let offset = l.staged.unwrap_or_default();
        let Some(dst_box) = dst_box else {
            return Err(missing(reshard_core::Side::Dst));
        };
        let g = CopyGeometry::new(
            &l.region,
            Place::Within(&l.region),
            Place::Within(dst_box),
            elem_bytes,
        );
        let len = bytes_of(&l.region);
        // not counted as a local copy: the plan's totals count the hop, received above
        g.copy(&recv_into[offset..offset + len], &mut *shard, 0..g.len());
    }
    Ok(stats)
}

#[cfg(test)]
mod tests;
