//! Quantizing in flight for `reshard.torch`: one rank's part of a reshard into fp8 with
//! scales, with the core's arithmetic (`reshard_core::convert`) and the runtime's program of
//! it (`lower_plan` of the core's `QuantPlan`: its amax exchanges, then its values and scales
//! by peer, in the program's order).
//!
//! A [`QuantPacking`] is computed once per layouts, scheme and rank. Its calls, in order:
//! [`QuantPacking::amax`] (the local amax of the source shard, and the partial amax this rank
//! sends each peer that shares a block with it), [`QuantPacking::merge`] (the peers' partial
//! amax, then the scales), [`QuantPacking::pack`] (every message quantized straight from the
//! source shard: a message holds the fp8 values of its transfers, row-major, one after the
//! other, then at the next multiple of 16 the scales they carry) and
//! [`QuantPacking::unpack`] (values into the destination shard, scales into the scale shard).
//! Local copies travel as a message from the rank to itself.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use reshard_core::convert::{AmaxGrid, BlockGrid, Scales};
use reshard_core::plan::{QuantPlan, QuantRankPlan};
use reshard_core::region::Region;
use reshard_core::{DType, Plan, Rank};

use crate::layout::PyLayout;
use crate::{error, plan_options};

mod messages;
mod scales;

use messages::{Message, lowered};
use scales::request;
pub(crate) use scales::{quant_scale_dtype, quant_scale_shape, quantized_scale_layouts};

/// Calls `f(element index in shard, run length)` for every row of `region` (inside `shard`),
/// row-major.
fn for_rows(shard: &Region, region: &Region, mut f: impl FnMut(usize, usize)) {
    if region.is_empty() {
        return;
    }
    let n = region.ndim();
    if n == 0 {
        f(0, 1);
        return;
    }
    let len = region.extent[n - 1] as usize;
    let rows: u64 = region.extent[..n - 1].iter().product();
    let mut p = region.offset.clone();
    for _ in 0..rows {
        let local = (0..n).fold(0u64, |acc, d| {
            acc * shard.extent[d] + (p[d] - shard.offset[d])
        });
        f(local as usize, len);
        for d in (0..n - 1).rev() {
            p[d] += 1;
            if p[d] < region.offset[d] + region.extent[d] {
                break;
            }
            p[d] = region.offset[d];
        }
    }
}

/// A contiguous CPU tensor's bytes: its address and size, checked to be `want` bytes.
fn raw(tensor: &Bound<'_, PyAny>, want: usize, what: &str) -> PyResult<(usize, usize)> {
    let device = tensor
        .getattr("device")?
        .getattr("type")?
        .str()?
        .to_string();
    if device != "cpu" {
        return Err(error(format!(
            "{what}: the tensor is on {device}; quantizing in flight copies CPU tensors only"
        )));
    }
    if !tensor.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(error(format!("{what}: the tensor must be contiguous")));
    }
    let numel: usize = tensor.call_method0("numel")?.extract()?;
    let elem: usize = tensor.call_method0("element_size")?.extract()?;
    if numel * elem != want {
        return Err(error(format!(
            "{what}: the tensor has {} bytes, expected {want}",
            numel * elem
        )));
    }
    let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
    Ok((ptr, want))
}

/// # Safety
/// `ptr` and `len` describe live memory that nothing else touches during the borrow.
unsafe fn bytes_mut<'a>((ptr, len): (usize, usize)) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}

/// A message as [`QuantPacking::messages`] describes it: peer, bytes, the value transfers
/// `(at, src, dst, offset, extent)` and the scale boxes `(at, offset, extent)`.
type MessageParts = (
    Rank,
    usize,
    Vec<(usize, Rank, Rank, Vec<u64>, Vec<u64>)>,
    Vec<(usize, Vec<u64>, Vec<u64>)>,
);

/// One rank's part of a reshard into fp8 with scales (see the module docs).
#[pyclass(frozen, module = "reshard", name = "QuantPacking")]
pub(crate) struct QuantPacking {
    qp: QuantPlan,
    qrp: QuantRankPlan,
    src_dtype: DType,
    src_shard: Option<Region>,
    dst_shard: Option<Region>,
    /// Amax exchanges, sorted by peer and blocks: both ends order them alike.
    amax: Vec<(Rank, Region)>,
    sends: Vec<Message>,
    recvs: Vec<Message>,
    local: Option<Message>,
}

/// A source rank's amax of the blocks its shard touches, before the peers' partial amax are
/// merged ([`QuantPacking::amax`]). One per tensor and call: tensors of equal layouts share
/// their [`QuantPacking`], never this.
#[pyclass(frozen, module = "reshard", name = "QuantAmax")]
pub(crate) struct QuantAmax(AmaxGrid);

