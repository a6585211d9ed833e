//! Runs a plan: cuts transfers into bounded chunks, hands them to a [`Transport`], copies the
//! local parts straight from shard to shard, and reports what did not complete.
//!
//! Every rank runs [`run_rank`] with its own [`RankPlan`]: sends on one thread, local copies and
//! receives on another, both in the plan's schedule order (one total order on rank pairs, so
//! blocking transports cannot deadlock). The receives go to the transport as one batch
//! ([`Transport::recv_all`]), which may take them as they come, each sender's in order.
//! [`run_local`] runs all ranks as threads of this process.

pub mod baseline;
pub mod checksum;
pub mod copy;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use copy::{Cast, CopyGeometry, Place};

use crate::error::{Dims, Error, Result, Side};
use crate::layout::{Layout, Rank};
use crate::plan::{Plan, RankPlan, Transfer};
use crate::region::Region;
use crate::transport::{Fault, LocalFabric, Outgoing, Receive, Transport};

/// Knobs of the executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecOptions {
    /// Largest chunk a transfer is cut into.
    pub chunk_bytes: usize,
    /// Bound on the staging memory of one rank; at least two chunks (one in, one out).
    pub staging_bytes: usize,
    /// How long a rank waits for a peer before failing.
    pub timeout: Duration,
    /// Whether every transfer is checksummed by its sender and checked by its receiver
    /// ([`checksum`]): a byte changed on the way fails the job, naming the transfer.
    pub checksum: bool,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            chunk_bytes: 4 << 20,
            staging_bytes: 64 << 20,
            timeout: Duration::from_secs(60),
            checksum: false,
        }
    }
}

impl ExecOptions {
    /// Rejects options that cannot hold their promises.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_bytes == 0 {
            return Err(Error::InvalidOption {
                field: "--chunk-bytes",
                value: "0".into(),
                reason: "a chunk must hold at least one byte".into(),
            });
        }
        if self.chunk_bytes.saturating_mul(2) > self.staging_bytes {
            return Err(Error::InvalidOption {
                field: "--chunk-bytes",
                value: self.chunk_bytes.to_string(),
                reason: format!(
                    "two chunks must fit in the staging bound of {} bytes",
                    self.staging_bytes
                ),
            });
        }
        if self.timeout.is_zero() {
            return Err(Error::InvalidOption {
                field: "--timeout",
                value: "0".into(),
                reason: "must be positive".into(),
            });
        }
        Ok(())
    }
}

/// What one rank did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankStats {
    pub rank: Rank,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub bytes_local: u64,
    pub chunks_sent: u64,
    pub chunks_received: u64,
    pub peak_staging_bytes: u64,
}

impl RankStats {
    /// Adds `other`'s counts to these, as one rank's phases add up; the peak is the larger.
    pub fn absorb(&mut self, other: &RankStats) {
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.bytes_local += other.bytes_local;
        self.chunks_sent += other.chunks_sent;
        self.chunks_received += other.chunks_received;
        self.peak_staging_bytes = self.peak_staging_bytes.max(other.peak_staging_bytes);
    }
}

/// What a whole run did.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    pub elapsed: Duration,
    pub ranks: Vec<RankStats>,
}

impl RunStats {
    /// The run's stats from every rank's outcome, or every rank's failure.
    pub fn gather(
        elapsed: Duration,
        results: impl IntoIterator<Item = Result<RankStats>>,
    ) -> Result<RunStats> {
        let mut stats = RunStats {
            elapsed,
            ranks: Vec::new(),
        };
        let mut failures = Vec::new();
        for r in results {
            match r {
                Ok(s) => stats.ranks.push(s),
                Err(e) => failures.push(e),
            }
        }
        if failures.is_empty() {
            Ok(stats)
        } else {
            Err(Error::Incomplete { failures })
        }
    }

