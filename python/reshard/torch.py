"""Reshard torch tensors with ``torch.distributed`` point-to-point.

Every rank of the process group calls :func:`reshard_` (or :func:`reshard_many_` for a whole
model) with its own local tensors (None where it holds no shard). Each rank computes its part of the plan alone, from the layouts
(cached per layout pair), packs what it sends to each peer into one flat buffer with torch
tensor ops, exchanges all buffers in one ``batch_isend_irecv``, copies the regions it holds on
both sides locally meanwhile, and unpacks. The same call runs over gloo on CPU and NCCL on GPU,
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
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._core import Layout, Refit, ReshardError, crc32c, rank_plan

__all__ = ["reshard_", "reshard_many_", "torch_dtype", "local_tensor", "DEFAULT_BUCKET_BYTES"]

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


@dataclass
class _Entry:
    """One tensor of a reshard on this rank: its plan and its local tensors."""

    plan: _LocalPlan
    dtype: torch.dtype
    src: Optional[torch.Tensor]
    dst: Optional[torch.Tensor]


def _prepare(name: str, src_local, dst_local, src_layout, dst_layout, rank: int, world: int) -> _Entry:
    label = f"{name}: " if name else ""
    for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, Layout):
            raise ReshardError(f"{label}{what}: expected a reshard.Layout, got {type(layout).__name__}")
        _check_ranks(label, what, layout, world)
    if src_layout.dtype != dst_layout.dtype:
        # the core converts float dtypes in flight (`--dst-dtype`); this executor does not yet
        raise ReshardError(
            f"{label}dst_layout: dtype {dst_layout.dtype} differs from src_layout's {src_layout.dtype}, "
            "and the torch executor moves tensors in one dtype"
        )
    try:
        plan = _local_plan(src_layout, dst_layout, rank)
    except ReshardError as e:
        raise ReshardError(f"{label}{e}") from None
    _check_tensor(label, "src_local", src_local, src_layout, plan.src_shape, rank)
    _check_tensor(label, "dst_local", dst_local, dst_layout, plan.dst_shape, rank)
    if src_local is not None and dst_local is not None and src_local.device != dst_local.device:
        raise ReshardError(f"{label}src_local is on {src_local.device} but dst_local on {dst_local.device}")
    return _Entry(plan, torch_dtype(src_layout), src_local, dst_local)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Message:
    """Everything one rank sends to (or receives from) one peer in one batch."""

    def __init__(self) -> None:
        self.parts: List[Tuple[torch.Tensor, _Piece, torch.dtype]] = []
        self.nbytes = 0

    def add(self, tensor: torch.Tensor, piece: _Piece, dtype: torch.dtype) -> None:
        self.parts.append((tensor, piece, dtype))
        self.nbytes = _aligned(self.nbytes) + piece.nbytes

    def direct(self) -> Optional[torch.Tensor]:
        """The bytes of the one region this message holds, in place, if they are contiguous:
        such a message needs no staging copy."""
        if len(self.parts) != 1:
            return None
        tensor, piece, _ = self.parts[0]
        view = tensor[piece.local]
        if not view.is_contiguous():
            return None
        return view.reshape(-1).view(torch.uint8)

    def regions(self, buffer: torch.Tensor):
        """Each region's slot in the packed ``buffer`` and its place in the local tensor."""
        for (at, nbytes), (tensor, piece, dtype) in zip(self.spans(), self.parts):
            slot = buffer[at : at + nbytes].view(dtype).view(piece.shape)
            yield slot, tensor[piece.local]

    def spans(self) -> List[Tuple[int, int]]:
        """Each region's ``(start, length)`` in the packed buffer."""
        out = []
        at = 0
        for _, piece, _ in self.parts:
            at = _aligned(at)
            out.append((at, piece.nbytes))
            at += piece.nbytes
        return out

    def checked_nbytes(self) -> int:
        """The size of the message with its checksums: the packed regions, then one
        little-endian u32 per region."""
        return _aligned(self.nbytes) + 4 * len(self.parts)

    def sums_of(self, buffer: torch.Tensor) -> List[int]:
        """The CRC-32C of every region's bytes in the packed ``buffer``."""
        data = buffer[: self.nbytes]
        if data.device.type != "cpu":
            data = data.cpu()
        return crc32c(data, self.spans())

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