/// A source rank's scales of one tensor in one call ([`QuantPacking::merge`]).
#[pyclass(frozen, module = "reshard", name = "QuantScales")]
pub(crate) struct QuantScales(Scales);

impl QuantPacking {
    /// Quantizes the message `m` from the source shard `src` into `out`.
    fn pack_one(&self, m: &Message, scales: &Scales, src: &[u8], out: &mut [u8]) {
        let shard = self
            .src_shard
            .as_ref()
            .expect("a sender holds a source shard");
        let elem = self.src_dtype.size();
        let mut at = 0;
        for t in &m.values {
            for_rows(shard, &t.region, |first, len| {
                scales.quantize_run(
                    shard,
                    self.src_dtype,
                    first as u64,
                    &src[first * elem..(first + len) * elem],
                    &mut out[at..at + len],
                );
                at += len;
            });
        }
        let size = self.qp.scale_bytes();
        let mut at = m.scales_at;
        for s in &m.scales {
            let n = s.region.volume() as usize * size;
            scales.write(&s.region, &mut out[at..at + n]);
            at += n;
        }
    }

    /// Copies the message `m` from `buf` into the destination and scale shards.
    fn unpack_one(&self, m: &Message, buf: &[u8], dst: &mut [u8], scale: &mut [u8]) {
        let shard = self
            .dst_shard
            .as_ref()
            .expect("a receiver holds a destination shard");
        let mut at = 0;
        for t in &m.values {
            for_rows(shard, &t.region, |first, len| {
                dst[first..first + len].copy_from_slice(&buf[at..at + len]);
                at += len;
            });
        }
        let blocks = self.qrp.dst_blocks.as_ref().expect("a receiver has scales");
        let size = self.qp.scale_bytes();
        let mut at = m.scales_at;
        for s in &m.scales {
            for_rows(blocks, &s.region, |first, len| {
                let n = len * size;
                scale[first * size..first * size + n].copy_from_slice(&buf[at..at + n]);
                at += n;
            });
        }
    }

    fn src_bytes(&self) -> usize {
        self.src_shard
            .as_ref()
            .map_or(0, |s| s.volume() as usize * self.src_dtype.size())
    }
}

#[pymethods]
impl QuantPacking {
    /// `QuantPacking(src, dst, rank, quant, scale_dtype=None)`: `rank`'s part of the reshard
    /// from `src` into the fp8 layout `dst`, quantized as `quant` says.
    #[new]
    #[pyo3(signature = (src, dst, rank, quant, scale_dtype = None))]
    fn new(
        src: &Bound<'_, PyLayout>,
        dst: &Bound<'_, PyLayout>,
        rank: usize,
        quant: &str,
        scale_dtype: Option<&str>,
    ) -> PyResult<QuantPacking> {
        let (src, dst) = (src.get().inner.clone(), dst.get().inner.clone());
        let req = request(quant, scale_dtype)?;
        let plan = Plan::with_quant(src.clone(), dst.clone(), plan_options(None), Some(req))
            .map_err(error)?;
        let qp = plan.quant().expect("a quantizing plan").clone();
        let rp = plan.rank_part(rank);
        let qrp = qp.for_rank(&src, &dst, &rp);
        let (amax, sends, recvs, local) = lowered(&src, &dst, rank, &rp, &qp, &qrp)?;
        Ok(QuantPacking {
            src_dtype: src.dtype(),
            src_shard: src.local_region(rank),
            dst_shard: dst.local_region(rank),
            qp,
            qrp,
            amax,
            sends,
            recvs,
            local,
        })
    }

    /// `(peer, bytes)` of every partial amax message, each way, in exchange order.
    #[getter]
    fn amax_messages(&self) -> Vec<(usize, usize)> {
        self.amax
            .iter()
            .map(|(p, b)| (*p, b.volume() as usize * 4))
            .collect()
    }

    /// `(peer, bytes)` of every message this rank sends.
    #[getter]
    fn sends(&self) -> Vec<(usize, usize)> {
        self.sends.iter().map(|m| (m.peer, m.size)).collect()
    }

    /// `(peer, bytes)` of every message this rank receives.
    #[getter]
    fn recvs(&self) -> Vec<(usize, usize)> {
        self.recvs.iter().map(|m| (m.peer, m.size)).collect()
    }

    /// Bytes of the rank's message to itself (its local copies), 0 if none.
    #[getter]
    fn local_bytes(&self) -> usize {
        self.local.as_ref().map_or(0, |m| m.size)
    }

