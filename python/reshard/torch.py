"""Reshard torch tensors with ``torch.distributed`` point-to-point.

Every rank of the process group calls :func:`reshard_` (or :func:`reshard_many_` for a whole
model) with its own local tensors (None where it holds no shard). Each rank computes its part
of the plan alone, from the layouts, and keeps it as a program per set of names, layouts and
options (a refit every step reruns it); packs what it sends to each peer into one flat buffer,
exchanges all buffers in one ``batch_isend_irecv``, copies the regions it holds on both sides
locally meanwhile, and unpacks. CPU tensors are packed and unpacked in Rust
(:class:`reshard._core.Packing`, one call per bucket and direction), tensors on other devices
with one batched torch copy per message. The same call runs over gloo on CPU and NCCL on GPU,
inside one process group or between two (training and inference ranks of one world).

Rank numbers in layouts are ranks of ``group`` (the global world when ``group`` is None).

With ``checksum=True`` every packed message ends with the CRC-32C of each region it holds,
summed by the sender after packing; the receiver sums what arrived and raises
:class:`reshard.ReshardError` naming the transfer (sender, receiver, offset, extent) before it
unpacks anything. The sums are taken in CPU memory: on a GPU, each message is copied to the
host for them.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import struct
import threading
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _torch_args as _args
from . import _torch_prequant as _tpq
from . import _torch_quant as _tq
from ._core import Layout, Packing, Refit, ReshardError, crc32c, rank_plan
from ._torch_quant import scale_tensor

__all__ = [
    "reshard_",
    "reshard_many_",
    "torch_dtype",
    "local_tensor",
    "free_staging",
    "scale_tensor",
    "DEFAULT_BUCKET_BYTES",
]

_TORCH_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in [
        ("bool", "bool"),
        ("u8", "uint8"),
        ("i8", "int8"),
        ("fp8e4m3", "float8_e4m3fn"),
        ("fp8e5m2", "float8_e5m2"),
        ("bf16", "bfloat16"),
        ("f16", "float16"),
        ("i16", "int16"),
        ("u16", "uint16"),
        ("f32", "float32"),
        ("i32", "int32"),
        ("u32", "uint32"),
        ("f64", "float64"),
        ("i64", "int64"),
        ("u64", "uint64"),
    ]
    if hasattr(torch, attr)
}

# Regions inside a packed buffer start at multiples of this, so that a byte buffer can be
# viewed as any element type.
_ALIGN = 16

#: Tensors are exchanged in buckets of about this many bytes of global tensor (a tensor larger
#: than a bucket gets a bucket of its own), to bound the staging memory of a whole-model refit.
DEFAULT_BUCKET_BYTES = 1 << 30


def torch_dtype(layout: Layout) -> torch.dtype:
    """The torch dtype of a layout's elements."""
    try:
        return _TORCH_DTYPES[layout.dtype]
    except KeyError:
        raise ReshardError(
            f"dtype {layout.dtype} has no torch equivalent in torch {torch.__version__}"
        ) from None


def local_tensor(layout: Layout, rank: int, global_tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The part of ``global_tensor`` that ``rank`` holds in ``layout`` (a view), or None."""
    region = layout.local_region(rank)
    if region is None:
        return None
    return global_tensor[_slices(*region)]


def _slices(offset: Sequence[int], extent: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, extent))


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
class _LocalPlan:
    """One rank's part of the reshard of one tensor, in local coordinates."""

    src_shape: Optional[Tuple[int, ...]]
    dst_shape: Optional[Tuple[int, ...]]
    sends: Dict[int, List[_Piece]]
    recvs: Dict[int, List[_Piece]]
    locals: List[Tuple[Tuple[slice, ...], Tuple[slice, ...]]]


def _relative(offset, extent, origin) -> Tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(offset, extent, origin))


