//! The three exchanges of a delta phase and the work between them, as a rank runs them:
//! [`PhaseWork::fence`] (tell the senders the version held here, then encode against what
//! each receiver holds), [`PhaseWork::headers`] (tell each receiver what its transfers carry,
//! and make room for the encodings coming here) and [`PhaseWork::values`] (move the values,
//! then apply the encodings and check them).
//!
//! Every exchange is one [`run_transfers`] over the phase's links: the fences and headers as
//! small transfers beside the shards, the encodings as runs of bytes beside them, the dense
//! transfers exactly as a refit without delta moves them.

use std::collections::{BTreeMap, BTreeSet};

use super::delta::wire::{Carries, FENCE_BYTES, Fence, HEADER_BYTES, Header};
use super::delta::{DeltaReport, DeltaRun};
use crate::exec::options::ExecOptions;
use crate::exec::program::{Buf, Step, Steps};
use crate::exec::scaling::Casts;
use crate::exec::stage::Patch;
use crate::exec::stats::RankStats;
use crate::exec::transfers::run_transfers;
pub(crate) use encode::Kept;
use encode::{Encode, Msgs, Sent, add_blocks};
use reshard_core::checksum;
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::delta::{HEADER_BYTES as DELTA_HEADER, apply};
use reshard_core::error::{Dims, Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::region::Region;
use reshard_transport::Transport;
use steps::{beside, by_peer, owned};

mod encode;
mod steps;

/// A rank's delta work in one phase, between its exchanges. Everything a transport may hold
/// on to (the steps, the bytes sent) lives here, so that it outlives each exchange.
pub(crate) struct PhaseWork {
    /// Which phase of the program: the key of its bases.
    phase: usize,
    rank: Rank,
    /// The version this rank's shards held when the refit began.
    held: Option<u64>,
    /// How many source and destination buffers the phase lends (the encodings come after).
    buffers: (usize, usize),
    fence: Msgs,
    sent: Sent,
    got: Got,
    data: Steps<'static, 'static>,
}

/// What this rank receives in the phase.
#[derive(Default)]
struct Got {
    /// Per receive: what its sender said it carries.
    headers: Vec<Option<Header>>,
    blobs: Vec<Vec<u8>>,
}

/// The most bytes an encoding of `len` bytes of `elem`-byte elements can take: the header,
/// and every block dense with its tag.
fn largest_encoding(len: usize, elem: usize, block_elems: usize) -> usize {
    DELTA_HEADER + (len / elem.max(1)).div_ceil(block_elems) + len
}

fn protocol(rank: Rank, peer: Rank, detail: String) -> Error {
    Error::Protocol { rank, peer, detail }
}

impl PhaseWork {
    /// The work of phase `phase`, whose steps are `steps` over `buffers` (how many source and
    /// destination buffers the phase lends), on a rank whose shards hold `held`: its fences,
    /// one to each sender.
    pub fn new(
        phase: usize,
        steps: &Steps<'_, '_>,
        buffers: (usize, usize),
        held: Option<u64>,
    ) -> PhaseWork {
        let rank = steps.rank;
        let mut fence = Msgs {
            steps: Steps {
                rank,
                ..Steps::default()
            },
            bytes: Vec::new(),
        };
        for (k, &peer) in by_peer(&steps.recvs, |s| s.from).keys().enumerate() {
            fence.bytes.extend_from_slice(&Fence { held }.write());
            fence
                .steps
                .sends
                .push(beside(rank, peer, FENCE_BYTES, true, 0, k * FENCE_BYTES));
        }
        for (k, &peer) in by_peer(&steps.sends, |s| s.to).keys().enumerate() {
            fence
                .steps
                .recvs
                .push(beside(peer, rank, FENCE_BYTES, false, 0, k * FENCE_BYTES));
        }
        PhaseWork {
            phase,
            rank,
            held,
            buffers,
            fence,
            sent: Sent::default(),
            got: Got::default(),
            data: Steps::default(),
        }
    }

    /// The first exchange: the fences. Then every send is encoded against its base when its
    /// receiver holds that base (or marked dense, and its base renewed), and the headers are
    /// written.
    #[allow(clippy::too_many_arguments)]
    pub fn fence<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        (steps, forwards, kept): (&Steps<'_, '_>, &BTreeMap<usize, Rank>, &Kept),
        src_bufs: &[&[u8]],
        casts: &Casts,
        run: &mut DeltaRun<'_>,
        report: &mut DeltaReport,
        transport: &T,
        chunk: usize,
        options: &ExecOptions,
    ) -> Result<()> {
        let PhaseWork {
            phase,
            rank,
            fence,
            sent,
            ..
        } = self;
        let fence: &'buf Msgs = fence;
        let mut fences_in = vec![0u8; fence.steps.recvs.len() * FENCE_BYTES];
        run_transfers(
            &fence.steps,
            &[fence.bytes.as_slice()],
            &mut [fences_in.as_mut_slice()],
            transport,
            chunk,
            casts,
            options,
        )?;
        report.control_bytes += fence.bytes.len() as u64;
        let mut held_by = BTreeMap::new();
        for (s, bytes) in fence.steps.recvs.iter().zip(fences_in.chunks(FENCE_BYTES)) {
            let f = Fence::read(bytes).map_err(|d| protocol(*rank, s.from, d))?;
            held_by.insert(s.from, f.held);
        }
        let mut encode = Encode {
            phase: *phase,
            forwards,
            kept,
            rank: *rank,
            run,
            report,
            checksum: options.checksum,
        };
        encode.sends(sent, steps, src_bufs, casts, &held_by)
    }

    /// The second exchange: the headers. Then the values' steps are laid out: the dense
    /// transfers as they are, each delta as a run of bytes beside the shard, received into a
    /// buffer of its own.
    pub fn headers<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        steps: &Steps<'_, '_>,
        run: &DeltaRun<'_>,
        report: &mut DeltaReport,
        transport: &T,
        chunk: usize,
        options: &ExecOptions,
    ) -> Result<()> {
        let rank = self.rank;
        let headers: &'buf Msgs = &self.sent.headers;
        let incoming: usize = headers.steps.recvs.iter().map(|s| s.bytes() as usize).sum();
        let mut headers_in = vec![0u8; incoming];
        run_transfers(
            &headers.steps,
            &[headers.bytes.as_slice()],
            &mut [headers_in.as_mut_slice()],
            transport,
            chunk,
            &Casts::default(),
            options,
        )?;
        report.control_bytes += headers.bytes.len() as u64;
        // each receive's header, in the order its sender wrote them
        self.got.headers = vec![None; steps.recvs.len()];
        let mut read = headers_in.chunks(HEADER_BYTES);
        for (peer, recvs) in by_peer(&steps.recvs, |s| s.from) {
            for i in recvs {
                let bytes = read.next().unwrap_or_default();
                let h = Header::read(bytes).map_err(|d| protocol(rank, peer, d))?;
                self.got.headers[i] = Some(h);
            }
        }
        self.data = lay_out(
            steps,
            self.held,
            self.buffers,
            &self.sent.headers_of,
            &mut self.got,
            run,
            report,
        )?;
        Ok(())
    }

    /// The third exchange: the values. Then every delta that landed is applied onto its
    /// destination (checked whole before a byte is written), and with `--checksum` its
    /// region is checked against the sender's CRC.
    #[allow(clippy::too_many_arguments)]
    pub fn values<'buf, T: Transport<'buf> + ?Sized>(
        &'buf mut self,
        (steps, kept, patches): Patching<'_, '_>,
        src_bufs: &[&'buf [u8]],
        dst_bufs: &mut [&mut [u8]],
        casts: &Casts,
        run: &DeltaRun<'_>,
        report: &mut DeltaReport,
        transport: &T,
        chunk: usize,
        options: &ExecOptions,
    ) -> Result<RankStats> {
        let (n_src, n_dst) = self.buffers;
        let data: &'buf Steps<'static, 'static> = &self.data;
        let mut sources: Vec<&'buf [u8]> = src_bufs.to_vec();
        sources.resize(n_src, &[]);
        sources.extend(self.sent.blobs.iter().map(Vec::as_slice));
        let got = &mut self.got;
        let stats = {
            let mut dsts: Vec<&mut [u8]> = dst_bufs.iter_mut().map(|b| &mut **b).collect();
            dsts.resize_with(n_dst, || &mut []);
            dsts.extend(got.blobs.iter_mut().map(Vec::as_mut_slice));
            run_transfers(data, &sources, &mut dsts, transport, chunk, casts, options)?
        };
        let (mut kept, mut patches) = (kept, patches);
        let mut blobs = std::mem::take(&mut got.blobs).into_iter();
        for (s, header) in steps.recvs.iter().zip(&got.headers) {
            let Some(h) = header else {
                continue;
            };
            let blob = match h.carries {
                Carries::Delta { base, .. } => {
                    let mut blob = blobs.next().unwrap_or_default();
                    apply_one(s, &blob, dst_bufs, (base, h.crc), run.version, report)?;
                    if let Some((bufs, patches)) = patches.as_mut() {
                        // copied only when a relaying rank keeps it to forward too
                        let patch = match kept.is_some() {
                            true => blob.clone(),
                            false => std::mem::take(&mut blob),
                        };
                        stage_patch(s, patch, bufs, patches);
                    }
                    blob
                }
                Carries::Dense(_) => Vec::new(),
            };
            // what a relaying rank forwards later, as it came (a hop that came dense goes on
            // dense, for the same reason)
            if let Some(kept) = kept.as_deref_mut() {
                kept.insert((s.from, s.region.clone().into_owned()), (*h, blob));
            }
        }
        Ok(stats)
    }
}

