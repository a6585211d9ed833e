//! The plan of a quantizing reshard (`--quant`): besides the transfers of fp8 values, the
//! partial amax that source ranks exchange when a block straddles their shards, and the
//! scales every sender carries to the destinations along with the values, so that each
//! destination receives its scale shard exactly once. Like the transfers, all of it follows
//! from the layouts alone, without communication.
//!
//! Amax messages and scale transfers are regions of the scale grid (one element per block,
//! [`BlockGrid::grid_shape`]): an amax message carries 4 bytes (an f32) per block, a scale
//! transfer one scale (`--scale-dtype`) per block.

use crate::convert::{BlockGrid, Quant, QuantScheme, ScaleDType, amax_exchange};
use crate::error::{Error, Result, Side};
use crate::layout::{Layout, Rank};
use crate::region::Region;

use super::{RankPlan, Transfer};

/// Bytes of one partial amax on the wire (an f32).
pub const AMAX_BYTES: usize = 4;

/// What a plan quantizes with, and the block grid over the tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantPlan {
    /// The scheme, the destination's fp8 format and the scale dtype.
    pub quant: Quant,
    /// The blocks of the tensor under the scheme.
    pub grid: BlockGrid,
}

/// The quantization a caller asks for: the scheme and, optionally, the scale dtype (the
/// scheme's default otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantRequest {
    /// The scheme (`--quant`).
    pub scheme: QuantScheme,
    /// The scale dtype (`--scale-dtype`); `None` takes the scheme's default.
    pub scale_dtype: Option<ScaleDType>,
}

impl QuantPlan {
    /// Checks the request against both layouts before any byte moves: an fp8 destination, a
    /// float source, a scale dtype the scheme can use, enough dims, and destination shard
    /// boundaries on block boundaries.
    pub fn new(request: QuantRequest, src: &Layout, dst: &Layout) -> Result<QuantPlan> {
        let convert = |source| Error::Convert {
            tensor: "tensor".into(),
            source,
        };
        let quant = Quant::new(
            request.scheme,
            src.dtype(),
            dst.dtype(),
            request.scale_dtype,
        )
        .map_err(convert)?;
        let grid = BlockGrid::new(request.scheme, dst.shape()).map_err(convert)?;
        grid.check_aligned(dst, Side::Dst).map_err(convert)?;
        Ok(QuantPlan { quant, grid })
    }

    /// Bytes of one scale.
    pub fn scale_bytes(&self) -> usize {
        self.quant.scale_dtype.size()
    }

    /// The scales a destination rank holds (a box of the scale grid), if it is one.
    pub fn dst_scale_box(&self, dst: &Layout, rank: Rank) -> Option<Region> {
        dst.local_region(rank)
            .map(|shard| self.grid.scale_region(&shard))
    }

    /// Bytes of a destination rank's scale shard (0 if it is not a destination).
    pub fn dst_scale_bytes(&self, dst: &Layout, rank: Rank) -> u64 {
        self.dst_scale_box(dst, rank)
            .map_or(0, |b| b.volume() * self.scale_bytes() as u64)
    }

    /// The blocks a source rank quantizes (the blocks its shard touches), if it is one.
    pub fn src_scale_box(&self, src: &Layout, rank: Rank) -> Option<Region> {
        src.local_region(rank)
            .map(|shard| self.grid.blocks_touching(&shard))
    }

    /// The scale transfer that goes with the value transfer `t`: the scales of the blocks it
    /// carries into its destination shard, or `None` when it carries none.
    pub fn scales_of(&self, dst: &Layout, t: &Transfer) -> Option<Transfer> {
        let shard = dst.local_region(t.dst)?;
        let region = self.grid.scales_carried(&shard, &t.region);
        (!region.is_empty()).then_some(Transfer::direct(t.src, t.dst, region))
    }

    /// Every scale transfer of the plan, in the order of `transfers`.
    pub fn scale_transfers(&self, dst: &Layout, transfers: &[Transfer]) -> Vec<Transfer> {
        transfers
            .iter()
            .filter_map(|t| self.scales_of(dst, t))
            .collect()
    }