@functools.lru_cache(maxsize=4096)
def _local_plan(src: Layout, dst: Layout, rank: int) -> _LocalPlan:
    rp = rank_plan(src, dst, rank)
    src_region = src.local_region(rank)
    dst_region = dst.local_region(rank)
    # a rank sends (receives) only if it holds a source (destination) shard
    src_origin = () if src_region is None else src_region[0]
    dst_origin = () if dst_region is None else dst_region[0]
    elem = src.elem_bytes

    def piece(t, origin) -> _Piece:
        n = 1
        for e in t.extent:
            n *= e
        return _Piece(
            _relative(t.offset, t.extent, origin),
            tuple(t.extent),
            n * elem,
            t.src,
            t.dst,
            tuple(t.offset),
        )

    sends: Dict[int, List[_Piece]] = {}
    for t in rp.sends:
        sends.setdefault(t.dst, []).append(piece(t, src_origin))
    recvs: Dict[int, List[_Piece]] = {}
    for t in rp.recvs:
        recvs.setdefault(t.src, []).append(piece(t, dst_origin))
    locals_ = [
        (_relative(t.offset, t.extent, src_origin), _relative(t.offset, t.extent, dst_origin))
        for t in rp.locals
    ]
    return _LocalPlan(
        src_shape=None if src_region is None else tuple(src_region[1]),
        dst_shape=None if dst_region is None else tuple(dst_region[1]),
        sends=sends,
        recvs=recvs,
        locals=locals_,
    )


def _check_tensor(
    name: str, what: str, tensor, layout: Layout, shape: Optional[Tuple[int, ...]], rank: int
) -> None:
    """A rank in the layout gives a tensor of its shard's shape and dtype; others give None."""
    if shape is None:
        if tensor is not None:
            raise ReshardError(
                f"{name}{what}: rank {rank} is not part of this layout ({layout.spec}), "
                "yet a tensor was given for it (pass None)"
            )
        return
    dtype = torch_dtype(layout)
    if not isinstance(tensor, torch.Tensor):
        raise ReshardError(
            f"{name}{what}: rank {rank} holds a shard of shape {shape} ({layout.dtype}) in "
            f"{layout.spec}, but {type(tensor).__name__} was given instead of a tensor"
        )
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ReshardError(
            f"{name}{what}: rank {rank} holds a shard of shape {shape} ({layout.dtype}) in "
            f"{layout.spec}, but the tensor given has shape {tuple(tensor.shape)} and dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}"
        )


def _check_ranks(name: str, what: str, layout: Layout, world: int) -> None:
    beyond = [r for r in layout.ranks if r >= world]
    if beyond:
        raise ReshardError(
            f"{name}{what}: rank {beyond[0]} of {layout.spec} is not in the process group (size {world})"
        )


def _check_entry(name: str, src_local, dst_local, src_layout, dst_layout, plan, rank: int) -> None:
    """This rank's tensors fit its shards of the layouts, on one device."""
    label = f"{name}: " if name else ""
    _check_tensor(label, "src_local", src_local, src_layout, plan.src_shape, rank)
    _check_tensor(label, "dst_local", dst_local, dst_layout, plan.dst_shape, rank)
    if src_local is not None and dst_local is not None and src_local.device != dst_local.device:
        raise ReshardError(f"{label}src_local is on {src_local.device} but dst_local on {dst_local.device}")


