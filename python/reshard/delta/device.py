"""The delta codec's path for tensors on other devices than the CPU (CUDA): torch operations
that write the core's bytes on the device, with one host sync per bucket, and apply received
messages through what the core says each encoding writes (:mod:`reshard.delta.codec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .._core import ReshardError, crc32c, delta_written
from .format import (
    BITMASK,
    BLOCK,
    CHUNK_BYTES,
    DENSE,
    FORMAT_VERSION,
    HEADER_BYTES,
    OFFSETS,
    REGION_BLOCKS,
    REGION_DENSE,
    SPARE,
    Applied,
    Encoded,
    Outgoing,
    Patches,
    aligned,
    as_bytes,
    bits,
    blocks_at,
    flat,
    head_bytes,
    mode_of,
    nblocks,
    regions_of,
    summary,
    to_device,
)

# ----------------------------------------------------------------------------------------
# Other devices: torch operations


@dataclass
class _Plan:
    """The blocks of one region on its device: tags, changed counts and encoded sizes."""

    tags: torch.Tensor
    counts: torch.Tensor
    sizes: torch.Tensor
    #: (encoded bytes, changed elements, blocks per tag), int64 on the device
    stats: torch.Tensor


def _block_counts(changed: torch.Tensor, n: int) -> torch.Tensor:
    nb = nblocks(n)
    if n % BLOCK:
        grid = torch.zeros(nb * BLOCK, dtype=torch.bool, device=changed.device)
        grid[:n] = changed
    else:
        grid = changed
    return grid.view(nb, BLOCK).view(torch.uint8).sum(1, dtype=torch.int64)


def _lengths(n: int, device) -> torch.Tensor:
    return (n - torch.arange(nblocks(n), device=device, dtype=torch.int64) * BLOCK).clamp(max=BLOCK)


def _plan(new: torch.Tensor, base: torch.Tensor) -> _Plan:
    """Prices every block of a region by the core's rule (``reshard_core::delta::choose``):
    1 byte unchanged, ``3 + changed * (2 + elem)`` offsets, ``1 + ceil(n / 8) + changed *
    elem`` a bitmask, ``1 + n * elem`` dense, a tie going to the first of those."""
    n, elem, device = new.numel(), new.element_size(), new.device
    counts = _block_counts(bits(new) != bits(base), n)
    lengths = _lengths(n, device)
    cost = torch.stack(
        [
            torch.where(counts == 0, 1, 1 << 62),
            3 + counts * (2 + elem),
            1 + (lengths + 7) // 8 + counts * elem,
            1 + lengths * elem,
        ]
    )
    choice = cost.argmin(0)
    sizes = cost.gather(0, choice.unsqueeze(0)).squeeze(0)
    # the tags of TIE_ORDER (0, 2, 1, 3) by arithmetic: a table built on the host would
    # be copied to the device once per region, a host sync each
    tags = choice + (choice == 1).to(choice.dtype) - (choice == 2).to(choice.dtype)
    stats = torch.cat(
        [
            torch.stack([HEADER_BYTES + sizes.sum(), counts.sum()]),
            # per tag (bincount would ask the device for its largest tag)
            (tags.unsqueeze(1) == torch.arange(4, device=device)).sum(0),
        ]
    )
    return _Plan(tags, counts, sizes, stats)


def _header(elem: int, nb: int, length: int) -> bytes:
    """A region's u64 length and the core's header of its encoding."""
    return (
        length.to_bytes(8, "little")
        + bytes([FORMAT_VERSION, elem])
        + BLOCK.to_bytes(4, "little")
        + bytes(8)  # the first block
        + nb.to_bytes(4, "little")
    )


def encode_on_device(messages: Sequence[Sequence[Outgoing]], checksum: bool):
    """Every message of a bucket by torch operations on the regions' device, one host sync."""
    all_regions = [r for m in messages for r in m]
    if not all_regions:
        return [(None, []) for _ in messages]
    device = all_regions[0].new.device
    flats = [flat(r.new) for r in all_regions]
    bases = [None if r.base is None else flat(r.base) for r in all_regions]
    plans: List[Optional[_Plan]] = []
    for new, base in zip(flats, bases):
        plans.append(_plan(new, base) if base is not None and new.numel() else None)

    # the one sync: every plan's statistics, and with checksums every new region's bytes
    parts = [p.stats for p in plans if p is not None]
    stats: List[List[int]] = []
    host = None
    if parts or checksum:
        blob = [torch.cat(parts).view(torch.uint8)] if parts else []
        if checksum:
            blob += [as_bytes(f) for f in flats if f.numel()]
        host = torch.cat(blob).cpu() if blob else torch.empty(0, dtype=torch.uint8)
        if parts:
            flat_stats = host[: 48 * len(parts)].view(torch.int64).tolist()
            stats = [flat_stats[6 * k : 6 * k + 6] for k in range(len(parts))]
    at_crc = 48 * len(parts)
    crcs: List[int] = []
    if checksum:
        pieces = []
        for f in flats:
            size = f.numel() * f.element_size()
            pieces.append((at_crc, size))
            at_crc += size
        crcs = crc32c(host, pieces) if pieces else []

    # the layout of every message, in one buffer
    outs: List[List[Encoded]] = []
    spans: List[Tuple[int, int]] = []
    patches = Patches()
    writes = []  # (region index, offset of its section, mode)
    at, k, s = 0, 0, 0
    for regions in messages:
        start = at
        head = head_bytes(len(regions), checksum)
        encoded: List[Encoded] = []
        at += head
        for r in regions:
            n, elem = r.new.numel(), r.new.element_size()
            size = n * elem
            plan = plans[k]
            got = stats[s] if plan is not None else [HEADER_BYTES, 0, nblocks(n), 0, 0, 0]
            s += plan is not None
            mode = mode_of(r.base is not None, size, got[0], got[1])
            section = at
            if mode == REGION_BLOCKS:
                patches.add(at, _header(elem, nblocks(n), got[0]))
                at += 8 + got[0]
            elif mode == REGION_DENSE:
                at += size
            writes.append((k, section, mode))
            at = aligned(at)
            encoded.append(summary(mode, n, at - section, got[2:], got[1]))
            k += 1
        patches.head(start, at, encoded, crcs[k - len(regions) : k], checksum)
        spans.append((start, at))
        outs.append(encoded)

    buf = torch.zeros(at + SPARE, dtype=torch.uint8, device=device)
    spare = at
    patches.write(buf)
    for k, section, mode in writes:
        new = flats[k]
        if mode == REGION_DENSE and new.numel():
            buf[section : section + new.numel() * new.element_size()].view(new.dtype).copy_(new)
        elif mode == REGION_BLOCKS:
            _write_blocks(buf, section + 8, new, bases[k], plans[k], spare)
    for r, new in zip(all_regions, flats):
        if r.keep is not None:
            r.keep.copy_(new)
    return [(buf[a:b], e) for (a, b), e in zip(spans, outs)]


