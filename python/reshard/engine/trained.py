"""The training side of an engine refit read from the trainer's own tensors: no model family
and no config.

Each rank says what it holds (one ``all_gather_object``): a DTensor's global shape, dtype,
mesh and placements (FSDP2, tensor parallelism, HSDP, ``_StridedShard``), or a plain tensor's
shape and dtype (a whole tensor, as a trainer without sharding holds it: the ranks that hold
one of a name hold replicas, checked on a sample of their elements: shards passed as plain
tensors are refused, not taken for whole ones). Every rank then builds the same
:class:`Trained`: each tensor's name, global shape, dtype and layout over the group's ranks,
in the order the ranks gave them. Where the ranks disagree (two DTensors of one name that
differ, a DTensor beside a plain tensor, two plain tensors of other shapes), every rank
refuses the call naming the tensor and the ranks.

A tensor that is another one under a second name (the tied ``lm_head.weight`` a
``state_dict()`` holds beside the embedding) is left out: the engine loads the one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .._core import AgreementError, ArgumentError, Layout
from ..dtensor import describe, is_dtensor, layout_of, local_of, state_dict_of
from ..transfer.arguments import memory_key
from ..transfer.checks import collective


@dataclass(frozen=True)
class Trained:
    """Every tensor the trainer ranks hold, by name: its layout over the group's ranks (its
    global shape and dtype with it). The same on every rank of the group."""

    tensors: Tuple[Tuple[str, Layout], ...]

    @property
    def names(self) -> List[str]:
        return [name for name, _ in self.tensors]

    def layout(self, name: str) -> Layout:
        return dict(self.tensors)[name]

    @property
    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {name: tuple(layout.shape) for name, layout in self.tensors}


def _aliases(tensors: Mapping[str, object]) -> Dict[str, str]:
    """Names whose tensor is an earlier name's (same storage, shape and strides) -> that name."""
    seen: Dict[tuple, str] = {}
    out = {}
    for name, t in tensors.items():
        local = local_of(t)
        if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0:
            continue
        key = memory_key(local)
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def _describe(name: str, t) -> tuple:
    if is_dtensor(t):
        return ("dtensor", describe(t))
    if not isinstance(t, torch.Tensor):
        return ("refuse", f"src: {name} is a {type(t).__name__}, not a tensor or a DTensor")
    if t.device.type == "meta":
        return ("refuse", f"src: {name} is a meta tensor (it holds no values)")
    return ("whole", tuple(t.shape), str(t.dtype).removeprefix("torch."), _sample(t))


# Elements of a plain tensor compared across the ranks that hold one of a name.
_SAMPLED = 64


def _sample(t: torch.Tensor) -> bytes:
    """A few of ``t``'s elements, evenly spaced, as bytes: replicas hold the same, while
    shards passed as plain tensors (which would be taken for whole ones) differ."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    at = torch.linspace(0, flat.numel() - 1, min(_SAMPLED, flat.numel()), device=flat.device).long()
    return flat[at].cpu().contiguous().view(torch.uint8).numpy().tobytes()


def trained(src, group, rank: int) -> Tuple[Trained, Dict[str, torch.Tensor]]:
    """The :class:`Trained` of every rank's ``src`` (this rank's tensors by name: DTensors or
    whole tensors; a module's ``state_dict()``; None on a rank that trains nothing), and this
    rank's local tensors by name. Every rank of ``group`` calls it; a refusal reaches every
    rank (this rank raises :class:`ArgumentError` for its own problem, the others an
    :class:`AgreementError` naming it)."""
    tensors = state_dict_of(src) or {}
    if not isinstance(tensors, Mapping):
        raise ArgumentError(f"src: expected a mapping of names to tensors, got {type(src).__name__}")
    aliases = _aliases(tensors)
    mine: Dict[str, tuple] = {}
    problem: Optional[str] = None
    for name, t in tensors.items():
        if not isinstance(name, str):
            problem = problem or f"src: a name is {type(name).__name__} {name!r}, not a string"
            continue
        if name in aliases:
            continue
        desc = _describe(name, t)
        if desc[0] == "refuse":
            problem = problem or desc[1]
            continue
        mine[name] = desc
    heard: List[object] = [None] * dist.get_world_size(group)
    with collective(group, "the exchange of the trainer's tensors"):
        dist.all_gather_object(heard, (problem, mine), group=group)
    for other, (theirs, _) in enumerate(heard):
        if theirs is not None:
            if other == rank:
                raise ArgumentError(theirs)
            raise AgreementError(f"nothing was moved: rank {other}: {theirs}")
    layouts = _merge([held for _, held in heard], group)
    local = {name: local_of(tensors[name]) for name in mine}
    return Trained(tuple(layouts.items())), local


def _merge(heard: List[Dict[str, tuple]], group) -> Dict[str, Layout]:
    """Every name's layout from what the ranks said they hold."""
    holders: Dict[str, List[Tuple[int, tuple]]] = {}
    for rank, held in enumerate(heard):
        for name, desc in held.items():
            holders.setdefault(name, []).append((rank, desc))
    out: Dict[str, Layout] = {}
    for name, said in holders.items():
        (first_rank, first), *rest = said
        for other, desc in rest:
            if desc[:3] == first[:3] and desc != first:
                raise ArgumentError(
                    f"src: {name}: ranks {first_rank} and {other} hold plain tensors of one shape "
                    "but other values: a plain tensor is a whole one (replicas hold the same); "
                    "pass shards as DTensors, or give a Refit with their layout"
                )
            if desc != first:
                raise ArgumentError(
                    f"src: {name}: rank {first_rank} holds {_shown(first)}, rank {other} {_shown(desc)}: "
                    "the trainer ranks must hold one tensor's shards (DTensors of one mesh) or replicas"
                )
        if first[0] == "dtensor":
            layout = layout_of(first[1], group)
            holding = {r for r, _ in said}
            stray = sorted(set(layout.ranks) - holding)
            if stray:
                raise ArgumentError(
                    f"src: {name}: a DTensor on the ranks {sorted(layout.ranks)}, but rank {stray[0]} "
                    "passes none: every rank of its mesh passes its shard"
                )
            out[name] = layout
        else:
            _, shape, dtype, _ = first
            ranks = [r for r, _ in said]
            out[name] = Layout(shape, dtype, len(ranks), ranks, "R")
    return out


def _shown(desc: tuple) -> str:
    if desc[0] == "dtensor":
        shape, dtype, mesh, _ranks, placements = desc[1]
        return f"a DTensor {list(shape)} {dtype} on mesh {list(mesh)} {[p[0] for p in placements]}"
    return f"a tensor {list(desc[1])} {desc[2]}"
