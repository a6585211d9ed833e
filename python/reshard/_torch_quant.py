"""Quantizing in flight for :mod:`reshard.torch`: a reshard into an fp8 destination with its
scales (``reshard_(..., quant=...)``), over ``torch.distributed`` point-to-point.

Each rank, from the layouts alone, knows its part (:class:`reshard._core.QuantPacking`): the
source ranks whose shards share a block first exchange their partial amax (a few bytes per
block piece, nothing when every block lies in one shard); every sender then quantizes while it
packs, so the wire carries fp8 values (one byte per element) followed by the scales they go
with; every destination writes the values into its shard and the scales into its scale shard
(:func:`reshard.quant_scale_shape`). CPU tensors only.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.distributed as dist

from ._core import Layout, QuantPacking, ReshardError, quant_scale_shape

_SCALE_DTYPES = {"f32": torch.float32, "e8m0": torch.uint8}


@functools.lru_cache(maxsize=256)
def _packing(src: Layout, dst: Layout, rank: int, quant: str, scale_dtype: Optional[str]) -> QuantPacking:
    return QuantPacking(src, dst, rank, quant, scale_dtype)


def packing_of(label: str, src: Layout, dst: Layout, rank: int, quant: str, scale_dtype) -> QuantPacking:
    """This rank's part, or :class:`ReshardError` naming the tensor."""
    if not isinstance(quant, str):
        raise ReshardError(f"{label}quant: expected a scheme such as 'block:128x128', got {quant!r:.60}")
    if scale_dtype is not None and not isinstance(scale_dtype, str):
        raise ReshardError(f"{label}scale_dtype: expected 'f32' or 'e8m0', got {scale_dtype!r:.60}")
    try:
        return _packing(src, dst, rank, quant, scale_dtype)
    except ReshardError as e:
        raise ReshardError(f"{label}{e}") from None


def check_scale(label: str, scale, packing: QuantPacking, rank: int) -> None:
    """``scale`` is the rank's scale shard: of its shape and the scale dtype, on the CPU,
    contiguous; None on a rank that holds no destination shard."""
    shape = packing.scale_shape
    if shape is None:
        if scale is not None:
            raise ReshardError(
                f"{label}scale: rank {rank} holds no destination shard, "
                "yet a scale tensor was given (pass None)"
            )
        return
    want = _SCALE_DTYPES[packing.scale_dtype]
    if not isinstance(scale, torch.Tensor):
        raise ReshardError(
            f"{label}scale: rank {rank} holds a scale shard of shape {tuple(shape)} "
            f"({packing.scale_dtype}), but {type(scale).__name__} was given instead of a tensor"
        )
    if tuple(scale.shape) != tuple(shape) or scale.dtype != want:
        raise ReshardError(
            f"{label}scale: rank {rank} holds a scale shard of shape {tuple(shape)} "
            f"({packing.scale_dtype}, torch {str(want).removeprefix('torch.')}), but the tensor "
            f"given has shape {tuple(scale.shape)} and dtype {str(scale.dtype).removeprefix('torch.')}"
        )
    if scale.device.type != "cpu":
        raise ReshardError(
            f"{label}scale: the tensor is on {scale.device}; quantizing in flight runs on CPU tensors only"
        )


def check_cpu(label: str, what: str, tensor) -> None:
    if tensor is not None and tensor.device.type != "cpu":
        raise ReshardError(
            f"{label}{what}: the tensor is on {tensor.device}; quantizing in flight runs on CPU tensors only"
        )


def scale_tensor(
    dst_layout: Layout, rank: int, quant: str, scale_dtype: Optional[str] = None
) -> Optional[torch.Tensor]:
    """A zeroed scale shard for ``rank`` (None if it holds no shard of ``dst_layout``), of the
    shape and dtype ``reshard_(..., quant=quant, scale=...)`` writes: f32 scales, or one
    ``uint8`` biased exponent per block for e8m0."""
    from ._core import quant_scale_dtype

    shape = quant_scale_shape(dst_layout, rank, quant)
    if shape is None:
        return None
    return torch.zeros(shape, dtype=_SCALE_DTYPES[quant_scale_dtype(quant, scale_dtype)])


