"""What every part of the torch executor checks alike: the torch dtype of a layout, a rank's
tensors against its shards, and the agreement of the group on the job before any byte moves
(the command line's plan agreement, for torch). Below the executor (:mod:`reshard.torch`) and
its helpers, which all use it.
"""

from __future__ import annotations

import collections
import hashlib
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._core import Layout, ReshardError

_TORCH_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in [
        ("bool", "bool"),
        ("u8", "uint8"),
        ("i8", "int8"),
        ("fp8e4m3", "float8_e4m3fn"),
        ("fp8e5m2", "float8_e5m2"),
        ("bf16", "bfloat16"),
        ("f16", "float16"),
        ("i16", "int16"),
        ("u16", "uint16"),
        ("f32", "float32"),
        ("i32", "int32"),
        ("u32", "uint32"),
        ("f64", "float64"),
        ("i64", "int64"),
        ("u64", "uint64"),
    ]
    if hasattr(torch, attr)
}

def torch_dtype(layout: Layout) -> torch.dtype:
    """The torch dtype of a layout's elements."""
    try:
        return _TORCH_DTYPES[layout.dtype]
    except KeyError:
        raise ReshardError(
            f"dtype {layout.dtype} has no torch equivalent in torch {torch.__version__}"
        ) from None


def _check_tensor(
    name: str, what: str, tensor, layout: Layout, shape: Optional[Tuple[int, ...]], rank: int
) -> None:
    """A rank in the layout gives a tensor of its shard's shape and dtype; others give None."""
    if shape is None:
        if tensor is not None:
            raise ReshardError(
                f"{name}{what}: rank {rank} is not part of this layout ({layout.spec}), "
                "yet a tensor was given for it (pass None)"
            )
        return
    dtype = torch_dtype(layout)
    if not isinstance(tensor, torch.Tensor):
        raise ReshardError(
            f"{name}{what}: rank {rank} holds a shard of shape {shape} ({layout.dtype}) in "
            f"{layout.spec}, but {type(tensor).__name__} was given instead of a tensor"
        )
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ReshardError(
            f"{name}{what}: rank {rank} holds a shard of shape {shape} ({layout.dtype}) in "
            f"{layout.spec}, but the tensor given has shape {tuple(tensor.shape)} and dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}"
        )


def _check_ranks(name: str, what: str, layout: Layout, world: int) -> None:
    beyond = [r for r in layout.ranks if r >= world]
    if beyond:
        raise ReshardError(
            f"{name}{what}: rank {beyond[0]} of {layout.spec} is not in the process group (size {world})"
        )


def _fingerprint(command: str, pairs, names: List[str], **options) -> List[Tuple[str, str]]:
    """What this rank is about to run, as (field, value) pairs in a fixed order: every rank
    of the group must run alike (the command line's plan agreement, for torch)."""
    fields = [("command", command)]
    fields += [(k, repr(v)) for k, v in sorted(options.items())]
    for name in names:
        label = f"{name}: " if name else ""
        for what, layout in (("src_layout", pairs[name][2]), ("dst_layout", pairs[name][3])):
            shape = ",".join(str(n) for n in layout.shape)
            fields.append((f"{label}{what}", f"{layout.spec} shape={shape} dtype={layout.dtype}"))
    return fields


# The fingerprints every rank of a group has agreed on, oldest first: a job's later calls
# with the same tensors and layouts (a refit every step) skip the exchange. Every rank of a
# group that agreed sees the same calls in the same order, so all skip alike.
_AGREED: "collections.OrderedDict[Tuple[object, str], None]" = collections.OrderedDict()
_AGREED_MAX = 4096


def _first_difference(ours, theirs) -> Optional[Tuple[str, str, str]]:
    """The first field whose value differs: (field, ours, theirs), "(none)" where absent."""
    mine, other = dict(ours), dict(theirs)
    for field, _ in list(ours) + list(theirs):
        a, b = mine.get(field, "(none)"), other.get(field, "(none)")
        if a != b:
            return field, a, b
    return None


def _agree(fingerprint, prepare, group, rank: int):
    """Runs ``prepare`` (this rank's local checks and plans) and, on a fingerprint this group
    has not agreed on yet, compares every rank's fingerprint and outcome through the group:
    a difference or a rank's bad input raises :class:`ReshardError` on every rank (its own
    message on the rank with bad input, naming that rank elsewhere), before any byte moves."""
    digest = hashlib.blake2b(repr(fingerprint).encode(), digest_size=16).hexdigest()
    key = (group, digest)
    if key in _AGREED:
        _AGREED.move_to_end(key)
        return prepare()
    try:
        result, problem = prepare(), None
    except ReshardError as e:
        result, problem = None, str(e)
    heard = [None] * dist.get_world_size(group)
    dist.all_gather_object(heard, (digest, problem), group=group)
    if problem is not None:
        raise ReshardError(problem)  # this rank's own bad input, as its checks said it
    for r, (_, their_problem) in enumerate(heard):
        if their_problem is not None:
            raise ReshardError(f"nothing was moved: rank {r}: {their_problem}")
    if any(d != digest for d, _ in heard):
        # rare: the whole fingerprints, to name what differs
        everyone = [None] * len(heard)
        dist.all_gather_object(everyone, fingerprint, group=group)
        for r, theirs in enumerate(everyone):
            diff = _first_difference(everyone[0], theirs)
            if diff is not None:
                field, ours, other = diff
                raise ReshardError(
                    "the ranks disagree on the job, so nothing was moved: "
                    f"rank {r} runs {field} {other}; rank 0 runs {field} {ours}"
                )
    _AGREED[key] = None
    if len(_AGREED) > _AGREED_MAX:
        _AGREED.popitem(last=False)
    return result


def _group_rank(group) -> Tuple[int, int]:
    """This process's rank in ``group`` (the default group when None), and the group's size."""
    if not dist.is_initialized():
        raise ReshardError("torch.distributed is not initialized (call init_process_group first)")
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return dist.get_rank(group), dist.get_world_size(group)
