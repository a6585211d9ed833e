"""The codec of a delta refit from Python: a transfer's region, as its row-major stream of
elements in the wire dtype, encoded against its base (what the receiver holds of it) in the
core's wire format (``reshard_core::delta``), and the messages that carry a peer's regions.

The encoding is the core's, one definition: an 18-byte header, then for every block of
:data:`BLOCK` elements a tag and its payload, the smallest by the core's rule (unchanged: the
tag alone; offsets: their u16 count, the changed elements' u16 offsets, their values; a bitmask
and the changed values; dense: every value), values always the new values, never
differences, so applying onto the right base gives the new region bit for bit.

CPU tensors are encoded and applied by the core's kernels through the extension
(:func:`reshard._core.delta_encode`, :func:`reshard._core.delta_apply`, GIL released).
Tensors on another device are encoded by torch operations here that produce the same bytes,
on the device, with one host sync per bucket (the sizes of all its regions' encodings, and
their checksums, in one copy); such a receiver copies the bucket's messages to the host once,
the core reads every encoding there and lists what it writes
(:func:`reshard._core.delta_written`, checked whole first), and torch writes the values into
the tensors on their device. ``torch_ops=True`` runs the torch path on CPU tensors too (the
conformance tests compare both paths byte for byte).

A message (one per peer and bucket) carries its regions in the plan's order (which both sides
know, with their shapes and dtypes)::

    length   u64: the message's bytes, this field included
    modes    u8 per region: 0 unchanged, 1 dense, 2 blocks
    crcs     with checksums: the CRC-32C of every new region, int64 each
    regions  every region not unchanged, each at a multiple of 8 bytes:
             dense   its values
             blocks  u64 length, then the core's encoding of that many bytes

every section at a multiple of 8 bytes, the padding zero. A region goes unchanged when no
element changed, dense without a base or when its encoding is not smaller than its values. No
message is longer than :func:`largest` says from its regions' sizes alone, so a receiver can
take one into a buffer of that size without being told its length first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from ._core import ReshardError, crc32c, delta_apply, delta_encode, delta_written

#: Elements per block of a region's stream (``reshard_core::delta::BLOCK_ELEMS``).
BLOCK = 4096
#: Bytes of the core's header of an encoding.
HEADER_BYTES = 18
_VERSION = 1

# The core's block tags; ENCODINGS names them by tag.
UNCHANGED, BITMASK, OFFSETS, DENSE = 0, 1, 2, 3
ENCODINGS = ("unchanged", "bitmask", "offsets", "dense")

# A region's mode in its message.
REGION_UNCHANGED, REGION_DENSE, REGION_BLOCKS = 0, 1, 2

# Sections of a message start at multiples of this, so that bytes view as any element type.
ALIGN = 8

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The core's order of a tie (unchanged, offsets, bitmask, dense) as tags: the torch path
# prices the encodings in this order, so that argmin picks the first cheapest as the core does.
_TIE_ORDER = (UNCHANGED, OFFSETS, BITMASK, DENSE)

# The torch path writes the values of at most this many bytes of a region at a time (its
# temporaries are about 20 times as large).
_CHUNK_BYTES = 4 << 20

# Bytes past the end of a bucket's buffer that the torch path's masked writes land in.
_SPARE = 8


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bits(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor viewed as integers of its width: compared bit for bit, NaNs and
    signed zeros included."""
    return flat.view(_INTS[flat.element_size()])


def as_bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8)


def _flat(view: torch.Tensor) -> torch.Tensor:
    """A region's row-major stream with a stride of 1 (the view itself where it has one)."""
    flat = view.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a single element may have any stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def _nblocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _head_bytes(regions: int, checksum: bool) -> int:
    return 8 + aligned(regions) + (8 * regions if checksum else 0)


