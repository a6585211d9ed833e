//! `bench` of an already-quantized source (an fp8 `--dtype` with `--quant`): the fp8 values
//! and their scales move as two coupled tensors ([`QuantizedMove`]). Three methods, in turn on
//! the same buffers: the coupled reshard (both tensors in one exchange, the batch of
//! [`QuantizedMove::batch`]: one schedule, one stream per peer pair), gather+broadcast of both
//! tensors, and the reshard of the values alone, which is what the transport takes to move the
//! bulk of the bytes and so shows what carrying the scales beside them costs.
//!
//! The source is the `normal` fill quantized block by block. Every shard of either side holds
//! whole blocks (the move is refused otherwise), so a rank's boxes of the values and scales
//! are its box of the fill quantized on its own: no rank materializes the whole tensor. Every
//! repetition of every method is verified, values and (but for the values alone) scales.

use std::collections::BTreeMap;
use std::time::Duration;

use indicatif::ProgressBar;

use reshard::batch::{Batch, RankBatch, run_local_batch, run_rank_batch};
use reshard::convert::quantize_shard;
use reshard::exec::baseline::{self, BaselineJob};
use reshard::exec::{self, ExecOptions, RankJob, RankStats};
use reshard::fill::Fill;
use reshard::layout::Layout;
use reshard::plan::{GatherBroadcast, QuantizedMove};
use reshard::runtime::{AnyTransport, Destination, Links};
use reshard::transport::Job;
use reshard::transport::segment::SharedBuffer;
use reshard::{DType, Error, Rank, Region, Side};

use super::BenchArgs;
use super::driver::{CaseResult, poison};
use super::suite::Case;
use crate::cli::measure::Measured;

/// A rank's boxes of the values and of the scales.
type Boxes = (Vec<u8>, Vec<u8>);

/// What a case of an already-quantized source adds to its [`Case`]: the coupled move (whose
/// values' plan is the case's `plan`), its batch, and gather+broadcast of the scale tensor
/// (the values' is the case's `baseline`).
pub(in crate::cli) struct Coupled {
    pub(in crate::cli) mv: QuantizedMove,
    batch: Batch,
    pub(in crate::cli) scale_baseline: GatherBroadcast,
}

impl Coupled {
    pub(super) fn new(mv: QuantizedMove) -> Result<Coupled, Error> {
        let scale_baseline = GatherBroadcast::on_hosts(mv.scales.src(), mv.scales.dst(), None)?;
        let batch = Batch::quantized(&mv)?;
        Ok(Coupled {
            mv,
            batch,
            scale_baseline,
        })
    }

    /// The value layout and scale layout of `side`.
    fn layouts(&self, side: Side) -> (&Layout, &Layout) {
        match side {
            Side::Src => (self.mv.values.src(), self.mv.scales.src()),
            Side::Dst => (self.mv.values.dst(), self.mv.scales.dst()),
        }
    }

    /// `rank`'s boxes of the values and of the scales on `side`, if it holds a shard there:
    /// its box of the fill, made in f32 and quantized. Since the shard holds whole blocks,
    /// that is its slice of the whole tensor quantized block by block.
    fn boxes(&self, fill: Fill, side: Side, rank: Rank) -> Result<Option<Boxes>, Error> {
        let (values, scales) = self.layouts(side);
        let Some(region) = values.local_region(rank) else {
            return Ok(None);
        };
        let mut v = vec![0u8; values.local_bytes(rank) as usize];
        let mut s = vec![0u8; scales.local_bytes(rank) as usize];
        if region.volume() == 0 {
            return Ok(Some((v, s)));
        }
        let f32_layout = Layout::new(
            values.shape().to_vec(),
            DType::F32,
            values.mesh().clone(),
            values.placements().to_vec(),
        )
        .map_err(|source| Error::Layout { side, source })?;
        let x = fill.shard(&f32_layout, rank)?.unwrap_or_default();
        let (quant, grid) = (self.mv.quant, &self.mv.grid);
        quantize_shard(quant, grid, &region, DType::F32, &x, &mut v, &mut s).map_err(|source| {
            Error::Convert {
                tensor: "tensor".into(),
                source,
            }
        })?;
        Ok(Some((v, s)))
    }

