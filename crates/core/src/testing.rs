//! Test support shared by every module's tests: proptest strategies that generate layouts, and
//! an independent reference model that materializes the global tensor and slices it.

use proptest::prelude::*;

use crate::dtype::DType;
use crate::fill::Fill;
use crate::layout::{Layout, Mesh, Placement, Rank};

/// `torch.chunk` sizes as torch computes them (chunks of `ceil(n/k)` until `n` runs out),
/// padded with empty chunks to `k` as DTensor pads them. Written independently of
/// `layout::chunk` on purpose.
pub fn torch_chunk_sizes(n: usize, k: usize) -> Vec<usize> {
    let c = n.div_ceil(k);
    let mut left = n;
    (0..k)
        .map(|_| {
            let s = c.min(left);
            left -= s;
            s
        })
        .collect()
}

/// A dense N-D array of global linear indices: the reference's view of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexArray {
    /// The array's shape, in elements.
    pub shape: Vec<usize>,
    /// The global linear index of each element, row-major.
    pub data: Vec<u64>,
}

impl IndexArray {
    /// The whole tensor: element `i` is `i`.
    pub fn global(shape: &[u64]) -> IndexArray {
        let n: u64 = shape.iter().product();
        IndexArray {
            shape: shape.iter().map(|&d| d as usize).collect(),
            data: (0..n).collect(),
        }
    }

    /// `torch.narrow`: the slab `start..start+len` of `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> IndexArray {
        let outer: usize = self.shape[..dim].iter().product();
        let inner: usize = self.shape[dim + 1..].iter().product();
        let mut data = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let base = o * self.shape[dim] * inner;
            data.extend_from_slice(&self.data[base + start * inner..base + (start + len) * inner]);
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        IndexArray { shape, data }
    }

    /// The bytes of these elements under `fill`, `elem` bytes each.
    pub fn bytes(&self, fill: Fill, elem: usize) -> Vec<u8> {
        self.data
            .iter()
            .flat_map(|&i| fill.value(i).to_le_bytes()[..elem].to_vec())
            .collect()
    }
}

/// The local shard of the rank at mesh `coords`, the DTensor way: start from the global tensor
/// and, mesh axis by mesh axis, keep this rank's `torch.chunk` of the sharded dim.
pub fn reference_shard(
    shape: &[u64],
    mesh: &[usize],
    placements: &[Placement],
    coords: &[usize],
) -> IndexArray {
    let mut local = IndexArray::global(shape);
    for (axis, p) in placements.iter().enumerate() {
        if let Placement::Shard(d) = *p {
            let sizes = torch_chunk_sizes(local.shape[d], mesh[axis]);
            let start: usize = sizes[..coords[axis]].iter().sum();
            local = local.narrow(d, start, sizes[coords[axis]]);
        }
    }
    local
}

/// Every rank's reference shard bytes under `fill`.
pub fn reference_shards(layout: &Layout, fill: Fill) -> std::collections::BTreeMap<Rank, Vec<u8>> {
    let mesh = layout.mesh();
    mesh.ranks()
        .iter()
        .enumerate()
        .map(|(p, &r)| {
            let shard = reference_shard(
                layout.shape(),
                mesh.dims(),
                layout.placements(),
                &mesh.coords(p),
            );
            (r, shard.bytes(fill, layout.dtype().size()))
        })
        .collect()
}

/// One side: mesh shape, placements (dims resolved), and its ranks drawn from `0..world`.
pub fn arb_side(
    ndim: usize,
    world: usize,
) -> impl Strategy<Value = (Vec<usize>, Vec<Placement>, Vec<Rank>)> {
    let placement = prop_oneof![
        1 => Just(Placement::Replicate),
        3 => (0..ndim.max(1)).prop_map(Placement::Shard),
    ];
    prop::collection::vec((1usize..=4, placement), 1..=3)
        .prop_filter("mesh fits the world", move |axes| {
            axes.iter().map(|a| a.0).product::<usize>() <= world
        })
        .prop_flat_map(move |axes| {
            let size: usize = axes.iter().map(|a| a.0).product();
            let dims: Vec<usize> = axes.iter().map(|a| a.0).collect();
            let mut places: Vec<Placement> = axes.iter().map(|a| a.1).collect();
            if ndim == 0 {
                places = vec![Placement::Replicate; places.len()];
            }
            let ranks =
                prop::sample::subsequence((0..world).collect::<Vec<_>>(), size).prop_shuffle();
            (Just(dims), Just(places), ranks)
        })
}