def largest(sizes: Sequence[int], checksum: bool) -> int:
    """The most bytes a message of regions of ``sizes`` bytes can take: each dense, or its
    encoding (smaller than its values) after its length."""
    return _head_bytes(len(sizes), checksum) + sum(8 + aligned(size) for size in sizes)


def says_nothing(encoded: Sequence[Encoded], checksum: bool) -> bool:
    """Whether a message tells its receiver nothing it does not know (every region unchanged,
    no checksums): it need not be sent where the receiver learns its size first."""
    return not checksum and all(e.mode == REGION_UNCHANGED for e in encoded)


@dataclass
class Outgoing:
    """One region to send: ``new`` the region as this rank holds it (any view, in the wire
    dtype), ``base`` what the receiver holds of it (as many elements, any shape; None: send it
    dense), ``keep`` a contiguous tensor of as many elements that takes the new values (the
    base of the next version; it may be ``base`` itself, updated in place)."""

    new: torch.Tensor
    base: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None


@dataclass
class Encoded:
    """How one region went: its mode, the bytes it takes in its message (a multiple of 8),
    its blocks by tag (a region sent dense counts them all dense) and the elements that differ
    from its base. ``sections`` (from :func:`encode` only): its bytes in the message."""

    mode: int
    nbytes: int = 0
    blocks: List[int] = field(default_factory=lambda: [0, 0, 0, 0])
    changed: int = 0
    sections: List[torch.Tensor] = field(default_factory=list)


@dataclass
class Applied:
    """How one received region went: its mode, and with checksums the CRC-32C its sender sent
    and the one of the region after applying."""

    mode: int
    sent_crc: Optional[int] = None
    crc: Optional[int] = None


def _mode(has_base: bool, size: int, encoded: int, changed: int) -> int:
    """A region's mode from its encoding's size (the same rule on both paths)."""
    if not has_base:
        return REGION_DENSE
    if changed == 0:
        return REGION_UNCHANGED
    return REGION_DENSE if encoded >= size else REGION_BLOCKS


def _summary(mode: int, n: int, nbytes: int, tally: Sequence[int], changed: int) -> Encoded:
    blocks = list(tally) if mode == REGION_BLOCKS or mode == REGION_UNCHANGED else [0, 0, 0, _nblocks(n)]
    return Encoded(mode, nbytes, blocks, changed)


def _crc_of(data: torch.Tensor) -> int:
    """The CRC-32C of a contiguous CPU byte tensor."""
    return crc32c(data, [(0, data.numel())])[0]


def _uses_torch(tensors, torch_ops: Optional[bool]) -> bool:
    if torch_ops is not None:
        return torch_ops
    return any(t.device.type != "cpu" for t in tensors)


def encode_messages(
    messages: Sequence[Sequence[Outgoing]], checksum: bool, torch_ops: Optional[bool] = None
) -> List[Tuple[torch.Tensor, List[Encoded]]]:
    """Every message of a bucket, one per list of regions: its bytes and how each region
    went. Every ``keep`` takes its region's new values. CPU tensors by the core's kernels,
    others by torch operations with one host sync for the whole bucket (``torch_ops`` forces
    either)."""
    if _uses_torch((r.new for m in messages for r in m), torch_ops):
        return _encode_torch(messages, checksum)
    return [_encode_cpu(regions, checksum) for regions in messages]


def apply_messages(
    incoming: Sequence[Tuple[Optional[torch.Tensor], str, Sequence[Tuple[torch.Tensor, str]]]],
    checksum: bool,
    torch_ops: Optional[bool] = None,
) -> List[List[Applied]]:
    """Applies every message of a bucket, each ``(buffer, what, [(view, label)])``: its bytes
    (None: not sent, as it said nothing; a buffer may be longer than its message), what names
    it in errors, and the views of its regions
    (holding their bases) with their labels. Raises :class:`ReshardError` naming the region
    of a malformed message (an encoding is checked whole before it writes anything)."""
    views = [v for _, _, regions in incoming for v, _ in regions]
    if _uses_torch(views, torch_ops):
        return _apply_torch(incoming, checksum)
    out = []
    for buffer, what, regions in incoming:
        applied = []
        for reader, view, label, mode in _regions(buffer, what, regions, checksum, applied):
            _apply_region_cpu(reader, mode, view, label)
        if checksum:
            for a, (view, _) in zip(applied, regions):
                a.crc = _crc_of(as_bytes(_flat(view)))
        out.append(applied)
    return out


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