    /// The shape of this rank's scale shard, or None if it is not a destination.
    #[getter]
    fn scale_shape(&self) -> Option<Vec<u64>> {
        self.qrp.dst_blocks.as_ref().map(|b| b.extent.clone())
    }

    /// The scale dtype: `f32` or `e8m0` (one byte per scale).
    #[getter]
    fn scale_dtype(&self) -> String {
        self.qp.quant.scale_dtype.to_string()
    }

    /// The block's extent along every dim (a dim a block spans whole has the dim's size).
    #[getter]
    fn block(&self) -> Vec<u64> {
        self.qp.grid.block().to_vec()
    }

    /// The scheme as it prints (`block:128x128`, `block:128x128:ue8m0`, `mx:32`, `channel`,
    /// `tensor`).
    #[getter]
    fn scheme(&self) -> String {
        self.qp.quant.scheme.to_string()
    }

    /// `(fmax, emax)` of the fp8 format: the largest magnitude and the exponent of the
    /// largest power of two (448 and 8 for e4m3, 57344 and 15 for e5m2).
    #[getter]
    fn fp8_limits(&self) -> (f32, i32) {
        (self.qp.quant.fp8.fmax(), self.qp.quant.fp8.emax())
    }

    /// `(peer, offset, extent)` of every partial amax exchange, in grid coordinates, in the
    /// order of [`QuantPacking::amax_messages`].
    #[getter]
    #[allow(clippy::type_complexity)]
    fn amax_blocks(&self) -> Vec<(usize, Vec<u64>, Vec<u64>)> {
        self.amax
            .iter()
            .map(|(p, b)| (*p, b.offset.clone(), b.extent.clone()))
            .collect()
    }

    /// The grid coordinates of the first scale of this rank's scale shard, or None if it is
    /// not a destination.
    #[getter]
    fn scale_offset(&self) -> Option<Vec<u64>> {
        self.qrp.dst_blocks.as_ref().map(|b| b.offset.clone())
    }

    /// What every message of one direction holds and where (`which`: `"sends"`, `"recvs"`
    /// or `"local"`): `(peer, bytes, values, scales)` per message, with `values` as
    /// `(at, src, dst, offset, extent)` (fp8 bytes of a transfer, row-major, in global
    /// coordinates) and `scales` as `(at, offset, extent)` (scales of a box of the grid,
    /// row-major, in the scale dtype). What the checksums cover, and the layout another
    /// packer of the same messages (torch operations on a device) must follow.
    #[allow(clippy::type_complexity)]
    fn messages(&self, which: &str) -> PyResult<Vec<MessageParts>> {
        let list: Vec<&Message> = match which {
            "sends" => self.sends.iter().collect(),
            "recvs" => self.recvs.iter().collect(),
            "local" => self.local.iter().collect(),
            other => {
                return Err(error(format!(
                    "which: {other} is invalid: expected `sends`, `recvs` or `local`"
                )));
            }
        };
        let size = self.qp.scale_bytes();
        Ok(list
            .into_iter()
            .map(|m| {
                let mut at = 0;
                let values = m
                    .values
                    .iter()
                    .map(|t| {
                        let here = at;
                        at += t.region.volume() as usize;
                        let r = &t.region;
                        (here, t.src, t.dst, r.offset.clone(), r.extent.clone())
                    })
                    .collect();
                let mut at = m.scales_at;
                let scales = m
                    .scales
                    .iter()
                    .map(|s| {
                        let here = at;
                        at += s.region.volume() as usize * size;
                        (here, s.region.offset.clone(), s.region.extent.clone())
                    })
                    .collect();
                (m.peer, m.size, values, scales)
            })
            .collect())
    }