    pub fn bytes_remote(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes_received).sum()
    }

    pub fn bytes_local(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes_local).sum()
    }

    pub fn peak_staging_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .map(|r| r.peak_staging_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// One rank's share of a run: its plan and its shards.
pub struct RankJob<'buf, 'dst> {
    pub plan: &'buf RankPlan,
    /// The source layout: where every sender's shard lies.
    pub src_layout: &'buf Layout,
    /// The rank's source box and shard, if it is a source.
    pub src: Option<(&'buf Region, &'buf [u8])>,
    /// The rank's destination box and shard, if it is a destination.
    pub dst: Option<(&'buf Region, &'dst mut [u8])>,
    /// The destination's dtype (`--dst-dtype`): when it differs from the source layout's,
    /// this rank converts what it sends and copies locally, and its destination shard holds
    /// elements of this dtype.
    pub dst_dtype: crate::DType,
}

/// Runs one rank's part of a plan over `transport`.
pub fn run_rank<'buf, T: Transport<'buf> + ?Sized>(
    job: RankJob<'buf, '_>,
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats> {
    let RankJob {
        plan,
        src_layout,
        src,
        dst,
        dst_dtype,
    } = job;
    let rank = plan.rank;
    // transfers move destination elements; the sender converts while it packs
    let elem_bytes = dst_dtype.size();
    let cast = Cast::between(src_layout.dtype(), dst_dtype).map_err(|source| Error::Convert {
        tensor: "tensor".into(),
        source,
    })?;
    check_job(
        plan,
        src_layout.dtype().size(),
        elem_bytes,
        src,
        dst.as_ref().map(|(b, d)| (*b, d.len())),
    )?;
    // every sender's box, for the receives
    let senders: BTreeMap<Rank, Region> = plan
        .recvs
        .iter()
        .map(|t| {
            let b = src_layout
                .local_region(t.src)
                .ok_or_else(|| Error::Protocol {
                    rank,
                    peer: t.src,
                    detail: "the plan receives from a rank that is not a source".into(),
                })?;
            Ok((t.src, b))
        })
        .collect::<Result<_>>()?;
    let src_len = src.map_or(0, |s| s.1.len());
    let dst_len = dst.as_ref().map_or(0, |d| d.1.len());
    let step = |t: &'buf Transfer, src_box: &'buf Region, dst_box: &'buf Region| Step {
        from: t.src,
        to: t.dst,
        region: &t.region,
        elem_bytes,
        src_box,
        dst_box,
        src_at: Some((0, 0..src_len)),
        dst_at: Some((0, 0..dst_len)),
        cast,
    };
    let (src_box, dst_box) = (src.map(|s| s.0), dst.as_ref().map(|d| d.0));
    let mut steps = Steps {
        rank,
        ..Steps::default()
    };
    if let Some(src_box) = src_box {
        steps.sends = plan
            .sends
            .iter()
            .map(|t| step(t, src_box, &t.region))
            .collect();
        if let Some(dst_box) = dst_box {
            steps.locals = plan
                .locals
                .iter()
                .map(|t| step(t, src_box, dst_box))
                .collect();
        }
    }
    if let Some(dst_box) = dst_box {
        steps.recvs = plan
            .recvs
            .iter()
            .map(|t| Step {
                src_box: &senders[&t.src],
                src_at: None,
                ..step(t, &t.region, dst_box)
            })
            .collect();
    }
    let src_bufs: Vec<&'buf [u8]> = src.map(|s| s.1).into_iter().collect();
    let mut dst_bufs: Vec<&mut [u8]> = dst.map(|d| d.1).into_iter().collect();
    run_steps(&steps, &src_bufs, &mut dst_bufs, transport, options)
}

/// One transfer as a rank runs it: the region, the boxes that hold it on both sides, and
/// where those boxes lie in this rank's buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step<'a> {
    pub from: Rank,
    pub to: Rank,
    /// In global tensor coordinates.
    pub region: &'a Region,
    pub elem_bytes: usize,
    /// The box holding `region` on the sender: a dense row-major piece of a source buffer.
    pub src_box: &'a Region,
    /// The box holding `region` on the receiver.
    pub dst_box: &'a Region,
    /// On this rank, when it sends: the source buffer and the bytes of `src_box` in it.
    pub src_at: Option<(usize, std::ops::Range<usize>)>,
    /// On this rank, when it receives: the destination buffer and the bytes of `dst_box`.
    pub dst_at: Option<(usize, std::ops::Range<usize>)>,
    /// The conversion from the source's dtype (`elem_bytes` is the destination's): done by
    /// the sender while it packs, or in a local copy. Every step of a converting job carries
    /// it, the receives too, because both ends cut its transfers alike ([`cut_chunk`]).
    pub cast: Option<Cast>,
}