/// A random pair of layouts of one tensor: N-D (up to 8-D), uneven and empty shards, nested
/// sharding of one dim, several sharded dims, replicas, and source and destination rank sets
/// that are disjoint, overlapping or equal.
pub fn arb_layout_pair() -> impl Strategy<Value = (Layout, Layout)> {
    let shape = prop_oneof![
        8 => prop::collection::vec(0u64..=9, 1..=3),
        2 => prop::collection::vec(1u64..=4, 4..=5),
        1 => prop::collection::vec(1u64..=2, 6..=8),
    ];
    (
        shape,
        prop::sample::select(DType::ALL.to_vec()),
        1usize..=14,
    )
        .prop_flat_map(|(shape, dtype, world)| {
            let ndim = shape.len();
            (
                Just(shape),
                Just(dtype),
                arb_side(ndim, world),
                arb_side(ndim, world),
            )
                .prop_map(|(shape, dtype, (sm, sp, sr), (dm, dp, dr))| {
                    let src =
                        Layout::new(shape.clone(), dtype, Mesh::new(sm, sr).unwrap(), sp).unwrap();
                    let dst = Layout::new(shape, dtype, Mesh::new(dm, dr).unwrap(), dp).unwrap();
                    (src, dst)
                })
        })
}

/// A host map over ranks `0..=max` of the pair: each rank's host drawn from `draws`, the
/// hosts renumbered in order of first use so that none is empty.
pub fn host_map(src: &Layout, dst: &Layout, draws: &[usize]) -> crate::topology::HostMap {
    let max = src
        .mesh()
        .ranks()
        .iter()
        .chain(dst.mesh().ranks())
        .max()
        .copied()
        .unwrap_or(0);
    let mut renumber = std::collections::BTreeMap::new();
    let hosts = (0..=max)
        .map(|r| {
            let next = renumber.len();
            *renumber.entry(draws[r % draws.len()]).or_insert(next)
        })
        .collect::<Vec<usize>>();
    crate::topology::HostMap::from_indices(&hosts).unwrap()
}

/// Layouts ([`arb_layout_pair`]), a host map over their ranks (consecutive hosts of a few
/// ranks, or ranks scattered over up to 4 hosts), and planner options.
pub fn arb_hosts_case() -> impl Strategy<
    Value = (
        Layout,
        Layout,
        crate::topology::HostMap,
        crate::plan::PlanOptions,
    ),
> {
    use crate::plan::PlanOptions;
    (
        arb_layout_pair(),
        prop_oneof![
            (1usize..=4).prop_map(|k| (0..16).map(|r| r / k).collect::<Vec<_>>()),
            prop::collection::vec(0usize..4, 1..=16),
        ],
        prop_oneof![
            Just(PlanOptions::default()),
            Just(PlanOptions { min_split_bytes: 0 }),
            (1u64..64).prop_map(|min_split_bytes| PlanOptions { min_split_bytes }),
        ],
    )
        .prop_map(|((src, dst), draws, options)| {
            let hosts = host_map(&src, &dst, &draws);
            (src, dst, hosts, options)
        })
}

/// An fp8e4m3 layout of `shape` from a spec, its ranks from `first` (for the tests of
/// already-quantized moves).
pub fn fp8_layout(spec: &str, shape: &[u64], first: Rank) -> Layout {
    crate::layout::LayoutSpec::parse(spec)
        .unwrap()
        .resolve(shape, DType::Fp8E4M3, first)
        .unwrap()
}

/// The quantization `scheme` (e.g. `block:2x4`) with its default scale dtype.
pub fn quant_request(scheme: &str) -> crate::plan::QuantRequest {
    crate::plan::QuantRequest {
        scheme: crate::convert::QuantScheme::parse(scheme).unwrap(),
        scale_dtype: None,
    }
}

/// A random 2-D layout spec over up to 3x3 ranks, sharding in whole blocks or not.
pub fn arb_block_spec() -> impl Strategy<Value = String> {
    let place = prop_oneof![Just("R"), Just("S(0)"), Just("S(1)")];
    prop_oneof![
        (1usize..=4, place.clone()).prop_map(|(n, p)| format!("mesh={n} place={p}")),
        (1usize..=3, 1usize..=3, place.clone(), place)
            .prop_map(|(a, b, p, q)| format!("mesh={a}x{b} place={p},{q}")),
    ]
}