# Multiplying 8 bytes of 0 or 1 by this gathers them, the first as the lowest bit, into the
# top byte: each byte's bit lands alone there, and no two partial products meet below it.
_GATHER = 0x0102040810204080


def _pack_bits(rows: torch.Tensor) -> torch.Tensor:
    """Boolean rows of :data:`BLOCK` as their bitmasks, bit ``i % 8`` of byte ``i // 8`` for
    element ``i`` (the core's order), one row of ``BLOCK // 8`` bytes per row."""
    words = rows.contiguous().view(torch.uint8).view(torch.int64)
    return ((words * _GATHER) >> 56).bitwise_and(0xFF).to(torch.uint8)


def _write_blocks(buf: torch.Tensor, at: int, new: torch.Tensor, base: torch.Tensor, plan: _Plan, spare: int):
    """Writes the core's blocks of one region (its header written already) into ``buf`` from
    byte ``at + HEADER_BYTES``: every byte lands by an indexed write, those a block does not
    have at ``spare`` (past the messages)."""
    device, n, elem = buf.device, new.numel(), new.element_size()
    tags, counts, sizes = plan.tags, plan.counts, plan.sizes
    starts = at + HEADER_BYTES + torch.cumsum(sizes, 0) - sizes
    mask_bytes = (_lengths(n, device) + 7) // 8
    is_offsets, is_bitmask, is_dense = tags == OFFSETS, tags == BITMASK, tags == DENSE
    # tags, and the offsets blocks' counts (u16)
    pos = [starts, torch.where(is_offsets, starts + 1, spare), torch.where(is_offsets, starts + 2, spare)]
    val = [tags, counts & 0xFF, counts >> 8]
    buf.index_put_((torch.cat(pos),), torch.cat(val).to(torch.uint8))
    # where each block's values start
    values_at = starts + torch.where(is_dense, 1, torch.where(is_bitmask, 1 + mask_bytes, 3 + 2 * counts))
    rows = max(1, CHUNK_BYTES // (BLOCK * elem))
    column = torch.arange(BLOCK, device=device, dtype=torch.int64)
    byte = torch.arange(elem, device=device, dtype=torch.int64)
    mask_column = torch.arange(BLOCK // 8, device=device, dtype=torch.int64)
    for b0 in range(0, nblocks(n), rows):
        b1 = min(nblocks(n), b0 + rows)
        e0, e1 = b0 * BLOCK, min(n, b1 * BLOCK)
        changed = bits(new[e0:e1]) != bits(base[e0:e1])
        grid = torch.zeros((b1 - b0) * BLOCK, dtype=torch.bool, device=device)
        grid[: e1 - e0] = changed
        grid = grid.view(b1 - b0, BLOCK)
        chosen = grid | is_dense[b0:b1, None]
        rank = torch.cumsum(chosen, 1) - 1  # of an element among its block's values
        # the values: every element of a dense block, the changed ones of the others
        where = torch.where(chosen, values_at[b0:b1, None] + rank * elem, spare).view(-1)[: e1 - e0]
        buf.index_put_(((where[:, None] + byte).view(-1),), as_bytes(new[e0:e1]))
        # the offsets blocks' offsets (u16), in their changed elements' order
        listed = grid & is_offsets[b0:b1, None]
        first = torch.where(listed, starts[b0:b1, None] + 3 + 2 * rank, spare).view(-1)
        lo = (column & 0xFF).to(torch.uint8).expand(b1 - b0, BLOCK).reshape(-1)
        hi = (column >> 8).to(torch.uint8).expand(b1 - b0, BLOCK).reshape(-1)
        buf.index_put_((torch.cat([first, first + 1]),), torch.cat([lo, hi]))
        # the bitmask blocks' masks, as many bytes as each block's elements need
        masked = is_bitmask[b0:b1, None] & (mask_column < mask_bytes[b0:b1, None])
        where = torch.where(masked, starts[b0:b1, None] + 1 + mask_column, spare)
        buf.index_put_((where.view(-1),), _pack_bits(grid).view(-1))


def apply_on_device(incoming, checksum: bool) -> List[List[Applied]]:
    """Applies a bucket's messages onto tensors of any device: one copy of the messages to the
    host, where the core reads every encoding, then torch writes on the device."""
    buffers = [b for b, _, _ in incoming if b is not None]
    hosts: List[Optional[torch.Tensor]] = []
    if buffers and buffers[0].device.type != "cpu":
        joined = torch.cat(buffers).cpu()
        at = 0
        for b, _, _ in incoming:
            hosts.append(None if b is None else joined[at : at + b.numel()])
            at += 0 if b is None else b.numel()
    else:
        hosts = [b for b, _, _ in incoming]
    out = []
    for (device_buffer, what, regions), host in zip(incoming, hosts):
        applied: List[Applied] = []
        for reader, view, label, mode in regions_of(host, what, regions, checksum, applied):
            if mode == REGION_DENSE:
                at = reader.at
                reader.take(view.numel() * view.element_size())
                if view.numel():
                    data = device_buffer[at : at + view.numel() * view.element_size()]
                    view.copy_(data.view(view.dtype).view(view.shape))
            elif mode == REGION_BLOCKS:
                at, length = blocks_at(reader)
                scatter(host, at, length, view, label)
        out.append(applied)
    if checksum:
        views = [view for _, _, regions in incoming for view, _ in regions]
        data = [as_bytes(flat(v)) for v in views]
        joined = torch.cat(data).cpu() if data else torch.empty(0, dtype=torch.uint8)
        pieces, at = [], 0
        for d in data:
            pieces.append((at, d.numel()))
            at += d.numel()
        crcs = iter(crc32c(joined, pieces) if pieces else [])
        for applied in out:
            for a in applied:
                a.crc = next(crcs)
    return out


def scatter(host: torch.Tensor, at: int, length: int, view: torch.Tensor, label: str) -> None:
    """Writes what the encoding at ``host[at:at + length]`` changes into ``view``, on its
    device."""
    elem = view.element_size()
    try:
        offsets, values, _ = delta_written(host, list(view.shape), list(view.stride()), elem, at, length)
    except ReshardError as e:
        raise ReshardError(f"{label}: {e}") from None
    if not offsets:
        return
    span = 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    storage = view.as_strided((span,), (1,))
    index = to_device(torch.frombuffer(offsets, dtype=torch.int64), view.device)
    data = to_device(torch.frombuffer(values, dtype=torch.uint8), view.device)
    target = bits(storage)
    target[index] = data.view(target.dtype)