    /// Bytes of the scale shards of every destination rank.
    pub(super) fn dst_scale_bytes(&self) -> u64 {
        self.mv.scales.dst().shard_bytes()
    }
}

/// The three methods of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// Both tensors in one exchange.
    Reshard,
    /// Gather+broadcast of the values, then of the scales.
    GatherBroadcast,
    /// The values' reshard alone.
    ValuesOnly,
}

/// The order in repetition `i`: each method goes first, second and third in turn.
fn order(i: u32) -> [Method; 3] {
    use Method::*;
    crate::cli::measure::in_turn([Reshard, GatherBroadcast, ValuesOnly], i)
}

/// Checks `rank`'s values (and its scales, unless `scales` is `None`) against `expected`.
fn verify(rank: Rank, expected: &Boxes, values: &[u8], scales: Option<&[u8]>) -> Result<(), Error> {
    crate::cli::quant_check::compare(
        rank,
        (&expected.0, values),
        scales.map(|s| (&expected.1[..], s)),
    )
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

/// Every rank a thread of this process: the three methods on the same buffers.
pub(super) fn threads(
    args: &BenchArgs,
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
    let mut dst_values = exec::zeroed_shards(values.dst())?;
    let mut dst_scales = exec::zeroed_shards(scales.dst())?;
    let mut full_values = baseline::full_buffers(&case.baseline)?;
    let mut full_scales = baseline::full_buffers(&c.scale_baseline)?;
    let fulls =
        full_bytes(&case.baseline, &full_values) + full_bytes(&c.scale_baseline, &full_scales);
    let (mut ours, mut gb, mut alone) = (
        Measured::default(),
        Measured::default(),
        Measured::default(),
    );
    let mut checked = 0;
    for i in 0..args.repetitions() {
        let timed = i >= args.warmup;
        for method in order(i) {
            for buf in dst_values.values_mut().chain(dst_scales.values_mut()) {
                poison(buf);
            }
            if method == Method::GatherBroadcast {
                for buf in full_values.values_mut().chain(full_scales.values_mut()) {
                    poison(buf);
                }
            }
            let (elapsed, wire, peak, measured, extra): (Duration, u64, u64, &mut Measured, u64) =
                match method {
                    Method::Reshard => {
                        let a = run_coupled_threads(
                            &c.batch,
                            (&mut src_values, &mut src_scales),
                            (&mut dst_values, &mut dst_scales),
                            options,
                        )?;
                        let peak = a.peak_staging_bytes();
                        (a.elapsed, a.bytes_remote(), peak, &mut ours, 0)
                    }
                    Method::GatherBroadcast => {
                        let a = baseline::run_local_gather_broadcast(
                            &case.baseline,
                            &mut src_values,
                            &mut dst_values,
                            &mut full_values,
                            options,
                        )?;
                        let b = baseline::run_local_gather_broadcast(
                            &c.scale_baseline,
                            &mut src_scales,
                            &mut dst_scales,
                            &mut full_scales,
                            options,
                        )?;
                        (
                            a.elapsed + b.elapsed,
                            a.bytes_remote() + b.bytes_remote(),
                            a.peak_staging_bytes().max(b.peak_staging_bytes()),
                            &mut gb,
                            fulls,
                        )
                    }
                    Method::ValuesOnly => {
                        let a = exec::run_local(values, &src_values, &mut dst_values, options)?;
                        let peak = a.peak_staging_bytes();
                        (a.elapsed, a.bytes_remote(), peak, &mut alone, 0)
                    }
                };
            bar.inc(1);
            for (&r, want) in &expected {
                let v = dst_values.get(&r).map_or(&[][..], Vec::as_slice);
                let s = dst_scales.get(&r).map_or(&[][..], Vec::as_slice);
                verify(r, want, v, (method != Method::ValuesOnly).then_some(s))?;
            }
            checked += 1;
            if timed {
                measured.times.push(elapsed.as_secs_f64());
                measured.wire_bytes = wire;
                measured.peak_extra = peak.saturating_add(extra);
            }
        }
    }
    Ok(CaseResult {
        reshard: ours,
        gather_broadcast: gb,
        reshard_then_quantize: None,
        values_only: Some(alone),
        verified: checked == 3 * args.repetitions(),
    })
}

/// One rank's side of one tensor of the pair: its part of the reshard and of the baseline,
/// its source shard and destination buffers ([`Tensor::connect`] opens the links of both
/// methods).
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
    fn connect_reshard<J: Job + ?Sized>(
        &self,
        job: &J,
        connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    ) -> Result<AnyTransport<'j>, Error> {
        job.barrier()?;
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
    fn connect_baseline<'t, J: Job + ?Sized>(
        &'t self,
        rank: Rank,
        job: &J,
        connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
        whole: &'t Region,
    ) -> Result<AnyTransport<'j>, Error> {
        job.barrier()?;
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
    fn connect<J: Job + ?Sized>(
        batch: &'j Batch,
        values: &Tensor<'j>,
        direct: bool,
        job: &J,
        connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    ) -> Result<CoupledRank<'j>, Error> {
        let part = batch.rank_batch(job.rank())?;
        let links = Links::of_batch(&part);
        job.barrier()?;
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

