"""Already-quantized tensors for :mod:`reshard.torch`: an fp8 source with its scales, resharded
into an fp8 destination of the same format and scheme (``reshard_(..., quant=...,
scale=..., src_scale=...)``).

The values and the scale tensor move as two coupled tensors over the same meshes and
placements (the core's ``QuantizedMove``): the values byte for byte, each scale with its
block, in the same exchange as the plain tensors beside them. No block may be cut by a shard
boundary on either side (a rank would hold part of a block whose scale is meaningless for the
rest), so each side's scale shard is exactly the scales of its rank's blocks; a layout that
cuts one is refused, naming the tensor, side, dim, boundary and block size, on every rank
before any byte moves.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .._core import ArgumentError, Layout, ReshardError, quantized_scale_layouts
from ..transfer.checks import agree, check_ranks, check_tensor, control_device, job_fingerprint

# The scale tensor of ``name`` among the plain reshard's tensors.
_SCALES = "{} (scales)"


def is_prequantized(src_layout: Layout, dst_layout: Layout) -> bool:
    """An fp8 source: its values are already quantized and come with their scales."""
    return src_layout.dtype in ("fp8e4m3", "fp8e5m2")


def _scale_layouts(label: str, src: Layout, dst: Layout, quant: str, scale_dtype) -> Tuple[Layout, Layout]:
    """The scale tensor's layouts on both sides, or the core's refusal naming the tensor."""
    if not isinstance(quant, str):
        raise ArgumentError(f"{label}quant: expected a scheme such as 'block:128x128', got {quant!r:.60}")
    if scale_dtype is not None and not isinstance(scale_dtype, str):
        raise ArgumentError(f"{label}scale_dtype: expected 'f32' or 'e8m0', got {scale_dtype!r:.60}")
    try:
        return quantized_scale_layouts(src, dst, quant, scale_dtype)
    except ReshardError as e:
        # the core says "tensor: ..."; the caller's name says which
        text = str(e)
        if label:
            text = label + text.removeprefix("tensor: ")
        raise type(e)(text) from None


def _empty_as(tensor, layout: Layout, rank: int):
    """An empty scale shard of any shape (as :func:`reshard.quant_scale_shape` gives an
    empty value shard: no blocks) stands for the scale layout's empty shard, whose shape the
    chunking of the scale grid decides."""
    region = layout.local_region(rank)
    if region is None or 0 not in region[1] or not isinstance(tensor, torch.Tensor) or tensor.numel():
        return tensor
    return tensor.new_empty(tuple(region[1]))


def plan(
    moves: Mapping[str, tuple],
    pairs: Dict[str, tuple],
    names: List[str],
    group,
    quant: str,
    scale_dtype: Optional[str],
    rank: int,
    world: int,
) -> Tuple[Dict[str, tuple], List[str]]:
    """Checks the already-quantized ``moves`` (name -> ``(src_local, dst_local, src_layout,
    dst_layout, src_scale, scale)``) through the group, as :func:`reshard_many_` checks its
    tensors, and returns the plain reshard's ``pairs`` and ``names`` with every move's values
    and scales added."""
    order = sorted(moves)

    def prepare():
        out = {}
        for name in order:
            if _SCALES.format(name) in pairs or _SCALES.format(name) in moves:
                raise ArgumentError(f"{name}: the name {_SCALES.format(name)!r} is taken by another tensor")
            src_local, dst_local, src_layout, dst_layout, src_scale, scale = moves[name]
            label = f"{name}: " if name else ""
            for what, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
                check_ranks(label, what, layout, world)
            src_scales, dst_scales = _scale_layouts(label, src_layout, dst_layout, quant, scale_dtype)
            given = []
            src_scale, scale = _empty_as(src_scale, src_scales, rank), _empty_as(scale, dst_scales, rank)
            for what, tensor, layout in (
                ("src_local", src_local, src_layout),
                ("dst_local", dst_local, dst_layout),
                ("src_scale", src_scale, src_scales),
                ("scale", scale, dst_scales),
            ):
                region = layout.local_region(rank)
                check_tensor(label, what, tensor, layout, None if region is None else tuple(region[1]), rank)
                if tensor is not None:
                    given.append((what, tensor))
            for what, tensor in given[1:]:
                if tensor.device != given[0][1].device:
                    raise ArgumentError(
                        f"{label}{what} is on {tensor.device} but {given[0][0]} on {given[0][1].device}"
                    )
            out[name] = (
                (src_local, dst_local, src_layout, dst_layout),
                (src_scale, scale, src_scales, dst_scales),
            )
        return out

    fingerprint = job_fingerprint("reshard quantized", moves, order, quant=quant, scale_dtype=scale_dtype)
    device = control_device(group, (t for name in order for t in moves[name][:2]))
    checked = agree(fingerprint, prepare, group, rank, device=device)
    pairs = dict(pairs)
    for name in order:
        values, scales = checked[name]
        pairs[name] = values
        pairs[_SCALES.format(name)] = scales
    return pairs, sorted(pairs)


def split(entries: Mapping[str, tuple], src_scales: Mapping[str, object]):
    """Splits the fp8 entries of :func:`reshard_many_` (name -> ``(src_local, dst_local,
    src_layout, dst_layout, scale)``) into those quantized in flight (with the source scale
    shard given, if any, last: their checks refuse it on every rank) and those already
    quantized (their source scale shards from ``src_scales``, None where not given)."""
    extra = sorted(set(src_scales) - set(entries))
    if extra:
        raise ArgumentError(f"src_scales: {extra[0]!r} is not one of the tensors quantized as quant says")
    quantize, moves = {}, {}
    for name, (src_local, dst_local, src_layout, dst_layout, scale) in entries.items():
        if is_prequantized(src_layout, dst_layout):
            moves[name] = (src_local, dst_local, src_layout, dst_layout, src_scales.get(name), scale)
        else:
            quantize[name] = (*entries[name], src_scales.get(name))
    return quantize, moves


def refuse_src_scale(label: str, src_scale, src_layout: Layout) -> None:
    """A source quantized in flight has no scales yet: one given is a mistake."""
    if src_scale is not None:
        raise ArgumentError(
            f"{label}src_scale: given for a {src_layout.dtype} source; only an fp8 source "
            "(already quantized) comes with its scales"
        )