def _peer(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def run(items, group) -> None:
    """Runs the quantizing reshards ``items`` (``(label, packing, src_local, dst_local,
    scale)`` each, in the same order on every rank): the local amax of every tensor, one
    agreement that every source was finite, one batch of partial amax exchanges, one batch of
    quantized messages, then the unpacking into every destination and scale shard."""
    srcs = [None if it[2] is None else it[2].contiguous() for it in items]
    amaxes, outgoing, problem = [], [], None
    for (label, packing, *_), src in zip(items, srcs):
        try:
            amax, payloads = packing.amax(src)
            amaxes.append(amax)
            outgoing.append(payloads)
        except ReshardError as e:
            problem = f"{label}src_local: {e}"
            break
    # a non-finite value fails on its own rank; every rank of the group learns it before any
    # value moves, so none waits for a peer that gave up
    heard: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(heard, problem, group=group)
    if problem is not None:
        raise ReshardError(problem)
    for r, theirs in enumerate(heard):
        if theirs is not None:
            raise ReshardError(f"nothing was moved: rank {r}: {theirs}")

    # partial amax: both ends of a pair post their messages in tensor order, then peer order
    ops, inboxes = [], []
    for (_, packing, *_), payloads in zip(items, outgoing):
        inbox = []
        for (peer, n), payload in zip(packing.amax_messages, payloads):
            into = torch.empty(n, dtype=torch.uint8)
            inbox.append(into)
            out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.isend, out, _peer(group, peer), group))
            ops.append(dist.P2POp(dist.irecv, into, _peer(group, peer), group))
        inboxes.append(inbox)
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    scales = [
        packing.merge(amax, [t.numpy().tobytes() for t in inbox])
        for (_, packing, *_), amax, inbox in zip(items, amaxes, inboxes)
    ]

    ops, landed = [], []
    for (_, packing, *_), src, sc in zip(items, srcs, scales):
        sends = [torch.empty(n, dtype=torch.uint8) for _, n in packing.sends]
        recvs = [torch.empty(n, dtype=torch.uint8) for _, n in packing.recvs]
        local = torch.empty(packing.local_bytes, dtype=torch.uint8) if packing.local_bytes else None
        if sends or local is not None:
            packing.pack(sc, src, sends, local)
        ops += [dist.P2POp(dist.isend, b, _peer(group, p), group) for (p, _), b in zip(packing.sends, sends)]
        ops += [dist.P2POp(dist.irecv, b, _peer(group, p), group) for (p, _), b in zip(packing.recvs, recvs)]
        landed.append((recvs, local))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    for (_, packing, _, dst_local, scale), (recvs, local) in zip(items, landed):
        if dst_local is None:
            continue
        dense = torch.contiguous_format
        target = dst_local if dst_local.is_contiguous() else torch.empty_like(dst_local, memory_format=dense)
        scales = scale if scale.is_contiguous() else torch.empty_like(scale, memory_format=dense)
        packing.unpack(recvs, target, scales, local)
        if target is not dst_local:
            dst_local.view(torch.uint8).copy_(target.view(torch.uint8))
        if scales is not scale:
            scale.copy_(scales)


def reshard(entries, group, quant, scale_dtype, rank: int, world: int) -> None:
    """Reshards ``entries`` (name -> ``(src_local, dst_local, src_layout, dst_layout,
    scale)``) into fp8 with scales (see :mod:`reshard._torch_quant`); checked through the
    group before any byte moves, as :func:`reshard_many_`."""
    from .torch import _agree, _check_ranks, _check_tensor, _fingerprint

    names = sorted(entries)

    def prepare():
        items = []
        for name in names:
            src_local, dst_local, src_layout, dst_layout, scale = entries[name]
            label = f"{name}: " if name else ""
            for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
                _check_ranks(label, what, layout, world)
            packing = packing_of(label, src_layout, dst_layout, rank, quant, scale_dtype)
            sides = (("src_local", src_local, src_layout), ("dst_local", dst_local, dst_layout))
            for what, tensor, layout in sides:
                region = layout.local_region(rank)
                shape = None if region is None else tuple(region[1])
                _check_tensor(label, what, tensor, layout, shape, rank)
                check_cpu(label, what, tensor)
            check_scale(label, scale, packing, rank)
            items.append((label, packing, src_local, dst_local, scale))
        return items

    fingerprint = _fingerprint("reshard quant", entries, names, quant=quant, scale_dtype=scale_dtype)
    run(_agree(fingerprint, prepare, group, rank), group)


def refit_scales(refit, dst, rank: int):
    """Splits a rank's inference tensors into the weights (and other parameters) and the
    scale shards of the fp8 weights, by weight name; a fused scale buffer stands for its
    members' scales (each a view of its slice)."""
    dst = dict(dst or {})
    by_scale = {scale: weight for weight, (scale, _) in refit.scales.items()}
    scales = {}
    for buffer, members in refit.scale_fused(rank).items():
        tensor = dst.pop(buffer, None)
        if tensor is None:
            continue
        for weight, dim, offset, extent in members:
            if tensor.dim() <= dim or tensor.shape[dim] < offset + extent:
                raise ReshardError(
                    f"dst: {buffer}: rank {rank}'s fused scale buffer has shape "
                    f"{tuple(tensor.shape)}, but {weight}'s scales lie at "
                    f"{offset}..{offset + extent} of dim {dim}"
                )
            scales[weight] = tensor.narrow(dim, offset, extent)
    for name in list(dst):
        if name in by_scale:
            scales[by_scale[name]] = dst.pop(name)
    return dst, scales
