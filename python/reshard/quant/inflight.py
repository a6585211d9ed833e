"""Quantizing in flight for :mod:`reshard.torch`: a reshard into an fp8 destination with its
scales (``reshard_(..., quant=...)``), over ``torch.distributed`` point-to-point.

Each rank, from the layouts alone, knows its part (:class:`reshard._core.QuantPacking`): the
source ranks whose shards share a block first exchange their partial amax (a few bytes per
block piece, nothing when every block lies in one shard); every sender then quantizes while it
packs, so the wire carries fp8 values (one byte per element) followed by the scales they go
with; every destination writes the values into its shard and the scales into its scale shard
(:func:`reshard.quant_scale_shape`). CPU tensors are quantized and unpacked by the Rust
kernels, tensors on other devices by torch operations on their device
(:mod:`reshard.quant.ops`), bit for bit alike and with the same bytes on the wire.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .._core import (
    ArgumentError,
    ChecksumError,
    Layout,
    QuantPacking,
    ReshardError,
    crc32c,
    quant_scale_shape,
)
from ..transfer import arguments as _arguments
from ..transfer.bucket import global_rank
from ..transfer.checks import (
    agree,
    check_ranks,
    check_tensor,
    control_device,
    job_fingerprint,
    refuse_together,
)
from . import ops as _ops
from . import prequantized as _prequantized

_SCALE_DTYPES = {"f32": torch.float32, "e8m0": torch.uint8}


@functools.lru_cache(maxsize=256)
def _packing(src: Layout, dst: Layout, rank: int, quant: str, scale_dtype: Optional[str]) -> QuantPacking:
    return QuantPacking(src, dst, rank, quant, scale_dtype)


def packing_of(label: str, src: Layout, dst: Layout, rank: int, quant: str, scale_dtype) -> QuantPacking:
    """This rank's part, or :class:`ArgumentError` naming the tensor."""
    if not isinstance(quant, str):
        raise ArgumentError(f"{label}quant: expected a scheme such as 'block:128x128', got {quant!r:.60}")
    if scale_dtype is not None and not isinstance(scale_dtype, str):
        raise ArgumentError(f"{label}scale_dtype: expected 'f32' or 'e8m0', got {scale_dtype!r:.60}")
    try:
        return _packing(src, dst, rank, quant, scale_dtype)
    except ReshardError as e:
        # the core says "tensor: ..." where it has no name; the caller's name says which
        text = str(e)
        raise type(e)(label + text.removeprefix("tensor: ") if label else text) from None


def check_scale(label: str, scale, packing: QuantPacking, rank: int) -> None:
    """``scale`` is the rank's scale shard: of its shape and the scale dtype; None on a rank
    that holds no destination shard."""
    shape = packing.scale_shape
    if shape is None:
        if scale is not None:
            raise ArgumentError(
                f"{label}scale: rank {rank} holds no destination shard, "
                "yet a scale tensor was given (pass None)"
            )
        return
    want = _SCALE_DTYPES[packing.scale_dtype]
    if not isinstance(scale, torch.Tensor):
        raise ArgumentError(
            f"{label}scale: rank {rank} holds a scale shard of shape {tuple(shape)} "
            f"({packing.scale_dtype}), but {type(scale).__name__} was given instead of a tensor"
        )
    if tuple(scale.shape) != tuple(shape) or scale.dtype != want:
        raise ArgumentError(
            f"{label}scale: rank {rank} holds a scale shard of shape {tuple(shape)} "
            f"({packing.scale_dtype}, torch {str(want).removeprefix('torch.')}), but the tensor "
            f"given has shape {tuple(scale.shape)} and dtype {str(scale.dtype).removeprefix('torch.')}"
        )


def check_devices(label: str, src_local, dst_local, scale) -> None:
    """The tensors a rank gives for one reshard are on one device."""
    tensors = (("src_local", src_local), ("dst_local", dst_local), ("scale", scale))
    given = [(what, t) for what, t in tensors if t is not None]
    for what, tensor in given[1:]:
        if tensor.device != given[0][1].device:
            raise ArgumentError(
                f"{label}{what} is on {tensor.device} but {given[0][0]} on {given[0][1].device}"
            )


def scale_tensor(
    dst_layout: Layout, rank: int, quant: str, scale_dtype: Optional[str] = None, device=None
) -> Optional[torch.Tensor]:
    """A zeroed scale shard for ``rank`` (None if it holds no shard of ``dst_layout``), of the
    shape and dtype ``reshard_(..., quant=quant, scale=...)`` writes: f32 scales, or one
    ``uint8`` biased exponent per block for e8m0; on ``device`` (the CPU by default), which
    must be the destination shard's."""
    from .._core import quant_scale_dtype

    shape = quant_scale_shape(dst_layout, rank, quant)
    if shape is None:
        return None
    dtype = _SCALE_DTYPES[quant_scale_dtype(quant, scale_dtype)]
    return torch.zeros(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=1024)
