"""One bucket of a plain reshard on this rank: the local plans of its tensors, the messages
to and from each peer, and the copying program that packs, exchanges and unpacks them
(:class:`reshard._core.Packing` for CPU tensors, batched torch copies elsewhere), with the
staging arenas it reuses between calls.
"""

from __future__ import annotations

import functools
import struct
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._core import ArgumentError, ChecksumError, Layout, Packing, ReshardError, crc32c, rank_program
from . import control as _control
from .checks import check_ranks, check_tensor, torch_dtype

# Regions inside a packed buffer start at multiples of this, so that a byte buffer can be
# viewed as any element type.
_ALIGN = 16

# A region of a message of several regions that is one run of its destination shard and at
# least this large travels as an operation of its own, which the receiver posts straight into
# its tensor: no staging copy on that side. Both ends cut a message alike, from the layouts.
IN_PLACE_BYTES = 256 * 1024


def _one_run(offset, extent, box) -> bool:
    """Whether the region (global ``offset``, ``extent``) is one run of the row-major ``box``
    (its global offset and extent): every dim after its first of more than one element whole."""
    _, whole = box
    first = next((d for d, n in enumerate(extent) if n > 1), len(extent))
    return all(extent[d] == whole[d] for d in range(first + 1, len(extent)))


@dataclass(frozen=True)
class _Piece:
    """One region of one message: where it sits in the local tensor and in the buffer, and
    (for errors) which transfer it is."""

    local: Tuple[slice, ...]
    shape: Tuple[int, ...]
    nbytes: int
    src: int
    dst: int
    offset: Tuple[int, ...]


@dataclass(frozen=True)
class LocalPlan:
    """One rank's part of the reshard of one tensor, in local coordinates."""

    src_shape: Optional[Tuple[int, ...]]
    dst_shape: Optional[Tuple[int, ...]]
    sends: Dict[int, List[_Piece]]
    recvs: Dict[int, List[_Piece]]
    locals: List[Tuple[Tuple[slice, ...], Tuple[slice, ...]]]


def _relative(offset, extent, origin) -> Tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(offset, extent, origin))


def _piece(p, src: int, dst: int) -> _Piece:
    """A region of the runtime's program (``rank_program``'s tuple) as the executor views it."""
    _, local, extent, offset, _, nbytes = p
    return _Piece(
        tuple(slice(o, o + n) for o, n in zip(local, extent)),
        tuple(extent),
        nbytes,
        src,
        dst,
        tuple(offset),
    )


@functools.lru_cache(maxsize=4096)
def local_plan(src: Layout, dst: Layout, rank: int) -> LocalPlan:
    """This rank's part of one tensor's reshard: the runtime's program for it
    (:func:`reshard._core.rank_program`), its regions by peer in the program's order."""
    sends_out, recvs_out, locals_out = rank_program([(src, dst)], rank)
    src_region = src.local_region(rank)
    dst_region = dst.local_region(rank)
    sends: Dict[int, List[_Piece]] = {
        peer: [_piece(p, rank, peer) for p in pieces] for peer, _, pieces in sends_out
    }
    recvs: Dict[int, List[_Piece]] = {
        peer: [_piece(p, peer, rank) for p in pieces] for peer, _, pieces in recvs_out
    }
    locals_ = [
        (
            tuple(slice(o, o + n) for o, n in zip(src_at, extent)),
            tuple(slice(o, o + n) for o, n in zip(dst_at, extent)),
        )
        for _, src_at, dst_at, extent in locals_out
    ]
    return LocalPlan(
        src_shape=None if src_region is None else tuple(src_region[1]),
        dst_shape=None if dst_region is None else tuple(dst_region[1]),
        sends=sends,
        recvs=recvs,
        locals=locals_,
    )


def check_entry(name: str, src_local, dst_local, src_layout, dst_layout, plan, rank: int) -> None:
    """This rank's tensors fit its shards of the layouts, on one device."""
    label = f"{name}: " if name else ""
    check_tensor(label, "src_local", src_local, src_layout, plan.src_shape, rank)
    check_tensor(label, "dst_local", dst_local, dst_layout, plan.dst_shape, rank)
    if src_local is not None and dst_local is not None and src_local.device != dst_local.device:
        raise ArgumentError(f"{label}src_local is on {src_local.device} but dst_local on {dst_local.device}")