    /// Every partial amax message of the plan (`src` sends its partial amax of `region` to
    /// `dst`; each pair exchanges both ways), sorted.
    pub fn amax_messages(&self, src: &Layout) -> Vec<Transfer> {
        let mut out: Vec<Transfer> = src
            .mesh()
            .ranks()
            .iter()
            .flat_map(|&r| {
                amax_exchange(src, &self.grid, r)
                    .into_iter()
                    .map(move |(peer, region)| Transfer::direct(r, peer, region))
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// `rank`'s part: its amax exchanges and the scale transfers that go with its value
    /// transfers, in the same order (so that both ends of a pair take them alike).
    pub fn for_rank(&self, src: &Layout, dst: &Layout, rp: &RankPlan) -> QuantRankPlan {
        let scales = |list: &[Transfer]| self.scale_transfers(dst, list);
        QuantRankPlan {
            amax: amax_exchange(src, &self.grid, rp.rank),
            src_blocks: self.src_scale_box(src, rp.rank),
            dst_blocks: self.dst_scale_box(dst, rp.rank),
            sends: scales(&rp.sends),
            recvs: scales(&rp.recvs),
            locals: scales(&rp.locals),
        }
    }
}

/// The amax and scale traffic of a quantizing plan, beside the values' [`super::Totals`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuantTotals {
    /// Bytes of partial amax between source ranks (4 per block piece, each way).
    pub amax_bytes: u64,
    /// Partial amax messages between source ranks.
    pub amax_messages: u64,
    /// Bytes of scales sent to other ranks.
    pub scale_bytes: u64,
    /// Bytes of scales copied inside a rank.
    pub scale_bytes_local: u64,
    /// Scale transfers between ranks.
    pub scale_messages: u64,
    /// With an already-quantized source ([`super::QuantizedMove`]): what gather+broadcast of
    /// the scale tensor moves besides the values' `gather_broadcast_bytes`. A quantizing plan
    /// has none: its baseline moves the source's dtype and quantizes after the move.
    pub scale_gather_broadcast_bytes: Option<u64>,
}

impl QuantPlan {
    /// The amax and scale traffic of `plan` (whose quantization this is).
    pub fn totals(&self, plan: &super::Plan) -> QuantTotals {
        let mut t = QuantTotals::default();
        for m in self.amax_messages(plan.src()) {
            t.amax_bytes += m.region.volume() * AMAX_BYTES as u64;
            t.amax_messages += 1;
        }
        for s in self.scale_transfers(plan.dst(), plan.transfers()) {
            let bytes = s.region.volume() * self.scale_bytes() as u64;
            if s.is_local() {
                t.scale_bytes_local += bytes;
            } else {
                t.scale_bytes += bytes;
                t.scale_messages += 1;
            }
        }
        t
    }
}

/// One rank's part of a quantizing plan (see [`QuantPlan::for_rank`]). Regions are in scale
/// grid coordinates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantRankPlan {
    /// The peers this source rank exchanges partial amax with, and the blocks of each: it
    /// sends its partial amax of those blocks and receives the peer's.
    pub amax: Vec<(Rank, Region)>,
    /// The blocks this rank quantizes, if it is a source: its staged scales.
    pub src_blocks: Option<Region>,
    /// The scale shard this rank receives, if it is a destination.
    pub dst_blocks: Option<Region>,
    /// Scale transfers it sends.
    pub sends: Vec<Transfer>,
    /// Scale transfers it receives.
    pub recvs: Vec<Transfer>,
    /// Scale transfers it copies locally.
    pub locals: Vec<Transfer>,
}

impl QuantRankPlan {
    /// Bytes of the partial amax this rank sends (and as many it receives).
    pub fn amax_bytes(&self) -> usize {
        self.amax
            .iter()
            .map(|(_, b)| b.volume() as usize * AMAX_BYTES)
            .sum()
    }

