//! A lower bound for any plan, relaying or not: what must cross each NVLink domain's NICs.
//!
//! The reshard's own lower bound holds for the plan as given, which sends every byte straight
//! from a source to its destination. A plan that sends a byte into a domain once and fans it
//! out over NVLink there (as NCCL's node-aware mode does) can beat it. No plan beats this one:
//! per NVLink domain,
//! - **in**: the bytes its destination ranks need that no source rank inside it holds must
//!   enter through the NICs of its GPUs;
//! - **out**: the bytes that only its source ranks hold and that some destination rank
//!   outside it needs must leave through them;
//!
//! all tensors at once, spread evenly over the NICs of the domain's GPUs that run a rank.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use rustc_hash::FxHashMap;

use super::SimError;
use super::cluster::{Cluster, Link};
use crate::layout::Layout;
use crate::plan::Plan;

/// Seconds no plan of these tensors can beat on `cluster`, whatever it relays.
pub fn domain_bound(plans: &[Plan], cluster: &Cluster) -> Result<f64, SimError> {
    let mut gpus: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    let mut traffic: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
    for plan in plans {
        let (src, dst) = (plan.src(), plan.dst());
        let elem = plan.elem_bytes() as u64;
        let src_boxes = boxes_by_domain(src, cluster, &mut gpus)?;
        let dst_boxes = boxes_by_domain(dst, cluster, &mut gpus)?;
        for (&domain, needed) in &dst_boxes.by_domain {
            let local = src_boxes.by_domain.get(&domain);
            let missing: u64 = needed
                .iter()
                .map(|&b| {
                    let held: u64 = local.map_or(0, |l| {
                        l.iter()
                            .map(|&s| overlap(&dst_boxes.ranges[b], &src_boxes.ranges[s]))
                            .sum()
                    });
                    volume(&dst_boxes.ranges[b]) - held
                })
                .sum();
            let t = traffic.entry(domain).or_default();
            t.0 = t.0.saturating_add(missing.saturating_mul(elem));
        }
        for (&domain, held) in &src_boxes.by_domain {
            let only_here = held
                .iter()
                .filter(|&&s| src_boxes.domain_count[s] == 1)
                .collect::<Vec<_>>();
            if only_here.is_empty() {
                continue;
            }
            let wanted_elsewhere: Vec<usize> = (0..dst_boxes.ranges.len())
                .filter(|&b| dst_boxes.domains[b].iter().any(|&d| d != domain))
                .collect();
            let leaving: u64 = only_here
                .iter()
                .map(|&&s| {
                    wanted_elsewhere
                        .iter()
                        .map(|&b| overlap(&src_boxes.ranges[s], &dst_boxes.ranges[b]))
                        .sum::<u64>()
                })
                .sum();
            let t = traffic.entry(domain).or_default();
            t.1 = t.1.saturating_add(leaving.saturating_mul(elem));
        }
    }
    let nic = cluster.bandwidth(Link::Network);
    Ok(traffic
        .iter()
        .map(|(domain, &(inward, outward))| {
            let n = gpus.get(domain).map_or(1, |g| g.len().max(1)) as f64;
            inward.max(outward) as f64 / (n * nic)
        })
        .fold(0.0, f64::max))
}

/// The distinct boxes of a layout, and which NVLink domains hold each.
struct Boxes {
    /// Per box, its range along every dim.
    ranges: Vec<Vec<Range<u64>>>,
    /// Per box, how many domains hold it.
    domain_count: Vec<usize>,
    /// Per box, the domains that hold it.
    domains: Vec<Vec<usize>>,
    /// Per domain, the boxes its ranks hold.
    by_domain: BTreeMap<usize, Vec<usize>>,
}

fn boxes_by_domain(
    layout: &Layout,
    cluster: &Cluster,
    gpus: &mut BTreeMap<usize, BTreeSet<usize>>,
) -> Result<Boxes, SimError> {
    let mesh = layout.mesh();
    let mut ids: FxHashMap<usize, usize> = FxHashMap::default();
    let mut ranges = Vec::new();
    // (domain, box) for every rank, deduplicated below
    let mut held: Vec<(usize, usize)> = Vec::with_capacity(mesh.size());
    let mut last_gpu = None;
    for (position, &rank) in mesh.ranks().iter().enumerate() {
        let gpu = cluster.gpu(rank)?;
        let domain = cluster.domain(gpu);
        if last_gpu != Some(gpu) {
            gpus.entry(domain).or_default().insert(gpu);
            last_gpu = Some(gpu);
        }
        let index = layout.piece_index(&mesh.coords(position));
        let next = ranges.len();
        let b = *ids.entry(layout.box_id(&index)).or_insert(next);
        if b == next {
            ranges.push(
                index
                    .iter()
                    .enumerate()
                    .map(|(d, &i)| layout.dim_pieces(d)[i].clone())
                    .collect(),
            );
        }
        held.push((domain, b));
    }
    held.sort_unstable();
    held.dedup();
    let mut boxes = Boxes {
        domain_count: vec![0; ranges.len()],
        domains: vec![Vec::new(); ranges.len()],
        ranges,
        by_domain: BTreeMap::new(),
    };
    for (domain, b) in held {
        boxes.domain_count[b] += 1;
        boxes.domains[b].push(domain);
        boxes.by_domain.entry(domain).or_default().push(b);
    }
    Ok(boxes)
}

fn volume(ranges: &[Range<u64>]) -> u64 {
    ranges
        .iter()
        .fold(1u64, |acc, r| acc.saturating_mul(r.end - r.start))
}

/// Elements two boxes share.
fn overlap(a: &[Range<u64>], b: &[Range<u64>]) -> u64 {
    a.iter().zip(b).fold(1u64, |acc, (x, y)| {
        acc.saturating_mul(x.end.min(y.end).saturating_sub(x.start.max(y.start)))
    })
}
