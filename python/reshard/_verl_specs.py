"""verl's ShardSpec export as reshard's layouts: each ``(name, local shard, ShardSpec)`` (or
``(name, tensor)``) described as a plain tuple every rank can exchange, and the descriptions of
a bucket turned into the same source layouts on every rank (:mod:`reshard.verl_backend`)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import dtensor as _dt
from ._core import ArgumentError, Layout
from .engine.recorded import split_layout


def describe(item) -> Tuple[str, tuple, Optional[torch.Tensor]]:
    """An exported weight as ``(name, description, local tensor)``: the description is plain
    values (it travels to every rank), the same on every trainer rank except for an explicit
    block's place. A weight that cannot be described is a ``("refuse", message)``."""
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        what = type(item).__name__ if not isinstance(item, (tuple, list)) else f"{len(item)} values"
        text = f"weights: expected (name, tensor) or (name, shard, ShardSpec), got {what}"
        return "", ("refuse", text), None
    name, tensor = item[0], item[1]
    spec = item[2] if len(item) == 3 else None
    if not isinstance(name, str):
        return str(name), ("refuse", f"weights: a name is {type(name).__name__} {name!r}, not a string"), None
    try:
        if _dt.is_dtensor(tensor):
            if spec is None:
                spec = _spec_of(tensor)
            tensor = _dt.local_of(tensor)
        if not isinstance(tensor, torch.Tensor):
            raise _Refused(f"{name}: {type(tensor).__name__} is not a tensor")
        dtype = str(tensor.dtype).replace("torch.", "")
        if spec is None:
            return name, ("whole", tuple(tensor.shape), dtype, None), tensor
        return name, _describe_spec(name, tensor, spec, dtype), tensor
    except _Refused as e:
        return name, ("refuse", str(e)), None


class _Refused(Exception):
    pass


def _spec_of(dt):
    from verl.workers.engine.spec import ShardSpec

    return ShardSpec.from_param(dt)


def _describe_spec(name: str, tensor: torch.Tensor, spec, dtype: str) -> tuple:
    full = getattr(spec, "full_shape", None)
    if full is None:
        raise _Refused(f"{name}: {type(spec).__name__} is not a ShardSpec (no full_shape)")
    shape = tuple(int(n) for n in full)
    if getattr(spec, "to_hf_chunk", None) is not None:
        raise _Refused(
            f"{name}: ShardSpec.to_hf_chunk: a converter makes the HF tensors from the parameter; "
            "reshard moves tensors as the trainer holds them (export HF tensors instead)"
        )
    slots = _slots(name, shape, getattr(spec, "hf_slots", None))
    place = getattr(spec, "place", None)
    if place is not None:
        offset, extent = _box_of(name, shape, place, tensor)
        return ("box", shape, dtype, offset, extent, bool(getattr(spec, "contributes", True)), slots)
    mesh = getattr(spec, "mesh", None)
    if mesh is None:
        if tensor.numel() != numel(shape):
            raise _Refused(
                f"{name}: ShardSpec without a mesh: the tensor is the whole parameter, but it has "
                f"{tensor.numel()} elements and full_shape {list(shape)} has {numel(shape)}"
            )
        return ("whole", shape, dtype, slots)
    placements = tuple(spec.placements or ())
    if len(placements) != mesh.ndim:
        raise _Refused(f"{name}: ShardSpec: {len(placements)} placements for a {mesh.ndim}-dim mesh")
    described = []
    for axis, p in enumerate(placements):
        kind = type(p).__name__
        if kind == "_StridedShard":
            described.append(("strided", int(p.dim), int(p.split_factor)))
        elif p.is_shard():
            described.append(("shard", int(p.dim), 1))
        elif p.is_replicate():
            described.append(("replicate", 0, 1))
        else:
            raise _Refused(
                f"{name}: ShardSpec.placements: {p!r} on mesh dim {axis} holds no values reshard can "
                "move (a Partial holds summands): only Shard, _StridedShard and Replicate"
            )
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return ("mesh", shape, dtype, tuple(int(n) for n in mesh.mesh.shape), ranks, tuple(described), slots)


