//! `bench --quant`: the quantizing reshard (the senders quantize as they pack, the wire
//! carries fp8 values and their scales) against two ways of quantizing after the move, on
//! the receivers: (a) the same reshard in the source's dtype, then every destination
//! quantizes the shard it got, and (b) gather+broadcast of the source's dtype, then every
//! destination quantizes its box. Destination shards hold whole blocks (the case checks it),
//! so every receiver quantizes alone. Each repetition of each method is verified, values and
//! scales, against the naive reference, by the harness
//! ([`reshard::runtime::harness`]); the receivers' threads that quantize between
//! threads are started before their clock starts.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use reshard::convert::quantize_shard;
use reshard::convert::reference::QuantizedTensor;
use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, QuantJob, RankJob, RankStats};
use reshard::fill::Fill;
use reshard::plan::{GatherBroadcast, QuantPlan, QuantRankPlan};
use reshard::runtime::harness::{Checked, Compare, Repeat, Sample, compare};
use reshard::runtime::refit::check;
use reshard::runtime::{AnyTransport, Destination, Links};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Plan, Rank, RankPlan, Region};

use super::result::{CaseResult, Method};
use super::suite::Case;
use reshard::runtime::harness::poison;

/// The three methods of a quantizing case, in the order of the first repetition:
/// [`Method::Reshard`] quantizes in flight; [`Method::ReshardThenQuantize`] is (a), the
/// reshard in the source's dtype, then quantized on the receivers; [`Method::GatherBroadcast`]
/// is (b), gather+broadcast in the source's dtype, then quantized on the receivers.
fn methods() -> Vec<Method> {
    vec![
        Method::Reshard,
        Method::ReshardThenQuantize,
        Method::GatherBroadcast,
    ]
}

fn convert_error(source: reshard::convert::ConvertError) -> Error {
    Error::Convert {
        tensor: "tensor".into(),
        source,
    }
}

/// One receiver's quantization after the move: `received` (its shard in the source's dtype)
/// into `values` and `scales`.
fn quantize_received(
    q: &QuantPlan,
    shard: &Region,
    plain: &Plan,
    received: &[u8],
    values: &mut [u8],
    scales: &mut [u8],
) -> Result<(), Error> {
    quantize_shard(
        q.quant,
        &q.grid,
        shard,
        plain.dst().dtype(),
        received,
        values,
        scales,
    )
    .map_err(convert_error)
}

/// Every destination quantizing what it received, each on a thread of its own as the ranks
/// would; returns the time they took together, from when every thread had started.
fn quantize_all(
    q: &QuantPlan,
    plain: &Plan,
    received: &BTreeMap<Rank, Vec<u8>>,
    values: &mut BTreeMap<Rank, Vec<u8>>,
    scales: &mut BTreeMap<Rank, Vec<u8>>,
) -> Result<Duration, Error> {
    // the threads wait at the gate until every one has started; the clock starts as it opens
    let gate = (Mutex::new(false), Condvar::new());
    let wait = |gate: &(Mutex<bool>, Condvar)| {
        let mut open = gate.0.lock().unwrap_or_else(|p| p.into_inner());
        while !*open {
            open = gate.1.wait(open).unwrap_or_else(|p| p.into_inner());
        }
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = values
            .iter_mut()
            .zip(scales.values_mut())
            .filter_map(|((r, v), sc)| {
                let shard = plain.dst().local_region(*r)?;
                let got = received.get(r)?;
                let (gate, wait) = (&gate, &wait);
                let worker = std::thread::Builder::new().spawn_scoped(s, move || {
                    wait(gate);
                    quantize_received(q, &shard, plain, got, v, sc)
                });
                Some(worker)
            })
            .collect();
        *gate.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
        gate.1.notify_all();
        let started = Instant::now();
        workers.into_iter().try_for_each(|w| match w {
            Ok(w) => w.join().unwrap_or_else(|_| Err(quantize_panicked())),
            Err(source) => Err(Error::ThreadStart {
                what: "a receiver's quantization".into(),
                source,
            }),
        })?;
        Ok(started.elapsed())
    })
}

fn quantize_panicked() -> Error {
    Error::Internal {
        rank: 0,
        detail: "a receiver's quantization panicked".into(),
    }
}

