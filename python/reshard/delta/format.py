"""The wire format of a delta refit's messages from Python, shared by both codec paths
(:mod:`reshard.delta.codec`): the core's block tags and sizes, the message's sections and how
a receiver reads them, and what each region's encoding reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from .._core import ReshardError, crc32c

#: Elements per block of a region's stream (``reshard_core::delta::BLOCK_ELEMS``).
BLOCK = 4096
#: Bytes of the core's header of an encoding.
HEADER_BYTES = 18
FORMAT_VERSION = 1

# The core's block tags; ENCODINGS names them by tag.
UNCHANGED, BITMASK, OFFSETS, DENSE = 0, 1, 2, 3
ENCODINGS = ("unchanged", "bitmask", "offsets", "dense")

# A region's mode in its message.
REGION_UNCHANGED, REGION_DENSE, REGION_BLOCKS = 0, 1, 2

# Sections of a message start at multiples of this, so that bytes view as any element type.
ALIGN = 8

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The core's order of a tie (unchanged, offsets, bitmask, dense) as tags: the torch path
# prices the encodings in this order, so that argmin picks the first cheapest as the core does.
TIE_ORDER = (UNCHANGED, OFFSETS, BITMASK, DENSE)

# The torch path writes the values of at most this many bytes of a region at a time (its
# temporaries are about 20 times as large).
CHUNK_BYTES = 4 << 20

# Bytes past the end of a bucket's buffer that the torch path's masked writes land in.
SPARE = 8


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bits(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor viewed as integers of its width: compared bit for bit, NaNs and
    signed zeros included."""
    return flat.view(INTS[flat.element_size()])


def as_bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8)


def flat(view: torch.Tensor) -> torch.Tensor:
    """A region's row-major stream with a stride of 1 (the view itself where it has one)."""
    flat = view.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a single element may have any stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def nblocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def head_bytes(regions: int, checksum: bool) -> int:
    return 8 + aligned(regions) + (8 * regions if checksum else 0)


def largest(sizes: Sequence[int], checksum: bool) -> int:
    """The most bytes a message of regions of ``sizes`` bytes can take: each dense, or its
    encoding (smaller than its values) after its length."""
    return head_bytes(len(sizes), checksum) + sum(8 + aligned(size) for size in sizes)


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


def mode_of(has_base: bool, size: int, encoded: int, changed: int) -> int:
    """A region's mode from its encoding's size (the same rule on both paths)."""
    if not has_base:
        return REGION_DENSE
    if changed == 0:
        return REGION_UNCHANGED
    return REGION_DENSE if encoded >= size else REGION_BLOCKS


def summary(mode: int, n: int, nbytes: int, tally: Sequence[int], changed: int) -> Encoded:
    blocks = list(tally) if mode == REGION_BLOCKS or mode == REGION_UNCHANGED else [0, 0, 0, nblocks(n)]
    return Encoded(mode, nbytes, blocks, changed)


def crc_of(data: torch.Tensor) -> int:
    """The CRC-32C of a contiguous CPU byte tensor."""
    return crc32c(data, [(0, data.numel())])[0]


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


def regions_of(buffer, what, regions, checksum, applied: List[Applied]):
    """Reads a message's header and yields ``(reader, view, label, mode)`` per region, the
    reader at its section; fills ``applied``."""
    if buffer is None:
        applied.extend(Applied(REGION_UNCHANGED) for _ in regions)
        return
    reader = Reader(buffer, what)
    length = message_length(reader.take(8))
    if length < head_bytes(len(regions), checksum) or length > buffer.numel():
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


def blocks_at(reader: Reader) -> Tuple[int, int]:
    """The offset and length of a region's encoding, read past."""
    length = int(reader.take(8).view(torch.int64)[0])
    at = reader.at
    if length < 0:
        raise ReshardError(f"{reader.what}: an encoding of {length} bytes in the message")
    reader.take(length)
    return at, length


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``, copied without waiting for the device (pinned)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class Patches:
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
            pos = to_device(torch.tensor(self.pos, dtype=torch.int64), buf.device)
            val = to_device(torch.frombuffer(self.val, dtype=torch.uint8), buf.device)
            buf.index_put_((pos,), val)
