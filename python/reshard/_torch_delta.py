"""The block codec of a delta refit, in torch operations (so it runs on the tensors' own
device): one transfer's region, as its row-major stream of elements in the wire dtype, is
compared bit for bit with the base (what the sender last sent of it), cut into blocks of
:data:`BLOCK` elements, and every block is sent the cheapest way:

* unchanged: nothing but its tag;
* offsets: the number of changed elements, their offsets in the block (u16) and their values;
* bitmask: the number of changed elements, one bit per element, and the changed values;
* dense: every value of the block.

The cost of each (in bytes, the tag included) is the core's rule (``reshard_core::delta``):
1 for unchanged, ``3 + changed * (2 + elem)`` for offsets, ``3 + ceil(n / 8) + changed * elem``
for a bitmask (here with the count, which the receiver reads instead of counting bits) and
``1 + n * elem`` for dense; ties go to the first of unchanged, offsets, bitmask, dense. Values
are always the new values, never differences: applying a delta onto the right base gives the
new region bit for bit, and nothing drifts over many versions.

An encoded region is self-describing given its element count and dtype (which both sides know
from the plan): a mode byte in the message header says whether the region is unchanged as a
whole, dense as a whole (no base, or no cheaper), or cut into blocks, whose tags come first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ._core import ReshardError

#: Elements per block of a region's stream (the core codec's block).
BLOCK = 4096

# A block's encodings, in the order ties are broken (the core's order).
UNCHANGED, OFFSETS, BITMASK, DENSE = 0, 1, 2, 3
ENCODINGS = ("unchanged", "offsets", "bitmask", "dense")

# A whole region's mode in the message header.
REGION_UNCHANGED, REGION_DENSE, REGION_BLOCKS = 0, 1, 2

# Sections of a message start at multiples of this, so that bytes view as any element type.
ALIGN = 8

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bits(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor viewed as integers of its width: compared bit for bit, NaNs and
    signed zeros included."""
    return flat.view(_INTS[flat.element_size()])


def as_bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8)


@dataclass
class Encoded:
    """One region, encoded: its mode, the sections of the message it adds (each aligned by the
    message), and what it cost."""

    mode: int
    sections: List[torch.Tensor]
    blocks: List[int] = field(default_factory=lambda: [0, 0, 0, 0])
    changed: int = 0

    @property
    def nbytes(self) -> int:
        return sum(aligned(s.numel()) for s in self.sections)


def _nblocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def encode_dense(new: torch.Tensor) -> Encoded:
    """The region ``new`` (contiguous, 1-D) sent whole."""
    nb = _nblocks(new.numel())
    return Encoded(REGION_DENSE, [as_bytes(new)] if new.numel() else [], [0, 0, 0, nb])