/// Applies the delta `blob` that receive `s` landed, over version `base`, onto its
/// destination (checked whole before a byte is written), then checks its region against the
/// sender's CRC when it sent one.
fn apply_one(
    s: &Step<'_>,
    blob: &[u8],
    dst_bufs: &mut [&mut [u8]],
    (base, crc): (u64, Option<u32>),
    version: u64,
    report: &mut DeltaReport,
) -> Result<()> {
    let rank = s.to;
    let shard = s
        .dst_at
        .clone()
        .and_then(|(b, bytes)| dst_bufs.get_mut(b)?.get_mut(bytes))
        .ok_or(Error::MissingBuffer {
            side: Side::Dst,
            rank,
        })?;
    let unpack = CopyGeometry::new(
        &s.region,
        Place::Stream,
        Place::Within(&s.dst_box),
        s.elem_bytes,
    );
    let applied = apply(&unpack, blob, shard)
        .map_err(|e| protocol(rank, s.from, format!("its delta: {e}")))?;
    report.received.elems += applied.elems;
    report.received.changed += applied.changed;
    add_blocks(&mut report.received.blocks, applied.blocks);
    if let Some(sent) = crc {
        let landed = region_crc(shard, &s.dst_box, &s.region, s.elem_bytes);
        if landed != sent {
            return Err(Error::DeltaMismatch {
                src: s.from,
                dst: rank,
                offset: s.region.offset.clone(),
                extent: Dims(s.region.extent.clone()),
                version,
                base,
                sent,
                landed,
            });
        }
    }
    Ok(())
}

