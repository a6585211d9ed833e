//! A rank's steps: each transfer as the rank runs it, with the boxes that hold it and where
//! they lie in the rank's buffers; and the checks that every step fits its buffers before
//! any byte moves.

use std::collections::BTreeMap;

use reshard_core::error::{Dims, Error, Result, Side};
use reshard_core::layout::{Layout, Rank};
use reshard_core::plan::{RankPlan, Transfer};
use reshard_core::region::Region;

pub use super::program::{Step, Steps, cut_chunk};

/// Checks a rank's steps against its buffers before any byte moves: every slot lies inside
/// its buffer and holds exactly its box, and every region lies inside its boxes.
pub(super) fn check_steps(
    steps: &Steps<'_, '_>,
    src_bufs: &[&[u8]],
    dst_bufs: &[&mut [u8]],
) -> Result<()> {
    let rank = steps.rank;
    let slot =
        |side: Side, at: &Option<(usize, std::ops::Range<usize>)>, s: &Step<'_>, lens: &[usize]| {
            let peer = if side == Side::Src { s.to } else { s.from };
            let holder = if side == Side::Src {
                &s.src_box
            } else {
                &s.dst_box
            };
            let Some((b, bytes)) = at else {
                return Err(Error::MissingBuffer { side, rank });
            };
            let elem = match side {
                Side::Src => s.convert.src_elem().unwrap_or(s.elem_bytes),
                _ => s.elem_bytes,
            };
            let expected = holder.volume().saturating_mul(elem as u64);
            match lens.get(*b) {
                Some(&len) if bytes.start <= bytes.end && bytes.end <= len => {}
                _ => return Err(Error::MissingBuffer { side, rank }),
            }
            if bytes.len() as u64 != expected {
                return Err(Error::BufferSize {
                    side,
                    rank,
                    extent: Dims(holder.extent.clone()),
                    expected,
                    got: bytes.len() as u64,
                });
            }
            if holder.ndim() != s.region.ndim() || !holder.contains(&s.region) {
                return Err(Error::Protocol {
                    rank,
                    peer,
                    detail: format!(
                        "this rank's {side} shard does not hold {} of the plan",
                        s.region
                    ),
                });
            }
            Ok(())
        };
    let src_lens: Vec<usize> = src_bufs.iter().map(|b| b.len()).collect();
    let dst_lens: Vec<usize> = dst_bufs.iter().map(|b| b.len()).collect();
    for s in &steps.sends {
        slot(Side::Src, &s.src_at, s, &src_lens)?;
    }
    for s in &steps.recvs {
        slot(Side::Dst, &s.dst_at, s, &dst_lens)?;
    }
    for s in &steps.locals {
        slot(Side::Src, &s.src_at, s, &src_lens)?;
        slot(Side::Dst, &s.dst_at, s, &dst_lens)?;
    }
    Ok(())
}

/// Checks a rank's job before any byte moves: the shards it needs are there and of the right
/// size, and every region lies inside the shard it is read from or written to.
pub(super) fn check_job(
    plan: &RankPlan,
    src_elem: usize,
    dst_elem: usize,
    src: Option<(&Region, &[u8])>,
    dst: Option<(&Region, usize)>,
) -> Result<()> {
    let rank = plan.rank;
    let needs_src = !plan.sends.is_empty() || !plan.locals.is_empty();
    let needs_dst = !plan.recvs.is_empty() || !plan.locals.is_empty();
    if needs_src && src.is_none() {
        return Err(Error::MissingBuffer {
            side: Side::Src,
            rank,
        });
    }
    if needs_dst && dst.is_none() {
        return Err(Error::MissingBuffer {
            side: Side::Dst,
            rank,
        });
    }
    let sized = |side, region: &Region, got: usize, elem_bytes: usize| {
        let expected = region.volume().saturating_mul(elem_bytes as u64);
        if expected == got as u64 {
            Ok(())
        } else {
            Err(Error::BufferSize {
                side,
                rank,
                extent: Dims(region.extent.clone()),
                expected,
                got: got as u64,
            })
        }
    };
    if let Some((region, buf)) = src {
        sized(Side::Src, region, buf.len(), src_elem)?;
    }
    if let Some((region, len)) = dst {
        sized(Side::Dst, region, len, dst_elem)?;
    }
    let inside = |holder: Option<&Region>, t: &Transfer, side: Side| match holder {
        Some(b) if b.ndim() == t.region.ndim() && b.contains(&t.region) => Ok(()),
        _ => Err(Error::Protocol {
            rank,
            peer: if side == Side::Src { t.dst } else { t.src },
            detail: format!(
                "this rank's {side} shard does not hold {} of the plan",
                t.region
            ),
        }),
    };
    let (src_box, dst_box) = (src.map(|s| s.0), dst.map(|d| d.0));
    for t in &plan.sends {
        inside(src_box, t, Side::Src)?;
    }
    for t in &plan.recvs {
        inside(dst_box, t, Side::Dst)?;
    }
    for t in &plan.locals {
        inside(src_box, t, Side::Src)?;
        inside(dst_box, t, Side::Dst)?;
    }
    Ok(())
}

/// Checks that every rank of `layout` has a buffer of exactly its shard's size, and no other
/// rank has one ([`Layout::check_buffers`]).
pub fn check_buffers(layout: &Layout, side: Side, buffers: &BTreeMap<Rank, Vec<u8>>) -> Result<()> {
    layout.check_buffers(side, buffers)
}