def _plan_of(name: str, src_layout, dst_layout, rank: int, world: int) -> _LocalPlan:
    label = f"{name}: " if name else ""
    for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        _check_ranks(label, what, layout, world)
    if src_layout.dtype != dst_layout.dtype:
        # float casts were turned into moves of one dtype before (_torch_cast); what is left
        # is a conversion no engine loads (integers, bool, fp8 without quant)
        raise ReshardError(
            f"{label}dst_layout: dtype {dst_layout.dtype} differs from src_layout's {src_layout.dtype}, "
            "and only float dtypes (f64, f32, bf16, f16) convert into each other"
        )
    try:
        return _local_plan(src_layout, dst_layout, rank)
    except ReshardError as e:
        raise ReshardError(f"{label}{e}") from None


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Message:
    """Everything one rank sends to (or receives from) one peer in one bucket: its regions,
    each in a tensor slot of the bucket, and where each lies in the packed buffer."""

    def __init__(self) -> None:
        self.parts: List[Tuple[int, _Piece, torch.dtype]] = []
        self.nbytes = 0
        self.spans: List[Tuple[int, int]] = []

    def add(self, slot: int, piece: _Piece, dtype: torch.dtype) -> None:
        at = _aligned(self.nbytes)
        self.parts.append((slot, piece, dtype))
        self.spans.append((at, piece.nbytes))
        self.nbytes = at + piece.nbytes

    def direct(self, tensors: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """The bytes of the one region this message holds, in place, if they are contiguous:
        such a message needs no staging copy."""
        if len(self.parts) != 1:
            return None
        slot, piece, _ = self.parts[0]
        view = _given(tensors[slot])[piece.local]
        if not view.is_contiguous():
            return None
        return view.reshape(-1).view(torch.uint8)

    def regions(self, buffer: torch.Tensor, tensors: List[Optional[torch.Tensor]]):
        """Each region's slot in the packed ``buffer`` and its place in its tensor."""
        slots, places = [], []
        for (at, nbytes), (slot, piece, dtype) in zip(self.spans, self.parts):
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
        """Compares what arrived in ``buffer`` with the sums the sender wrote after it."""
        at = _aligned(self.nbytes)
        trailer = buffer[at : at + 4 * len(self.parts)]
        sent = struct.unpack(f"<{len(self.parts)}I", bytes(trailer.cpu().tolist()))
        landed = self.sums_of(buffer)
        for (_, piece, _), s, got in zip(self.parts, sent, landed):
            if s != got:
                raise ReshardError(
                    f"rank {group_rank}: checksum mismatch in the transfer from rank "
                    f"{piece.src} to rank {piece.dst} at offset {list(piece.offset)} extent "
                    f"{'x'.join(map(str, piece.shape))}: sent with crc32c {s:#010x} but "
                    f"arrived as {got:#010x}"
                )

    def program(self) -> Tuple[int, List[Tuple[int, List[int], List[int], int]]]:
        """The message as :class:`reshard._core.Packing` takes it."""
        pieces = [
            (slot, [s.start for s in piece.local], list(piece.shape), at)
            for (at, _), (slot, piece, _) in zip(self.spans, self.parts)
        ]
        return self.nbytes, pieces


def _given(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    assert tensor is not None, "checked by _check_entry"
    return tensor


def _peer(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


class _Bucket:
    """The copying program of one bucket of tensors on this rank, computed once per model and
    layouts: its tensors are slots ``2 j`` (source) and ``2 j + 1`` (destination) of its
    ``j``-th tensor; a message per peer and direction; the local copies; and the same as a
    :class:`reshard._core.Packing`, which copies CPU tensors in Rust."""

    def __init__(self, members: List[int], plans: List[_LocalPlan], layouts) -> None:
        self.members = members
        sends: Dict[int, _Message] = {}
        recvs: Dict[int, _Message] = {}
        self.locals: List[Tuple[int, Tuple[slice, ...], int, Tuple[slice, ...]]] = []
        slots = []
        for j, (plan, (src_layout, dst_layout)) in enumerate(zip(plans, layouts)):
            dtype = torch_dtype(src_layout)
            slots.append(None if plan.src_shape is None else (list(plan.src_shape), src_layout.elem_bytes))
            slots.append(None if plan.dst_shape is None else (list(plan.dst_shape), dst_layout.elem_bytes))
            # a rank with sends (receives) has a source (destination): _check_entry sees to it
            for peer, pieces in plan.sends.items():
                for p in pieces:
                    sends.setdefault(peer, _Message()).add(2 * j, p, dtype)
            for peer, pieces in plan.recvs.items():
                for p in pieces:
                    recvs.setdefault(peer, _Message()).add(2 * j + 1, p, dtype)
            for src_slices, dst_slices in plan.locals:
                self.locals.append((2 * j, src_slices, 2 * j + 1, dst_slices))
        self.sends = [(peer, sends[peer]) for peer in sorted(sends)]
        self.recvs = [(peer, recvs[peer]) for peer in sorted(recvs)]
        self.packing = Packing(
            slots,
            [m.program() for _, m in self.sends],
            [m.program() for _, m in self.recvs],
            [
                (s, [x.start for x in ss], d, [x.start for x in ds], [x.stop - x.start for x in ss])
                for s, ss, d, ds in self.locals
            ],
        )

    def exchange(self, tensors: List[Optional[torch.Tensor]], group, device, checksum: bool) -> None:
        """Pack, post every send and receive, copy locally, wait, unpack. With ``checksum``,
        every message is packed with its sums, and checked before any unpacking. CPU tensors
        are copied by the Rust program, all messages in one call; others by one batched
        torch copy per message."""
        native = _NATIVE and device.type == "cpu"
        ops = []
        staged = _buffers(self.sends, tensors, device, checksum, "send")
        for (peer, m), buffer in zip(self.sends, staged):
            buffer = _given(m.direct(tensors) if buffer is None else buffer)
            ops.append(dist.P2POp(dist.isend, buffer, _peer(group, peer), group))
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
        for (peer, m), buffer in zip(self.recvs, landing):
            buffer = _given(m.direct(tensors) if buffer is None else buffer)
            ops.append(dist.P2POp(dist.irecv, buffer, _peer(group, peer), group))
        requests = dist.batch_isend_irecv(ops) if ops else []

        # local copies need no communication: they run while the messages travel
        if native:
            self.packing.copy_locals(tensors)
        elif self.locals:
            _copies(
                [_given(tensors[d])[ds] for _, _, d, ds in self.locals],
                [_given(tensors[s])[ss] for s, ss, _, _ in self.locals],
            )

        for request in requests:
            request.wait()
        if checksum:
            me = dist.get_rank(group)
            for (_, m), buffer in zip(self.recvs, landing):
                m.check(_given(buffer), me)
        if native:
            self.packing.unpack(landing, tensors)
        else:
            for (_, m), buffer in zip(self.recvs, landing):
                if buffer is not None:
                    slots, places = m.regions(buffer, tensors)
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
    arena = getattr(_STAGING, way, None)
    if arena is None or arena.numel() < total:
        arena = None
        setattr(_STAGING, way, None)  # the old arena goes before the new one is allocated
        arena = torch.empty(total, dtype=torch.uint8)
        setattr(_STAGING, way, arena)
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
_STAGING = threading.local()


def free_staging() -> None:
    """Releases this thread's staging buffers in CPU memory, which :func:`reshard_many_` keeps
    between calls (as large as the largest bucket's messages of this rank)."""
    _STAGING.__dict__.clear()


#: Whether CPU tensors are packed by the Rust program (:class:`reshard._core.Packing`);
#: otherwise by batched torch copies, as tensors on other devices always are.
_NATIVE = True


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


def _fingerprint(command: str, pairs, names: List[str], **options) -> List[Tuple[str, str]]:
    """What this rank is about to run, as (field, value) pairs in a fixed order: every rank
    of the group must run alike (the command line's plan agreement, for torch)."""
    fields = [("command", command)]
    fields += [(k, repr(v)) for k, v in sorted(options.items())]
    for name in names:
        label = f"{name}: " if name else ""
        for what, layout in (("src_layout", pairs[name][2]), ("dst_layout", pairs[name][3])):
            shape = ",".join(str(n) for n in layout.shape)
            fields.append((f"{label}{what}", f"{layout.spec} shape={shape} dtype={layout.dtype}"))
    return fields


# The fingerprints every rank of a group has agreed on, oldest first: a job's later calls
# with the same tensors and layouts (a refit every step) skip the exchange. Every rank of a
# group that agreed sees the same calls in the same order, so all skip alike.
_AGREED: "collections.OrderedDict[Tuple[object, str], None]" = collections.OrderedDict()
_AGREED_MAX = 4096


def _first_difference(ours, theirs) -> Optional[Tuple[str, str, str]]:
    """The first field whose value differs: (field, ours, theirs), "(none)" where absent."""
    mine, other = dict(ours), dict(theirs)
    for field, _ in list(ours) + list(theirs):
        a, b = mine.get(field, "(none)"), other.get(field, "(none)")
        if a != b:
            return field, a, b
    return None


def _agree(fingerprint, prepare, group, rank: int):
    """Runs ``prepare`` (this rank's local checks and plans) and, on a fingerprint this group
    has not agreed on yet, compares every rank's fingerprint and outcome through the group:
    a difference or a rank's bad input raises :class:`ReshardError` on every rank (its own
    message on the rank with bad input, naming that rank elsewhere), before any byte moves."""
    digest = hashlib.blake2b(repr(fingerprint).encode(), digest_size=16).hexdigest()
    key = (group, digest)
    if key in _AGREED:
        _AGREED.move_to_end(key)
        return prepare()
    try:
        result, problem = prepare(), None
    except ReshardError as e:
        result, problem = None, str(e)
    heard = [None] * dist.get_world_size(group)
    dist.all_gather_object(heard, (digest, problem), group=group)
    if problem is not None:
        raise ReshardError(problem)  # this rank's own bad input, as its checks said it
    for r, (_, their_problem) in enumerate(heard):
        if their_problem is not None:
            raise ReshardError(f"nothing was moved: rank {r}: {their_problem}")
    if any(d != digest for d, _ in heard):
        # rare: the whole fingerprints, to name what differs
        everyone = [None] * len(heard)
        dist.all_gather_object(everyone, fingerprint, group=group)
        for r, theirs in enumerate(everyone):
            diff = _first_difference(everyone[0], theirs)
            if diff is not None:
                field, ours, other = diff
                raise ReshardError(
                    "the ranks disagree on the job, so nothing was moved: "
                    f"rank {r} runs {field} {other}; rank 0 runs {field} {ours}"
                )
    _AGREED[key] = None
    if len(_AGREED) > _AGREED_MAX:
        _AGREED.popitem(last=False)
    return result


def _group_rank(group) -> Tuple[int, int]:
    if not dist.is_initialized():
        raise ReshardError("torch.distributed is not initialized (call init_process_group first)")
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return dist.get_rank(group), dist.get_world_size(group)


def reshard_(
    src_local: Optional[torch.Tensor],
    dst_local: Optional[torch.Tensor],
    src_layout: Layout,
    dst_layout: Layout,
    group=None,
    checksum: bool = False,
    *,
    quant: Optional[str] = None,
    scale: Optional[torch.Tensor] = None,
    scale_dtype: Optional[str] = None,
    src_scale: Optional[torch.Tensor] = None,
) -> None:
    """Fill ``dst_local`` (this rank's shard in ``dst_layout``) from the source shards.

    Every rank of ``group`` calls it with its own tensors: ``src_local`` is this rank's
    shard in ``src_layout`` (None if it holds none), ``dst_local`` its shard in
    ``dst_layout`` (None if it receives none), both of the layouts' shape and dtype and on the
    device the process group's backend uses. ``dst_local`` may be strided but must not share
    memory with ``src_local``. Raises :class:`reshard.ReshardError` on bad input, before any
    byte moves. The first call with given layouts (and tensor names) also checks, through
    the group, that every rank was given the same ones: a rank with other layouts, tensors
    that do not fit them or any other bad argument (a ``scale`` without ``quant``, say) makes
    every rank raise, naming the rank and what differs, instead of waiting for the backend's
    timeout. Later calls with the same layouts skip the check: a bad argument then raises on
    its own rank only (see :mod:`reshard._torch_args`). ``dst_layout`` may have another float
    dtype than ``src_layout`` (f64, f32, bf16, f16): the source ranks convert as torch's
    ``.to()`` does, and the wire carries the destination dtype.

    With NCCL, ``batch_isend_irecv`` wants the group's communicator to exist before a batch
    that not every rank of the group joins: run one collective on the group first (a barrier).

    With ``checksum=True`` (on every rank alike), each message carries the CRC-32C of every
    transfer it holds, and a receiver raises :class:`reshard.ReshardError` naming a transfer
    that arrived changed (sender, receiver, offset, extent), before it unpacks any message.

    With ``quant`` (``"block:128x128"``, ``"block:128x128:ue8m0"``, ``"mx:32"``, ``"channel"``
    or ``"tensor"``), ``dst_layout`` is fp8 (``fp8e4m3`` or ``fp8e5m2``) and the source f64,
    f32, bf16 or f16: the senders quantize while they pack (the wire carries
    fp8), source ranks whose shards share a block first exchange their partial amax, and each
    destination rank's scales are written into ``scale``, its scale shard (shape
    :func:`reshard.quant_scale_shape`, f32, or uint8 biased exponents with
    ``scale_dtype="e8m0"``; :func:`scale_tensor` allocates one). Destination shard boundaries
    must fall on block boundaries. A NaN or infinity in a source raises
    :class:`reshard.ReshardError` on every rank, naming the block, before any value moves.
    CPU tensors are quantized by Rust kernels, others by torch operations on their device,
    bit for bit alike. ``checksum`` covers the fp8 values, the scales and the partial amax.

    An fp8 source is already quantized: with ``quant``, its scale shard ``src_scale`` (the
    same shape rule on the source side) and the values move together into ``dst_local`` and
    ``scale``, unchanged; a shard boundary on either side that cuts a block is an error.
    """
    reshard_many_(
        {"": (src_local, dst_local, src_layout, dst_layout)},
        group=group,
        checksum=checksum,
        quant=quant,
        scales=None if quant is None and scale is None else {"": scale},
        scale_dtype=scale_dtype,
        src_scales=None if src_scale is None else {"": src_scale},
    )


def _views(refit: Refit, tensors: Mapping[str, torch.Tensor], rank: int, side: str, what: str):
    """The parameters' local tensors by name from a rank's own tensors by name, where a
    fused buffer (vLLM's ``qkv_proj``, ``gate_up_proj``, ``w13``) stands for its members:
    each member is the view of its slice of the buffer."""
    fused = _refit_fused(refit, rank, side)
    views: Dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in fused:
            if not isinstance(tensor, torch.Tensor):
                raise ReshardError(f"{what}: {name}: expected a tensor, got {type(tensor).__name__}")
            for member, dim, offset, extent in fused[name]:
                if tensor.dim() <= dim or tensor.shape[dim] < offset + extent:
                    raise ReshardError(
                        f"{what}: {name}: rank {rank}'s fused buffer has shape "
                        f"{tuple(tensor.shape)}, but {member} lies at {offset}..{offset + extent} "
                        f"of dim {dim}"
                    )
                views[member] = tensor.narrow(dim, offset, extent)
        else:
            views[name] = tensor
    return views


@functools.lru_cache(maxsize=16)
def _refit_layouts(refit: Refit) -> Tuple[Tuple[str, Layout, Layout], ...]:
    """Every parameter of ``refit`` with its layouts, read once per refit: the same layout
    objects at every call hash and compare fast as the key of the cached program."""
    return tuple((name, *refit.layouts(name)) for name in refit.names)


@functools.lru_cache(maxsize=64)
def _refit_fused(refit: Refit, rank: int, side: str):
    return refit.fused(rank, side)


def _refit_pairs(refit: Refit, src, dst, rank: int):
    """Every parameter of ``refit`` as ``reshard_many_``'s pairs, with this rank's tensors."""
    srcs = _views(refit, src or {}, rank, "train", "src")
    dsts = _views(refit, dst or {}, rank, "infer", "dst")
    pairs = {}
    for name, src_layout, dst_layout in _refit_layouts(refit):
        pairs[name] = (srcs.pop(name, None), dsts.pop(name, None), src_layout, dst_layout)
    for what, left in (("src", srcs), ("dst", dsts)):
        if left:
            raise ReshardError(
                f"{what}: {sorted(left)[0]} is neither a parameter of {refit.model} nor a fused "
                f"buffer that rank {rank} holds (see Refit.names and Refit.fused)"
            )
    return pairs


def reshard_many_(
    pairs: Union[
        Mapping[str, Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Layout, Layout]], Refit
    ],
    group=None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    checksum: bool = False,
    *,
    src: Optional[Mapping[str, torch.Tensor]] = None,
    dst: Optional[Mapping[str, torch.Tensor]] = None,
    quant: Optional[str] = None,
    scales: Optional[Mapping[str, Optional[torch.Tensor]]] = None,
    scale_dtype: Optional[str] = None,
    src_scales: Optional[Mapping[str, Optional[torch.Tensor]]] = None,
) -> None:
    """:func:`reshard_` for many tensors at once (a whole model): ``pairs`` maps a name to
    ``(src_local, dst_local, src_layout, dst_layout)``.

    Or ``pairs`` is a :class:`reshard.Refit` (a model with both sides' parallelism), and
    ``src`` and ``dst`` are this rank's own tensors by name: its training shards, and its
    inference shards, where a vLLM fused buffer (``...qkv_proj.weight``) stands for its
    members (``Refit.fused(rank)``), written in place. Ranks of the group pass what they hold
    (``Refit.rank_names(rank)``) and nothing else.

    Every rank passes the same names (in any order). The tensors' messages to each peer are
    packed into one buffer per peer and exchanged in one ``batch_isend_irecv`` per bucket of
    about ``bucket_bytes`` of global tensor data, so two ranks exchange a bounded, equal number
    of messages however many tensors there are. ``checksum`` as for :func:`reshard_`.

    Tensors whose ``dst_layout`` has another float dtype (f64, f32, bf16, f16: a
    ``Refit(train_dtype=...)``) are converted by their source ranks before they move, as
    torch's ``.to()`` converts them, so the wire carries the destination dtype.
    Tensors whose ``dst_layout`` is fp8 (and source is not) are quantized in flight as
    ``quant`` says (see :func:`reshard_`), their scale shards given by name in ``scales``
    (None where the rank holds no shard); they move after the others, in one batch for all.
    Already-quantized tensors (fp8 sources, given in ``scales`` too) take their source scale
    shards by name in ``src_scales``, and move with the plain tensors.
    With a :class:`reshard.Refit` that has fp8 weights (``infer_quant``), ``quant`` is the
    refit's and the scale shards come in ``dst`` under the engine's names
    (``X.weight_scale_inv``, fused ones as ``qkv_proj.weight_scale_inv``; see
    :attr:`reshard.Refit.scales` and :meth:`reshard.Refit.scale_fused`).
    """
    rank, world = _group_rank(group)
    if rank < 0:
        return  # not a member of the group: nothing to send or receive
    given = pairs
    try:
        pairs, names, entries, moves, quant = _args.read(
            pairs, rank, bucket_bytes, src, dst, quant, scales, scale_dtype, src_scales
        )
    except ReshardError as e:
        _args.refuse(str(e), given, group, rank)  # on every rank, as the checks below
    if moves:  # already quantized: values and scales move with the plain tensors
        pairs, names = _tpq.plan(moves, pairs, names, group, quant, scale_dtype, rank, world)
    if names or not (entries or moves):
        _reshard_plain(pairs, names, group, bucket_bytes, checksum, rank, world)
    if entries:
        _tq.reshard(entries, group, quant, scale_dtype, rank, world, checksum)
    _args.passed(given, group)


def _reshard_plain(pairs, names, group, bucket_bytes: int, checksum: bool, rank: int, world: int) -> None:
    """:func:`reshard_many_` of tensors of one dtype on both sides."""
    key = (
        group,
        rank,
        world,
        bucket_bytes,
        bool(checksum),
        tuple((name, pairs[name][2], pairs[name][3]) for name in names),
    )
    program = _PROGRAMS.get(key)
    if program is None:

        def prepare() -> _Program:
            plans = []
            for name in names:
                _, _, src_layout, dst_layout = pairs[name]
                plan = _plan_of(name, src_layout, dst_layout, rank, world)
                _check_entry(name, *pairs[name], plan, rank)
                plans.append(plan)
            return _Program(names, pairs, plans, bucket_bytes)

        fingerprint = _fingerprint(
            "reshard_many_", pairs, names, bucket_bytes=bucket_bytes, checksum=bool(checksum)
        )
        program = _agree(fingerprint, prepare, group, rank)
        _PROGRAMS[key] = program
        if len(_PROGRAMS) > _PROGRAMS_MAX:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
        program.check(pairs, rank)
    program.run(pairs, group, checksum)


class _Program:
    """A reshard of many tensors on this rank, computed once per (group, names, layouts,
    options): the plans, cut into buckets, each with its copying program. A later call with
    the same ones (a refit every step) only checks the tensors and runs it."""

    def __init__(self, names: List[str], pairs, plans: List[_LocalPlan], bucket_bytes: int) -> None:
        self.names = names
        self.layouts = [(pairs[n][2], pairs[n][3]) for n in names]
        self.plans = plans
        self.buckets: List[_Bucket] = []
        # buckets are cut from global sizes, which every rank knows alike
        members: List[int] = []
        filled = 0
        for i, (src_layout, _) in enumerate(self.layouts):
            size = src_layout.elem_bytes
            for n in src_layout.shape:
                size *= n
            if members and filled + size > bucket_bytes:
                self.buckets.append(self._bucket(members))
                members, filled = [], 0
            members.append(i)
            filled += size
        if members:
            self.buckets.append(self._bucket(members))

    def _bucket(self, members: List[int]) -> _Bucket:
        return _Bucket(members, [self.plans[i] for i in members], [self.layouts[i] for i in members])

    def check(self, pairs, rank: int) -> None:
        """The tensors of this call fit the shards, as on the first call."""
        for name, plan in zip(self.names, self.plans):
            _check_entry(name, *pairs[name], plan, rank)

    def run(self, pairs, group, checksum: bool) -> None:
        items = [pairs[n] for n in self.names]
        device = next(
            (t.device for item in items for t in item[:2] if t is not None),
            torch.device("cpu"),
        )
        for bucket in self.buckets:
            tensors = [t for i in bucket.members for t in items[i][:2]]
            bucket.exchange(tensors, group, device, checksum)


# The programs of the latest calls, oldest first (a job refits the same model every step).
_PROGRAMS: "collections.OrderedDict[tuple, _Program]" = collections.OrderedDict()
_PROGRAMS_MAX = 16