def _messages(packing: QuantPacking, which: str):
    return packing.messages(which)


def _aligned(n: int) -> int:
    return (n + 15) // 16 * 16


def _spans(packing: QuantPacking, message) -> List[Tuple[int, int]]:
    """The byte spans of a message the checksums cover: each transfer's fp8 values, then
    each box of scales."""
    _, _, values, scales = message
    size = 4 if packing.scale_dtype == "f32" else 1
    return [(at, math.prod(extent)) for at, _, _, _, extent in values] + [
        (at, math.prod(extent) * size) for at, _, extent in scales
    ]


def _sums(buffer: torch.Tensor, spans) -> List[int]:
    data = buffer if buffer.device.type == "cpu" else buffer.cpu()
    return crc32c(data, spans)


def _seal(buffer: torch.Tensor, at: int, spans) -> None:
    """Writes the CRC-32C of every span of ``buffer`` at ``at``, one little-endian u32 each."""
    sums = _sums(buffer[:at], spans)
    trailer = torch.frombuffer(bytearray(struct.pack(f"<{len(sums)}I", *sums)), dtype=torch.uint8)
    buffer[at : at + trailer.numel()].copy_(trailer)


def _mismatch(buffer: torch.Tensor, at: int, spans) -> Optional[Tuple[int, int, int]]:
    """The first span whose bytes differ from the sum after them: (index, sent, arrived).
    The message is read on the host once (one copy from a device, not one per part)."""
    host = buffer[: at + 4 * len(spans)]
    host = host if host.device.type == "cpu" else host.cpu()
    trailer = host[at : at + 4 * len(spans)].numpy().tobytes()
    sent = struct.unpack(f"<{len(spans)}I", trailer)
    for i, (s, got) in enumerate(zip(sent, _sums(host[:at], spans))):
        if s != got:
            return i, s, got
    return None


def _box(offset, extent) -> str:
    return f"offset {list(offset)} extent {'x'.join(map(str, extent))}"


def _check_message(label: str, packing: QuantPacking, message, buffer: torch.Tensor, me: int) -> None:
    """Raises, naming the transfer (or the scales) that arrived changed."""
    spans = _spans(packing, message)
    bad = _mismatch(buffer, _aligned(message[1]), spans)
    if bad is None:
        return
    i, sent, got = bad
    _, _, values, scales = message
    if i < len(values):
        _, src, dst, offset, extent = values[i]
        what = f"the transfer from rank {src} to rank {dst} at {_box(offset, extent)}"
    else:
        _, offset, extent = scales[i - len(values)]
        what = f"the scales from rank {message[0]} to rank {me} of blocks at {_box(offset, extent)}"
    raise ChecksumError(
        f"rank {me}: {label}checksum mismatch in {what}: sent with crc32c {sent:#010x} but "
        f"arrived as {got:#010x}"
    )


