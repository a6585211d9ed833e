"""A refit into a live engine model by the map its own loader gives (:mod:`.loader_map`).

Every engine rank records its loader once; the ranks exchange what they recorded (one
``all_gather_object`` the first time), and every rank derives the same destination layout per
checkpoint tensor from it:

- where each rank's pieces of a tensor are one box of it and the boxes are a DTensor split
  (each dim cut as ``torch.chunk`` cuts it, over the ranks that hold it, replicas included:
  tensor-parallel shards, replicated kv heads, an expert on its ranks), that layout, and the
  rank receives straight into the parameter's view;
- otherwise (the padded vocabulary's uneven rows, a tensor cut in several places on one rank),
  every holder receives the whole tensor into a scratch tensor kept for the next refit, and
  copies its pieces from it.

A piece that the same rank holds twice is copied from the first; the boxes the loader zeroes
(padding) are zeroed after every refit, so the parameters equal the loader's result exactly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .._core import AgreementError, ArgumentError, Layout, Replicate, Shard
from ..transfer.checks import collective, group_key
from . import loader_map as em

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]

# One rank's recording of one model for one checkpoint: model -> {checkpoint key: RankMap}.
_RECORDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Every rank's recordings, by the group and what each rank recorded: key -> EngineMap.
_GATHERED: Dict[tuple, "EngineMap"] = {}


@dataclass
class EngineMap:
    """Every rank's :class:`reshard.engine.loader_map.RankMap` of one engine, by group rank, and the
    destination layout that each checkpoint tensor gets from them."""

    ranks: Dict[int, em.RankMap]
    layouts: Dict[str, Tuple[Layout, bool]] = field(default_factory=dict)
    #: checkpoint name -> rank -> its pieces, indexed once (every refit reads it)
    by_name: Dict[str, Dict[int, List[em.Piece]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rank, recorded in sorted(self.ranks.items()):
            for piece in recorded.pieces:
                self.by_name.setdefault(piece.name, {}).setdefault(rank, []).append(piece)

    def holders(self, name: str) -> Dict[int, List[em.Piece]]:
        """The ranks that load some of ``name``, each with its pieces (empty: none does)."""
        return self.by_name.get(name, {})

    def layout(self, name: str, shape, dtype) -> Optional[Tuple[Layout, bool]]:
        """The destination layout of checkpoint tensor ``name`` and whether it is a split that
        lands in place (False: whole copies into scratch); None where no rank loads it."""
        if name not in self.layouts:
            holders = self.holders(name)
            if not holders:
                return None
            boxes = {}
            for rank, pieces in holders.items():
                own = {(p.offset, p.extent) for p in pieces}
                boxes[rank] = own.pop() if len(own) == 1 else None
            layout = None
            if all(box is not None for box in boxes.values()):
                layout = split_layout(tuple(shape), dtype, boxes)
            if layout is not None:
                self.layouts[name] = (layout, True)
            else:
                ranks = sorted(holders)
                self.layouts[name] = (Layout(shape, dtype, len(ranks), ranks, "R"), False)
        return self.layouts[name]


def _chunks(n: int, k: int) -> List[Tuple[int, int]]:
    size = -(-n // k)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(k)]


def split_layout(shape: Tuple[int, ...], dtype, boxes: Dict[int, Box]) -> Optional[Layout]:
    """The DTensor layout whose local region on each rank of ``boxes`` is its box (one mesh
    axis per cut dim, in dim order, then one of replicas), or None where there is none."""
    cuts = []
    for d, n in enumerate(shape):
        intervals = sorted({(o[d], o[d] + e[d]) for o, e in boxes.values()})
        if len(intervals) == 1:
            if intervals[0] != (0, n):
                return None
        elif intervals != _chunks(n, len(intervals)):
            return None
        cuts.append(intervals)
    cut = [d for d in range(len(shape)) if len(cuts[d]) > 1]
    by_box: Dict[Tuple[int, ...], List[int]] = {}
    for rank, (o, e) in boxes.items():
        by_box.setdefault(tuple(cuts[d].index((o[d], o[d] + e[d])) for d in cut), []).append(rank)
    pieces = 1
    for d in cut:
        pieces *= len(cuts[d])
    if len(by_box) != pieces or len({len(r) for r in by_box.values()}) != 1:
        return None
    copies = len(next(iter(by_box.values())))
    mesh = [len(cuts[d]) for d in cut] + ([copies] if copies > 1 or not cut else [])
    placements = [Shard(d) for d in cut] + ([Replicate()] if copies > 1 or not cut else [])
    ranks = [r for key in sorted(by_box) for r in sorted(by_box[key])]
    layout = Layout(shape, dtype, mesh, ranks, placements)
    for rank, box in boxes.items():
        if layout.local_region(rank) != box:
            return None
    return layout


def _recorded(model: torch.nn.Module, checkpoint) -> em.RankMap:
    key = tuple(checkpoint.items())
    kept = _RECORDED.setdefault(model, {})
    if key not in kept:
        kept.clear()
        kept[key] = em.record(model, checkpoint)
    return kept[key]


def engine_map(
    checkpoint: Dict[str, Tuple[int, ...]], token, model: Optional[torch.nn.Module], group, rank: int
) -> EngineMap:
    """Every rank's recording of its loader fed ``checkpoint`` (name -> full shape): this
    rank's from ``model``, None where it holds no engine; ``token`` names the training side
    (the same on every rank).

    A recording that fails on one rank fails on every rank: the ranks exchange it (or its
    error) before anything else; this rank raises its own :class:`ArgumentError`, the others
    an :class:`AgreementError` naming it."""
    mine: object = None
    if model is not None:
        try:
            mine = _recorded(model, checkpoint)
        except ArgumentError as e:
            mine = e
    # the ranks agree whether they all hold what they recorded last time
    token = (token, tuple(checkpoint.items()), None if model is None else id(model))
    key = (group_key(group), token)
    fresh = torch.tensor([0 if key in _GATHERED and not isinstance(mine, ArgumentError) else 1])
    with collective(group, "the engines' recordings"):
        dist.all_reduce(fresh, op=dist.ReduceOp.MAX, group=group)
    if int(fresh.item()) == 0:
        return _GATHERED[key]
    heard: List[object] = [None] * dist.get_world_size(group)
    said = str(mine) if isinstance(mine, ArgumentError) else mine
    with collective(group, "the engines' recordings"):
        dist.all_gather_object(heard, said, group=group)
    for other, what in enumerate(heard):
        if isinstance(what, str):
            if other == rank:
                raise mine  # type: ignore[misc]
            raise AgreementError(f"rank {other} could not record its engine's loader: {what}")
    gathered = EngineMap({r: m for r, m in enumerate(heard) if m is not None})
    for old in [k for k in _GATHERED if k[0] == key[0]]:
        del _GATHERED[old]
    _GATHERED[key] = gathered
    return gathered


def _shaped(view: torch.Tensor, extent: Tuple[int, ...]) -> torch.Tensor:
    """``view`` (a box of a parameter) as a view of ``extent``'s shape: the two differ only
    in dims of size 1."""
    if tuple(view.shape) == tuple(extent):
        return view
    out = view
    for d in reversed([d for d, n in enumerate(view.shape) if n == 1]):
        out = out.squeeze(d)
    for d, n in enumerate(extent):
        if n == 1:
            out = out.unsqueeze(d)
    return out


def _box(tensor: torch.Tensor, at, size) -> torch.Tensor:
    return tensor[tuple(slice(a, a + n) for a, n in zip(at, size))]


@dataclass
class Recorded:
    """A recorded refit's pairs for ``reshard_many_`` (or a session's ``prepare``), and what
    follows once they landed: the pieces copied locally, the zeroed boxes."""

    pairs: Dict[str, tuple]
    copies: List[Tuple[torch.Tensor, torch.Tensor]]
    zeros: List[torch.Tensor]
    skipped: List[str]
    #: whether a scratch tensor was made afresh (it holds nothing a delta could build on)
    fresh: bool = False

    def finish(self) -> None:
        with torch.no_grad():
            for dst, src in self.copies:
                dst.copy_(src)
            for box in self.zeros:
                box.zero_()


# Scratch tensors of whole checkpoint tensors, kept for the next refit: a delta refit writes
# only what changed into them. By (params' owner, name).
_SCRATCH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def recorded_pairs(
    emap: EngineMap,
    train: Mapping[str, Layout],
    src: Optional[Mapping[str, torch.Tensor]],
    model: Optional[torch.nn.Module],
    rank: int,
) -> Recorded:
    """The pairs of a refit of the training shards (``src``: this rank's local tensors by
    name; ``train``: every tensor's training layout, in order) into ``model``'s live
    parameters, by every rank's recording (:func:`engine_map`). Raises
    :class:`ArgumentError` naming what is wrong on this rank, having run no collective (the
    caller refuses it on every rank)."""
    mine = emap.ranks.get(rank)
    params = dict(model.named_parameters()) if model is not None else {}
    if mine is not None:
        for name, (shape, dtype) in mine.params.items():
            p = params.get(name)
            if p is None or tuple(p.shape) != shape or str(p.dtype).removeprefix("torch.") != dtype:
                raise ArgumentError(f"{name}: the engine's parameter changed since its loader was recorded")
    scratch = _SCRATCH.setdefault(model, {}) if model is not None else {}
    pairs: Dict[str, tuple] = {}
    copies, skipped, fresh = [], [], False
    for name, src_layout in train.items():
        holders = emap.holders(name)
        if not holders:
            skipped.append(name)
            continue
        dtypes = {emap.ranks[r].params[p.param][1] for r, ps in holders.items() for p in ps}
        if len(dtypes) != 1:
            raise ArgumentError(f"{name}: the engine loads it into parameters of dtypes {sorted(dtypes)}")
        dtype = getattr(torch, dtypes.pop())
        dst_layout, in_place = emap.layout(name, src_layout.shape, dtype)
        own = holders.get(rank, [])
        dst = None
        if own:
            if in_place:
                first = own[0]
                dst = _shaped(_box(params[first.param].data, first.at, first.size), first.extent)
                rest = own[1:]
                source = dst
            else:
                shape = tuple(src_layout.shape)
                kept = scratch.get(name)
                device = params[own[0].param].device
                if kept is None or (tuple(kept.shape), kept.dtype, kept.device) != (shape, dtype, device):
                    kept = scratch[name] = torch.empty(shape, dtype=dtype, device=device)
                    fresh = True
                dst, rest, source = kept, own, kept
            for p in rest:
                box = _shaped(_box(params[p.param].data, p.at, p.size), p.extent)
                offset = p.offset if not in_place else tuple(a - b for a, b in zip(p.offset, own[0].offset))
                copies.append((box, _box(source, offset, p.extent)))
        have = None
        if src_layout.local_shape(rank) is not None:
            have = src.get(name) if src is not None else None
            if have is None:
                raise ArgumentError(f"src: {name} is missing (rank {rank} holds its shard {src_layout.spec})")
        pairs[name] = (have, dst, src_layout, dst_layout)
    zeros = []
    if mine is not None:
        for param, at, size in mine.zeros:
            zeros.append(_box(params[param].data, at, size))
    return Recorded(pairs, copies, zeros, skipped, fresh)
