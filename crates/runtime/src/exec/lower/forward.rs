//! The phase of forwards a relay plan takes in a delta refit ([`forward_phase`]).

use std::borrow::Cow;

use super::PlanJob;
use crate::exec::program::{Buf, Convert, LocalCopy, Phase, PhaseKind, Program, Step};
use reshard_core::plan::Transfer;
use reshard_transport::Lands;

/// The forwards of a relay plan in a delta refit: each relaying rank sends on the regions it
/// forwards, out of a copy of its shard made first (so that a rank may forward and receive
/// forwards in the same phase), and the delta machinery sends each as the delta its hop came
/// as, where the receiver holds its base.
pub(super) fn forward_phase<'p>(program: &mut Program<'p>, job: &PlanJob<'p>, part: usize) {
    let rank = job.plan.rank;
    let elem_bytes = job.dst_dtype.size();
    let Some(dst) = job.dst.as_ref() else {
        return;
    };
    let forwards: Vec<&'p Transfer> = job.plan.forwards().collect();
    let received: Vec<&'p Transfer> = job.plan.recvs.iter().filter(|t| t.via.is_some()).collect();
    if forwards.is_empty() && received.is_empty() {
        return;
    }
    let len: usize = forwards
        .iter()
        .map(|t| t.region.volume() as usize * elem_bytes)
        .sum();
    let staged = program.add_scratch(len, "forwarded regions");
    program.staging_bytes += len as u64;
    let mut phase = Phase::new(
        rank,
        PhaseKind::Forward,
        part,
        vec![Buf::Scratch(staged)],
        vec![dst.buf],
    );
    phase.skip_empty = true;
    let mut at = 0;
    for (i, t) in forwards.into_iter().enumerate() {
        let bytes = at..at + t.region.volume() as usize * elem_bytes;
        at = bytes.end;
        phase.before.push(LocalCopy {
            region: Cow::Borrowed(&t.region),
            from: (dst.buf, dst.bytes.clone()),
            from_box: dst.region.clone(),
            to: (Buf::Scratch(staged), bytes.clone()),
            to_box: Cow::Borrowed(&t.region),
            elem_bytes,
            cast: None,
            counted: false,
        });
        phase.steps.sends.push(Step {
            from: rank,
            to: t.dst,
            region: Cow::Borrowed(&t.region),
            elem_bytes,
            src_box: Cow::Borrowed(&t.region),
            dst_box: Cow::Borrowed(&t.region),
            src_at: Some((0, bytes)),
            dst_at: None,
            convert: Convert::Keep,
            lands: Lands::Shard,
        });
        phase.forwards.insert(i, t.src);
    }
    for t in received {
        phase.steps.recvs.push(Step {
            from: t.via.unwrap_or(t.src),
            to: rank,
            region: Cow::Borrowed(&t.region),
            elem_bytes,
            src_box: Cow::Borrowed(&t.region),
            dst_box: dst.region.clone(),
            src_at: None,
            dst_at: Some((0, dst.bytes.clone())),
            convert: Convert::Keep,
            lands: Lands::Shard,
        });
    }
    program.phases.push(phase);
}
