//! Plan summaries: totals, the gather+broadcast comparison, and the JSON of `reshard plan`.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::layout::{Layout, Rank};

use super::Plan;
use super::baseline::gather_replica;

/// Byte and message counts of a plan (the `totals` object of the plan JSON).
///
/// A count whose true value exceeds `2^64 - 1` (a near-2^64-byte tensor sent to several
/// replicas) holds `u64::MAX` and is named in [`Totals::overflow`]; the JSON writes it as
/// `null` and lists it under `overflow`, so that no reader takes the saturated number for a
/// real one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes that cross from one rank to another.
    pub bytes_remote: u64,
    /// Bytes copied inside a rank (source and destination on the same rank).
    pub bytes_local: u64,
    /// Remote transfers.
    pub messages: u64,
    /// The most bytes one rank sends to others (a relaying rank counts what it forwards).
    pub max_rank_send_bytes: u64,
    /// The most bytes one rank receives from others.
    pub max_rank_recv_bytes: u64,
    /// What gather+broadcast moves for the same layouts (see [`gather_broadcast_bytes`]).
    pub gather_broadcast_bytes: u64,
    /// The counts above that overflowed.
    pub overflow: Overflow,
    /// With `--quant`: the partial amax and the scales, which move beside the values.
    pub quant: Option<super::quant::QuantTotals>,
}

/// A set of [`Totals`] fields whose true value does not fit in 64 bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overflow(u8);

impl Overflow {
    /// The field names, in the order of the plan JSON.
    pub const FIELDS: [&'static str; 6] = [
        "bytes_remote",
        "bytes_local",
        "messages",
        "max_rank_send_bytes",
        "max_rank_recv_bytes",
        "gather_broadcast_bytes",
    ];

    /// The bit of `field`; none (0) for a name that is not a field.
    fn bit(field: &str) -> u8 {
        Overflow::FIELDS
            .iter()
            .position(|f| *f == field)
            .map_or(0, |i| 1 << i)
    }

    /// Marks `field` (one of [`Overflow::FIELDS`]) as overflowed.
    fn insert(&mut self, field: &str) {
        self.0 |= Overflow::bit(field);
    }

    /// Whether `field` overflowed (false for a name that is not one of [`Overflow::FIELDS`]).
    pub fn contains(&self, field: &str) -> bool {
        self.0 & Overflow::bit(field) != 0
    }

    /// Whether no count overflowed.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// The overflowed fields, in JSON order.
    pub fn fields(&self) -> Vec<&'static str> {
        Overflow::FIELDS
            .into_iter()
            .filter(|f| self.contains(f))
            .collect()
    }
}

/// `u64` sums that remember whether they overflowed, instead of saturating silently.
fn fit(total: u128, field: &'static str, overflow: &mut Overflow) -> u64 {
    u64::try_from(total).unwrap_or_else(|_| {
        overflow.insert(field);
        u64::MAX
    })
}

impl Totals {
    /// The counts of `plan`'s transfers, and of its quantization's traffic if any.
    pub fn of(plan: &Plan) -> Totals {
        let elem = plan.elem_bytes();
        let mut overflow = Overflow::default();
        let gather_broadcast = fit(
            gather_broadcast_bytes_wide(plan.src(), plan.dst()),
            "gather_broadcast_bytes",
            &mut overflow,
        );
        // in u128: replicated destinations of a near-2^64-byte tensor overflow u64
        let (mut remote, mut local, mut messages) = (0u128, 0u128, 0u128);
        let mut sent: BTreeMap<Rank, u128> = BTreeMap::new();
        let mut received: BTreeMap<Rank, u128> = BTreeMap::new();
        for t in plan.transfers() {
            let bytes = u128::from(t.bytes(elem));
            if t.is_local() {
                local += bytes;
            } else {
                remote += bytes;
                messages += 1;
                *sent.entry(t.sender()).or_default() += bytes;
                *received.entry(t.dst).or_default() += bytes;
            }
        }
        let max = |m: &BTreeMap<Rank, u128>| m.values().copied().max().unwrap_or(0);
        Totals {
            bytes_remote: fit(remote, "bytes_remote", &mut overflow),
            bytes_local: fit(local, "bytes_local", &mut overflow),
            messages: fit(messages, "messages", &mut overflow),
            max_rank_send_bytes: fit(max(&sent), "max_rank_send_bytes", &mut overflow),
            max_rank_recv_bytes: fit(max(&received), "max_rank_recv_bytes", &mut overflow),
            gather_broadcast_bytes: gather_broadcast,
            overflow,
            quant: plan.quant().map(|q| q.totals(plan)),
        }
    }

    /// The count as the JSON shows it: `None` (null) when it overflowed.
    fn shown(&self, field: &'static str, value: u64) -> Option<u64> {
        (!self.overflow.contains(field)).then_some(value)
    }
}