def _slots(name: str, shape: tuple, slots) -> Optional[tuple]:
    """``ShardSpec.hf_slots`` without a converter: slot ``e`` is ``full[e]`` (the identity split)."""
    if slots is None:
        return None
    slots = tuple((str(n), tuple(int(x) for x in s)) for n, s in slots)
    if not shape or len(slots) != shape[0]:
        raise _Refused(
            f"{name}: ShardSpec.hf_slots: {len(slots)} slots for a parameter of shape {list(shape)}: "
            "without a converter, slot e is full[e]"
        )
    for slot, slot_shape in slots:
        if numel(slot_shape) != numel(shape[1:]):
            raise _Refused(
                f"{name}: ShardSpec.hf_slots: {slot} has shape {list(slot_shape)}, but full[e] has "
                f"{numel(shape[1:])} elements"
            )
    return slots


def _box_of(name: str, shape: tuple, place, tensor: torch.Tensor) -> Tuple[tuple, tuple]:
    """An explicit ``ShardSpec.place`` as this rank's box (offset, extent) of the full tensor."""
    if isinstance(place, int) and not isinstance(place, bool):
        row = numel(shape[1:]) if shape else 1
        n = tensor.numel()
        if not shape or place % row or n % row:
            if not shape and place == 0 and n == 1:
                return (), ()
            raise _Refused(
                f"{name}: ShardSpec.place: flat offset {place} with {n} elements of a tensor of shape "
                f"{list(shape)} is not whole rows of dim 0, so no DTensor shard"
            )
        return (place // row,) + (0,) * (len(shape) - 1), (n // row,) + tuple(shape[1:])
    local_shape = getattr(place, "local_shape", None)
    offset = getattr(place, "global_offset", None)
    if local_shape is None or offset is None:
        raise _Refused(f"{name}: ShardSpec.place: {place!r} is neither a flat offset nor a BlockPlacement")
    offset = tuple(int(x) for x in offset)
    extent = tuple(int(x) for x in local_shape)
    if (
        len(offset) != len(shape)
        or len(extent) != len(shape)
        or any(o < 0 or e < 0 or o + e > n for o, e, n in zip(offset, extent, shape))
    ):
        raise _Refused(
            f"{name}: ShardSpec.place: block at {list(offset)} of shape {list(extent)} is not inside a "
            f"tensor of shape {list(shape)}"
        )
    if tensor.numel() != numel(extent):
        raise _Refused(
            f"{name}: ShardSpec.place: a block of shape {list(extent)}, but the shard has "
            f"{tensor.numel()} elements"
        )
    return offset, extent


def box_layout(shape: tuple, dtype: str, boxes: List[tuple]) -> Layout:
    """The layout whose boxes are the contributing trainer ranks' blocks (a DTensor split,
    :func:`reshard.engine.recorded.split_layout`), or refused naming the blocks."""
    held = [(r, tuple(o), tuple(e)) for r, o, e, contributes in boxes if contributes]
    if not held:
        raise ArgumentError("ShardSpec.contributes: no trainer rank contributes a block")
    layout = split_layout(tuple(shape), dtype, {r: (o, e) for r, o, e in held})
    if layout is not None:
        return layout
    blocks = ", ".join(f"rank {r}: {list(o)}+{list(e)}" for r, o, e in held)
    raise ArgumentError(
        f"ShardSpec.place: the trainer ranks' blocks ({blocks}) of a tensor of shape {list(shape)} "
        "are no DTensor split (one dim cut into torch.chunk pieces, or every block whole)"
    )


def short(desc: tuple) -> str:
    if desc[0] == "mesh":
        return f"mesh {list(desc[3])} {list(desc[5])} shape {list(desc[1])} {desc[2]}"
    return f"{desc[0]} shape {list(desc[1])} {desc[2]}"


def full_bytes(desc: tuple) -> int:
    if desc[0] == "refuse":
        return 0
    try:
        itemsize = torch.empty((), dtype=getattr(torch, desc[2])).element_size()
    except (AttributeError, TypeError):
        itemsize = 1
    return numel(desc[1]) * itemsize


def numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n
