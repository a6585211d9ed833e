//! A sender's side of a delta phase: each transfer encoded against its base when its
//! receiver holds that base, or dense with its base renewed, and the headers that say which.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use super::steps::{beside, by_peer};
use crate::exec::delta::wire::{Carries, Dense, HEADER_BYTES, Header};
use crate::exec::delta::{Base, DeltaReport, DeltaRun};
use crate::exec::program::{Step, Steps};
use crate::exec::scaling::Casts;
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::crc;
use reshard_core::delta::DeltaEncoder;
use reshard_core::error::{Error, Result, Side};
use reshard_core::layout::Rank;
use reshard_core::region::Region;

/// Small messages and their steps.
#[derive(Default)]
pub(super) struct Msgs {
    pub steps: Steps<'static, 'static>,
    pub bytes: Vec<u8>,
}

/// What this rank sends in the phase.
#[derive(Default)]
pub(super) struct Sent {
    pub headers: Msgs,
    /// Per send: what it carries, and its CRC (`None` for a send to itself, always dense).
    pub headers_of: Vec<Option<Header>>,
    /// The encodings, in the order of the delta sends.
    pub blobs: Vec<Vec<u8>>,
}

pub(super) fn add_blocks(to: &mut [u64; 4], from: [u64; 4]) {
    for (a, b) in to.iter_mut().zip(from) {
        *a += b;
    }
}

/// What a relaying rank received as deltas in its own transfers, by sender and region: the
/// encodings it forwards as they came, with their headers.
pub(crate) type Kept = BTreeMap<(Rank, Region), (Header, Vec<u8>)>;

/// A forward of a hop from `hop`: the encoding the hop came as, when it came as a delta over
/// the version the receiver holds; otherwise dense, out of the relaying rank's shard.
fn forward(
    kept: &Kept,
    hop: Rank,
    s: &Step<'_>,
    receiver: Option<u64>,
    sent: &mut Sent,
) -> (Carries, Option<u32>) {
    let Some((header, blob)) = kept.get(&(hop, s.region.clone().into_owned())) else {
        return (Carries::Dense(Dense::NoBase), None);
    };
    match header.carries {
        Carries::Delta { base, len } if receiver == Some(base) => {
            sent.blobs.push(blob.clone());
            (Carries::Delta { base, len }, header.crc)
        }
        Carries::Delta { .. } => (Carries::Dense(Dense::Stale), None),
        Carries::Dense(why) => (Carries::Dense(why), None),
    }
}

/// When a sender stops encoding a transfer of `len` bytes and sends it dense: once its
/// encoding passes its values' bytes, or once an eighth of it has been encoded into 97% or
/// more of that eighth's values (nearly everything changed: the rest would not save enough
/// to be worth encoding).
fn hopeless(len: usize) -> impl Fn(usize, usize) -> bool {
    move |encoded, covered| {
        encoded >= len || (covered >= len / 8 && encoded as u64 * 100 >= covered as u64 * 97)
    }
}

/// A sender's encoding of its transfers in one phase.
pub(super) struct Encode<'r, 'd> {
    pub phase: usize,
    /// Of a phase of forwards: the sends that forward a hop (with the rank it came from),
    /// and what this rank received and kept of its hops.
    pub forwards: &'r BTreeMap<usize, Rank>,
    pub kept: &'r Kept,
    pub rank: Rank,
    pub run: &'r mut DeltaRun<'d>,
    pub report: &'r mut DeltaReport,
    pub checksum: bool,
}