def _regions(buffer, what, regions, checksum, applied: List[Applied]):
    """Reads a message's header and yields ``(reader, view, label, mode)`` per region, the
    reader at its section; fills ``applied``."""
    if buffer is None:
        applied.extend(Applied(REGION_UNCHANGED) for _ in regions)
        return
    reader = Reader(buffer, what)
    length = message_length(reader.take(8))
    if length < _head_bytes(len(regions), checksum) or length > buffer.numel():
        raise ReshardError(
            f"{what}: the message says it has {length} bytes, but {buffer.numel()} arrived for "
            f"{len(regions)} regions"
        )
    reader.buffer = buffer[:length]
    modes = reader.take(len(regions)).tolist()
    crcs = reader.take(8 * len(regions)).view(torch.int64).tolist() if checksum else [None] * len(regions)
    for (view, label), mode, crc in zip(regions, modes, crcs):
        if mode not in (REGION_UNCHANGED, REGION_DENSE, REGION_BLOCKS):
            raise ReshardError(f"{label}: unknown region mode {mode} in the message header")
        applied.append(Applied(mode, None if crc is None else crc & 0xFFFFFFFF))
        yield reader, view, label, mode


def message_length(buffer: torch.Tensor) -> int:
    """The length a message says it has, from its first 8 bytes (on the host)."""
    return int(buffer[:8].cpu().view(torch.int64)[0])


def carried(buffer: torch.Tensor, regions: int, checksum: bool) -> int:
    """The bytes of a received message of ``regions`` regions, or 0 for one that says nothing
    (it stands for the size a receiver is otherwise told first, which no report counts)."""
    head = buffer[: 8 + regions].cpu()
    says = checksum or bool(head[8:].any())
    return int(head[:8].view(torch.int64)[0]) if says else 0


def _blocks_at(reader: Reader) -> Tuple[int, int]:
    """The offset and length of a region's encoding, read past."""
    length = int(reader.take(8).view(torch.int64)[0])
    at = reader.at
    if length < 0:
        raise ReshardError(f"{reader.what}: an encoding of {length} bytes in the message")
    reader.take(length)
    return at, length


def _apply_region_cpu(reader: Reader, mode: int, view: torch.Tensor, label: str) -> None:
    if mode == REGION_DENSE:
        data = reader.take(view.numel() * view.element_size())
        if view.numel():
            view.copy_(data.view(view.dtype).view(view.shape))
    elif mode == REGION_BLOCKS:
        at, length = _blocks_at(reader)
        try:
            delta_apply(reader.buffer, view, at, length)
        except ReshardError as e:
            raise ReshardError(f"{label}: {e}") from None


# ----------------------------------------------------------------------------------------
# CPU: the core's kernels


class _Patches:
    """Bytes at known offsets of a message (its header, lengths, padding), written at once."""

    def __init__(self) -> None:
        self.pos: List[int] = []
        self.val = bytearray()

    def add(self, at: int, data) -> None:
        self.pos.extend(range(at, at + len(data)))
        self.val += bytes(data)

    def head(self, at: int, end: int, encoded: Sequence[Encoded], crcs: Sequence[int], checksum: bool):
        """The head of the message at ``at..end``: its length, modes (and checksums), its
        padding zero."""
        modes = bytes(e.mode for e in encoded)
        self.add(at, (end - at).to_bytes(8, "little") + modes + bytes(aligned(len(modes)) - len(modes)))
        if checksum:
            self.add(at + 8 + aligned(len(modes)), b"".join(c.to_bytes(8, "little") for c in crcs))

    def write(self, buf: torch.Tensor) -> None:
        if self.pos:
            pos = _to_device(torch.tensor(self.pos, dtype=torch.int64), buf.device)
            val = _to_device(torch.frombuffer(self.val, dtype=torch.uint8), buf.device)
            buf.index_put_((pos,), val)