def run(items, group, checksum: bool = False, native: bool = True) -> None:
    """Runs the quantizing reshards ``items`` (``(label, packing, src_local, dst_local,
    scale, src_region, dst_region)`` each, in the same order on every rank): the local amax
    of every tensor, one agreement that every source was finite, one batch of partial amax
    exchanges, one batch of quantized messages, then the unpacking into every destination
    and scale shard. With ``checksum``, every message ends with the CRC-32C of each transfer
    and each box of scales it holds (a partial amax message, of its payload): a changed
    partial amax stops every rank before any value moves, a changed message raises on its
    receiver, naming the transfer, before it unpacks anything."""
    device = next(
        (t.device for it in items for t in it[2:5] if t is not None),
        torch.device("cpu"),
    )
    # the Rust kernels quantize and unpack CPU tensors (unless ``native`` is off: the torch
    # executor's ``_NATIVE``); torch operations (:mod:`reshard.quant.ops`) the others, with
    # the same bytes on the wire
    native = native and device.type == "cpu"
    wire = torch.device("cpu") if native else device
    me = dist.get_rank(group)
    srcs = [None if it[2] is None else (it[2].contiguous() if native else it[2]) for it in items]
    states, outgoing, problem = [], [], None
    for (label, packing, *_), src, item in zip(items, srcs, items):
        try:
            if native:
                amax, payloads = packing.amax(src)
                states.append(amax)
                outgoing.append([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads])
            elif src is None:
                states.append(None)
                outgoing.append([])
            else:
                source = _ops.Source(packing, item[5], src)
                states.append(source)
                outgoing.append(source.payloads())
        except ReshardError as e:
            problem = type(e)(f"{label}src_local: {e}")
            break
    if problem is None and not native:
        # every shard's flag in one host sync (not one per tensor); the first bad one named
        bad = _ops.first_nonfinite(states)
        if bad is not None:
            try:
                states[bad].check_finite()
            except ReshardError as e:
                problem = type(e)(f"{items[bad][0]}src_local: {e}")
    # a non-finite value fails on its own rank; every rank of the group learns it before any
    # value moves, so none waits for a peer that gave up
    refuse_together(problem, group, control_device(group, [device]))

    # partial amax: both ends of a pair post their messages in tensor order, then peer order
    extra = 4 if checksum else 0
    ops, inboxes = [], []
    for (_, packing, *_), payloads in zip(items, outgoing):
        inbox = []
        for (peer, n), payload in zip(packing.amax_messages, payloads):
            into = torch.empty(n + extra, dtype=torch.uint8, device=wire)
            inbox.append(into)
            if checksum:
                sealed = torch.empty(n + extra, dtype=torch.uint8, device=wire)
                sealed[:n].copy_(payload)
                _seal(sealed, n, [(0, n)])
                payload = sealed
            ops.append(dist.P2POp(dist.isend, payload, global_rank(group, peer), group))
            ops.append(dist.P2POp(dist.irecv, into, global_rank(group, peer), group))
        inboxes.append(inbox)
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if checksum:
        problem = None
        for (label, packing, *_), inbox in zip(items, inboxes):
            for (peer, offset, extent), (_, n), got in zip(packing.amax_blocks, packing.amax_messages, inbox):
                bad = _mismatch(got, n, [(0, n)])
                if bad is not None and problem is None:
                    problem = ChecksumError(
                        f"{label}checksum mismatch in the partial amax from rank {peer} "
                        f"to rank {me} of blocks at {_box(offset, extent)}: sent with crc32c "
                        f"{bad[1]:#010x} but arrived as {bad[2]:#010x}"
                    )
        refuse_together(problem, group, control_device(group, [device]))
    scales = []
    for (_, packing, *_), state, inbox in zip(items, states, inboxes):
        landed = [t[: t.numel() - extra] for t in inbox]
        if native:
            scales.append(packing.merge(state, [t.numpy().tobytes() for t in landed]))
        else:
            if state is not None:
                state.merge(landed)
            scales.append(state)

    ops, landed = [], []
    for (_, packing, *_), src, sc in zip(items, srcs, scales):
        sends, recvs = _messages(packing, "sends"), _messages(packing, "recvs")
        room = (lambda m, p=packing: _aligned(m[1]) + 4 * len(_spans(p, m))) if checksum else (lambda m: m[1])
        out = [torch.empty(room(m), dtype=torch.uint8, device=wire) for m in sends]
        into = [torch.empty(room(m), dtype=torch.uint8, device=wire) for m in recvs]
        local = None
        if native:
            if packing.local_bytes:
                local = torch.empty(packing.local_bytes, dtype=torch.uint8)
            if out or local is not None:
                packing.pack(sc, src, [b[: m[1]] for b, m in zip(out, sends)], local)
        elif out:
            sc.pack(sends, out)
        if checksum:
            for m, b in zip(sends, out):
                _seal(b, _aligned(m[1]), _spans(packing, m))
        ops += [dist.P2POp(dist.isend, b, global_rank(group, m[0]), group) for m, b in zip(sends, out)]
        ops += [dist.P2POp(dist.irecv, b, global_rank(group, m[0]), group) for m, b in zip(recvs, into)]
        landed.append((into, local))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if checksum:
        for (label, packing, *_), (into, _) in zip(items, landed):
            for m, b in zip(_messages(packing, "recvs"), into):
                _check_message(label, packing, m, b, me)
    for (_, packing, _, dst_local, scale, _, dst_region), sc, (into, local) in zip(items, scales, landed):
        if dst_local is None:
            continue
        recvs = _messages(packing, "recvs")
        if not native:
            _ops.unpack(packing, recvs, into, dst_region, dst_local, scale)
            if sc is not None:
                _ops.copy_local(sc, _messages(packing, "local"), dst_region, dst_local, scale)
            continue
        dense = torch.contiguous_format
        target = dst_local if dst_local.is_contiguous() else torch.empty_like(dst_local, memory_format=dense)
        scales_ = scale if scale.is_contiguous() else torch.empty_like(scale, memory_format=dense)
        packing.unpack([b[: m[1]] for b, m in zip(into, recvs)], target, scales_, local)
        if target is not dst_local:
            dst_local.view(torch.uint8).copy_(target.view(torch.uint8))
        if scales_ is not scale:
            scale.copy_(scales_)


