//! `bench` of an already-quantized source (an fp8 `--dtype` with `--quant`): the fp8 values
//! and their scales move as two coupled tensors ([`reshard::plan::QuantizedMove`]). Three methods, in turn on
//! the same buffers: the coupled reshard (both tensors in one exchange, the batch of
//! [`reshard::batch::Batch::quantized`]: one schedule, one stream per peer pair), gather+broadcast of both
//! tensors, and the reshard of the values alone, which is what the transport takes to move the
//! bulk of the bytes and so shows what carrying the scales beside them costs.
//!
//! The source is the `normal` fill quantized block by block. Every shard of either side holds
//! whole blocks (the move is refused otherwise), so a rank's boxes of the values and scales
//! are its box of the fill quantized on its own: no rank materializes the whole tensor. Every
//! repetition of every method is verified, values and (but for the values alone) scales, by
//! the harness ([`reshard::runtime::harness`]).

use std::collections::BTreeMap;

use indicatif::ProgressBar;

use reshard::batch::{Batch, RankBatch, run_local_batch, run_rank_batch};
use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, RankJob, RankStats};
use reshard::fill::Fill;
use reshard::layout::Layout;
use reshard::plan::GatherBroadcast;
use reshard::runtime::harness::{Checked, Compare, Repeat, Sample, compare};
use reshard::runtime::refit::check;
use reshard::runtime::{AnyTransport, Destination, Links};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{Error, Rank, Region, Side};

use super::coupled::{Boxes, Coupled};
use super::result::{CaseResult, Method};
use super::suite::Case;
use reshard::runtime::harness::poison;

/// The three methods, in the order of the first repetition.
fn methods() -> Vec<Method> {
    vec![Method::Reshard, Method::GatherBroadcast, Method::ValuesOnly]
}

/// Checks `rank`'s values (and its scales, unless `scales` is `None`) against `expected`, or
/// nothing where it has no boxes; returns what the check covered of the buffers.
fn verify(
    rank: Rank,
    expected: Option<&Boxes>,
    values: &[u8],
    scales: Option<&[u8]>,
) -> Result<Checked, Error> {
    let held = (values.len() + scales.map_or(0, <[u8]>::len)) as u64;
    let Some(expected) = expected else {
        return Ok(Checked::new(0, held));
    };
    let bytes = check::compare(
        rank,
        (&expected.0, values),
        scales.map(|s| (&expected.1[..], s)),
    )?;
    Ok(Checked::new(bytes, held))
}

/// Rank -> local buffer.
type Shards = BTreeMap<Rank, Vec<u8>>;

/// Runs the coupled batch between threads on the value and scale shards, lent to it as each
/// rank's buffers `[values, scales]` and back in place on return, also on error.
fn run_coupled_threads(
    batch: &Batch,
    src: (&mut Shards, &mut Shards),
    dst: (&mut Shards, &mut Shards),
    options: &ExecOptions,
) -> Result<reshard::exec::RunStats, Error> {
    fn join(values: &mut Shards, scales: &mut Shards) -> BTreeMap<Rank, Vec<Vec<u8>>> {
        std::mem::take(values)
            .into_iter()
            .map(|(r, v)| (r, vec![v, scales.remove(&r).unwrap_or_default()]))
            .collect()
    }
    fn split(joined: BTreeMap<Rank, Vec<Vec<u8>>>, values: &mut Shards, scales: &mut Shards) {
        for (r, mut both) in joined {
            scales.insert(r, both.pop().unwrap_or_default());
            values.insert(r, both.pop().unwrap_or_default());
        }
    }
    let sources = join(src.0, src.1);
    let mut dests = join(dst.0, dst.1);
    let stats = run_local_batch(batch, &sources, &mut dests, &mut BTreeMap::new(), options);
    split(sources, src.0, src.1);
    split(dests, dst.0, dst.1);
    stats
}

/// Bytes of the full-tensor buffers of a baseline, when it needs any.
fn full_bytes(gb: &GatherBroadcast, full: &BTreeMap<Rank, Vec<u8>>) -> u64 {
    if full.is_empty() { 0 } else { gb.full_bytes() }
}

/// Every rank a thread of this process: every rank's buffers of both tensors.
struct Threads<'a> {
    case: &'a Case,
    c: &'a Coupled,
    options: &'a ExecOptions,
    src: (Shards, Shards),
    dst: (Shards, Shards),
    full: (Shards, Shards),
    expected: BTreeMap<Rank, Boxes>,
}