def plan_of(name: str, src_layout, dst_layout, rank: int, world: int) -> LocalPlan:
    label = f"{name}: " if name else ""
    for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        check_ranks(label, what, layout, world)
    if src_layout.dtype != dst_layout.dtype:
        # float casts were turned into moves of one dtype before (transfer.cast); what is left
        # is a conversion no engine loads (integers, bool, fp8 without quant)
        raise ArgumentError(
            f"{label}dst_layout: dtype {dst_layout.dtype} differs from src_layout's {src_layout.dtype}, "
            "and only float dtypes (f64, f32, bf16, f16) convert into each other"
        )
    try:
        return local_plan(src_layout, dst_layout, rank)
    except ReshardError as e:
        raise type(e)(f"{label}{e}") from None  # of the core's kind, naming the tensor


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Message:
    """Everything one rank sends to (or receives from) one peer in one bucket: its regions,
    each in a tensor slot of the bucket, and where each lies in the packed buffer."""

    def __init__(self) -> None:
        self.parts: List[Tuple[int, _Piece, torch.dtype]] = []
        self.nbytes = 0
        self.spans: List[Tuple[int, int]] = []
        # how the message travels without checksums: (start, bytes, part) per operation, part
        # the index of a region received in place, None for bytes that are staged
        self.segments: List[Tuple[int, int, Optional[int]]] = []
        # the regions no operation of their own receives in place (set by cut)
        self.staged: frozenset = frozenset()

    def add(self, slot: int, piece: _Piece, dtype: torch.dtype, at: int) -> None:
        """Adds a region at byte ``at`` of the message, where the runtime's program puts it."""
        self.parts.append((slot, piece, dtype))
        self.spans.append((at, piece.nbytes))
        self.nbytes = max(self.nbytes, at + piece.nbytes)

    def cut(self, in_place: List[bool]) -> None:
        """Cuts the message into its operations: each region of ``in_place`` on its own, the
        regions between them together; one operation if no region is in place."""
        segments: List[Tuple[int, int, Optional[int]]] = []
        run: Optional[Tuple[int, int]] = None
        for i, ((at, n), own) in enumerate(zip(self.spans, in_place)):
            if not own:
                run = (at, at + n) if run is None else (run[0], at + n)
                continue
            if run is not None:
                segments.append((run[0], run[1] - run[0], None))
                run = None
            segments.append((at, n, i))
        if run is not None:
            segments.append((run[0], run[1] - run[0], None))
        self.segments = segments if len(segments) > 1 else [(0, self.nbytes, None)]
        own = {part for _, _, part in self.segments if part is not None}
        self.staged = frozenset(i for i in range(len(self.parts)) if i not in own)

    def view(self, part: int, tensors: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """Region ``part``'s bytes in its tensor, if they are contiguous there."""
        slot, piece, _ = self.parts[part]
        view = _given(tensors[slot])[piece.local]
        if not view.is_contiguous():
            return None
        return view.reshape(-1).view(torch.uint8)

    def direct(self, tensors: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """The bytes of the one region this message holds, in place, if they are contiguous:
        such a message needs no staging copy."""
        return self.view(0, tensors) if len(self.parts) == 1 else None

    def regions(self, buffer: torch.Tensor, tensors: List[Optional[torch.Tensor]], only=None):
        """Each region's slot in the packed ``buffer`` and its place in its tensor (of the
        regions ``only`` names, if given)."""
        slots, places = [], []
        for i, ((at, nbytes), (slot, piece, dtype)) in enumerate(zip(self.spans, self.parts)):
            if only is None or i in only:
                slots.append(buffer[at : at + nbytes].view(dtype).view(piece.shape))
                places.append(_given(tensors[slot])[piece.local])
        return slots, places

    def checked_nbytes(self) -> int:
        """The size of the message with its checksums: the packed regions, then one
        little-endian u32 per region."""
        return _aligned(self.nbytes) + 4 * len(self.parts)

    def sums_of(self, buffer: torch.Tensor) -> List[int]:
        """The CRC-32C of every region's bytes in the packed ``buffer``."""
        data = buffer[: self.nbytes]
        if data.device.type != "cpu":
            data = data.cpu()
        return crc32c(data, self.spans)

    def seal(self, buffer: torch.Tensor) -> None:
        """Writes the sums of the packed regions after them."""
        sums = self.sums_of(buffer)
        trailer = bytearray(struct.pack(f"<{len(sums)}I", *sums))
        at = _aligned(self.nbytes)
        buffer[at : at + len(trailer)].copy_(torch.frombuffer(trailer, dtype=torch.uint8))

    def check(self, buffer: torch.Tensor, group_rank: int) -> None:
        """Compares what arrived in ``buffer`` with the sums the sender wrote after it: the
        message is read on the host once (one copy from a device, not one per part)."""
        at = _aligned(self.nbytes)
        host = buffer[: at + 4 * len(self.parts)]
        host = host if host.device.type == "cpu" else host.cpu()
        sent = struct.unpack(f"<{len(self.parts)}I", host[at:].numpy().tobytes())
        landed = self.sums_of(host)
        for (_, piece, _), s, got in zip(self.parts, sent, landed):
            if s != got:
                raise ChecksumError(
                    f"rank {group_rank}: checksum mismatch in the transfer from rank "
                    f"{piece.src} to rank {piece.dst} at offset {list(piece.offset)} extent "
                    f"{'x'.join(map(str, piece.shape))}: sent with crc32c {s:#010x} but "
                    f"arrived as {got:#010x}"
                )

    def program(self, only=None) -> Tuple[int, List[Tuple[int, List[int], List[int], int]]]:
        """The message as :class:`reshard._core.Packing` takes it (the regions ``only`` names,
        if given)."""
        pieces = [
            (slot, [s.start for s in piece.local], list(piece.shape), at)
            for i, ((at, _), (slot, piece, _)) in enumerate(zip(self.spans, self.parts))
            if only is None or i in only
        ]
        return self.nbytes, pieces


def _given(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    assert tensor is not None, "checked by check_entry"
    return tensor


def global_rank(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


class Bucket:
    """The copying program of one bucket of tensors on this rank, computed once per model and
    layouts: its tensors are slots ``2 j`` (source) and ``2 j + 1`` (destination) of its
    ``j``-th tensor; a message per peer and direction; the local copies; and the same as a
    :class:`reshard._core.Packing`, which copies CPU tensors in Rust."""

    def __init__(self, members: List[int], plans: List[LocalPlan], layouts, rank: int) -> None:
        self.members = members
        self.locals: List[Tuple[int, Tuple[slice, ...], int, Tuple[slice, ...]]] = []
        slots = []
        dtypes = []
        for plan, (src_layout, dst_layout) in zip(plans, layouts):
            dtypes.append(torch_dtype(src_layout))
            slots.append(None if plan.src_shape is None else (list(plan.src_shape), src_layout.elem_bytes))
            slots.append(None if plan.dst_shape is None else (list(plan.dst_shape), dst_layout.elem_bytes))
        # the runtime's program of the whole bucket: its messages, their regions and offsets
        # (a rank with sends (receives) has a source (destination): check_entry sees to it)
        sends_out, recvs_out, locals_out = rank_program(list(layouts), rank)

        def messages(out, sending: bool) -> List[Tuple[int, Message]]:
            made = []
            for peer, nbytes, pieces in out:
                m = Message()
                receiver = peer if sending else rank
                in_place = []
                for p in pieces:
                    j, at = p[0], p[4]
                    ends = (rank, peer) if sending else (peer, rank)
                    piece = _piece(p, *ends)
                    m.add(2 * j + (0 if sending else 1), piece, dtypes[j], at)
                    box = layouts[j][1].local_region(receiver)
                    big = piece.nbytes >= IN_PLACE_BYTES
                    in_place.append(big and _one_run(piece.offset, piece.shape, box))
                assert m.nbytes == nbytes
                m.cut(in_place)
                made.append((peer, m))
            return made

        self.sends = messages(sends_out, True)
        self.recvs = messages(recvs_out, False)
        for j, src_at, dst_at, extent in locals_out:
            self.locals.append(
                (
                    2 * j,
                    tuple(slice(o, o + n) for o, n in zip(src_at, extent)),
                    2 * j + 1,
                    tuple(slice(o, o + n) for o, n in zip(dst_at, extent)),
                )
            )
        # without checksums, the regions received in place are not unpacked
        self.unpacking = Packing(
            slots,
            [],
            [m.program(m.staged) for _, m in self.recvs],
            [],
        )
        self.packing = Packing(
            slots,
            [m.program() for _, m in self.sends],
            [m.program() for _, m in self.recvs],
            [
                (s, [x.start for x in ss], d, [x.start for x in ds], [x.stop - x.start for x in ss])
                for s, ss, d, ds in self.locals
            ],
        )

    def exchange(
        self, tensors: List[Optional[torch.Tensor]], group, device, checksum: bool, native: bool = True
    ) -> None:
        """Pack, post every send and receive, copy locally, wait, unpack. With ``checksum``,
        every message is packed with its sums, travels whole, and is checked before any
        unpacking; without, a message travels as its operations (:meth:`Message.cut`), and a
        region cut out on its own lands in its tensor. CPU tensors are copied by the Rust
        program (unless ``native`` is off: the torch executor's ``_NATIVE``), all messages in
        one call; others by one batched torch copy per message."""
        native = native and device.type == "cpu"
        ops, peers = [], []

        def post(op, buffer, peer) -> None:
            ops.append(dist.P2POp(op, buffer, global_rank(group, peer), group))
            peers.append(peer)

        staged = _buffers(self.sends, tensors, device, checksum, "send")
        for (peer, m), buffer in zip(self.sends, staged):
            buffer = _given(m.direct(tensors) if buffer is None else buffer)
            if checksum or len(m.segments) == 1:
                post(dist.isend, buffer, peer)
            else:
                for start, n, _ in m.segments:
                    post(dist.isend, buffer[start : start + n], peer)
        if native:
            self.packing.pack(tensors, staged)
        else:
            for (_, m), buffer in zip(self.sends, staged):
                if buffer is not None:
                    _copies(*m.regions(buffer, tensors))
        if checksum:
            for (_, m), buffer in zip(self.sends, staged):
                m.seal(_given(buffer))
        landing = _buffers(self.recvs, tensors, device, checksum, "recv")
        # the regions cut out on their own that could not land in place: (message, region)
        fallback: List[Tuple[int, int]] = []
        for k, ((peer, m), buffer) in enumerate(zip(self.recvs, landing)):
            buffer = _given(m.direct(tensors) if buffer is None else buffer)
            if checksum or len(m.segments) == 1:
                post(dist.irecv, buffer, peer)
                continue
            for start, n, part in m.segments:
                view = None if part is None else m.view(part, tensors)
                if view is None and part is not None:
                    fallback.append((k, part))
                post(dist.irecv, buffer[start : start + n] if view is None else view, peer)
        requests = dist.batch_isend_irecv(ops) if ops else []

        # local copies need no communication: they run while the messages travel
        if native:
            self.packing.copy_locals(tensors)
        elif self.locals:
            _copies(
                [_given(tensors[d])[ds] for _, _, d, ds in self.locals],
                [_given(tensors[s])[ss] for s, ss, _, _ in self.locals],
            )

        _control.wait(requests, peers, group, "a reshard's messages")
        if checksum:
            me = dist.get_rank(group)
            for (_, m), buffer in zip(self.recvs, landing):
                m.check(_given(buffer), me)
        if native:
            (self.packing if checksum else self.unpacking).unpack(landing, tensors)
        else:
            for (_, m), buffer in zip(self.recvs, landing):
                if buffer is not None:
                    only = None if checksum else m.staged
                    slots, places = m.regions(buffer, tensors, only)
                    _copies(places, slots)
        if fallback:
            slots, places = [], []
            for k, part in fallback:
                (_, m), buffer = self.recvs[k], landing[k]
                s, p = m.regions(_given(buffer), tensors, {part})
                slots += s
                places += p
            _copies(places, slots)


def _buffers(messages, tensors, device, checksum: bool, way: str) -> List[Optional[torch.Tensor]]:
    """A staging buffer for every message that cannot go in place (None for those that can).
    In CPU memory they are cut from one arena per direction and thread, kept between calls
    (see :func:`free_staging`): a fresh buffer of a few hundred MiB costs as much in page
    faults and unmapping as packing it. Elsewhere each is a fresh tensor (torch's CUDA
    allocator keeps its blocks anyway)."""
    sizes: List[Optional[int]] = []
    for _, m in messages:
        inplace = not checksum and m.direct(tensors) is not None
        sizes.append(None if inplace else (m.checked_nbytes() if checksum else m.nbytes))
    if device.type != "cpu":
        return [None if n is None else torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    total = sum(_aligned(n) for n in sizes if n is not None)
    arena = getattr(STAGING, way, None)
    if arena is None or arena.numel() < total:
        arena = None
        setattr(STAGING, way, None)  # the old arena goes before the new one is allocated
        arena = torch.empty(total, dtype=torch.uint8)
        setattr(STAGING, way, arena)
    out: List[Optional[torch.Tensor]] = []
    at = 0
    for n in sizes:
        if n is None:
            out.append(None)
        else:
            out.append(arena[at : at + n])
            at += _aligned(n)
    return out


# This thread's staging arenas in CPU memory, by direction ("send", "recv").
STAGING = threading.local()


def free_staging() -> None:
    """Releases this thread's staging buffers in CPU memory, which :func:`reshard_many_` keeps
    between calls (as large as the largest bucket's messages of this rank)."""
    STAGING.__dict__.clear()


def _copies(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair, in one batched torch call where torch has it."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)
