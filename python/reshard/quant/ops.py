"""Quantizing in flight with torch operations, for tensors that the Rust kernels cannot read
in place (tensors on a GPU or another device; CPU tensors too when ``reshard.torch._NATIVE``
is off, which is how the tests run this path on a machine without a GPU).

It computes what :class:`reshard._core.QuantPacking` computes, bit for bit, and writes the
same bytes on the wire, so a rank on either path can talk to a rank on the other:

- every block's amax over the rank's source shard, in f32 (a NaN or an infinity is an
  error naming its block and element, the first in row-major order, as the core names it);
- the partial amax of the blocks its shard shares with peers, as little-endian f32,
  row-major over each exchanged box, merged by maximum;
- each block's scale and multiplier with the core's formulas (``reshard::convert::quant``),
  the powers of two and their logarithms taken from the f32 bit patterns so that they are
  exact on every device;
- ``q = fp8(clamp(x * mult, -FMAX, FMAX))`` in f32, torch's fp8 cast rounding to nearest
  even, per transfer (no copy of the whole shard is quantized at once);
- messages laid out as :meth:`QuantPacking.messages` says: the fp8 values of each transfer,
  row-major, then at the next multiple of 16 the scales they carry.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from .._core import ArgumentError, QuantPacking

# Rust's AMAX_FLOOR: the lower clamp of a block's amax for block, channel and tensor scales.
_AMAX_FLOOR = 1e-4
_FP8 = {448.0: torch.float8_e4m3fn, 57344.0: torch.float8_e5m2}


def _slices(offset: Sequence[int], extent: Sequence[int], origin: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(offset, extent, origin))


def blocks_touching(offset: Sequence[int], extent: Sequence[int], block: Sequence[int]):
    """The box of grid coordinates of the blocks a region touches (``BlockGrid::
    blocks_touching``): empty, at the origin, for an empty region."""
    if any(n == 0 for n in extent):
        return [0] * len(block), [0] * len(block)
    lo = [o // b for o, b in zip(offset, block)]
    hi = [-(-(o + n) // b) for o, n, b in zip(offset, extent, block)]
    return lo, [h - low for h, low in zip(hi, lo)]


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` in f32, exactly, for integer ``e`` in [-149, 127], from its bit pattern."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=0) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 30)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _log2_parts(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``floor(log2(t))`` of positive finite f32 values, exactly, and whether ``t`` is a
    power of two. A subnormal is first scaled by ``2^64`` (exact), so the exponent field
    always holds the answer."""
    small = t < 2.0**-126
    scaled = torch.where(small, t * 2.0**64, t)
    bits = scaled.view(torch.int32)
    floor = ((bits >> 23) & 0xFF) - 127 - small.to(torch.int32) * 64
    return floor, (bits & 0x7FFFFF) == 0


def _floor(like: torch.Tensor) -> torch.Tensor:
    """The amax floor as an f32 tensor (the f32 nearest 1e-4, as Rust's literal), filled on
    the device (a tensor built on the host would be a copy to it, a host sync)."""
    return torch.full((), _AMAX_FLOOR, dtype=torch.float32, device=like.device)


def block_scales(packing: QuantPacking, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every block's multiplier (f32) and stored scale (f32, or uint8 biased exponents for
    e8m0) from its amax, as ``Quant::scale`` computes them."""
    fmax, emax = packing.fp8_limits
    scheme = packing.scheme
    fm = torch.full_like(amax, fmax)
    if scheme.startswith("mx:") or scheme.endswith(":ue8m0"):
        if scheme.startswith("mx:"):
            floor, _ = _log2_parts(torch.where(amax == 0, torch.ones_like(amax), amax))
            e = torch.where(amax == 0, torch.full_like(floor, -127), floor - emax).clamp(-127, 127)
        else:
            ratio = amax.clamp(min=_floor(amax)) / fm
            floor, exact = _log2_parts(ratio)
            e = floor + (~exact).to(floor.dtype)
        mult, scale = _pow2(-e), _pow2(e)
        code = (e + 127).to(torch.uint8)
        return mult, code if packing.scale_dtype == "e8m0" else scale
    a = amax.clamp(min=_floor(amax))
    return fm / a, a / fm


def _element(grid: torch.Tensor, grid_offset, offset, extent, block) -> torch.Tensor:
    """Each element's value of ``grid`` (over the blocks from ``grid_offset``) for the region
    ``offset``/``extent``: a tensor of the region's shape."""
    n = len(offset)
    index = []
    for d in range(n):
        i = torch.arange(offset[d], offset[d] + extent[d], device=grid.device) // block[d] - grid_offset[d]
        shape = [1] * n
        shape[d] = extent[d]
        index.append(i.view(shape))
    return grid[tuple(index)]


def _value_text(x: float) -> str:
    """An f32 as Rust prints it in the core's errors."""
    if math.isnan(x):
        return "NaN"
    return "inf" if x > 0 else "-inf"