def _encode_cpu(regions: Sequence[Outgoing], checksum: bool) -> Tuple[torch.Tensor, List[Encoded]]:
    """One message of CPU regions, each encoded straight into it by the core."""
    head = _head_bytes(len(regions), checksum)
    room = largest([r.new.numel() * r.new.element_size() for r in regions], checksum)
    msg = torch.empty(room, dtype=torch.uint8)
    patches = _Patches()
    out: List[Encoded] = []
    crcs: List[int] = []
    at = head
    for r in regions:
        new, n = r.new, r.new.numel()
        size = n * new.element_size()
        in_place = r.keep is not None and r.keep is r.base
        if r.base is None:
            got = (0, [0, 0, 0, _nblocks(n)], 0)
        else:
            got = delta_encode(new, r.base, msg, at + 8, update_base=in_place, smaller_only=True)
        mode = _mode(r.base is not None, size, got[0], got[2])
        start = at
        if mode == REGION_BLOCKS:
            patches.add(at, got[0].to_bytes(8, "little"))
            end = at + 8 + got[0]
        elif mode == REGION_DENSE:
            if n:
                msg[at : at + size].view(new.dtype).view(new.shape).copy_(new)
            end = at + size
        else:
            end = at
        if r.keep is not None and not in_place:
            r.keep.view(new.shape).copy_(new)
        if checksum:
            if mode == REGION_DENSE:
                crcs.append(_crc_of(msg[start:end]))
            elif r.keep is not None:
                crcs.append(_crc_of(as_bytes(r.keep)))
            else:
                crcs.append(_crc_of(as_bytes(_flat(new))))
        at = aligned(end)
        patches.add(end, bytes(at - end))
        out.append(_summary(mode, n, at - start, got[1], got[2]))
    patches.head(0, at, out, crcs, checksum)
    patches.write(msg)
    return msg[:at], out


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
    nb = _nblocks(n)
    if n % BLOCK:
        grid = torch.zeros(nb * BLOCK, dtype=torch.bool, device=changed.device)
        grid[:n] = changed
    else:
        grid = changed
    return grid.view(nb, BLOCK).view(torch.uint8).sum(1, dtype=torch.int64)


def _lengths(n: int, device) -> torch.Tensor:
    return (n - torch.arange(_nblocks(n), device=device, dtype=torch.int64) * BLOCK).clamp(max=BLOCK)


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
    # the tags of _TIE_ORDER (0, 2, 1, 3) by arithmetic: a table built on the host would
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


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``, copied without waiting for the device (pinned)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _header(elem: int, nb: int, length: int) -> bytes:
    """A region's u64 length and the core's header of its encoding."""
    return (
        length.to_bytes(8, "little")
        + bytes([_VERSION, elem])
        + BLOCK.to_bytes(4, "little")
        + bytes(8)  # the first block
        + nb.to_bytes(4, "little")
    )