impl Encode<'_, '_> {
    /// Encodes every send against its base when its receiver holds it (see
    /// `PhaseWork::fence`), and writes the headers, each receiver's together.
    pub fn sends(
        &mut self,
        sent: &mut Sent,
        steps: &Steps<'_, '_>,
        src_bufs: &[&[u8]],
        casts: &Casts,
        held_by: &BTreeMap<Rank, Option<u64>>,
    ) -> Result<()> {
        let rank = self.rank;
        let mut encoders: BTreeMap<usize, DeltaEncoder> = BTreeMap::new();
        sent.headers_of.clear();
        sent.blobs.clear();
        for (i, s) in steps.sends.iter().enumerate() {
            if s.from == s.to {
                sent.headers_of.push(None);
                continue;
            }
            let src = s
                .src_at
                .clone()
                .and_then(|(b, bytes)| src_bufs.get(b)?.get(bytes))
                .ok_or(Error::MissingBuffer {
                    side: Side::Src,
                    rank,
                })?;
            let encoder = match encoders.entry(s.elem_bytes) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(
                    DeltaEncoder::new(s.elem_bytes, self.run.options.block_elems).map_err(|e| {
                        Error::Internal {
                            rank,
                            detail: e.to_string(),
                        }
                    })?,
                ),
            };
            let receiver = held_by.get(&s.to).copied().flatten();
            let (carries, crc) = match self.forwards.get(&i) {
                Some(&hop) => forward(self.kept, hop, s, receiver, sent),
                None => self.one((self.phase, i), s, src, casts, receiver, encoder, sent)?,
            };
            let len = s.bytes();
            match carries {
                Carries::Delta { len: n, .. } => {
                    self.report.sent.delta += 1;
                    self.report.sent.bytes += n;
                }
                Carries::Dense(why) => {
                    self.report.sent.dense += 1;
                    self.report.sent.bytes += len;
                    DeltaReport::note(&mut self.report.dense_to, s.to, why);
                }
            }
            self.report.sent.dense_bytes += len;
            sent.headers_of.push(Some(Header { carries, crc }));
        }
        let encoded: u64 = sent.blobs.iter().map(|b| b.len() as u64).sum();
        self.report.peak_encoded_bytes = self.report.peak_encoded_bytes.max(encoded);
        // the headers, each receiver's together, in its transfers' order
        let msgs = &mut sent.headers;
        *msgs = Msgs {
            steps: Steps {
                rank,
                ..Steps::default()
            },
            bytes: Vec::new(),
        };
        for (peer, sends) in by_peer(&steps.sends, |s| s.to) {
            let at = msgs.bytes.len();
            for h in sends.into_iter().filter_map(|i| sent.headers_of[i]) {
                h.write(&mut msgs.bytes);
            }
            let len = msgs.bytes.len() - at;
            msgs.steps.sends.push(beside(rank, peer, len, true, 0, at));
        }
        let mut at = 0;
        for (peer, recvs) in by_peer(&steps.recvs, |s| s.from) {
            let len = recvs.len() * HEADER_BYTES;
            msgs.steps.recvs.push(beside(peer, rank, len, false, 0, at));
            at += len;
        }
        Ok(())
    }

    /// One send: encoded against its base when it has one its receiver holds and the
    /// version is no anchor; otherwise dense, its base renewed. Its CRC with `--checksum`.
    #[allow(clippy::too_many_arguments)]
    fn one(
        &mut self,
        key: (usize, usize),
        s: &Step<'_>,
        src: &[u8],
        casts: &Casts,
        receiver: Option<u64>,
        encoder: &mut DeltaEncoder,
        sent: &mut Sent,
    ) -> Result<(Carries, Option<u32>)> {
        let rank = self.rank;
        let version = self.run.version;
        let len = s.bytes() as usize;
        let pack = CopyGeometry::converting(
            &s.region,
            Place::Within(&s.src_box),
            Place::Stream,
            s.elem_bytes,
            casts.resolve(&s.convert, rank)?,
        );
        let fits = |b: &Base| {
            b.to == s.to
                && b.region == *s.region
                && b.elem_bytes == s.elem_bytes
                && b.bytes.len() == len
        };
        let bases = &mut self.run.state.bases;
        if bases.get(&key).is_some_and(|b| !fits(b)) {
            bases.remove(&key);
        }
        let why = match bases.get(&key) {
            _ if self.run.options.anchors(version) => Some(Dense::Anchor),
            None => Some(Dense::NoBase),
            Some(b) if receiver != Some(b.version) => Some(Dense::Stale),
            Some(_) => None,
        };
        let base = match bases.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(Base {
                to: s.to,
                region: s.region.clone().into_owned(),
                elem_bytes: s.elem_bytes,
                version,
                bytes: reshard_core::memory::zeroed(len as u64, || {
                    format!("rank {rank}'s delta base of {} to rank {}", s.region, s.to)
                })?,
            }),
        };
        let carries = match why {
            None => {
                let mut out = Vec::new();
                let from = base.version;
                let stats = encoder
                    .encode_unless(&pack, src, &mut base.bytes, 0..len, &mut out, hopeless(len))
                    .map_err(|e| Error::Internal {
                        rank,
                        detail: e.to_string(),
                    })?;
                match stats {
                    Some(stats) if out.len() < len => {
                        self.report.sent.elems += stats.elems;
                        self.report.sent.changed += stats.changed;
                        add_blocks(&mut self.report.sent.blocks, stats.blocks);
                        let carries = Carries::Delta {
                            base: from,
                            len: out.len() as u64,
                        };
                        sent.blobs.push(out);
                        carries
                    }
                    _ => Carries::Dense(Dense::NotSmaller),
                }
            }
            Some(why) => {
                // what is sent now becomes the base
                pack.copy(src, &mut base.bytes, 0..len);
                Carries::Dense(why)
            }
        };
        base.version = version;
        let crc = match carries {
            Carries::Delta { .. } if self.checksum => Some(crc::bytes_sum(&base.bytes)),
            _ => None,
        };
        Ok((carries, crc))
    }
}