impl Compare for Threads<'_> {
    type Method = Method;
    fn methods(&self) -> Vec<Method> {
        methods()
    }
    fn poison(&mut self, m: Method) {
        for buf in self.dst.0.values_mut().chain(self.dst.1.values_mut()) {
            poison(buf);
        }
        if m == Method::GatherBroadcast {
            for buf in self.full.0.values_mut().chain(self.full.1.values_mut()) {
                poison(buf);
            }
        }
    }
    fn run(&mut self, m: Method) -> Result<Sample, Error> {
        let (src, dst, full, options) =
            (&mut self.src, &mut self.dst, &mut self.full, self.options);
        Ok(match m {
            Method::GatherBroadcast => {
                let a = baseline::run_local_gather_broadcast(
                    &self.case.baseline,
                    &mut src.0,
                    &mut dst.0,
                    &mut full.0,
                    options,
                )?;
                let b = baseline::run_local_gather_broadcast(
                    &self.c.scale_baseline,
                    &mut src.1,
                    &mut dst.1,
                    &mut full.1,
                    options,
                )?;
                Sample::of_run(&a).then(Sample::of_run(&b))
            }
            Method::ValuesOnly => Sample::of_run(&exec::run_local(
                &self.c.mv.values,
                &src.0,
                &mut dst.0,
                options,
            )?),
            _ => Sample::of_run(&run_coupled_threads(
                &self.c.batch,
                (&mut src.0, &mut src.1),
                (&mut dst.0, &mut dst.1),
                options,
            )?),
        })
    }
    fn verify(&mut self, m: Method) -> Result<Checked, Error> {
        let mut checked = Checked::default();
        for (&r, v) in &self.dst.0 {
            let s = self.dst.1.get(&r).map_or(&[][..], Vec::as_slice);
            let scales = (m != Method::ValuesOnly).then_some(s);
            checked = checked + verify(r, self.expected.get(&r), v, scales)?;
        }
        Ok(checked)
    }
    fn extra_bytes(&self, m: Method) -> u64 {
        match m {
            Method::GatherBroadcast => {
                full_bytes(&self.case.baseline, &self.full.0)
                    + full_bytes(&self.c.scale_baseline, &self.full.1)
            }
            _ => 0,
        }
    }
}

/// Every rank a thread of this process: the three methods on the same buffers.
pub(super) fn threads(
    repeat: Repeat,
    case: &Case,
    c: &Coupled,
    fill: Fill,
    options: &ExecOptions,
    bar: &ProgressBar,
) -> Result<CaseResult, Error> {
    let (values, scales) = (&c.mv.values, &c.mv.scales);
    let (mut src_values, mut src_scales) = (BTreeMap::new(), BTreeMap::new());
    for &r in values.src().mesh().ranks() {
        if let Some((v, s)) = c.boxes(fill, Side::Src, r)? {
            src_values.insert(r, v);
            src_scales.insert(r, s);
        }
    }
    let mut expected = BTreeMap::new();
    for &r in values.dst().mesh().ranks() {
        if let Some(b) = c.boxes(fill, Side::Dst, r)? {
            expected.insert(r, b);
        }
    }
    let mut subject = Threads {
        case,
        c,
        options,
        src: (src_values, src_scales),
        dst: (
            exec::zeroed_shards(values.dst())?,
            exec::zeroed_shards(scales.dst())?,
        ),
        full: (
            baseline::full_buffers(&case.baseline)?,
            baseline::full_buffers(&c.scale_baseline)?,
        ),
        expected,
    };
    let found = compare(&mut subject, repeat, None::<&dyn Job>, &mut || bar.inc(1))?;
    Ok(CaseResult::of(&found))
}

/// One rank's side of one tensor of the pair: its part of the reshard and of the baseline,
/// its source shard and destination buffers ([`Tensor::connect_reshard`] and [`Tensor::connect_baseline`] open the links of both
/// methods; each after the harness's barrier).
struct Tensor<'j> {
    layouts: (&'j Layout, &'j Layout),
    gb: &'j GatherBroadcast,
    mine: reshard::RankPlan,
    gather: Option<reshard::RankPlan>,
    broadcast: Option<reshard::RankPlan>,
    src_box: Option<Region>,
    dst_box: Option<Region>,
    source: Option<Vec<u8>>,
    shard: Option<SharedBuffer>,
    full: Option<SharedBuffer>,
}

