"""The data of one delta refit, after the fence (:mod:`reshard._torch_delta_session`): every
source rank encodes each of its transfers against its base where the destination holds it,
packs one message per peer, and the ranks exchange first the messages' sizes, then the
messages, point to point, while each copies the regions it holds on both sides; then every
destination applies what arrived onto its shards, in place, and with checksums compares each
region after applying.

A message is: a mode byte per region (unchanged, dense, blocks; in the plan's order of the
regions, which both sides know), with checksums an int64 CRC-32C of each new region, then the
sections of every region that is not unchanged (:func:`reshard._torch_delta.encode`), each
aligned to 8 bytes. A message whose regions are all unchanged, without checksums, is not sent
at all (its size says so).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _torch_delta as _codec
from ._core import ChecksumError, ReshardError, crc32c
from ._torch_bucket import _peer

# The fence's field of a rank's held version (as _torch_delta_session gathers it).
_HELD = 1


def _crc(flat: torch.Tensor) -> int:
    data = _codec.as_bytes(flat)
    if data.device.type != "cpu":
        data = data.cpu()
    return crc32c(data, [(0, data.numel())])[0]


def _concat(parts: List[torch.Tensor], device) -> torch.Tensor:
    """The byte tensors ``parts`` one after the other, each at a multiple of 8 bytes."""
    total = sum(_codec.aligned(p.numel()) for p in parts)
    out = torch.empty(total, dtype=torch.uint8, device=device)
    at = 0
    for p in parts:
        end = at + p.numel()
        out[at:end] = p
        at = _codec.aligned(end)
        out[end:at] = 0  # the padding, so that no stale memory leaves the rank
    return out


def _flat(view: torch.Tensor) -> torch.Tensor:
    """A region's row-major stream (the view itself where it is contiguous)."""
    return view.view(-1) if view.is_contiguous() else view.reshape(-1)


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
        return _flat(prev[piece.local])
    kept = session._bases.get(name, {}).get(_key(job, name, piece))
    if kept is None or kept[0] != held:
        return None
    return kept[1]


def _encode(session, job, peer: int, items, held: int, anchored: bool, report, bases, device):
    """This rank's message to ``peer``: its bytes (None: nothing to send)."""
    modes: List[int] = []
    crcs: List[int] = []
    sections: List[torch.Tensor] = []
    for name, piece in items:
        new = _flat(job.pairs[name][0][piece.local])
        base = None if anchored else _base_of(session, job, name, piece, held)
        encoded = _codec.encode(new, base)
        modes.append(encoded.mode)
        sections += encoded.sections
        report.bytes_dense += piece.nbytes
        report.changed += encoded.changed
        for what, count in zip(_codec.ENCODINGS, encoded.blocks):
            report.blocks[what] += count
        if base is None:
            report.regions_dense += 1
        else:
            report.regions_delta += 1
        if session.checksum:
            crcs.append(_crc(new))
        if session.keep_base:
            key = _key(job, name, piece)
            # the old base, encoded against now, takes the new region (no allocation); it
            # leaves the session first, so that a call that fails later leaves no wrong base
            kept = session._bases.get(name, {}).pop(key, None)
            same = kept is not None and kept[1].shape == new.shape and kept[1].dtype == new.dtype
            if same and kept[1].device == new.device:
                kept[1].copy_(new)
                bases.setdefault(name, {})[key] = (report.version, kept[1])
            else:
                bases.setdefault(name, {})[key] = (report.version, new.clone())
    if not session.checksum and all(m == _codec.REGION_UNCHANGED for m in modes):
        return None
    header = [torch.tensor(modes, dtype=torch.uint8, device=device)]
    if session.checksum:
        header.append(_codec.as_bytes(torch.tensor(crcs, dtype=torch.int64, device=device)))
    return _concat(header + sections, device)


