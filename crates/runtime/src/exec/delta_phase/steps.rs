//! The small steps a delta phase adds to its phase's: runs of bytes beside the shards.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::exec::program::{Convert, Step};
use reshard_core::layout::Rank;
use reshard_core::region::Region;
use reshard_transport::Lands;

/// A small transfer of `len` bytes from `from` to `to`, beside the shards, at `at` of
/// buffer `buf` on the side that holds it.
pub(super) fn beside(
    from: Rank,
    to: Rank,
    len: usize,
    sending: bool,
    buf: usize,
    at: usize,
) -> Step<'static> {
    let region: Cow<'static, Region> = Cow::Owned(Region::full(&[len as u64]));
    let slot = Some((buf, at..at + len));
    Step {
        from,
        to,
        region: region.clone(),
        elem_bytes: 1,
        src_box: region.clone(),
        dst_box: region,
        src_at: if sending { slot.clone() } else { None },
        dst_at: if sending { None } else { slot },
        convert: Convert::Keep,
        lands: Lands::Aside,
    }
}

/// A step that owns its regions.
pub(super) fn owned(s: &Step<'_>) -> Step<'static> {
    Step {
        from: s.from,
        to: s.to,
        region: Cow::Owned(s.region.clone().into_owned()),
        elem_bytes: s.elem_bytes,
        src_box: Cow::Owned(s.src_box.clone().into_owned()),
        dst_box: Cow::Owned(s.dst_box.clone().into_owned()),
        src_at: s.src_at.clone(),
        dst_at: s.dst_at.clone(),
        convert: s.convert.clone(),
        lands: s.lands,
    }
}

/// The peers of a phase: its senders (of its receives) and its receivers (of its sends), in
/// rank order, each with the indices of its transfers in schedule order.
pub(super) fn by_peer(
    steps: &[Step<'_>],
    peer: impl Fn(&Step<'_>) -> Rank,
) -> BTreeMap<Rank, Vec<usize>> {
    let mut out: BTreeMap<Rank, Vec<usize>> = BTreeMap::new();
    for (i, s) in steps.iter().enumerate() {
        if s.from != s.to {
            out.entry(peer(s)).or_default().push(i);
        }
    }
    out
}