impl<'j> Tensor<'j> {
    fn new(
        plan: &'j reshard::Plan,
        gb: &'j GatherBroadcast,
        rank: Rank,
        source: Option<Vec<u8>>,
    ) -> Result<Tensor<'j>, Error> {
        let (src, dst) = (plan.src(), plan.dst());
        let (gather, broadcast) = gb.rank_parts(rank);
        let dst_box = dst.local_region(rank);
        let shared = |len: u64| SharedBuffer::new(len as usize);
        Ok(Tensor {
            layouts: (src, dst),
            gb,
            mine: plan.rank_part(rank),
            gather,
            broadcast,
            src_box: src.local_region(rank),
            shard: dst_box
                .as_ref()
                .map(|_| shared(dst.local_bytes(rank)))
                .transpose()?,
            dst_box,
            source,
            full: gb
                .needs_full_buffer(rank)
                .then(|| shared(gb.full_bytes()))
                .transpose()?,
        })
    }

    /// Opens the reshard's links (every rank alike), with this rank's shard as the
    /// destination same-host senders may write into.
    fn connect_reshard(
        &self,
        connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    ) -> Result<AnyTransport<'j>, Error> {
        let shard = self
            .dst_box
            .as_ref()
            .and_then(|b| self.shard.as_ref().map(|s| (s, b)));
        connect(
            &Links::of_plan(&self.mine),
            shard.filter(|_| !self.mine.relays()),
        )
    }

    /// Opens the baseline's links (every rank alike), with this rank's full-tensor buffer (or
    /// shard) as the destination same-host senders may write into.
    fn connect_baseline(
        &self,
        rank: Rank,
        connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
        whole: &Region,
    ) -> Result<AnyTransport<'j>, Error> {
        let links = Links::of_plans([&self.gather, &self.broadcast].into_iter().flatten());
        let tensor = self
            .full
            .as_ref()
            .or(self.shard.as_ref().filter(|_| self.gb.gets_tensor(rank)));
        connect(&links, tensor.map(|f| (f, whole)))
    }

    fn poison(&mut self, full: bool) {
        if let Some(s) = self.shard.as_deref_mut() {
            poison(s);
        }
        if let (true, Some(f)) = (full, self.full.as_deref_mut()) {
            poison(f);
        }
    }

    fn reshard<T>(&mut self, transport: &T, options: &ExecOptions) -> Result<RankStats, Error>
    where
        T: for<'b> reshard::transport::Transport<'b> + ?Sized,
    {
        let work = RankJob {
            plan: &self.mine,
            src_layout: self.layouts.0,
            src: self.src_box.as_ref().zip(self.source.as_deref()),
            dst: self.dst_box.as_ref().zip(self.shard.as_deref_mut()),
            dst_dtype: self.layouts.1.dtype(),
            quant: None,
        };
        exec::run_rank_any(work, transport, options)
    }

    fn gather_broadcast<T>(
        &mut self,
        rank: Rank,
        transport: &T,
        options: &ExecOptions,
    ) -> Result<RankStats, Error>
    where
        T: for<'b> reshard::transport::Transport<'b> + ?Sized,
    {
        let work = BaselineJob {
            baseline: self.gb,
            gather: self.gather.as_ref(),
            broadcast: self.broadcast.as_ref(),
            src: self.src_box.as_ref().zip(self.source.as_deref()),
            full: self.full.as_deref_mut(),
            dst: self.dst_box.as_ref().zip(self.shard.as_deref_mut()),
        };
        baseline::run_rank_gather_broadcast(rank, work, transport, options)
    }

    fn full_bytes(&self) -> u64 {
        self.full.as_ref().map_or(0, |f| f.len() as u64)
    }
}

/// This rank's part of the coupled batch, over links of its own.
struct CoupledRank<'j> {
    batch: &'j Batch,
    part: RankBatch,
    transport: AnyTransport<'j>,
}

impl<'j> CoupledRank<'j> {
    /// Opens the batch's links (every rank alike). With `direct` (shared memory may carry
    /// some peers), the link is offered this rank's value shard, so that same-host senders
    /// write the values straight into it (the batch marks its value moves to land there,
    /// [`reshard::batch::BatchOptions::direct`]) while the scales go through rings; otherwise
    /// every chunk takes the link's usual way.
    fn connect(
        batch: &'j Batch,
        values: &Tensor<'j>,
        direct: bool,
        rank: Rank,
        connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    ) -> Result<CoupledRank<'j>, Error> {
        let part = batch.rank_batch(rank)?;
        let links = Links::of_batch(&part);
        let shard = values
            .dst_box
            .as_ref()
            .and_then(|b| values.shard.as_ref().map(|s| (s, b)))
            .filter(|_| direct);
        let transport = connect(&links, shard)?;
        Ok(CoupledRank {
            batch,
            part,
            transport,
        })
    }

    /// Moves the values and the scales, from and into this rank's buffers of them.
    fn run(
        &self,
        values: &mut Tensor<'_>,
        scales: &mut Tensor<'_>,
        options: &ExecOptions,
    ) -> Result<RankStats, Error> {
        let src: Vec<&[u8]> = [values.source.as_deref(), scales.source.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        let mut dst: Vec<&mut [u8]> = [values.shard.as_deref_mut(), scales.shard.as_deref_mut()]
            .into_iter()
            .flatten()
            .collect();
        run_rank_batch(
            self.batch,
            &self.part,
            &src,
            &mut dst,
            &mut [],
            &*self.transport,
            options,
        )
    }
}

/// Connects a rank's links to its peers ([`reshard::runtime::World::connect`]).
type Connect<'c, 'j> = &'c dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>;