def _exchange(sends: Dict[int, torch.Tensor], recvs: Dict[int, int], group, device):
    """Sends every message and receives every one of a known size, in one batch."""
    ops = []
    for peer, buffer in sends.items():
        ops.append(dist.P2POp(dist.isend, buffer, _peer(group, peer), group))
    landing = {}
    for peer, size in recvs.items():
        landing[peer] = torch.empty(size, dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, landing[peer], _peer(group, peer), group))
    return landing, (dist.batch_isend_irecv(ops) if ops else [])


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
        messages = {}
        for peer in sorted(sends):
            held = heard[peer][_HELD]
            messages[peer] = _encode(session, job, peer, sends[peer], held, anchored, report, bases, device)
        landing = _move(session.group, messages, list(recvs), device, report)
        for i in members:  # the regions this rank holds on both sides
            src_local, dst_local = job.pairs[job.names[i]][0], job.pairs[job.names[i]][1]
            for src_slices, dst_slices in job.plans[i].locals:
                dst_local[dst_slices].copy_(src_local[src_slices])
        for request in landing.pop(None):
            request.wait()
        if failure is not None:
            continue
        try:
            for peer in sorted(recvs):
                found = _apply(session, job, peer, recvs[peer], landing.get(peer), report, rank)
                problem = problem or found
        except Exception as e:  # raised below, after the other buckets
            failure = e

    # this rank sent what it sent: its bases are the new regions, whatever arrived here
    for name in job.names:
        if session.keep_base:
            session._bases[name] = bases.get(name, {})
        else:
            session._bases.pop(name, None)
    session._sent = version if session.keep_base else None
    session.last = version
    report.base_bytes = session.base_bytes
    if failure is not None or problem is not None:
        session.held = None  # a shard not applied, or not the base, holds no version
        if failure is not None:
            raise failure
        raise ChecksumError(problem)
    session.held = version


def _move(group, messages, peers: List[int], device, report) -> dict:
    """Sends this rank's messages of one bucket and posts the receives: first every
    message's size (one that says nothing changed, without checksums, is not sent), then the
    messages. The buffers that will arrive by peer, and under None the requests to wait."""
    sizes_out = {
        p: torch.tensor([0 if m is None else m.numel()], dtype=torch.int64, device=device).view(torch.uint8)
        for p, m in messages.items()
    }
    sizes_in, requests = _exchange(sizes_out, {p: 8 for p in peers}, group, device)
    for request in requests:
        request.wait()
    sizes = {p: int(t.view(torch.int64)[0]) for p, t in sizes_in.items()}
    outgoing = {p: m for p, m in messages.items() if m is not None}
    report.bytes_sent += sum(m.numel() for m in outgoing.values())
    report.bytes_received += sum(sizes.values())
    landing, requests = _exchange(outgoing, {p: n for p, n in sizes.items() if n > 0}, group, device)
    landing[None] = requests
    return landing


def _apply(session, job, peer: int, items, buffer, report, rank: int) -> Optional[str]:
    """Applies the message from ``peer`` onto this rank's shards; returns the first region
    whose checksum differs after applying (None if none)."""
    what = f"rank {rank}: the message from rank {peer}"
    if buffer is None:
        if session.checksum:
            raise ReshardError(f"{what} did not arrive, yet checksums were asked for")
        return None  # every region unchanged
    reader = _codec.Reader(buffer, what)
    modes = reader.take(len(items)).cpu().tolist()
    crcs = reader.take(8 * len(items)).view(torch.int64).cpu().tolist() if session.checksum else None
    problem = None
    for i, ((name, piece), mode) in enumerate(zip(items, modes)):
        view = job.pairs[name][1][piece.local]
        flat = _flat(view)
        extent = "x".join(map(str, piece.shape))
        label = f"{what}, {name + ': ' if name else ''}region at offset {list(piece.offset)} extent {extent}"
        _codec.decode(reader, mode, flat, label)
        if mode != _codec.REGION_UNCHANGED and not view.is_contiguous():
            view.copy_(flat.view(view.shape))
        if crcs is not None:
            report.checked += 1
            got, sent = _crc(flat), crcs[i]
            if got != sent and problem is None:
                problem = (
                    f"{label}: checksum mismatch after applying: the sender's new region has "
                    f"crc32c {sent:#010x}, this rank's {got:#010x}; its shard did not hold the "
                    f"base (version {session.held}) the delta was computed against (was it "
                    "changed outside the refit?). This rank now holds no version, so the next "
                    "refit sends it dense"
                )
    return problem