/// Checks every destination's values and scales against the reference; returns what the
/// checks covered of the buffers.
fn verify_all(
    plan: &Plan,
    reference: Option<&QuantizedTensor>,
    values: &BTreeMap<Rank, Vec<u8>>,
    scales: &BTreeMap<Rank, Vec<u8>>,
) -> Result<Checked, Error> {
    let mut checked = Checked::default();
    for (&r, v) in values {
        let s = scales.get(&r).map_or(&[][..], Vec::as_slice);
        let bytes = match reference {
            Some(reference) => check::verify_quantized(plan, reference, r, v, s)?,
            None => 0,
        };
        checked = checked + Checked::new(bytes, (v.len() + s.len()) as u64);
    }
    Ok(checked)
}

/// Every rank a thread of this process: every rank's buffers.
struct Threads<'a> {
    plan: &'a Plan,
    plain: &'a Plan,
    q: &'a QuantPlan,
    gb: &'a GatherBroadcast,
    options: &'a ExecOptions,
    reference: Option<QuantizedTensor>,
    sources: BTreeMap<Rank, Vec<u8>>,
    values: BTreeMap<Rank, Vec<u8>>,
    scales: BTreeMap<Rank, Vec<u8>>,
    received: BTreeMap<Rank, Vec<u8>>,
    full: BTreeMap<Rank, Vec<u8>>,
}

impl Compare for Threads<'_> {
    type Method = Method;
    fn methods(&self) -> Vec<Method> {
        methods()
    }
    fn poison(&mut self, m: Method) {
        for buf in self
            .values
            .values_mut()
            .chain(self.scales.values_mut())
            .chain(self.received.values_mut())
        {
            poison(buf);
        }
        if m == Method::GatherBroadcast {
            self.full.values_mut().for_each(|f| poison(f));
        }
    }
    fn run(&mut self, m: Method) -> Result<Sample, Error> {
        let (plan, plain, q, options) = (self.plan, self.plain, self.q, self.options);
        let (stats, after) = match m {
            Method::ReshardThenQuantize => {
                let stats = exec::run_local(plain, &self.sources, &mut self.received, options)?;
                let after =
                    quantize_all(q, plain, &self.received, &mut self.values, &mut self.scales)?;
                (stats, after)
            }
            Method::GatherBroadcast => {
                let stats = baseline::run_local_gather_broadcast(
                    self.gb,
                    &mut self.sources,
                    &mut self.received,
                    &mut self.full,
                    options,
                )?;
                let after =
                    quantize_all(q, plain, &self.received, &mut self.values, &mut self.scales)?;
                (stats, after)
            }
            _ => {
                let stats = exec::run_local_quantized(
                    plan,
                    &self.sources,
                    &mut self.values,
                    &mut self.scales,
                    options,
                )?;
                (stats, Duration::ZERO)
            }
        };
        let sample = Sample::of_run(&stats);
        Ok(Sample {
            seconds: Some((stats.elapsed + after).as_secs_f64()),
            ..sample
        })
    }
    fn verify(&mut self, _: Method) -> Result<Checked, Error> {
        verify_all(
            self.plan,
            self.reference.as_ref(),
            &self.values,
            &self.scales,
        )
    }
    fn extra_bytes(&self, m: Method) -> u64 {
        let received = self.received.values().map(|r| r.len() as u64).max();
        let full = if self.full.is_empty() {
            0
        } else {
            self.gb.full_bytes()
        };
        match m {
            Method::ReshardThenQuantize => received.unwrap_or(0),
            Method::GatherBroadcast => received.unwrap_or(0) + full,
            _ => 0,
        }
    }
}

/// Every rank a thread of this process: the three methods on the same buffers.
pub(super) fn threads(
    repeat: Repeat,
    case: &Case,
    (plain, q): (&Plan, &QuantPlan),
    fill: Fill,
    options: &ExecOptions,
    bar: &ProgressBar,
) -> Result<CaseResult, Error> {
    let (plan, gb) = (&case.plan, &case.baseline);
    let mut subject = Threads {
        plan,
        plain,
        q,
        gb,
        options,
        reference: check::reference(plan, fill)?,
        sources: fill.shards(plan.src())?,
        values: exec::zeroed_shards(plan.dst())?,
        scales: exec::zeroed_scale_shards(plan)?,
        received: exec::zeroed_shards(plain.dst())?,
        full: baseline::full_buffers(gb)?,
    };
    let found = compare(&mut subject, repeat, None::<&dyn Job>, &mut || bar.inc(1))?;
    Ok(CaseResult::of(&found))
}