def encode(new: torch.Tensor, base: Optional[torch.Tensor]) -> Encoded:
    """The region ``new`` against ``base`` (both contiguous, 1-D, of one dtype and length;
    None: no base, so dense), each block the cheapest way."""
    n = new.numel()
    if base is None or n == 0:
        return encode_dense(new)
    elem = new.element_size()
    nb = _nblocks(n)
    device = new.device
    changed_at = bits(new) != bits(base)
    if n % BLOCK:
        grid = torch.zeros(nb * BLOCK, dtype=torch.bool, device=device)
        grid[:n] = changed_at
        grid = grid.view(nb, BLOCK)
    else:
        grid = changed_at.view(nb, BLOCK)
    counts = grid.view(torch.uint8).sum(1, dtype=torch.int64)  # summing bools would copy them
    lengths = (n - torch.arange(nb, device=device) * BLOCK).clamp(max=BLOCK)
    big = torch.full_like(counts, 1 << 62)
    cost = torch.stack(
        [
            torch.where(counts == 0, torch.ones_like(counts), big),
            3 + counts * (2 + elem),
            3 + (lengths + 7) // 8 + counts * elem,
            1 + lengths * elem,
        ]
    )
    tags = cost.argmin(0)
    tally = torch.bincount(tags, minlength=4).tolist()
    changed = int(counts.sum())
    if tally[UNCHANGED] == nb:
        return Encoded(REGION_UNCHANGED, [], tally, 0)
    if tally[DENSE] == nb:
        return Encoded(REGION_DENSE, [as_bytes(new)], tally, changed)
    offsets_rows = tags == OFFSETS
    bitmask_rows = tags == BITMASK
    sel = changed_at
    if tally[DENSE]:
        sel = (grid | (tags == DENSE).unsqueeze(1)).view(-1)[:n]
    # the selected elements, in row-major order: one index list gives the values and offsets
    at = torch.nonzero(sel).view(-1)
    values = new[at]
    offsets = at[offsets_rows[at // BLOCK]] % BLOCK
    masks = _pack_bits(grid[bitmask_rows]) if tally[BITMASK] else grid.new_zeros(0, dtype=torch.uint8)
    if tally[BITMASK] and bool(bitmask_rows[-1]) and n % BLOCK:
        # the last block is short: its mask has only the bytes its elements need
        masks = masks[: masks.numel() - BLOCK // 8 + (n % BLOCK + 7) // 8]
    sections = [
        tags.to(torch.uint8),
        as_bytes(counts[offsets_rows | bitmask_rows].to(torch.int16)),
        masks,
        as_bytes(offsets.to(torch.int16)),
        as_bytes(values),
    ]
    return Encoded(REGION_BLOCKS, sections, tally, changed)


# Multiplying 8 bytes of 0 or 1 by this gathers them, the first as the lowest bit, into the
# top byte: each byte's bit lands alone there, and no two partial products meet below it.
_GATHER = 0x0102040810204080


def _pack_bits(rows: torch.Tensor) -> torch.Tensor:
    """Boolean rows of :data:`BLOCK` as their bitmasks, bit ``i % 8`` of byte ``i // 8`` for
    element ``i`` (little-endian), flattened."""
    words = rows.contiguous().view(torch.uint8).view(torch.int64)
    return ((words * _GATHER) >> 56).bitwise_and(0xFF).to(torch.uint8).view(-1)


# Each byte of a mask repeated into the 8 bytes of a word, then byte i keeps bit i alone.
_SPREAD = 0x0101010101010101
_BIT_OF_BYTE = 0x8040201008040201 - (1 << 64)  # as a signed 64-bit integer


def _unpack_bits(masks: torch.Tensor) -> torch.Tensor:
    """The booleans of the bitmask bytes ``masks`` (as :func:`_pack_bits` packs them)."""
    words = (masks.to(torch.int64) * _SPREAD).bitwise_and(_BIT_OF_BYTE)
    return words.view(torch.uint8) != 0


class Reader:
    """Reads the sections of one received message in order, refusing to read past its end."""

    def __init__(self, buffer: torch.Tensor, what: str) -> None:
        self.buffer = buffer
        self.at = 0
        self.what = what

    def take(self, nbytes: int) -> torch.Tensor:
        end = self.at + nbytes
        if end > self.buffer.numel():
            raise ReshardError(
                f"{self.what}: the message ends at byte {self.buffer.numel()}, but its header "
                f"says a section lies at {self.at}..{end}"
            )
        out = self.buffer[self.at : end]
        self.at = aligned(end)
        return out


def decode(reader: Reader, mode: int, out: torch.Tensor, what: str) -> None:
    """Applies one encoded region onto ``out`` (contiguous, 1-D, the base of the region: what
    the destination holds), reading its sections from ``reader``."""
    n = out.numel()
    elem = out.element_size()
    if mode == REGION_UNCHANGED:
        return
    if mode == REGION_DENSE:
        if n:
            bits(out).copy_(reader.take(n * elem).view(bits(out).dtype))
        return
    if mode != REGION_BLOCKS:
        raise ReshardError(f"{what}: unknown region mode {mode} in the message header")
    nb = _nblocks(n)
    device = out.device
    tags = reader.take(nb).cpu().to(torch.int64)
    if nb and int(tags.max()) > DENSE:
        raise ReshardError(f"{what}: unknown block encoding {int(tags.max())} in the message")
    offsets_rows = tags == OFFSETS
    bitmask_rows = tags == BITMASK
    counted = offsets_rows | bitmask_rows
    counts = reader.take(2 * int(counted.sum())).view(torch.int16).cpu().to(torch.int64)
    lengths = (n - torch.arange(nb) * BLOCK).clamp(max=BLOCK)
    if bool((counts < 1).any()) or bool((counts > lengths[counted]).any()):
        raise ReshardError(f"{what}: a block's count of changed elements is out of range")
    per_block = torch.zeros(nb, dtype=torch.int64)
    per_block[counted] = counts
    nbitmask = int(bitmask_rows.sum())
    nmask = nbitmask * (BLOCK // 8)
    if nbitmask and bool(bitmask_rows[-1]) and n % BLOCK:
        nmask -= BLOCK // 8 - (n % BLOCK + 7) // 8
    masks = reader.take(nmask)
    noffsets = int(per_block[offsets_rows].sum())
    offsets = reader.take(2 * noffsets).view(torch.int16)
    nvalues = int(per_block.sum()) + int(lengths[tags == DENSE].sum())
    values = reader.take(nvalues * elem).view(bits(out).dtype)

    rows = None
    if noffsets:
        first = torch.nonzero(offsets_rows).view(-1)
        rows = torch.repeat_interleave(first, per_block[offsets_rows]).to(device)
        cols = offsets.to(torch.int64)
        if bool(((cols < 0) | (cols >= BLOCK)).any()):
            raise ReshardError(f"{what}: a changed element's offset lies outside its block")
        if not nbitmask and not bool((tags == DENSE).any()):
            # offsets alone: their elements' indices, in order, say where the values go
            at = rows * BLOCK + cols
            if bool((at[1:] <= at[:-1]).any()) or int(at[-1]) >= n:
                raise ReshardError(f"{what}: a block's offsets are not increasing within its elements")
            bits(out)[at] = values
            return
    sel = torch.zeros(nb, BLOCK, dtype=torch.bool, device=device)
    sel[(tags == DENSE).to(device)] = True
    if nbitmask:
        full = torch.zeros(nbitmask * (BLOCK // 8), dtype=torch.uint8, device=device)
        full[:nmask] = masks
        sel[bitmask_rows.to(device)] = _unpack_bits(full).view(nbitmask, BLOCK)
    if rows is not None:
        sel[rows, cols] = True
    sel = sel.view(-1)[:n]
    if int(sel.view(torch.uint8).sum(dtype=torch.int64)) != nvalues:
        raise ReshardError(
            f"{what}: the message's masks and offsets select another number of elements than "
            f"the {nvalues} values it carries"
        )
    bits(out).masked_scatter_(sel, values)
