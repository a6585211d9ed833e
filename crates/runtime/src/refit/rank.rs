//! One rank of a measured refit ([`RefitRun::run`](super::RefitRun::run)): its buffers of
//! both batches, filled and zeroed, and both methods' links, compared by the harness.

use super::RefitRun;
use super::check::{QuantCheck, verify_values};
use crate::batch::baseline::{RankBaseline, run_rank_batch_baseline};
use crate::batch::{Batch, RankBatch, run_rank_batch};
use crate::exec::ExecOptions;
use crate::harness::{Checked, Compare, Sample};
use crate::{AnyTransport, Links, World};
use reshard_core::error::Error;
use reshard_core::fill::Fill;
use reshard_core::{Layout, Rank};

/// The two methods of a refit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Method {
    /// The batch: every tensor in one schedule, the fp8 weights quantized in flight.
    Reshard,
    /// Per tensor, gathered whole and broadcast whole, in its source dtype.
    GatherBroadcast,
}

/// A rank's source and destination buffers of a batch.
type Buffers = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// A batch's buffers on one rank: the sources filled, the destinations zeroed.
fn buffers(batch: &Batch, ids: &[usize], fills: &[Fill], rb: &RankBatch) -> Result<Buffers, Error> {
    let rank = rb.rank;
    let zeroed = |len: usize, what: &str| {
        reshard_core::memory::zeroed(len as u64, || format!("rank {rank}'s {what}"))
    };
    let mut src = rb
        .src
        .iter()
        .map(|b| zeroed(b.len, "source buffer"))
        .collect::<Result<Vec<_>, _>>()?;
    for (buffer, bytes) in rb.src.iter().zip(&mut src) {
        for p in &buffer.pieces {
            let layout = &batch.tensors()[p.tensor].src;
            fills[ids[p.tensor]].fill_region(layout, &p.region, &mut bytes[p.bytes.clone()]);
        }
    }
    let dst = rb
        .dst
        .iter()
        .map(|b| zeroed(b.len, "destination buffer"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((src, dst))
}

/// Zeroed buffers of `bufs`' sizes for `rank` ([`Error::OutOfMemory`] when they do not fit).
pub(super) fn zeroed_buffers(
    rank: Rank,
    bufs: &[crate::batch::Buffer],
) -> Result<Vec<Vec<u8>>, Error> {
    bufs.iter()
        .map(|b| reshard_core::memory::zeroed(b.len as u64, || format!("rank {rank}'s {}", b.name)))
        .collect()
}

/// Overwrites buffers with a pattern no fill produces everywhere. Within a repetition the
/// full-tensor buffer passes from tensor to tensor unpoisoned: each tensor's own seed keeps
/// the bytes one left behind from verifying as the next one's.
fn poison<'b>(bufs: impl IntoIterator<Item = &'b mut Vec<u8>>) {
    bufs.into_iter().for_each(|b| crate::harness::poison(b));
}

fn lengths(bufs: &[Vec<u8>]) -> u64 {
    bufs.iter().map(|b| b.len() as u64).sum()
}

/// One rank of a refit: its buffers of both batches and both methods' links.
pub(super) struct RankRefit<'r, 'w> {
    run: &'r RefitRun,
    world: &'w World,
    options: ExecOptions,
    pub(super) rb: RankBatch,
    /// Gather+broadcast's part and buffers, when it has a batch of its own.
    base: Option<(RankBatch, Buffers)>,
    mine: RankBaseline,
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    scales: Vec<Vec<u8>>,
    quant: QuantCheck,
    full: Vec<u8>,
    pub(super) reshard: Option<AnyTransport<'w>>,
    baseline: Option<AnyTransport<'w>>,
}

impl<'r, 'w> RankRefit<'r, 'w> {
    pub(super) fn new(
        run: &'r RefitRun,
        world: &'w World,
        rank: Rank,
        options: ExecOptions,
    ) -> Result<RankRefit<'r, 'w>, Error> {
        let rb = run.batch.rank_batch(rank)?;
        let (src, dst) = buffers(&run.batch, &run.ids, &run.fills, &rb)?;
        let base = match &run.full {
            Some((b, ids)) => {
                let brb = b.rank_batch(rank)?;
                let bufs = buffers(b, ids, &run.fills, &brb)?;
                Some((brb, bufs))
            }
            None => None,
        };
        let full_len = run.baseline.full_bytes(rank) as u64;
        Ok(RankRefit {
            run,
            world,
            options,
            mine: run.baseline.for_rank(rank)?,
            scales: QuantCheck::scale_buffers(&rb)?,
            quant: QuantCheck::new(&run.batch, rank, |i| run.fills[run.ids[i]])?,
            full: reshard_core::memory::zeroed(full_len, || {
                format!("rank {rank}'s full-tensor buffer")
            })?,
            rb,
            base,
            src,
            dst,
            reshard: None,
            baseline: None,
        })
    }

    /// Every tensor either batch moves: MPI's datatypes cover them.
    fn layouts(&self) -> impl Iterator<Item = &'r Layout> {
        let (base, _) = self.run.baseline_batch();
        let run: &'r RefitRun = self.run;
        run.batch
            .tensors()
            .iter()
            .map(|t| &t.src)
            .chain(base.tensors().iter().map(|t| &t.src))
    }
}