impl Serialize for Totals {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let values = [
            self.bytes_remote,
            self.bytes_local,
            self.messages,
            self.max_rank_send_bytes,
            self.max_rank_recv_bytes,
            self.gather_broadcast_bytes,
        ];
        let extra = usize::from(!self.overflow.is_empty())
            + self.quant.map_or(0, |q| {
                5 + usize::from(q.scale_gather_broadcast_bytes.is_some())
            });
        let mut st = s.serialize_struct("Totals", values.len() + extra)?;
        for (field, value) in Overflow::FIELDS.into_iter().zip(values) {
            st.serialize_field(field, &self.shown(field, value))?;
        }
        if let Some(q) = &self.quant {
            st.serialize_field("amax_bytes", &q.amax_bytes)?;
            st.serialize_field("amax_messages", &q.amax_messages)?;
            st.serialize_field("scale_bytes", &q.scale_bytes)?;
            st.serialize_field("scale_bytes_local", &q.scale_bytes_local)?;
            st.serialize_field("scale_messages", &q.scale_messages)?;
            if let Some(bytes) = q.scale_gather_broadcast_bytes {
                st.serialize_field("scale_gather_broadcast_bytes", &bytes)?;
            }
        }
        if self.overflow.is_empty() {
            st.skip_field("overflow")?;
        } else {
            st.serialize_field("overflow", &self.overflow.fields())?;
        }
        st.end()
    }
}

/// Wire bytes of the gather+broadcast baseline: a ring all-gather inside one source replica
/// (each of its `k` ranks receives what it lacks: `(k - 1) x total`), then a broadcast of the
/// whole tensor to every destination rank that does not hold it yet. The replica chosen is the
/// one that contains the most destination ranks; a fully replicated source needs no gather.
/// Saturates at `u64::MAX`; [`Totals`] reports the overflow.
pub fn gather_broadcast_bytes(src: &Layout, dst: &Layout) -> u64 {
    u64::try_from(gather_broadcast_bytes_wide(src, dst)).unwrap_or(u64::MAX)
}

/// [`gather_broadcast_bytes`] without the saturation: at most `2^31 x 2^64`, which fits.
pub fn gather_broadcast_bytes_wide(src: &Layout, dst: &Layout) -> u128 {
    let total = u128::from(src.total_bytes());
    let holders: BTreeSet<Rank> = gather_replica(src, dst).into_iter().collect();
    let replica_size = (src.mesh().size() / src.replication().max(1)) as u128;
    let gather = (replica_size - 1) * total;
    let receivers = dst
        .mesh()
        .ranks()
        .iter()
        .filter(|r| !holders.contains(r))
        .count() as u128;
    gather + receivers * total
}

/// One transfer in the plan JSON.
#[derive(Clone, Debug, Serialize)]
pub struct TransferJson {
    /// The source rank.
    pub src: Rank,
    /// The destination rank.
    pub dst: Rank,
    /// The region's first element along each dim.
    pub offset: Vec<u64>,
    /// The region's size along each dim, in elements.
    pub extent: Vec<u64>,
    /// Bytes the transfer carries (in the wire dtype).
    pub bytes: u64,
    /// A relayed transfer: the rank on `dst`'s host that received the bytes from `src` and
    /// forwards them to `dst`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<Rank>,
}

/// The `totals` object of the plan JSON: the counts, and where the hosts are known, the
/// bytes on every host's link.
#[derive(Clone, Debug, Serialize)]
pub struct TotalsJson {
    /// The plan's byte and message counts.
    #[serde(flatten)]
    pub totals: Totals,
    /// Bytes out of and into every host (`--hosts`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_links: Option<Vec<super::hosts::HostLink>>,
    /// The most bytes into or out of one host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busiest_link_bytes: Option<u64>,
}

/// The plan JSON of `reshard plan --json` (the design notes fix its fields).
#[derive(Clone, Debug, Serialize)]
pub struct PlanJson {
    /// The tensor's shape, in elements.
    pub shape: Vec<u64>,
    /// The source's dtype.
    pub dtype: String,
    /// The source's element size, in bytes.
    pub elem_bytes: usize,
    /// The destination's dtype (`--dst-dtype`): what the wire carries, so what `bytes` counts.
    pub dst_dtype: String,
    /// The destination's element size, in bytes.
    pub dst_elem_bytes: usize,
    /// Every transfer, sorted by (src, dst, region).
    pub transfers: Vec<TransferJson>,
    /// The counts, and the bytes on the hosts' links.
    pub totals: TotalsJson,
    /// With `--quant`: the scheme, the scale grid, and the amax and scale traffic.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quant: Option<QuantJson>,
}