class Source:
    """A source rank's part of one tensor on this path: its shard, the blocks the shard
    touches, their amax, then their multipliers and scales."""

    def __init__(self, packing: QuantPacking, region, src: torch.Tensor) -> None:
        self.packing = packing
        self.offset, self.extent = list(region[0]), list(region[1])
        self.block = packing.block
        self.blocks_offset, self.blocks_extent = blocks_touching(self.offset, self.extent, self.block)
        self.src = src
        x = src.to(torch.float32)
        #: Whether the shard holds a NaN or an infinity in f32, on its device:
        #: :func:`first_nonfinite` reads every source's at once (one host sync for all), and
        #: :meth:`check_finite` names the element.
        self.nonfinite = (~torch.isfinite(x)).any()
        self.amax = self._local_amax(x)
        self.mult: Optional[torch.Tensor] = None
        self.stored: Optional[torch.Tensor] = None

    def check_finite(self) -> None:
        """Raises :class:`ArgumentError` naming the first non-finite element of the shard (in
        row-major order, as the core names it), if any."""
        x = self.src.to(torch.float32)
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            flat = int(torch.nonzero(bad.reshape(-1))[0])
            local = []
            for n in reversed(self.extent):
                local.append(flat % n)
                flat //= n
            element = [o + i for o, i in zip(self.offset, reversed(local))]
            value = float(x[tuple(e - o for e, o in zip(element, self.offset))])
            block = [e // b for e, b in zip(element, self.block)]
            raise ArgumentError(
                f"block {block} holds a non-finite value ({_value_text(value)}) at element "
                f"{element}, which fp8 cannot carry"
            )

    def _local_amax(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            return x.abs()
        # the blocks touched, padded with zeros (they change no amax), one axis per block
        padded = torch.zeros(
            [g * b for g, b in zip(self.blocks_extent, self.block)], dtype=torch.float32, device=x.device
        )
        start = [o - g * b for o, g, b in zip(self.offset, self.blocks_offset, self.block)]
        if x.numel():
            padded[_slices(start, self.extent, [0] * len(start))] = x.abs()
        view = padded.reshape([v for g, b in zip(self.blocks_extent, self.block) for v in (g, b)])
        return view.amax(dim=tuple(range(1, 2 * x.dim(), 2)))

    def payloads(self) -> List[torch.Tensor]:
        """The partial amax this rank sends each peer of ``packing.amax_blocks``, as bytes."""
        out = []
        for _, offset, extent in self.packing.amax_blocks:
            part = self.amax[_slices(offset, extent, self.blocks_offset)].contiguous()
            out.append(part.reshape(-1).view(torch.uint8))
        return out

    def merge(self, landed: Sequence[torch.Tensor]) -> None:
        """Takes the peers' partial amax (one uint8 tensor per exchange, in order), then
        computes the scales."""
        for (_, offset, extent), got in zip(self.packing.amax_blocks, landed):
            where = _slices(offset, extent, self.blocks_offset)
            theirs = got.to(self.amax.device).view(torch.float32).view(list(extent))
            self.amax[where] = torch.maximum(self.amax[where], theirs)
        self.mult, self.stored = block_scales(self.packing, self.amax)

    def quantized(self, offset, extent) -> torch.Tensor:
        """The fp8 values of a region of the shard (global coordinates)."""
        assert self.mult is not None, "merge comes first"
        fmax, _ = self.packing.fp8_limits
        x = self.src[_slices(offset, extent, self.offset)].to(torch.float32)
        mult = _element(self.mult, self.blocks_offset, offset, extent, self.block)
        return (x * mult).clamp(-fmax, fmax).to(_FP8[fmax])

    def scales(self, offset, extent) -> torch.Tensor:
        """The stored scales of a box of blocks (grid coordinates)."""
        assert self.stored is not None, "merge comes first"
        return self.stored[_slices(offset, extent, self.blocks_offset)]

    def pack(self, messages, buffers: Sequence[torch.Tensor]) -> None:
        """Writes every message (``packing.messages("sends")``) into its buffer."""
        for (_, _, values, scales), buffer in zip(messages, buffers):
            for at, _, _, offset, extent in values:
                q = self.quantized(offset, extent).reshape(-1).view(torch.uint8)
                buffer[at : at + q.numel()].copy_(q)
            for at, offset, extent in scales:
                s = self.scales(offset, extent).contiguous().reshape(-1).view(torch.uint8)
                buffer[at : at + s.numel()].copy_(s)


def first_nonfinite(sources: Sequence[Optional[Source]]) -> Optional[int]:
    """The index of the first source (None: none) that holds a NaN or an infinity: the flags
    of all in one host sync; :meth:`Source.check_finite` then names the element."""
    given = [(i, s) for i, s in enumerate(sources) if s is not None]
    if not given:
        return None
    found = torch.stack([s.nonfinite for _, s in given]).tolist()
    return next((i for (i, _), bad in zip(given, found) if bad), None)


def unpack(
    packing: QuantPacking, messages, buffers, dst_region, dst: torch.Tensor, scale: torch.Tensor
) -> None:
    """Copies every received message into the destination shard and the scale shard."""
    origin = list(dst_region[0])
    scale_origin = packing.scale_offset
    fp8 = dst.dtype
    for (_, _, values, scales), buffer in zip(messages, buffers):
        buffer = buffer.to(dst.device)
        for at, _, _, offset, extent in values:
            n = math.prod(extent)
            dst[_slices(offset, extent, origin)].copy_(buffer[at : at + n].view(fp8).view(list(extent)))
        for at, offset, extent in scales:
            n = math.prod(extent) * scale.element_size()
            got = buffer[at : at + n].view(scale.dtype).view(list(extent))
            scale[_slices(offset, extent, scale_origin)].copy_(got)


def copy_local(source: Source, messages, dst_region, dst: torch.Tensor, scale: torch.Tensor) -> None:
    """The rank's message to itself, quantized straight into its destination and scale
    shards."""
    origin = list(dst_region[0])
    scale_origin = source.packing.scale_offset
    for _, _, values, scales in messages:
        for _, _, _, offset, extent in values:
            dst[_slices(offset, extent, origin)].copy_(source.quantized(offset, extent))
        for _, offset, extent in scales:
            scale[_slices(offset, extent, scale_origin)].copy_(source.scales(offset, extent))