    /// The staging a source rank needs for its part: its outgoing partial amax, then its
    /// scales (`scale_bytes` each), which the sends read until the run ends.
    pub fn stage_bytes(&self, scale_bytes: usize) -> usize {
        self.amax_bytes()
            + self
                .src_blocks
                .as_ref()
                .map_or(0, |b| b.volume() as usize * scale_bytes)
    }

    /// The peers it exchanges partial amax with.
    pub fn amax_peers(&self) -> impl Iterator<Item = Rank> + '_ {
        self.amax.iter().map(|(p, _)| *p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::layout::LayoutSpec;
    use crate::plan::Plan;

    fn layout(spec: &str, shape: &[u64], dtype: DType, first: Rank) -> Layout {
        LayoutSpec::parse(spec)
            .unwrap()
            .resolve(shape, dtype, first)
            .unwrap()
    }

    fn request(s: &str) -> QuantRequest {
        QuantRequest {
            scheme: QuantScheme::parse(s).unwrap(),
            scale_dtype: None,
        }
    }

    #[test]
    fn every_destination_gets_each_of_its_scales_once() {
        let shape = [256, 384];
        let src = layout("mesh=3 place=S(0)", &shape, DType::Bf16, 0);
        let dst = layout("mesh=3 place=S(1)", &shape, DType::Fp8E4M3, 3);
        let q = QuantPlan::new(request("block:128x128"), &src, &dst).unwrap();
        let plan =
            Plan::quantized(src.clone(), dst.clone(), Default::default(), q.clone()).unwrap();
        let scales = q.scale_transfers(&dst, plan.transfers());
        for r in 3..6 {
            let want = q.dst_scale_box(&dst, r).unwrap();
            let got: u64 = scales
                .iter()
                .filter(|t| t.dst == r)
                .map(|t| {
                    assert!(want.contains(&t.region));
                    t.region.volume()
                })
                .sum();
            assert_eq!(got, want.volume(), "rank {r}");
        }
        // 86-row shards cut both block rows: ranks 0-1 and 1-2 exchange
        let amax = q.amax_messages(&src);
        let pairs: Vec<(Rank, Rank)> = amax.iter().map(|t| (t.src, t.dst)).collect();
        assert_eq!(pairs, [(0, 1), (1, 0), (1, 2), (2, 1)]);
    }

    /// One rank's part of a quantizing plan, computed alone, is the whole plan's part; a
    /// quantization whose blocks the destination cuts is refused as by the whole plan.
    #[test]
    fn a_rank_plans_its_quantized_part_alone() {
        let shape = [256, 384];
        let src = layout("mesh=3 place=S(0)", &shape, DType::Bf16, 0);
        let dst = layout("mesh=3 place=S(1)", &shape, DType::Fp8E4M3, 2);
        let q = QuantPlan::new(request("block:128x128"), &src, &dst).unwrap();
        let options = Default::default();
        let plan = Plan::quantized(src.clone(), dst.clone(), options, q.clone()).unwrap();
        for rank in 0..5 {
            let alone = super::super::rank_plan_quantized(&src, &dst, rank, &options, &q);
            assert_eq!(alone.unwrap(), plan.rank_part(rank), "rank {rank}");
        }
        let cut = layout("mesh=3 place=S(0)", &shape, DType::Fp8E4M3, 2);
        let err = super::super::rank_plan_quantized(&src, &cut, 2, &options, &q).unwrap_err();
        assert!(
            err.to_string().contains("cuts a quantization block"),
            "{err}"
        );
    }

    #[test]
    fn destinations_that_cut_a_block_are_refused() {
        let shape = [256, 256];
        let src = layout("mesh=2 place=S(0)", &shape, DType::Bf16, 0);
        let dst = layout("mesh=3 place=S(0)", &shape, DType::Fp8E4M3, 2);
        let err = QuantPlan::new(request("block:128x128"), &src, &dst)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "dst: a shard boundary at 86 along dim 0 cuts a quantization block of 128x128"
            ),
            "{err}"
        );
        let bf16 = layout("mesh=2 place=S(0)", &shape, DType::Bf16, 2);
        let err = QuantPlan::new(request("channel"), &src, &bf16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the destination dtype is bf16"), "{err}");
    }
}