/// Connects a rank's links to its peers ([`reshard::runtime::World::connect`]).
type Connect<'c, 'j> = &'c dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>;

/// This process's rank: its buffers and every method's links.
struct OwnRank<'a, 'j> {
    rank: Rank,
    case: &'a Case,
    plain: &'a Plan,
    q: &'a QuantPlan,
    options: &'a ExecOptions,
    connect: Connect<'a, 'j>,
    mine: RankPlan,
    part: QuantRankPlan,
    mine_plain: RankPlan,
    gather: Option<RankPlan>,
    broadcast: Option<RankPlan>,
    src_box: Option<Region>,
    dst_box: Option<Region>,
    source: Option<Vec<u8>>,
    stage: Vec<u8>,
    /// In shared memory, so that same-host senders quantize straight into it.
    values: Option<SharedBuffer>,
    scales: Option<Vec<u8>>,
    received: Option<SharedBuffer>,
    full: Option<SharedBuffer>,
    /// Only the destinations check, so only they build the reference.
    reference: Option<QuantizedTensor>,
    whole: Region,
    transports: BTreeMap<&'static str, AnyTransport<'j>>,
}

impl OwnRank<'_, '_> {
    /// After the move, a destination quantizes what it received.
    fn quantize(&mut self) -> Result<(), Error> {
        match (
            &self.dst_box,
            self.received.as_deref(),
            self.values.as_deref_mut(),
            self.scales.as_deref_mut(),
        ) {
            (Some(b), Some(r), Some(v), Some(s)) => {
                quantize_received(self.q, b, self.plain, r, v, s)
            }
            _ => Ok(()),
        }
    }
}

impl Compare for OwnRank<'_, '_> {
    type Method = Method;
    fn methods(&self) -> Vec<Method> {
        methods()
    }
    fn connect(&mut self, m: Method) -> Result<(), Error> {
        let transport = match m {
            // The quantizing reshard's same-host senders write the values straight into the
            // value shard; its scales and partial amax travel as transfers of their own,
            // through rings.
            Method::Reshard => {
                let mut links = Links::of_plan(&self.mine);
                links.senders.extend(self.part.amax_peers());
                links.receivers.extend(self.part.amax_peers());
                let shard = self
                    .dst_box
                    .as_ref()
                    .and_then(|b| self.values.as_ref().map(|v| (v, b)));
                (self.connect)(&links, shard.filter(|_| !self.mine.relays()))?
            }
            Method::ReshardThenQuantize => {
                let shard = self
                    .dst_box
                    .as_ref()
                    .and_then(|b| self.received.as_ref().map(|s| (s, b)));
                (self.connect)(&Links::of_plan(&self.mine_plain), shard)?
            }
            _ => {
                let links = Links::of_plans([&self.gather, &self.broadcast].into_iter().flatten());
                let gb = &self.case.baseline;
                let tensor = self
                    .full
                    .as_ref()
                    .or(self.received.as_ref().filter(|_| gb.gets_tensor(self.rank)));
                (self.connect)(&links, tensor.map(|f| (f, &self.whole)))?
            }
        };
        self.transports.insert(m.key(), transport);
        Ok(())
    }
    fn poison(&mut self, m: Method) {
        for buf in [
            self.values.as_deref_mut(),
            self.scales.as_deref_mut(),
            self.received.as_deref_mut(),
        ]
        .into_iter()
        .flatten()
        {
            poison(buf);
        }
        if let (Method::GatherBroadcast, Some(f)) = (m, self.full.as_deref_mut()) {
            poison(f);
        }
    }
    fn run(&mut self, m: Method) -> Result<Sample, Error> {
        let rank = self.rank;
        let transport = self
            .transports
            .get(m.key())
            .ok_or_else(|| Error::Internal {
                rank,
                detail: "a bench method ran before its links were opened".into(),
            })?;
        let (plan, options) = (&self.case.plan, self.options);
        let stats: RankStats = match m {
            Method::Reshard => {
                let work = RankJob {
                    plan: &self.mine,
                    src_layout: plan.src(),
                    src: self.src_box.as_ref().zip(self.source.as_deref()),
                    dst: self.dst_box.as_ref().zip(self.values.as_deref_mut()),
                    dst_dtype: plan.dst().dtype(),
                    quant: Some(QuantJob {
                        tensor: "tensor",
                        plan: self.q,
                        rank: &self.part,
                        stage: &mut self.stage,
                        scales: self.scales.as_deref_mut(),
                    }),
                };
                exec::run_rank(work, &**transport, options)?
            }
            Method::ReshardThenQuantize => {
                let work = RankJob {
                    plan: &self.mine_plain,
                    src_layout: self.plain.src(),
                    src: self.src_box.as_ref().zip(self.source.as_deref()),
                    dst: self.dst_box.as_ref().zip(self.received.as_deref_mut()),
                    dst_dtype: self.plain.dst().dtype(),
                    quant: None,
                };
                let stats = exec::run_rank(work, &**transport, options)?;
                self.quantize()?;
                stats
            }
            _ => {
                let work = BaselineJob {
                    baseline: &self.case.baseline,
                    gather: self.gather.as_ref(),
                    broadcast: self.broadcast.as_ref(),
                    src: self.src_box.as_ref().zip(self.source.as_deref()),
                    full: self.full.as_deref_mut(),
                    dst: self.dst_box.as_ref().zip(self.received.as_deref_mut()),
                };
                let stats = baseline::run_rank_gather_broadcast(rank, work, &**transport, options)?;
                self.quantize()?;
                stats
            }
        };
        Ok(Sample::of_rank(&stats))
    }
    fn verify(&mut self, _: Method) -> Result<Checked, Error> {
        let Some(v) = self.values.as_deref() else {
            return Ok(Checked::default());
        };
        let s = self.scales.as_deref().unwrap_or(&[]);
        let held = (v.len() + s.len()) as u64;
        let bytes = match &self.reference {
            Some(reference) => {
                check::verify_quantized(&self.case.plan, reference, self.rank, v, s)?
            }
            None => 0,
        };
        Ok(Checked::new(bytes, held))
    }
    fn extra_bytes(&self, m: Method) -> u64 {
        let received = self.received.as_ref().map_or(0, |r| r.len() as u64);
        let full = self.full.as_ref().map_or(0, |f| f.len() as u64);
        match m {
            Method::ReshardThenQuantize => received,
            Method::GatherBroadcast => received + full,
            _ => 0,
        }
    }
}