/// The `quant` object of the plan JSON. `amax` and `scales` list transfers whose `offset` and
/// `extent` are in scale grid coordinates (one element per block): an amax message carries
/// 4 bytes per block, a scale transfer `scale_elem_bytes` per block.
#[derive(Clone, Debug, Serialize)]
pub struct QuantJson {
    /// `"quantized"` when the source is already fp8 with its scales ([`super::QuantizedMove`]):
    /// nothing is quantized, `amax` is empty and `scales` is the scale tensor's own plan.
    /// Left out for a plan that quantizes as it packs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'static str>,
    /// The scheme, as `--quant` writes it (`block:128x128`, `mx:32`, ...).
    pub scheme: String,
    /// The scale dtype (`f32` or `e8m0`).
    pub scale_dtype: String,
    /// Bytes per scale.
    pub scale_elem_bytes: usize,
    /// The block's extent along every dim of the tensor.
    pub block: Vec<u64>,
    /// The scale tensor's shape.
    pub scale_shape: Vec<u64>,
    /// The partial amax messages between source ranks.
    pub amax: Vec<TransferJson>,
    /// The scale transfers to the destinations.
    pub scales: Vec<TransferJson>,
}

impl QuantJson {
    fn of(plan: &Plan, q: &super::QuantPlan) -> QuantJson {
        let json = |elem: usize| {
            move |t: super::Transfer| TransferJson {
                src: t.src,
                dst: t.dst,
                bytes: t.bytes(elem),
                offset: t.region.offset,
                extent: t.region.extent,
                via: None,
            }
        };
        QuantJson {
            source: None,
            scheme: q.quant.scheme.to_string(),
            scale_dtype: q.quant.scale_dtype.to_string(),
            scale_elem_bytes: q.scale_bytes(),
            block: q.grid.block().to_vec(),
            scale_shape: q.grid.grid_shape(),
            amax: q
                .amax_messages(plan.src())
                .into_iter()
                .map(json(super::quant::AMAX_BYTES))
                .collect(),
            scales: q
                .scale_transfers(plan.dst(), plan.transfers())
                .into_iter()
                .map(json(q.scale_bytes()))
                .collect(),
        }
    }
}

impl PlanJson {
    /// The JSON of `plan`.
    pub fn of(plan: &Plan) -> PlanJson {
        let elem = plan.elem_bytes();
        PlanJson {
            shape: plan.src().shape().to_vec(),
            dtype: plan.src().dtype().to_string(),
            elem_bytes: plan.src().dtype().size(),
            dst_dtype: plan.dst().dtype().to_string(),
            dst_elem_bytes: elem,
            transfers: plan
                .transfers()
                .iter()
                .map(|t| TransferJson {
                    src: t.src,
                    dst: t.dst,
                    offset: t.region.offset.clone(),
                    extent: t.region.extent.clone(),
                    bytes: t.bytes(elem),
                    via: t.via,
                })
                .collect(),
            totals: {
                let links = plan.host_links();
                TotalsJson {
                    totals: plan.totals(),
                    busiest_link_bytes: links.as_ref().map(super::HostLinks::busiest),
                    host_links: links.map(|l| l.links),
                }
            },
            quant: plan.quant().map(|q| QuantJson::of(plan, q)),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::dtype::DType;
    use crate::layout::LayoutSpec;
    use crate::plan::Plan;

    fn plan(shape: &[u64], src: &str, dst: &str) -> Plan {
        let layout = |spec: &str, first| {
            LayoutSpec::parse(spec)
                .unwrap()
                .resolve(shape, DType::U8, first)
                .unwrap()
        };
        Plan::new(layout(src, 0), layout(dst, 4)).unwrap()
    }

    /// A 2^62-byte tensor to four replicas moves 2^64 bytes: one more than a u64 holds.
    #[test]
    fn overflowed_totals_are_marked_not_passed_off_as_real() {
        let t = plan(&[1 << 62], "mesh=1 place=R", "mesh=4 place=R").totals();
        // the one source sends all of it
        assert_eq!(
            t.overflow.fields(),
            [
                "bytes_remote",
                "max_rank_send_bytes",
                "gather_broadcast_bytes"
            ]
        );
        assert_eq!(t.max_rank_recv_bytes, 1 << 62);
        assert!(!t.overflow.contains("max_rank_recv_bytes") && !t.overflow.contains("nonsense"));
        let json = serde_json::to_value(t).unwrap();
        assert!(json["bytes_remote"].is_null(), "{json}");
        assert!(json["gather_broadcast_bytes"].is_null(), "{json}");
        assert_eq!(json["messages"], 4);
        assert_eq!(
            json["overflow"],
            serde_json::json!([
                "bytes_remote",
                "max_rank_send_bytes",
                "gather_broadcast_bytes"
            ])
        );
        // one replica fewer fits, and the JSON has no `overflow` key
        let t = plan(&[1 << 62], "mesh=1 place=R", "mesh=3 place=R").totals();
        assert!(t.overflow.is_empty());
        assert_eq!(t.bytes_remote, 3 << 62);
        let json = serde_json::to_value(t).unwrap();
        assert_eq!(json["bytes_remote"], 3u64 << 62);
        assert!(json.get("overflow").is_none(), "{json}");
    }
}