impl Compare for RankRefit<'_, '_> {
    type Method = Method;

    fn methods(&self) -> Vec<Method> {
        vec![Method::Reshard, Method::GatherBroadcast]
    }

    fn connect(&mut self, method: Method) -> Result<(), Error> {
        match method {
            Method::Reshard => {
                let links = Links::of_batch(&self.rb);
                self.reshard = Some(self.world.connect(&links, self.layouts(), None)?);
            }
            Method::GatherBroadcast => {
                let mut links = Links::default();
                for p in self.mine.parts.iter().flat_map(|(g, b)| [g, b]).flatten() {
                    links.senders.extend(p.senders());
                    links.receivers.extend(p.receivers());
                }
                self.baseline = Some(self.world.connect(&links, self.layouts(), None)?);
            }
        }
        Ok(())
    }

    fn poison(&mut self, method: Method) {
        match method {
            Method::Reshard => poison(self.dst.iter_mut().chain(&mut self.scales)),
            Method::GatherBroadcast => {
                match &mut self.base {
                    Some((_, (_, dst))) => poison(dst.iter_mut()),
                    None => poison(self.dst.iter_mut()),
                }
                crate::harness::poison(&mut self.full);
            }
        }
    }

    fn run(&mut self, method: Method) -> Result<Sample, Error> {
        let not_connected = || Error::Internal {
            rank: self.rb.rank,
            detail: "a refit method ran before its links were opened".into(),
        };
        let stats = match method {
            Method::Reshard => {
                let transport = self.reshard.as_ref().ok_or_else(not_connected)?;
                let srcs: Vec<&[u8]> = self.src.iter().map(Vec::as_slice).collect();
                let mut dsts: Vec<&mut [u8]> = self.dst.iter_mut().map(Vec::as_mut_slice).collect();
                let mut scales: Vec<&mut [u8]> =
                    self.scales.iter_mut().map(Vec::as_mut_slice).collect();
                run_rank_batch(
                    &self.run.batch,
                    &self.rb,
                    &srcs,
                    &mut dsts,
                    &mut scales,
                    &**transport,
                    &self.options,
                )?
            }
            Method::GatherBroadcast => {
                let transport = self.baseline.as_ref().ok_or_else(not_connected)?;
                let (batch, _) = self.run.baseline_batch();
                let (rb, src, dst) = match &mut self.base {
                    Some((rb, (src, dst))) => (&*rb, &*src, dst),
                    None => (&self.rb, &self.src, &mut self.dst),
                };
                let srcs: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
                let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
                run_rank_batch_baseline(
                    batch,
                    &self.run.baseline,
                    &self.mine,
                    rb,
                    &srcs,
                    &mut dsts,
                    &mut self.full,
                    &**transport,
                    &self.options,
                )?
            }
        };
        Ok(Sample::of_rank(&stats))
    }

    fn verify(&mut self, method: Method) -> Result<Checked, Error> {
        let run = self.run;
        match method {
            Method::Reshard => {
                let fill = |i: usize| run.fills[run.ids[i]];
                let values = verify_values(&run.batch, &self.rb, &self.dst, fill)?;
                let quantized = self
                    .quant
                    .verify(&run.batch, &self.rb, &self.dst, &self.scales)?;
                let held = lengths(&self.dst) + lengths(&self.scales);
                Ok(Checked::new(values + quantized, held))
            }
            Method::GatherBroadcast => {
                let (batch, ids) = run.baseline_batch();
                let (rb, dst) = match &self.base {
                    Some((rb, (_, dst))) => (rb, dst),
                    None => (&self.rb, &self.dst),
                };
                let checked = verify_values(batch, rb, dst, |i| run.fills[ids[i]])?;
                Ok(Checked::new(checked, lengths(dst)))
            }
        }
    }

    fn extra_bytes(&self, method: Method) -> u64 {
        match method {
            Method::Reshard => 0,
            Method::GatherBroadcast => self.full.len() as u64,
        }
    }
}