/// This process's rank: its buffers of both tensors and every method's links.
struct OwnRank<'j, 'c, J: ?Sized> {
    rank: Rank,
    job: &'j J,
    connect: Connect<'c, 'j>,
    options: &'c ExecOptions,
    batch: &'j Batch,
    direct: bool,
    values: Tensor<'j>,
    scales: Tensor<'j>,
    expected: Option<Boxes>,
    whole: (Region, Region),
    coupled: Option<CoupledRank<'j>>,
    baselines: Option<(AnyTransport<'j>, AnyTransport<'j>)>,
    values_only: Option<AnyTransport<'j>>,
}

impl<J: Job + ?Sized> Compare for OwnRank<'_, '_, J> {
    type Method = Method;
    fn methods(&self) -> Vec<Method> {
        methods()
    }
    fn connect(&mut self, m: Method) -> Result<(), Error> {
        let (rank, connect) = (self.rank, self.connect);
        match m {
            Method::GatherBroadcast => {
                let v = self.values.connect_baseline(rank, connect, &self.whole.0)?;
                self.job.barrier()?;
                let s = self.scales.connect_baseline(rank, connect, &self.whole.1)?;
                self.baselines = Some((v, s));
            }
            Method::ValuesOnly => self.values_only = Some(self.values.connect_reshard(connect)?),
            _ => {
                let coupled =
                    CoupledRank::connect(self.batch, &self.values, self.direct, rank, connect)?;
                self.coupled = Some(coupled);
            }
        }
        Ok(())
    }
    fn poison(&mut self, m: Method) {
        let full = m == Method::GatherBroadcast;
        self.values.poison(full);
        self.scales.poison(full);
    }
    fn run(&mut self, m: Method) -> Result<Sample, Error> {
        let (rank, options) = (self.rank, self.options);
        let not_connected = || Error::Internal {
            rank,
            detail: "a bench method ran before its links were opened".into(),
        };
        let stats = match m {
            Method::GatherBroadcast => {
                let (v, s) = self.baselines.as_ref().ok_or_else(not_connected)?;
                let mut stats = self.values.gather_broadcast(rank, &**v, options)?;
                stats.absorb(&self.scales.gather_broadcast(rank, &**s, options)?);
                stats
            }
            Method::ValuesOnly => {
                let t = self.values_only.as_ref().ok_or_else(not_connected)?;
                self.values.reshard(&**t, options)?
            }
            _ => {
                let coupled = self.coupled.as_ref().ok_or_else(not_connected)?;
                coupled.run(&mut self.values, &mut self.scales, options)?
            }
        };
        Ok(Sample::of_rank(&stats))
    }
    fn verify(&mut self, m: Method) -> Result<Checked, Error> {
        let Some(v) = self.values.shard.as_deref() else {
            return Ok(Checked::default());
        };
        let s = self.scales.shard.as_deref().unwrap_or(&[]);
        let scales = (m != Method::ValuesOnly).then_some(s);
        verify(self.rank, self.expected.as_ref(), v, scales)
    }
    fn extra_bytes(&self, m: Method) -> u64 {
        match m {
            Method::GatherBroadcast => self.values.full_bytes() + self.scales.full_bytes(),
            _ => 0,
        }
    }
}

/// This process is one rank of a job: its share of the three methods, in turn, on the same
/// buffers. With `direct`, the coupled reshard writes its values straight into same-host
/// receivers ([`CoupledRank::connect`]). Returns the report for rank 0 and the transport's
/// name.
#[allow(clippy::too_many_arguments)]
pub(super) fn rank<'j, J: Job + ?Sized>(
    repeat: Repeat,
    case: &'j Case,
    c: &'j Coupled,
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: Connect<'_, 'j>,
    direct: bool,
    bar: &ProgressBar,
) -> Result<(serde_json::Value, String), Error> {
    let rank = job.rank();
    let (source_values, source_scales) = c.boxes(fill, Side::Src, rank)?.unzip();
    let mut subject = OwnRank {
        rank,
        job,
        connect,
        options,
        batch: &c.batch,
        direct,
        values: Tensor::new(&c.mv.values, &case.baseline, rank, source_values)?,
        scales: Tensor::new(&c.mv.scales, &c.scale_baseline, rank, source_scales)?,
        expected: c.boxes(fill, Side::Dst, rank)?,
        whole: (
            Region::full(c.mv.values.dst().shape()),
            Region::full(c.mv.scales.dst().shape()),
        ),
        coupled: None,
        baselines: None,
        values_only: None,
    };
    let found = compare(&mut subject, repeat, Some(job), &mut || bar.inc(1))?;
    let name = subject
        .values_only
        .as_ref()
        .map_or("?", |t| t.name())
        .to_string();
    Ok((CaseResult::rank_report(&found), name))
}