/// This process is one rank of a job: its share of the three methods, in turn, on the same
/// buffers. Returns the report for rank 0 and the transport's name.
#[allow(clippy::too_many_arguments)]
pub(super) fn rank<'j, J: Job + ?Sized>(
    repeat: Repeat,
    case: &Case,
    (plain, q): (&Plan, &QuantPlan),
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: Connect<'_, 'j>,
    bar: &ProgressBar,
) -> Result<(serde_json::Value, String), Error> {
    let rank = job.rank();
    let (plan, gb) = (&case.plan, &case.baseline);
    let (src, dst) = (plan.src(), plan.dst());
    let mine = plan.rank_part(rank);
    let part = q.for_rank(src, dst, &mine);
    let (gather, broadcast) = gb.rank_parts(rank);
    let dst_box = dst.local_region(rank);
    let shared = |len: u64| SharedBuffer::new(len as usize);
    let mut subject = OwnRank {
        rank,
        case,
        plain,
        q,
        options,
        connect,
        stage: vec![0u8; part.stage_bytes(q.scale_bytes())],
        mine_plain: plain.rank_part(rank),
        gather,
        broadcast,
        src_box: src.local_region(rank),
        source: fill.shard(src, rank)?,
        values: dst_box
            .as_ref()
            .map(|_| shared(dst.local_bytes(rank)))
            .transpose()?,
        scales: dst_box
            .as_ref()
            .map(|_| vec![0u8; q.dst_scale_bytes(dst, rank) as usize]),
        received: dst_box
            .as_ref()
            .map(|_| shared(plain.dst().local_bytes(rank)))
            .transpose()?,
        full: gb
            .needs_full_buffer(rank)
            .then(|| shared(gb.full_bytes()))
            .transpose()?,
        reference: match dst_box {
            Some(_) => check::reference(plan, fill)?,
            None => None,
        },
        whole: Region::full(dst.shape()),
        dst_box,
        mine,
        part,
        transports: BTreeMap::new(),
    };
    let found = compare(&mut subject, repeat, Some(job), &mut || bar.inc(1))?;
    let name = subject
        .transports
        .get(Method::Reshard.key())
        .map_or("?", |t| t.name())
        .to_string();
    Ok((CaseResult::rank_report(&found), name))
}
