//! `refit --run` into an fp8 engine: one rank's quantized tensors, beside the batch. Each
//! runs as a planned single-tensor reshard over the batch's transport
//! ([`reshard::batch::quant`]), and every fp8 value and scale of the rank's shards is
//! checked against the naive quantizer ([`reshard::convert::reference`]): the rank's
//! destination box materialized from the fill and quantized block by block on its own
//! (the inference shards hold whole blocks, which the plan checked, so the blocks of the box
//! are the tensor's).

use reshard::batch::quant::{PartBuffers, QuantTensor, RankQuant, run_rank_quantized};
use reshard::convert::BlockGrid;
use reshard::convert::reference::{first_difference, quantize_tensor};
use reshard::exec::{ExecOptions, RankStats};
use reshard::fill::Fill;
use reshard::model::Refit;
use reshard::transport::Transport;
use reshard::{Error, Plan, PlanOptions, Rank};

/// One rank's quantized tensors: their plans, its parts, its buffers and what they must
/// hold after every run.
pub struct QuantRank {
    tensors: Vec<QuantTensor>,
    rank: RankQuant,
    src: Vec<Option<Vec<u8>>>,
    dst: Vec<Option<Vec<u8>>>,
    scales: Vec<Option<Vec<u8>>>,
    /// Per part with a destination: the fp8 values and the scales of the rank's boxes.
    expected: Vec<Option<(Vec<u8>, Vec<u8>)>>,
}

/// The refit's quantized tensors (their refit indices and plans).
pub fn tensors(
    refit: &Refit,
    options: PlanOptions,
) -> Result<(Vec<usize>, Vec<QuantTensor>), Error> {
    let mut ids = Vec::new();
    let mut out = Vec::new();
    for (i, t) in refit.tensors.iter().enumerate() {
        if let Some(q) = refit.quant_plan(i) {
            let plan = Plan::quantized(t.src.clone(), t.dst.clone(), options, q.clone())?;
            ids.push(i);
            out.push(QuantTensor {
                name: t.name.clone(),
                plan,
            });
        }
    }
    Ok((ids, out))
}

impl QuantRank {
    /// `rank`'s parts with their source shards filled (`fill_of` a quantized tensor's fill,
    /// by its index among `tensors`), zeroed destinations, and the reference when `verify`.
    pub fn new(
        tensors: Vec<QuantTensor>,
        rank: Rank,
        fill_of: impl Fn(usize) -> Fill,
        verify: bool,
    ) -> Result<QuantRank, Error> {
        let rq = RankQuant::new(&tensors, rank)?;
        let zeroed = |len: usize, what: &str, name: &str| {
            reshard::memory::zeroed(len as u64, || format!("rank {rank}'s {what} of {name}"))
        };
        let (mut src, mut dst, mut scales, mut expected) = (vec![], vec![], vec![], vec![]);
        for p in &rq.parts {
            let t = &tensors[p.tensor];
            let fill = fill_of(p.tensor);
            src.push(match &p.src {
                Some(b) => {
                    let mut buf = zeroed(p.src_len, "source shard", &t.name)?;
                    fill.fill_region(t.plan.src(), b, &mut buf);
                    Some(buf)
                }
                None => None,
            });
            match &p.dst {
                Some(b) => {
                    dst.push(Some(zeroed(p.dst_len, "destination shard", &t.name)?));
                    scales.push(Some(zeroed(p.scale_len, "scale shard", &t.name)?));
                    expected.push(match verify {
                        true => Some(reference(t, b, fill)?),
                        false => None,
                    });
                }
                None => {
                    dst.push(None);
                    scales.push(None);
                    expected.push(None);
                }
            }
        }
        Ok(QuantRank {
            tensors,
            rank: rq,
            src,
            dst,
            scales,
            expected,
        })
    }

    pub fn parts(&self) -> &RankQuant {
        &self.rank
    }

    pub fn plans(&self) -> impl Iterator<Item = &Plan> {
        self.tensors.iter().map(|t| &t.plan)
    }

    /// Bytes of its buffers: sources, destinations (fp8) and scales.
    pub fn bytes(&self) -> (u64, u64, u64) {
        let sum = |v: &[Option<Vec<u8>>]| v.iter().flatten().map(|b| b.len() as u64).sum();
        (sum(&self.src), sum(&self.dst), sum(&self.scales))
    }

    /// Overwrites its destinations and scales with a pattern no run leaves behind.
    pub fn poison(&mut self) {
        for b in self.dst.iter_mut().chain(&mut self.scales).flatten() {
            reshard::memory::fill_around_caches(b, 0xA5);
        }
    }

    /// Runs its parts over `transport`.
    pub fn run<T>(&mut self, transport: &T, options: &ExecOptions) -> Result<RankStats, Error>
    where
        T: for<'b> Transport<'b> + ?Sized,
    {
        let buffers = self
            .src
            .iter()
            .zip(self.dst.iter_mut().zip(self.scales.iter_mut()))
            .map(|(s, (d, sc))| PartBuffers {
                src: s.as_deref(),
                dst: d.as_deref_mut(),
                scales: sc.as_deref_mut(),
            })
            .collect();
        run_rank_quantized(&self.tensors, &self.rank, buffers, transport, options)
    }

    /// Checks every fp8 value and scale of its destinations against the reference.
    pub fn verify(&self) -> Result<(), Error> {
        let rank = self.rank.rank;
        for (i, p) in self.rank.parts.iter().enumerate() {
            let (Some((values, scales)), Some(dst), Some(got)) =
                (&self.expected[i], &self.dst[i], &self.scales[i])
            else {
                continue;
            };
            let name = &self.tensors[p.tensor].name;
            let failed = |e: Error| Error::Batch {
                what: "tensor",
                name: name.clone(),
                reason: e.to_string(),
            };
            if let Some((offset, expected, found, mismatches)) = first_difference(values, dst) {
                return Err(failed(Error::VerifyFailed {
                    rank,
                    offset,
                    expected,
                    found,
                    mismatches,
                }));
            }
            if let Some((offset, expected, found, mismatches)) = first_difference(scales, got) {
                return Err(failed(Error::ScalesVerifyFailed {
                    rank,
                    offset,
                    expected,
                    found,
                    mismatches,
                }));
            }
        }
        Ok(())
    }
}

/// The fp8 values and scales of destination box `b` of `t`: the box materialized from the
/// fill and quantized naively on its own grid, which is the tensor's grid cut at block
/// boundaries (checked here again, independently of the plan).
fn reference(
    t: &QuantTensor,
    b: &reshard::Region,
    fill: Fill,
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let q = t.plan.quant().expect("a quantizing plan");
    let named = |source| Error::Convert {
        tensor: t.name.clone(),
        source,
    };
    let block = q.grid.block();
    let aligned = (0..b.ndim()).all(|d| b.offset[d].is_multiple_of(block[d]));
    if !aligned {
        return Err(Error::Internal {
            rank: 0,
            detail: format!(
                "{}: destination box {b:?} is not on block boundaries of {block:?}",
                t.name
            ),
        });
    }
    let src = t.plan.src();
    let mut tensor = vec![0u8; (b.volume() as usize) * src.dtype().size()];
    fill.fill_region(src, b, &mut tensor);
    let grid = BlockGrid::new(q.quant.scheme, &b.extent).map_err(named)?;
    let out = quantize_tensor(q.quant, &grid, src.dtype(), &tensor).map_err(named)?;
    Ok((out.values, out.scales))
}