def _encode_torch(messages: Sequence[Sequence[Outgoing]], checksum: bool):
    """Every message of a bucket by torch operations on the regions' device, one host sync."""
    all_regions = [r for m in messages for r in m]
    if not all_regions:
        return [(None, []) for _ in messages]
    device = all_regions[0].new.device
    flats = [_flat(r.new) for r in all_regions]
    bases = [None if r.base is None else _flat(r.base) for r in all_regions]
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
    patches = _Patches()
    writes = []  # (region index, offset of its section, mode)
    at, k, s = 0, 0, 0
    for regions in messages:
        start = at
        head = _head_bytes(len(regions), checksum)
        encoded: List[Encoded] = []
        at += head
        for r in regions:
            n, elem = r.new.numel(), r.new.element_size()
            size = n * elem
            plan = plans[k]
            got = stats[s] if plan is not None else [HEADER_BYTES, 0, _nblocks(n), 0, 0, 0]
            s += plan is not None
            mode = _mode(r.base is not None, size, got[0], got[1])
            section = at
            if mode == REGION_BLOCKS:
                patches.add(at, _header(elem, _nblocks(n), got[0]))
                at += 8 + got[0]
            elif mode == REGION_DENSE:
                at += size
            writes.append((k, section, mode))
            at = aligned(at)
            encoded.append(_summary(mode, n, at - section, got[2:], got[1]))
            k += 1
        patches.head(start, at, encoded, crcs[k - len(regions) : k], checksum)
        spans.append((start, at))
        outs.append(encoded)

    buf = torch.zeros(at + _SPARE, dtype=torch.uint8, device=device)
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
    rows = max(1, _CHUNK_BYTES // (BLOCK * elem))
    column = torch.arange(BLOCK, device=device, dtype=torch.int64)
    byte = torch.arange(elem, device=device, dtype=torch.int64)
    mask_column = torch.arange(BLOCK // 8, device=device, dtype=torch.int64)
    for b0 in range(0, _nblocks(n), rows):
        b1 = min(_nblocks(n), b0 + rows)
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


def _apply_torch(incoming, checksum: bool) -> List[List[Applied]]:
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
        for reader, view, label, mode in _regions(host, what, regions, checksum, applied):
            if mode == REGION_DENSE:
                at = reader.at
                reader.take(view.numel() * view.element_size())
                if view.numel():
                    data = device_buffer[at : at + view.numel() * view.element_size()]
                    view.copy_(data.view(view.dtype).view(view.shape))
            elif mode == REGION_BLOCKS:
                at, length = _blocks_at(reader)
                _scatter(host, at, length, view, label)
        out.append(applied)
    if checksum:
        views = [view for _, _, regions in incoming for view, _ in regions]
        data = [as_bytes(_flat(v)) for v in views]
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


def _scatter(host: torch.Tensor, at: int, length: int, view: torch.Tensor, label: str) -> None:
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
    index = _to_device(torch.frombuffer(offsets, dtype=torch.int64), view.device)
    data = _to_device(torch.frombuffer(values, dtype=torch.uint8), view.device)
    target = bits(storage)
    target[index] = data.view(target.dtype)


# ----------------------------------------------------------------------------------------
# One region at a time (tests, and what the messages are made of)


def encode(new: torch.Tensor, base: Optional[torch.Tensor], torch_ops: Optional[bool] = None) -> Encoded:
    """One region as a message of its own would carry it: ``sections`` its bytes there (after
    the header). ``base`` is not changed."""
    [(msg, [encoded])] = encode_messages([[Outgoing(new, base)]], False, torch_ops)
    if encoded.mode != REGION_UNCHANGED:
        encoded.sections = [msg[_head_bytes(1, False) :]]
    return encoded


def decode(reader: Reader, mode: int, out: torch.Tensor, what: str, torch_ops: Optional[bool] = None) -> None:
    """Applies one region (its section at ``reader``, in ``mode``) onto ``out``, which holds
    its base."""
    if mode not in (REGION_UNCHANGED, REGION_DENSE, REGION_BLOCKS):
        raise ReshardError(f"{what}: unknown region mode {mode} in the message header")
    if not _uses_torch([out, reader.buffer], torch_ops):
        _apply_region_cpu(reader, mode, out, what)
        return
    if mode == REGION_DENSE:
        data = reader.take(out.numel() * out.element_size())
        if out.numel():
            out.copy_(data.view(out.dtype).view(out.shape))
    elif mode == REGION_BLOCKS:
        at, length = _blocks_at(reader)
        _scatter(reader.buffer.cpu(), at, length, out, what)
