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
the tensors on their device (:mod:`reshard.delta.device`). ``torch_ops=True`` runs the
torch path on CPU tensors too (the conformance tests compare both paths byte for byte). The
message's sections, tags and sizes are :mod:`reshard.delta.format`'s.

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

from typing import List, Optional, Sequence, Tuple

import torch

from .._core import ReshardError, delta_apply, delta_encode
from .device import apply_on_device, encode_on_device, scatter
from .format import (  # noqa: F401 (the codec's format, as its users name it)
    BITMASK,
    BLOCK,
    DENSE,
    ENCODINGS,
    HEADER_BYTES,
    OFFSETS,
    REGION_BLOCKS,
    REGION_DENSE,
    REGION_UNCHANGED,
    UNCHANGED,
    Applied,
    Encoded,
    Outgoing,
    Patches,
    Reader,
    aligned,
    as_bytes,
    bits,
    blocks_at,
    carried,
    crc_of,
    flat,
    head_bytes,
    largest,
    message_length,
    mode_of,
    nblocks,
    regions_of,
    says_nothing,
    summary,
)


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
        return encode_on_device(messages, checksum)
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
        return apply_on_device(incoming, checksum)
    out = []
    for buffer, what, regions in incoming:
        applied = []
        for reader, view, label, mode in regions_of(buffer, what, regions, checksum, applied):
            _apply_region_cpu(reader, mode, view, label)
        if checksum:
            for a, (view, _) in zip(applied, regions):
                a.crc = crc_of(as_bytes(flat(view)))
        out.append(applied)
    return out


def _apply_dense(reader: Reader, view: torch.Tensor) -> None:
    """A region sent dense: its values, read past, into ``view``."""
    data = reader.take(view.numel() * view.element_size())
    if view.numel():
        view.copy_(data.view(view.dtype).view(view.shape))


def _apply_region_cpu(reader: Reader, mode: int, view: torch.Tensor, label: str) -> None:
    if mode == REGION_DENSE:
        _apply_dense(reader, view)
    elif mode == REGION_BLOCKS:
        at, length = blocks_at(reader)
        try:
            delta_apply(reader.buffer, view, at, length)
        except ReshardError as e:
            raise ReshardError(f"{label}: {e}") from None


# ----------------------------------------------------------------------------------------
# CPU: the core's kernels


def _encode_cpu(regions: Sequence[Outgoing], checksum: bool) -> Tuple[torch.Tensor, List[Encoded]]:
    """One message of CPU regions, each encoded straight into it by the core."""
    head = head_bytes(len(regions), checksum)
    room = largest([r.new.numel() * r.new.element_size() for r in regions], checksum)
    msg = torch.empty(room, dtype=torch.uint8)
    patches = Patches()
    out: List[Encoded] = []
    crcs: List[int] = []
    at = head
    for r in regions:
        new, n = r.new, r.new.numel()
        size = n * new.element_size()
        in_place = r.keep is not None and r.keep is r.base
        if r.base is None:
            got = (0, [0, 0, 0, nblocks(n)], 0)
        else:
            got = delta_encode(new, r.base, msg, at + 8, update_base=in_place, smaller_only=True)
        mode = mode_of(r.base is not None, size, got[0], got[2])
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
                crcs.append(crc_of(msg[start:end]))
            elif r.keep is not None:
                crcs.append(crc_of(as_bytes(r.keep)))
            else:
                crcs.append(crc_of(as_bytes(flat(new))))
        at = aligned(end)
        patches.add(end, bytes(at - end))
        out.append(summary(mode, n, at - start, got[1], got[2]))
    patches.head(0, at, out, crcs, checksum)
    patches.write(msg)
    return msg[:at], out


# ----------------------------------------------------------------------------------------
# One region at a time (tests, and what the messages are made of)


def encode(new: torch.Tensor, base: Optional[torch.Tensor], torch_ops: Optional[bool] = None) -> Encoded:
    """One region as a message of its own would carry it: ``sections`` its bytes there (after
    the header). ``base`` is not changed."""
    [(msg, [encoded])] = encode_messages([[Outgoing(new, base)]], False, torch_ops)
    if encoded.mode != REGION_UNCHANGED:
        encoded.sections = [msg[head_bytes(1, False) :]]
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
        _apply_dense(reader, out)
    elif mode == REGION_BLOCKS:
        at, length = blocks_at(reader)
        scatter(reader.buffer.cpu(), at, length, out, what)