/// What [`PhaseWork::values`] works on besides its buffers: the phase's steps, where a
/// relaying rank keeps the deltas it receives, and, in a staged refit, the phase's
/// destination buffers with the patches it keeps.
type Patching<'a, 'b> = (
    &'a Steps<'b, 'b>,
    Option<&'a mut Kept>,
    Option<(&'a [Buf], &'a mut Vec<Patch>)>,
);

/// Keeps the delta `blob` that receive `s` applied onto a shadow of a live shard, for the
/// commit to apply onto the live shard itself (a delta that landed in the program's scratch
/// reaches the shards by a local copy, which the commit copies).
fn stage_patch(s: &Step<'_>, blob: Vec<u8>, bufs: &[Buf], patches: &mut Vec<Patch>) {
    let Some((b, at)) = s.dst_at.clone() else {
        return;
    };
    if let Some(&Buf::Dst(buf)) = bufs.get(b) {
        patches.push(Patch {
            buf,
            at,
            dst_box: s.dst_box.clone().into_owned(),
            region: s.region.clone().into_owned(),
            elem: s.elem_bytes,
            blob,
        });
    }
}

/// Lays out the values' steps (see [`PhaseWork::headers`]), checking every header against
/// what this rank holds before any value moves.
fn lay_out(
    steps: &Steps<'_, '_>,
    held: Option<u64>,
    (n_src, n_dst): (usize, usize),
    sends: &[Option<Header>],
    got: &mut Got,
    run: &DeltaRun<'_>,
    report: &mut DeltaReport,
) -> Result<Steps<'static, 'static>> {
    let rank = steps.rank;
    let mut data = Steps {
        rank,
        locals: steps.locals.iter().map(owned).collect(),
        ..Steps::default()
    };
    // the encodings are lent after the phase's own buffers
    let mut k = 0;
    for (s, h) in steps.sends.iter().zip(sends) {
        match h.map(|h| h.carries) {
            Some(Carries::Delta { len, .. }) => {
                data.sends
                    .push(beside(s.from, s.to, len as usize, true, n_src + k, 0));
                k += 1;
            }
            _ => data.sends.push(owned(s)),
        }
    }
    got.blobs.clear();
    for (s, header) in steps.recvs.iter().zip(&got.headers) {
        let len = s.bytes() as usize;
        match header.map(|h| h.carries) {
            Some(Carries::Delta { base, len: sent }) => {
                if held != Some(base) {
                    return Err(protocol(
                        rank,
                        s.from,
                        format!(
                            "sent a delta over version {base}, but this rank holds {}",
                            held.map_or("no version".into(), |v| format!("version {v}"))
                        ),
                    ));
                }
                let most = largest_encoding(len, s.elem_bytes, run.options.block_elems);
                let sent = usize::try_from(sent)
                    .ok()
                    .filter(|&n| n <= most)
                    .ok_or_else(|| {
                        protocol(
                            rank,
                            s.from,
                            format!("announced a delta of {sent} bytes for a transfer of {len}"),
                        )
                    })?;
                let j = got.blobs.len();
                got.blobs
                    .push(reshard_core::memory::zeroed(sent as u64, || {
                        format!("rank {rank}'s delta from rank {}", s.from)
                    })?);
                data.recvs
                    .push(beside(s.from, s.to, sent, false, n_dst + j, 0));
                report.received.delta += 1;
                report.received.bytes += sent as u64;
            }
            Some(Carries::Dense(why)) => {
                data.recvs.push(owned(s));
                report.received.dense += 1;
                report.received.bytes += len as u64;
                DeltaReport::note(&mut report.dense_from, s.from, why);
            }
            None => data.recvs.push(owned(s)),
        }
        report.received.dense_bytes += len as u64;
    }
    let incoming: u64 = got.blobs.iter().map(|b| b.len() as u64).sum();
    report.peak_encoded_bytes = report.peak_encoded_bytes.max(incoming);
    Ok(data)
}

/// The CRC-32C of `region`'s stream as `holder` holds it in `shard`.
fn region_crc(shard: &[u8], holder: &Region, region: &Region, elem: usize) -> u32 {
    let len = region.volume() as usize * elem;
    checksum::region_sum(shard, holder, region, elem, 0..len)
}

/// The pairs of ranks a delta phase links, both ways: the fences go from receivers to
/// senders.
pub(crate) fn both_ways(pairs: impl Iterator<Item = (Rank, Rank)>) -> BTreeSet<(Rank, Rank)> {
    pairs.flat_map(|(a, b)| [(a, b), (b, a)]).collect()
}