def reshard(
    entries, group, quant, scale_dtype, rank: int, world: int, checksum: bool = False, native: bool = True
) -> None:
    """Reshards ``entries`` (name -> ``(src_local, dst_local, src_layout, dst_layout,
    scale, src_scale)``, where a ``src_scale`` is refused) into fp8 with scales (see
    :mod:`reshard.quant.inflight`); checked through the group before any byte moves, as
    :func:`reshard_many_`."""
    names = sorted(entries)

    def prepare():
        items = []
        for name in names:
            src_local, dst_local, src_layout, dst_layout, scale, src_scale = entries[name]
            label = f"{name}: " if name else ""
            _prequantized.refuse_src_scale(label, src_scale, src_layout)
            for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
                check_ranks(label, what, layout, world)
            packing = packing_of(label, src_layout, dst_layout, rank, quant, scale_dtype)
            regions = []
            sides = (("src_local", src_local, src_layout), ("dst_local", dst_local, dst_layout))
            for what, tensor, layout in sides:
                region = layout.local_region(rank)
                shape = None if region is None else tuple(region[1])
                check_tensor(label, what, tensor, layout, shape, rank)
                regions.append(region)
            check_scale(label, scale, packing, rank)
            check_devices(label, src_local, dst_local, scale)
            items.append((label, packing, src_local, dst_local, scale, *regions))
        return items

    fingerprint = job_fingerprint(
        "reshard quant", entries, names, quant=quant, scale_dtype=scale_dtype, checksum=bool(checksum)
    )
    device = control_device(group, (t for name in names for t in entries[name][:2]))
    run(agree(fingerprint, prepare, group, rank, device=device), group, bool(checksum), native)


def _is_fp8(layout: Layout) -> bool:
    return layout.dtype in ("fp8e4m3", "fp8e5m2")


def read(pairs, rank: int, bucket_bytes, src, dst, quant, scales, scale_dtype, src_scales):
    """This rank's arguments of :func:`reshard.torch.reshard_many_`, checked
    (:func:`reshard.transfer.arguments.read`) and sorted by how they move: ``(pairs, names,
    entries, moves, quant)`` as :func:`route` gives them."""
    if src_scales is not None and not isinstance(src_scales, Mapping):
        raise ArgumentError(
            f"src_scales: expected a mapping of names to tensors, got {type(src_scales).__name__}"
        )
    pairs, quant, scales = _arguments.read(pairs, rank, bucket_bytes, src, dst, quant, scales)
    return (*route(pairs, sorted(pairs), quant, scales, scale_dtype, src_scales), quant)


def route(pairs, names, quant, scales, scale_dtype, src_scales):
    """Sorts the tensors of :func:`reshard_many_` by how they move: ``(pairs, names)`` of the
    plain ones, the entries quantized in flight (name -> ``(src_local, dst_local,
    src_layout, dst_layout, scale, src_scale)``), and the already-quantized moves (name -> the same
    with the source scale shard before the scale shard). Quantized are the fp8 destinations
    of other sources, and whatever the caller gives scales for (the core then names what
    does not fit)."""
    if quant is None and (scales is not None or scale_dtype is not None):
        raise ArgumentError("scale, scale_dtype: given only with quant")
    if quant is None and src_scales is not None:
        raise ArgumentError("src_scale: given only with quant")
    quantized = {
        name: pairs[name]
        for name in names
        if (_is_fp8(pairs[name][3]) and not _is_fp8(pairs[name][2])) or name in (scales or {})
    }
    if not quantized and quant is None:
        return pairs, names, {}, {}
    if quant is None:
        name = sorted(quantized)[0]
        raise ArgumentError(
            f"{name + ': ' if name else ''}dst_layout: dtype {pairs[name][3].dtype} needs quant "
            f"(a scheme such as 'block:128x128') and the scale shards"
        )
    scales = dict(scales or {})
    extra = sorted(set(scales) - set(quantized))
    if extra:
        raise ArgumentError(f"scales: {extra[0]!r} is not one of the tensors")
    entries = {name: (*item, scales.get(name)) for name, item in quantized.items()}
    entries, moves = _prequantized.split(entries, dict(src_scales or {}))
    names = [n for n in names if n not in quantized]
    return {n: pairs[n] for n in names}, names, entries, moves
