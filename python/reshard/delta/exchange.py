"""The data of one delta refit, after the fence (:mod:`reshard.delta.session`): every
source rank encodes each of its transfers against its base where the destination holds it,
one message per peer and bucket (:mod:`reshard.delta.codec`: the core's encoding of each
region, the message's format), and the ranks exchange the messages, point to point, while
each copies the regions it holds on both sides; then every destination applies what arrived
onto its shards, in place, and with checksums compares each region after applying.

Over gloo a message lands in a buffer of the largest size it can have (known from the plan
alone, and only the bytes that arrive are touched), so the messages move in one exchange.
Other backends (NCCL) want a receive of the sent size: the messages' sizes go first, and a
message that says nothing (every region unchanged, without checksums) is not sent at all.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._core import ChecksumError, ReshardError
from ..transfer import control as _control
from ..transfer.bucket import global_rank
from . import codec as _codec

# The fence's field of a rank's held version (as the session gathers it).
_HELD = 1


def _by_peer(job, members: List[int], side: str) -> Dict[int, List[Tuple[str, object]]]:
    out: Dict[int, List[Tuple[str, object]]] = {}
    for i in members:
        for peer, pieces in getattr(job.plans[i], side).items():
            out.setdefault(peer, []).extend((job.names[i], p) for p in pieces)
    return out


def _buckets(job, bucket_bytes: int) -> List[List[int]]:
    """The tensors cut into buckets of about ``bucket_bytes`` of global tensor in the wire
    dtype (one bucket for a larger one), from global sizes, which every rank knows alike."""
    buckets: List[List[int]] = []
    members: List[int] = []
    filled = 0
    for i, name in enumerate(job.names):
        layout = job.pairs[name][2]
        size = layout.elem_bytes
        for n in layout.shape:
            size *= n
        if members and filled + size > bucket_bytes:
            buckets.append(members)
            members, filled = [], 0
        members.append(i)
        filled += size
    if members:
        buckets.append(members)
    return buckets


def _key(job, name: str, piece) -> tuple:
    _, _, src_layout, dst_layout = job.pairs[name]
    return (src_layout, dst_layout, piece.dst, piece.offset, piece.shape)


def _base_of(session, job, name: str, piece, held: int) -> Optional[torch.Tensor]:
    """The region as this rank sent it at version ``held`` (what the destination holds), or
    None where this rank has no such base."""
    if held < 0:
        return None
    if job.previous is not None:
        prev = job.previous[name][0]
        if prev is None or session.last != held:
            return None
        return prev[piece.local]
    kept = session.state.bases.get(name, {}).get(_key(job, name, piece))
    if kept is None or kept[0] != held:
        return None
    return kept[1]


def _outgoing(session, job, name: str, piece, held: int, anchored: bool, report, bases) -> _codec.Outgoing:
    """One region to send: its base, and with ``keep_base`` the tensor that keeps its new
    values (the old base, reused where it fits)."""
    new = job.pairs[name][0][piece.local]
    base = None if anchored else _base_of(session, job, name, piece, held)
    keep = None
    if session.keep_base:
        key = _key(job, name, piece)
        # the old base takes the new region (no allocation); it leaves the session first, so
        # that a call that fails later leaves no wrong base
        kept = session.state.bases.get(name, {}).pop(key, None)
        if kept is not None and (kept[1].numel(), kept[1].dtype, kept[1].device) == (
            new.numel(),
            new.dtype,
            new.device,
        ):
            keep = kept[1]
        else:
            keep = torch.empty(new.numel(), dtype=new.dtype, device=new.device)
        bases.setdefault(name, {})[key] = (report.version, keep)
    return _codec.Outgoing(new, base, keep)


def _encode(session, job, sends, held_by, anchored: bool, report, bases) -> dict:
    """This rank's messages of one bucket by peer, each with how its regions went, and its
    report's counts of them."""
    peers = sorted(sends)
    regions = [
        [_outgoing(session, job, name, p, held_by[peer], anchored, report, bases) for name, p in sends[peer]]
        for peer in peers
    ]
    messages = {}
    encoded = _codec.encode_messages(regions, session.checksum)
    for peer, outgoing, (message, summary) in zip(peers, regions, encoded):
        messages[peer] = (message, summary)
        for (_, piece), region, e in zip(sends[peer], outgoing, summary):
            report.bytes_dense += piece.nbytes
            report.changed += e.changed
            for what, count in zip(_codec.ENCODINGS, e.blocks):
                report.blocks[what] += count
            if region.base is None:
                report.regions_dense += 1
            else:
                report.regions_delta += 1
    return messages