    /// Computes the amax of the blocks the source shard `src` (a contiguous CPU tensor, or
    /// None on a rank that is no source) touches: `(amax, payloads)`, the partial amax this
    /// rank sends each peer of [`QuantPacking::amax_messages`] among them (`amax` None on a
    /// rank that is no source). A non-finite value is an error naming its block and element.
    #[allow(clippy::type_complexity)]
    fn amax<'py>(
        &self,
        py: Python<'py>,
        src: &Bound<'py, PyAny>,
    ) -> PyResult<(Option<QuantAmax>, Vec<Bound<'py, PyBytes>>)> {
        let Some(shard) = &self.src_shard else {
            return Ok((None, Vec::new()));
        };
        let r = raw(src, self.src_bytes(), "src_local")?;
        // SAFETY: the caller holds `src` for the call; nothing writes it meanwhile.
        let buf = unsafe { bytes_mut(r) };
        let grid: &BlockGrid = &self.qp.grid;
        let local = py
            .detach(|| AmaxGrid::local(grid, shard, buf, self.src_dtype))
            .map_err(error)?;
        let out = self
            .amax
            .iter()
            .map(|(_, b)| PyBytes::new(py, &local.payload(b)))
            .collect();
        Ok((Some(QuantAmax(local)), out))
    }

    /// Merges the peers' partial amax (one payload per [`QuantPacking::amax_messages`], in
    /// order) into `amax` and returns the scales (None on a rank that is no source).
    fn merge(
        &self,
        amax: Option<&Bound<'_, QuantAmax>>,
        payloads: Vec<Vec<u8>>,
    ) -> PyResult<Option<QuantScales>> {
        let Some(amax) = amax else {
            return Ok(None);
        };
        if payloads.len() != self.amax.len() {
            return Err(error(format!(
                "expected {} partial amax payloads, got {}",
                self.amax.len(),
                payloads.len()
            )));
        }
        let mut local = amax.get().0.clone();
        for ((_, blocks), p) in self.amax.iter().zip(&payloads) {
            local.merge(blocks, p).map_err(error)?;
        }
        Ok(Some(QuantScales(Scales::new(
            self.qp.quant,
            &self.qp.grid,
            &local,
        ))))
    }

    /// Quantizes every send message into its buffer (contiguous CPU uint8 tensors, one per
    /// [`QuantPacking::sends`]) and the local message into `local` (None without one), from
    /// the source shard `src` with `scales` (from [`QuantPacking::merge`]), with the GIL
    /// released.
    #[pyo3(signature = (scales, src, buffers, local = None))]
    fn pack(
        &self,
        py: Python<'_>,
        scales: &Bound<'_, QuantScales>,
        src: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyList>,
        local: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if self.sends.is_empty() && self.local.is_none() {
            return Ok(());
        }
        let scales = &scales.get().0;
        let s = raw(src, self.src_bytes(), "src_local")?;
        if buffers.len() != self.sends.len() {
            return Err(error(format!(
                "expected {} send buffers, got {}",
                self.sends.len(),
                buffers.len()
            )));
        }
        let mut outs = Vec::new();
        for (m, b) in self.sends.iter().zip(buffers.iter()) {
            outs.push((m, raw(&b, m.size, "send buffer")?));
        }
        if let (Some(m), Some(b)) = (&self.local, local) {
            outs.push((m, raw(b, m.size, "local buffer")?));
        }
        py.detach(|| {
            // SAFETY: the caller holds the tensors for the call; the buffers are distinct.
            let src = unsafe { bytes_mut(s) };
            for (m, r) in outs {
                self.pack_one(m, scales, src, unsafe { bytes_mut(r) });
            }
        });
        Ok(())
    }

    /// Copies every received message (one buffer per [`QuantPacking::recvs`]) and the local
    /// message (`local`, None without one) into the destination shard `dst` and the scale
    /// shard `scale` (contiguous CPU tensors), with the GIL released.
    #[pyo3(signature = (buffers, dst, scale, local = None))]
    fn unpack(
        &self,
        py: Python<'_>,
        buffers: &Bound<'_, PyList>,
        dst: &Bound<'_, PyAny>,
        scale: &Bound<'_, PyAny>,
        local: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (Some(shard), Some(blocks)) = (&self.dst_shard, &self.qrp.dst_blocks) else {
            return Ok(());
        };
        let d = raw(dst, shard.volume() as usize, "dst_local")?;
        let sc = raw(
            scale,
            blocks.volume() as usize * self.qp.scale_bytes(),
            "scale",
        )?;
        if buffers.len() != self.recvs.len() {
            return Err(error(format!(
                "expected {} receive buffers, got {}",
                self.recvs.len(),
                buffers.len()
            )));
        }
        let mut ins = Vec::new();
        for (m, b) in self.recvs.iter().zip(buffers.iter()) {
            ins.push((m, raw(&b, m.size, "receive buffer")?));
        }
        if let (Some(m), Some(b)) = (&self.local, local) {
            ins.push((m, raw(b, m.size, "local buffer")?));
        }
        py.detach(|| {
            // SAFETY: the caller holds the tensors for the call; they do not overlap.
            let (dst, scale) = unsafe { (bytes_mut(d), bytes_mut(sc)) };
            for (m, r) in ins {
                self.unpack_one(m, unsafe { bytes_mut(r) }, dst, scale);
            }
        });
        Ok(())
    }
}