/// This process is one rank of a job: its share of the three methods, in turn, on the same
/// buffers. With `direct`, the coupled reshard writes its values straight into same-host
/// receivers ([`CoupledRank::connect`]). Returns the report for rank 0 and the transport's name.
#[allow(clippy::too_many_arguments)]
pub(super) fn rank<'j, J: Job + ?Sized>(
    args: &BenchArgs,
    case: &'j Case,
    c: &'j Coupled,
    fill: Fill,
    options: &ExecOptions,
    job: &'j J,
    connect: &dyn Fn(&Links, Destination<'_>) -> Result<AnyTransport<'j>, Error>,
    direct: bool,
    bar: &ProgressBar,
) -> Result<(serde_json::Value, String), Error> {
    let rank = job.rank();
    let (source_values, source_scales) = c.boxes(fill, Side::Src, rank)?.unzip();
    let expected = c.boxes(fill, Side::Dst, rank)?;
    let mut values = Tensor::new(&c.mv.values, &case.baseline, rank, source_values)?;
    let mut scales = Tensor::new(&c.mv.scales, &c.scale_baseline, rank, source_scales)?;
    let whole_values = Region::full(c.mv.values.dst().shape());
    let whole_scales = Region::full(c.mv.scales.dst().shape());
    // the links, opened one after the other by every rank
    let v_reshard = values.connect_reshard(job, connect)?;
    let v_baseline = values.connect_baseline(rank, job, connect, &whole_values)?;
    let s_baseline = scales.connect_baseline(rank, job, connect, &whole_scales)?;
    let coupled = CoupledRank::connect(&c.batch, &values, direct, job, connect)?;
    let fulls = values.full_bytes() + scales.full_bytes();

    let (mut ours, mut gb, mut alone) = (
        Measured::default(),
        Measured::default(),
        Measured::default(),
    );
    let mut checked = 0;
    for i in 0..args.repetitions() {
        let timed = i >= args.warmup;
        for method in order(i) {
            let full = method == Method::GatherBroadcast;
            values.poison(full);
            scales.poison(full);
            match method {
                Method::Reshard => ours.repeat(job, timed, 0, || {
                    coupled.run(&mut values, &mut scales, options)
                })?,
                Method::GatherBroadcast => gb.repeat(job, timed, fulls, || {
                    let mut stats = values.gather_broadcast(rank, &*v_baseline, options)?;
                    stats.absorb(&scales.gather_broadcast(rank, &*s_baseline, options)?);
                    Ok(stats)
                })?,
                Method::ValuesOnly => {
                    alone.repeat(job, timed, 0, || values.reshard(&*v_reshard, options))?
                }
            }
            bar.inc(1);
            if let (Some(want), Some(v)) = (&expected, values.shard.as_deref()) {
                let s = scales.shard.as_deref().unwrap_or(&[]);
                verify(rank, want, v, (method != Method::ValuesOnly).then_some(s))?;
            }
            checked += 1;
        }
    }
    let report = serde_json::json!({
        "reshard": ours.report(),
        "gather_broadcast": gb.report(),
        "values_only": alone.report(),
        "verified": checked == 3 * args.repetitions(),
    });
    Ok((report, v_reshard.name().to_string()))
}