def run(session, job, heard, version: int, report, device, rank: int) -> None:
    """Moves the data of one refit whose fence passed, bucket by bucket, and fills
    ``report``'s statistics. A rank that fails to apply a message goes on exchanging the
    other buckets (its peers wait for them), then raises."""
    anchored = session.anchor is not None and version % session.anchor == 0
    bases: Dict[str, dict] = {}
    failure: Optional[BaseException] = None
    problem: Optional[str] = None
    for members in _buckets(job, session.bucket_bytes):
        sends, recvs = _by_peer(job, members, "sends"), _by_peer(job, members, "recvs")
        held_by = {peer: heard[peer][_HELD] for peer in sends}
        messages = _encode(session, job, sends, held_by, anchored, report, bases)
        landing = _move(session.group, messages, recvs, session.checksum, device, report)
        for i in members:  # the regions this rank holds on both sides
            src_local, dst_local = job.pairs[job.names[i]][0], job.pairs[job.names[i]][1]
            for src_slices, dst_slices in job.plans[i].locals:
                dst_local[dst_slices].copy_(src_local[src_slices])
        requests, peers = landing.pop(None)
        _control.wait(requests, peers, session.group, "a delta refit's messages")
        if _larger_receives(session.group):
            for peer, buffer in landing.items():
                report.bytes_received += _codec.carried(buffer, len(recvs[peer]), session.checksum)
        if failure is not None:
            continue
        try:
            found = _apply(session, job, recvs, landing, report, rank)
            problem = problem or found
        except Exception as e:  # raised below, after the other buckets
            failure = e

    # this rank sent what it sent: its bases are the new regions, whatever arrived here
    for name in job.names:
        if session.keep_base:
            session.state.bases[name] = bases.get(name, {})
        else:
            session.state.bases.pop(name, None)
    session.state.sent = version if session.keep_base else None
    session.last = version
    report.base_bytes = session.base_bytes
    if failure is not None or problem is not None:
        session.held = None  # a shard not applied, or not the base, holds no version
        if failure is not None:
            raise failure
        raise ChecksumError(problem)
    session.held = version


def _larger_receives(group) -> bool:
    """Whether the group's backend takes a message into a larger buffer (gloo does; NCCL
    wants the sent size)."""
    return dist.get_backend(group) == "gloo"


def _move(group, messages, recvs, checksum: bool, device, report) -> dict:
    """Sends this rank's messages of one bucket (by peer: the message and how its regions
    went) and posts the receives, landing in one buffer. The buffers that will arrive by
    peer, and under None the requests to wait and their peers. The report counts the
    messages that say something, as they are: over gloo, one that says nothing still goes, in
    place of the size another backend is told first."""
    peers = sorted(recvs)
    if _larger_receives(group):
        outgoing = {p: m for p, (m, _) in messages.items()}
        sizes = {p: _codec.largest([piece.nbytes for _, piece in recvs[p]], checksum) for p in peers}
    else:
        # the messages' sizes first; one that says nothing is not sent
        outgoing = {p: m for p, (m, e) in messages.items() if not _codec.says_nothing(e, checksum)}
        senders = sorted(messages)
        told = [outgoing[p].numel() if p in outgoing else 0 for p in senders]
        sizes_out = torch.tensor(told, dtype=torch.int64, device=device).view(torch.uint8)
        sizes_in = torch.empty(8 * len(peers), dtype=torch.uint8, device=device)
        ops = [_op(dist.isend, sizes_out[8 * i : 8 * i + 8], p, group) for i, p in enumerate(senders)]
        ops += [_op(dist.irecv, sizes_in[8 * i : 8 * i + 8], p, group) for i, p in enumerate(peers)]
        works = dist.batch_isend_irecv(ops) if ops else []
        _control.wait(works, senders + peers, group, "a delta refit's message sizes")
        sizes = dict(zip(peers, sizes_in.view(torch.int64).tolist()))
        report.bytes_received += sum(sizes.values())
    # a message that says nothing stands for a size, which no report counts
    report.bytes_sent += sum(m.numel() for m, e in messages.values() if not _codec.says_nothing(e, checksum))
    arriving = torch.empty(sum(sizes.values()), dtype=torch.uint8, device=device)
    landing: dict = {}
    at = 0
    for p in peers:
        if sizes[p] > 0:
            landing[p] = arriving[at : at + sizes[p]]
            at += sizes[p]
    ops = [_op(dist.isend, m, p, group) for p, m in outgoing.items()]
    ops += [_op(dist.irecv, buffer, p, group) for p, buffer in landing.items()]
    landing[None] = (dist.batch_isend_irecv(ops) if ops else [], list(outgoing) + list(landing))
    return landing


def _op(op, tensor: torch.Tensor, peer: int, group):
    return dist.P2POp(op, tensor, global_rank(group, peer), group)


def _apply(session, job, recvs, landing, report, rank: int) -> Optional[str]:
    """Applies the messages of one bucket onto this rank's shards; returns the first region
    whose checksum differs after applying (None if none)."""
    incoming = []
    for peer in sorted(recvs):
        what = f"rank {rank}: the message from rank {peer}"
        buffer = landing.get(peer)
        if buffer is None and session.checksum:
            raise ReshardError(f"{what} did not arrive, yet checksums were asked for")
        regions = []
        for name, piece in recvs[peer]:
            extent = "x".join(map(str, piece.shape))
            named = f"{name}: " if name else ""
            label = f"{what}, {named}region at offset {list(piece.offset)} extent {extent}"
            regions.append((job.pairs[name][1][piece.local], label))
        incoming.append((buffer, what, regions))
    problem = None
    for (_, _, regions), applied in zip(incoming, _codec.apply_messages(incoming, session.checksum)):
        for (_, label), a in zip(regions, applied):
            if a.crc is None:
                continue
            report.checked += 1
            if a.crc != a.sent_crc and problem is None:
                problem = (
                    f"{label}: checksum mismatch after applying: the sender's new region has "
                    f"crc32c {a.sent_crc:#010x}, this rank's {a.crc:#010x}; its shard did not hold "
                    f"the base (version {session.held}) the delta was computed against (was it "
                    "changed outside the refit?). This rank now holds no version, so the next "
                    "refit sends it dense"
                )
    return problem
