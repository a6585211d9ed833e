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
    grid = torch.zeros(nb * BLOCK, dtype=torch.bool, device=device)
    grid[:n] = bits(new) != bits(base)
    grid = grid.view(nb, BLOCK)
    counts = grid.sum(1)
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
    counted = offsets_rows | bitmask_rows
    sel = grid | (tags == DENSE).unsqueeze(1)
    values = new[sel.view(-1)[:n]]
    masks = grid[bitmask_rows].view(-1, BLOCK // 8, 8).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    masks = (masks << shifts).sum(-1, dtype=torch.uint8).view(-1)
    if bool(bitmask_rows[-1]) and n % BLOCK:
        # the last block is short: its mask has only the bytes its elements need
        masks = masks[: masks.numel() - BLOCK // 8 + (n % BLOCK + 7) // 8]
    offsets = grid[offsets_rows].nonzero()[:, 1].to(torch.int16)
    sections = [
        tags.to(torch.uint8),
        as_bytes(counts[counted].to(torch.int16)),
        masks,
        as_bytes(offsets),
        as_bytes(values),
    ]
    return Encoded(REGION_BLOCKS, sections, tally, changed)


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

    sel = torch.zeros(nb, BLOCK, dtype=torch.bool, device=device)
    sel[(tags == DENSE).to(device)] = True
    if nbitmask:
        full = torch.zeros(nbitmask * (BLOCK // 8), dtype=torch.uint8, device=device)
        full[:nmask] = masks
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        unpacked = ((full.view(-1, 1) >> shifts) & 1).bool().view(nbitmask, BLOCK)
        sel[bitmask_rows.to(device)] = unpacked
    if noffsets:
        rows = torch.repeat_interleave(
            torch.nonzero(offsets_rows).view(-1), per_block[offsets_rows]
        ).to(device)
        cols = offsets.to(torch.int64)
        if bool(((cols < 0) | (cols >= BLOCK)).any()):
            raise ReshardError(f"{what}: a changed element's offset lies outside its block")
        sel[rows, cols] = True
    sel = sel.view(-1)[:n]
    if int(sel.sum()) != nvalues:
        raise ReshardError(
            f"{what}: the message's masks and offsets select another number of elements than "
            f"the {nvalues} values it carries"
        )
    bits(out).masked_scatter_(sel, values)