def _given(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    assert tensor is not None, "checked by _prepare"
    return tensor


def _peer(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _exchange(entries: List[_Entry], group, device: torch.device, checksum: bool = False) -> None:
    """One batch: pack, post every send and receive, copy locally, wait, unpack. With
    ``checksum``, every message is packed with its sums, and checked before any unpacking."""
    sends: Dict[int, _Message] = {}
    recvs: Dict[int, _Message] = {}
    for e in entries:
        # _prepare saw to it that a rank with sends (receives) has a source (destination)
        for peer, pieces in e.plan.sends.items():
            for p in pieces:
                sends.setdefault(peer, _Message()).add(_given(e.src), p, e.dtype)
        for peer, pieces in e.plan.recvs.items():
            for p in pieces:
                recvs.setdefault(peer, _Message()).add(_given(e.dst), p, e.dtype)

    ops = []
    for peer in sorted(sends):
        m = sends[peer]
        buffer = None if checksum else m.direct()
        if buffer is None:
            size = m.checked_nbytes() if checksum else m.nbytes
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            for slot, region in m.regions(buffer):
                slot.copy_(region)
            if checksum:
                m.seal(buffer)
        ops.append(dist.P2POp(dist.isend, buffer, _peer(group, peer), group))
    unpack = []
    for peer in sorted(recvs):
        m = recvs[peer]
        buffer = None if checksum else m.direct()
        if buffer is None:
            size = m.checked_nbytes() if checksum else m.nbytes
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            unpack.append((m, buffer))
        ops.append(dist.P2POp(dist.irecv, buffer, _peer(group, peer), group))
    requests = dist.batch_isend_irecv(ops) if ops else []

    # local copies need no communication: they run while the messages travel
    for e in entries:
        for src_slices, dst_slices in e.plan.locals:
            _given(e.dst)[dst_slices].copy_(_given(e.src)[src_slices])

    for request in requests:
        request.wait()
    if checksum:
        me = dist.get_rank(group)
        for m, buffer in unpack:
            m.check(buffer, me)
    for m, buffer in unpack:
        for slot, region in m.regions(buffer):
            region.copy_(slot)


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
) -> None:
    """Fill ``dst_local`` (this rank's shard in ``dst_layout``) from the source shards.

    Every rank of ``group`` calls it with its own tensors: ``src_local`` is this rank's
    shard in ``src_layout`` (None if it holds none), ``dst_local`` its shard in
    ``dst_layout`` (None if it receives none), both of the layouts' shape and dtype and on the
    device the process group's backend uses. ``dst_local`` may be strided but must not share
    memory with ``src_local``. Raises :class:`reshard.ReshardError` on bad input, before any
    byte moves. The first call with given layouts (and tensor names) also checks, through
    the group, that every rank was given the same ones: a rank with other layouts, or whose
    tensors do not fit them, makes every rank raise, naming the rank and what differs,
    instead of waiting for the backend's timeout. Later calls with the same layouts skip
    the check.

    With NCCL, ``batch_isend_irecv`` wants the group's communicator to exist before a batch
    that not every rank of the group joins: run one collective on the group first (a barrier).

    With ``checksum=True`` (on every rank alike), each message carries the CRC-32C of every
    transfer it holds, and a receiver raises :class:`reshard.ReshardError` naming a transfer
    that arrived changed (sender, receiver, offset, extent), before it unpacks any message.
    """
    reshard_many_(
        {"": (src_local, dst_local, src_layout, dst_layout)}, group=group, checksum=checksum
    )


def _views(refit: Refit, tensors: Mapping[str, torch.Tensor], rank: int, side: str, what: str):
    """The parameters' local tensors by name from a rank's own tensors by name, where a
    fused buffer (vLLM's ``qkv_proj``, ``gate_up_proj``, ``w13``) stands for its members:
    each member is the view of its slice of the buffer."""
    fused = refit.fused(rank, side)
    views: Dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in fused:
            if not isinstance(tensor, torch.Tensor):
                raise ReshardError(f"{what}: {name}: expected a tensor, got {type(tensor).__name__}")
            for member, dim, offset, extent in fused[name]:
                if tensor.dim() <= dim or tensor.shape[dim] < offset + extent:
                    raise ReshardError(
                        f"{what}: {name}: rank {rank}'s fused buffer has shape "
                        f"{tuple(tensor.shape)}, but {member} lies at {offset}..{offset + extent} of dim {dim}"
                    )
                views[member] = tensor.narrow(dim, offset, extent)
        else:
            views[name] = tensor
    return views


def _refit_pairs(refit: Refit, src, dst, rank: int):
    """Every parameter of ``refit`` as ``reshard_many_``'s pairs, with this rank's tensors."""
    srcs = _views(refit, src or {}, rank, "train", "src")
    dsts = _views(refit, dst or {}, rank, "infer", "dst")
    pairs = {}
    for name in refit.names:
        src_layout, dst_layout = refit.layouts(name)
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
    """
    rank, world = _group_rank(group)
    if rank < 0:
        return  # not a member of the group: nothing to send or receive
    if isinstance(pairs, Refit):
        pairs = _refit_pairs(pairs, src, dst, rank)
    elif src is not None or dst is not None:
        raise ReshardError("src, dst: given only with a reshard.Refit (pairs carry their tensors)")
    if bucket_bytes <= 0:
        raise ReshardError(f"bucket_bytes: {bucket_bytes} is invalid: it must be positive")
    names = sorted(pairs)
    for name in names:
        item = pairs[name]
        if not isinstance(item, (tuple, list)) or len(item) != 4:
            raise ReshardError(
                f"{name}: expected (src_local, dst_local, src_layout, dst_layout), got {item!r:.80}"
            )
        for what, layout in (("src_layout", item[2]), ("dst_layout", item[3])):
            if not isinstance(layout, Layout):
                label = f"{name}: " if name else ""
                raise ReshardError(f"{label}{what}: expected a reshard.Layout, got {type(layout).__name__}")

    def prepare() -> List[Tuple[int, _Entry]]:
        entries = []
        for name in names:
            item = pairs[name]
            entry = _prepare(name, *item, rank=rank, world=world)
            src_layout = item[2]
            size = 1
            for n in src_layout.shape:
                size *= n
            entries.append((size * src_layout.elem_bytes, entry))
        return entries

    fingerprint = _fingerprint(
        "reshard_many_", pairs, names, bucket_bytes=bucket_bytes, checksum=bool(checksum)
    )
    entries = _agree(fingerprint, prepare, group, rank)

    device = next(
        (t.device for _, e in entries for t in (e.src, e.dst) if t is not None),
        torch.device("cpu"),
    )
    # buckets are cut from global sizes, which every rank knows alike
    bucket: List[_Entry] = []
    filled = 0
    for size, entry in entries:
        if bucket and filled + size > bucket_bytes:
            _exchange(bucket, group, device, checksum)
            bucket, filled = [], 0
        bucket.append(entry)
        filled += size
    if bucket:
        _exchange(bucket, group, device, checksum)