/// The chunk size a job cuts its transfers into: `requested`, or for a converting job, the
/// largest multiple of 8 bytes not above it (at least 8), so that every chunk holds whole
/// elements of every dtype on both sides. Both ends of a transfer compute the same.
pub fn cut_chunk(requested: usize, converts: bool) -> usize {
    if converts {
        (requested - requested % 8).max(8)
    } else {
        requested
    }
}

impl Step<'_> {
    /// Bytes of the transfer on the wire (destination elements).
    pub fn bytes(&self) -> u64 {
        self.region.volume() * self.elem_bytes as u64
    }
}

/// One rank's steps, each list in schedule order. The sends borrow for as long as the
/// transport may hold their chunks (`'s`); the rest only for the run (`'r`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Steps<'s, 'r> {
    pub rank: Rank,
    pub sends: Vec<Step<'s>>,
    pub recvs: Vec<Step<'r>>,
    pub locals: Vec<Step<'r>>,
}

/// Runs one rank's steps over `transport`: the sends on one thread, the local copies and the
/// receives on another (or all on one when the transport's sends never block). A failure on
/// either side breaks every link; the error lists exactly what did not arrive.
pub fn run_steps<'buf, T: Transport<'buf> + ?Sized>(
    steps: &Steps<'buf, '_>,
    src_bufs: &[&'buf [u8]],
    dst_bufs: &mut [&mut [u8]],
    transport: &T,
    options: &ExecOptions,
) -> Result<RankStats> {
    let rank = steps.rank;
    let converts = [&steps.sends, &steps.recvs, &steps.locals]
        .iter()
        .any(|list| list.iter().any(|s| s.cast.is_some()));
    let chunk = cut_chunk(options.chunk_bytes, converts);
    check_steps(steps, src_bufs, dst_bufs)?;
    let mut stats = RankStats {
        rank,
        ..RankStats::default()
    };
    // `check_steps` made sure every slot is in range
    let source = |s: &Step<'_>| -> &'buf [u8] {
        let (b, bytes) = s.src_at.clone().expect("checked");
        &src_bufs[b][bytes]
    };

    let send_all = || -> Result<(u64, u64)> {
        let (mut bytes, mut chunks) = (0u64, 0u64);
        // with --checksum: every receiver's chunk sums, in the order they are sent
        let mut sums: BTreeMap<Rank, Vec<u32>> = BTreeMap::new();
        for s in &steps.sends {
            let len = s.bytes() as usize;
            let chunk = transport.chunking().chunk_bytes(len, chunk);
            let src = source(s);
            let mut peer_sums = options.checksum.then(|| sums.entry(s.to).or_default());
            for range in checksum::chunks(len, chunk) {
                let out = Outgoing {
                    from: rank,
                    to: s.to,
                    src,
                    src_box: s.src_box,
                    region: s.region,
                    elem_bytes: s.elem_bytes,
                    range,
                    cast: s.cast,
                };
                match peer_sums.as_deref_mut() {
                    // summed by the transport as it reads the bytes, where it can
                    Some(peer_sums) => peer_sums.push(transport.send_summed(out)?),
                    None => transport.send(out)?,
                }
                chunks += 1;
            }
            bytes += len as u64;
        }
        // the sums follow every chunk to their receiver
        for (peer, peer_sums) in sums {
            transport.send_sums(peer, peer_sums)?;
        }
        Ok((bytes, chunks))
    };

    let receive_all =
        |stats: &mut RankStats, arrived: &mut [bool], dst_bufs: &mut [&mut [u8]]| -> Result<()> {
            for s in &steps.locals {
                let (b, bytes) = s.dst_at.clone().expect("checked");
                let g = CopyGeometry::converting(
                    s.region,
                    Place::Within(s.src_box),
                    Place::Within(s.dst_box),
                    s.elem_bytes,
                    s.cast,
                );
                g.copy(source(s), &mut dst_bufs[b][bytes], 0..g.len());
                stats.bytes_local += g.len() as u64;
            }
            let expected: Vec<Receive<'_>> = steps
                .recvs
                .iter()
                .map(|s| {
                    let (buffer, bytes) = s.dst_at.clone().expect("checked");
                    Receive {
                        from: s.from,
                        to: rank,
                        region: s.region,
                        src_box: s.src_box,
                        dst_box: s.dst_box,
                        elem_bytes: s.elem_bytes,
                        buffer,
                        bytes,
                    }
                })
                .collect();
            let landed = &mut |i: usize| {
                let len = expected[i].len();
                arrived[i] = true;
                stats.bytes_received += len as u64;
                stats.chunks_received +=
                    len.div_ceil(transport.chunking().chunk_bytes(len, chunk)) as u64;
            };
            transport.recv_all(&expected, dst_bufs, chunk, landed)?;
            if options.checksum {
                check_sums(steps, dst_bufs, transport, chunk, arrived)?;
            }
            Ok(())
        };

    // A failure on either side breaks every link at once, so that the other side and the
    // peers stop now rather than at their timeouts.
    let give_up_on = |e: &Error| {
        tracing::warn!(rank, error = %e, "failed: breaking every link");
        transport.abort();
    };
    let mut arrived = vec![false; steps.recvs.len()];
    let started = std::time::Instant::now();
    let (sent, received) = if !transport.sends_block() {
        // everything is posted first, then received, on this one thread
        let sent = send_all().inspect_err(give_up_on);
        let received = match &sent {
            Ok(_) => receive_all(&mut stats, &mut arrived, dst_bufs).inspect_err(give_up_on),
            Err(_) => Err(Error::Internal {
                rank,
                detail: "nothing was received: sending failed first".into(),
            }),
        };
        (sent, received)
    } else {
        std::thread::scope(|scope| {
            let sender = std::thread::Builder::new()
                .spawn_scoped(scope, || send_all().inspect_err(give_up_on));
            if sender.is_err() {
                transport.abort();
            }
            let received = receive_all(&mut stats, &mut arrived, dst_bufs).inspect_err(give_up_on);
            let sent = match sender {
                Ok(sender) => sender.join().unwrap_or_else(|_| {
                    Err(Error::Internal {
                        rank,
                        detail: "the send thread panicked".into(),
                    })
                }),
                Err(source) => Err(Error::ThreadStart {
                    what: format!("rank {rank}'s sender"),
                    source,
                }),
            };
            (sent, received)
        })
    };
    // Report everything that went wrong, and exactly what did not arrive.
    let mut failures = Vec::new();
    if let Err(e) = received {
        failures.push(e);
        let missing: Vec<&Step<'_>> = steps
            .recvs
            .iter()
            .zip(&arrived)
            .filter_map(|(s, &arrived)| (!arrived).then_some(s))
            .collect();
        let mut from: Vec<Rank> = missing.iter().map(|s| s.from).collect();
        from.sort_unstable();
        from.dedup();
        if !missing.is_empty() {
            failures.push(Error::NotArrived {
                rank,
                transfers: missing.len(),
                bytes: missing.iter().map(|s| s.bytes()).sum(),
                from,
            });
        }
    }
    let (bytes_sent, chunks_sent) = match sent {
        Ok(s) => s,
        Err(e) => {
            failures.push(e);
            (0, 0)
        }
    };
    if !failures.is_empty() {
        return Err(if failures.len() == 1 {
            failures.remove(0)
        } else {
            Error::Incomplete { failures }
        });
    }
    let moved = started.elapsed();
    transport.finish()?;
    tracing::debug!(
        rank,
        transport = transport.name(),
        moved_ms = moved.as_secs_f64() * 1e3,
        finished_ms = started.elapsed().as_secs_f64() * 1e3,
        bytes_received = stats.bytes_received,
        bytes_sent,
        "rank done"
    );
    stats.bytes_sent = bytes_sent;
    stats.chunks_sent = chunks_sent;
    stats.peak_staging_bytes = transport.peak_staging_bytes();
    Ok(stats)
}

/// With `--checksum`, once every transfer has landed: takes each sender's sums (sent after
/// its last chunk to this rank) and compares them with what landed. A transfer that differs
/// is marked as not arrived; the error names the first one.
fn check_sums<'buf, T: Transport<'buf> + ?Sized>(
    steps: &Steps<'_, '_>,
    dst_bufs: &[&mut [u8]],
    transport: &T,
    chunk: usize,
    arrived: &mut [bool],
) -> Result<()> {
    // each sender's transfers, in their order
    let mut senders: BTreeMap<Rank, Vec<usize>> = BTreeMap::new();
    for (i, s) in steps.recvs.iter().enumerate() {
        senders.entry(s.from).or_default().push(i);
    }
    let mut first = None;
    for (peer, transfers) in senders {
        let sums = transport.recv_sums(peer)?;
        let mut rest = &sums[..];
        for i in transfers {
            let s = &steps.recvs[i];
            let (b, bytes) = s.dst_at.clone().expect("checked");
            let len = s.bytes() as usize;
            let landed = checksum::Landed {
                from: s.from,
                to: s.to,
                region: s.region,
                elem_bytes: s.elem_bytes,
                shard: &dst_bufs[b][bytes],
                dst_box: s.dst_box,
                chunk: transport.chunking().chunk_bytes(len, chunk),
            };
            let n = landed.chunk_count().min(rest.len());
            let (mine, later) = rest.split_at(n);
            rest = later;
            if let Err(e) = landed.check(mine) {
                arrived[i] = false;
                first.get_or_insert(e);
            }
        }
        if !rest.is_empty() {
            return Err(Error::Protocol {
                rank: steps.rank,
                peer,
                detail: format!("sent {} checksums more than the chunks it sent", rest.len()),
            });
        }
    }
    first.map_or(Ok(()), Err)
}

/// Checks a rank's steps against its buffers before any byte moves: every slot lies inside
/// its buffer and holds exactly its box, and every region lies inside its boxes.
fn check_steps(steps: &Steps<'_, '_>, src_bufs: &[&[u8]], dst_bufs: &[&mut [u8]]) -> Result<()> {
    let rank = steps.rank;
    let slot =
        |side: Side, at: &Option<(usize, std::ops::Range<usize>)>, s: &Step<'_>, lens: &[usize]| {
            let peer = if side == Side::Src { s.to } else { s.from };
            let holder = if side == Side::Src {
                s.src_box
            } else {
                s.dst_box
            };
            let Some((b, bytes)) = at else {
                return Err(Error::MissingBuffer { side, rank });
            };
            let elem = match (side, s.cast) {
                (Side::Src, Some(cast)) => cast.src_elem,
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
            if holder.ndim() != s.region.ndim() || !holder.contains(s.region) {
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
fn check_job(
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
/// rank has one.
pub fn check_buffers(layout: &Layout, side: Side, buffers: &BTreeMap<Rank, Vec<u8>>) -> Result<()> {
    for (position, &rank) in layout.mesh().ranks().iter().enumerate() {
        let region = layout.region_at(position);
        let expected = region.volume() * layout.dtype().size() as u64;
        let got = buffers
            .get(&rank)
            .ok_or(Error::MissingBuffer { side, rank })?
            .len() as u64;
        if got != expected {
            return Err(Error::BufferSize {
                side,
                rank,
                extent: Dims(region.extent),
                expected,
                got,
            });
        }
    }
    if let Some(&rank) = buffers.keys().find(|&&r| !layout.mesh().contains(r)) {
        return Err(Error::UnexpectedBuffer { side, rank });
    }
    Ok(())
}

/// Runs a whole plan with every rank as a thread of this process (the `local` transport).
/// `src` holds every source rank's shard, `dst` every destination rank's shard (written in
/// place). Buffers are checked before any byte moves; on failure the error lists every rank
/// that did not complete.
///
/// ```
/// use std::collections::BTreeMap;
/// use reshard::{DType, Plan, exec, fill::Fill, layout::LayoutSpec};
/// let shape = [8, 8];
/// let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&shape, DType::Bf16, 0).unwrap();
/// let dst = LayoutSpec::parse("mesh=4 place=S(1)").unwrap().resolve(&shape, DType::Bf16, 2).unwrap();
/// let plan = Plan::new(src, dst).unwrap();
/// let srcs = Fill::Index.shards(plan.src()).unwrap();
/// let mut dsts = exec::zeroed_shards(plan.dst()).unwrap();
/// exec::run_local(&plan, &srcs, &mut dsts, &exec::ExecOptions::default()).unwrap();
/// assert!(Fill::Index.verify_shards(plan.dst(), &dsts).is_ok());
/// ```
pub fn run_local(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
) -> Result<RunStats> {
    run_local_with_faults(plan, src, dst, options, &[])
}

/// Most ranks [`run_local`] runs (two threads each); see [`crate::limits`].
pub use crate::limits::MAX_LOCAL_RANKS;

/// [`run_local`] with injected faults, for testing failure handling.
pub fn run_local_with_faults(
    plan: &Plan,
    src: &BTreeMap<Rank, Vec<u8>>,
    dst: &mut BTreeMap<Rank, Vec<u8>>,
    options: &ExecOptions,
    faults: &[Fault],
) -> Result<RunStats> {
    options.validate()?;
    check_buffers(plan.src(), Side::Src, src)?;
    check_buffers(plan.dst(), Side::Dst, dst)?;
    let ranks = plan.ranks();
    if ranks.len() > MAX_LOCAL_RANKS {
        return Err(Error::InvalidOption {
            field: "--transport",
            value: "local".into(),
            reason: format!(
                "local runs every rank as threads of one process, and {} ranks is over its limit of {MAX_LOCAL_RANKS}",
                ranks.len()
            ),
        });
    }
    let rank_plans = plan.rank_plans();
    let src_boxes: BTreeMap<Rank, Region> = regions(plan.src());
    let dst_boxes: BTreeMap<Rank, Region> = regions(plan.dst());
    let pairs: BTreeSet<(Rank, Rank)> = plan
        .transfers()
        .iter()
        .filter(|t| !t.is_local())
        .map(|t| (t.src, t.dst))
        .collect();
    let fabric = LocalFabric {
        timeout: options.timeout,
        faults: faults.to_vec(),
    };
    let mut endpoints = fabric.endpoints(&ranks, pairs);
    tracing::debug!(
        ranks = ranks.len(),
        transfers = plan.transfers().len(),
        chunk_bytes = options.chunk_bytes,
        "local run"
    );

    let started = Instant::now();
    let mut dst_shards: BTreeMap<Rank, &mut Vec<u8>> =
        dst.iter_mut().map(|(&r, b)| (r, b)).collect();
    let results: Vec<Result<RankStats>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&rank| {
                let job = RankJob {
                    plan: &rank_plans[&rank],
                    src_layout: plan.src(),
                    src: src_boxes.get(&rank).zip(src.get(&rank).map(Vec::as_slice)),
                    dst: dst_boxes
                        .get(&rank)
                        .zip(dst_shards.remove(&rank).map(Vec::as_mut_slice)),
                    dst_dtype: plan.dst().dtype(),
                };
                let endpoint = endpoints.remove(&rank);
                std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(scope, move || match endpoint {
                        // the endpoint lives as long as the thread: a rank that fails closes its links
                        Some(endpoint) => run_rank(job, &endpoint, options),
                        None => Ok(RankStats::default()),
                    })
            })
            .collect();
        handles
            .into_iter()
            .zip(&ranks)
            .map(|(h, &rank)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(Error::Internal {
                        rank,
                        detail: "the rank's thread panicked".into(),
                    })
                }),
                Err(source) => Err(Error::ThreadStart {
                    what: format!("rank {rank}"),
                    source,
                }),
            })
            .collect()
    });
    let elapsed = started.elapsed();
    let stats = RunStats::gather(elapsed, results)?;
    tracing::debug!(?elapsed, bytes = stats.bytes_remote(), "local run done");
    Ok(stats)
}

fn regions(layout: &Layout) -> BTreeMap<Rank, Region> {
    layout
        .mesh()
        .ranks()
        .iter()
        .enumerate()
        .map(|(p, &r)| (r, layout.region_at(p)))
        .collect()
}

/// A zero-filled local buffer for every rank of `layout`; [`Error::OutOfMemory`] when they do
/// not fit in memory.
pub fn zeroed_shards(layout: &Layout) -> Result<BTreeMap<Rank, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for &r in layout.mesh().ranks() {
        let buf = crate::memory::zeroed(layout.local_bytes(r), || {
            format!("rank {r}'s destination shard")
        })?;
        out.insert(r, buf);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
