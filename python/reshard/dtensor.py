"""DTensors as :func:`reshard.torch.reshard_many_` takes them: a layout read from the DTensor
(its global shape and dtype, its device mesh and placements), its local tensor moved.

FSDP2 over a tensor-parallel model (``fully_shard`` on a 2-D mesh) gives its parameters
``_StridedShard(d, split_factor=k)`` on the data-parallel axis: torch shards them over the
tensor-parallel axis first, then over the data-parallel one (right to left). Each rank's box
is then the one of plain ``Shard(d)`` placements on the mesh with those axes swapped: the
strided axis moved after the ``Shard(d)`` axes whose sizes multiply to ``k``, and the ranks
permuted with it. :func:`layout_of` builds that layout and checks, against torch's own split
of the dim, that every rank's box is the one the DTensor holds; a split that is not a box
(uneven sizes that interleave) is refused naming the tensor.

A rank that holds no shard of a tensor knows no DTensor of it: where a layout is not given,
the ranks exchange what they hold (one ``all_gather_object`` per call) and take the layout
from a rank that has it.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ._core import AgreementError, ArgumentError, Layout, Refit
from .transfer.checks import collective


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it first)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh") and hasattr(t, "placements")


def local_of(t):
    """The local tensor of a DTensor (a view of its storage, written in place), or ``t``."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()


def _group_ranks(ranks: List[int], members: Optional[Tuple[Tuple[int, int], ...]]) -> List[int]:
    """Global ranks as ranks of the group whose members are ``members`` ((global rank, group
    rank) pairs; None: the world, global ranks as they are)."""
    if members is None:
        return ranks
    of = dict(members)
    out = []
    for r in ranks:
        if r not in of:
            raise ArgumentError(f"ranks: global rank {r} of the DTensor's mesh is not in the group")
        out.append(of[r])
    return out


def describe(dt) -> tuple:
    """What makes a DTensor's layout, in plain values (to send to other ranks): shape, dtype,
    mesh shape, global ranks in row-major order, and placements as ``(kind, dim, split)``."""
    placements = []
    for p in dt.placements:
        kind = type(p).__name__
        if kind == "_StridedShard":
            placements.append(("strided", int(p.dim), int(p.split_factor)))
        elif kind == "Shard":
            placements.append(("shard", int(p.dim), 1))
        elif kind == "Replicate":
            placements.append(("replicate", 0, 1))
        else:
            placements.append((kind, repr(p), 0))
    mesh = dt.device_mesh
    return (
        tuple(dt.shape),
        str(dt.dtype).replace("torch.", ""),
        tuple(mesh.shape),
        tuple(mesh.mesh.flatten().tolist()),
        tuple(placements),
    )


def layout_of(dt, group=None) -> Layout:
    """The :class:`reshard.Layout` of a DTensor (or of :func:`describe`'s tuple), with
    ``_StridedShard`` resolved to a permuted mesh; ranks of ``group`` (global if None)."""
    desc = describe(dt) if is_dtensor(dt) else dt
    # cached by the group's global ranks, not by the group: a group destroyed and made again
    # leaves nothing stale (and keeps no destroyed group alive)
    members = None
    if group is not None:
        members = tuple((r, dist.get_group_rank(group, r)) for r in dist.get_process_group_ranks(group))
    return _layout_of(desc, members)


@functools.lru_cache(maxsize=4096)
def _layout_of(desc: tuple, members: Optional[Tuple[Tuple[int, int], ...]]) -> Layout:
    shape, dtype, mesh, ranks, placements = desc
    order, kinds = _order(shape, mesh, placements)
    ranks_t = torch.tensor(ranks, dtype=torch.int64).reshape(mesh) if mesh else torch.tensor(ranks)
    permuted = ranks_t.permute(order).flatten().tolist() if mesh else list(ranks)
    layout = Layout(
        shape,
        dtype,
        [mesh[i] for i in order],
        _group_ranks(permuted, members),
        [kinds[i] for i in order],
    )
    if any(kind == "strided" for kind, _, _ in placements):
        _check_boxes(desc, layout, _group_ranks(list(ranks), members))
    return layout


def _order(shape, mesh, placements) -> Tuple[List[int], List[object]]:
    """The mesh axes' order that makes every placement a plain one, and the placements."""
    n = len(placements)
    kinds: List[object] = []
    for kind, dim, _ in placements:
        if kind in ("shard", "strided"):
            kinds.append(f"S({dim})")
        elif kind == "replicate":
            kinds.append("R")
        else:  # Partial and others: the layout's own refusal names them
            kinds.append(_torch_placement(kind, dim))
    order = list(range(n))
    for axis in range(n - 1, -1, -1):
        kind, dim, split = placements[axis]
        if kind != "strided":
            continue
        at = order.index(axis)
        product, last = 1, None
        for j in range(at + 1, n):
            other = order[j]
            okind, odim, _ = placements[other]
            if okind == "shard" and _norm(odim, shape) == _norm(dim, shape):
                product *= mesh[other]
                last = j
                if product >= split:
                    break
        if product != split or last is None:
            raise ArgumentError(
                f"placements: _StridedShard(dim={dim}, split_factor={split}) on mesh axis {axis} "
                f"of a tensor of shape {list(shape)}: the later mesh axes that shard dim {dim} "
                f"(sizes {[mesh[o] for o in order[at + 1 :] if placements[o][0] == 'shard']}) do "
                f"not multiply to {split}, so its shards are not boxes"
            )
        order.insert(last, order.pop(at))
    return order, kinds


def _norm(dim: int, shape) -> int:
    return dim + len(shape) if dim < 0 else dim


def _torch_placement(kind: str, text: str):
    """A torch placement object of class ``kind`` for the layout's refusal to name."""
    return type(kind, (), {"__repr__": lambda self: text})()


def _check_boxes(desc, layout: Layout, ranks: List[int]) -> None:
    """Every rank's box in ``layout`` is what torch's own split of each sharded dim gives."""
    shape, _, mesh, _, placements = desc
    for dim in {_norm(d, shape) for kind, d, _ in placements if kind in ("shard", "strided")}:
        want = _torch_split(shape[dim], tuple(mesh), tuple(placements), dim, len(shape))
        for pos, rank in enumerate(ranks):
            region = layout.local_region(rank)
            got = list(range(region[0][dim], region[0][dim] + region[1][dim]))
            if want[pos] != got:
                raise ArgumentError(
                    f"placements: {_text(placements)} over mesh {list(mesh)} of a tensor of shape "
                    f"{list(shape)}: rank {rank} holds indices {want[pos][:8]}... of dim {dim}, "
                    "not one contiguous piece (uneven sizes interleave the strided shards)"
                )


def _text(placements) -> str:
    out = []
    for kind, dim, split in placements:
        if kind == "strided":
            out.append(f"_StridedShard(dim={dim}, split_factor={split})")
        elif kind == "shard":
            out.append(f"Shard({dim})")
        else:
            out.append("Replicate()" if kind == "replicate" else str(dim))
    return "[" + ", ".join(out) + "]"


@functools.lru_cache(maxsize=256)
def _torch_split(size: int, mesh: tuple, placements: tuple, dim: int, ndim: int) -> List[List[int]]:
    """The indices of ``dim`` that each mesh position holds, as torch's placements split them
    (left to right over the mesh axes)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    positions = 1
    for n in mesh:
        positions *= n
    for pos in range(positions):
        coords, rest = [], pos
        for n in reversed(mesh):
            coords.append(rest % n)
            rest //= n
        coords.reverse()
        piece = torch.arange(size)
        for axis, (kind, d, split) in enumerate(placements):
            if kind not in ("shard", "strided") or _norm(d, [0] * ndim) != dim:
                continue
            p = Shard(0) if kind == "shard" else _StridedShard(0, split_factor=split)
            shards, _ = p._split_tensor(piece, mesh[axis], with_padding=False)
            piece = shards[coords[axis]]
        out.append(piece.tolist())
    return out


def gather_layouts(mine: Mapping[str, Optional[tuple]], group) -> Dict[str, tuple]:
    """Every name's DTensor description from the rank that holds it: ``mine`` maps names to
    this rank's description (None where it holds none). One ``all_gather_object``."""
    world = dist.get_world_size(group)
    heard: List[Optional[dict]] = [None] * world
    with collective(group, "the exchange of the DTensors' layouts"):
        dist.all_gather_object(heard, {k: v for k, v in mine.items() if v is not None}, group=group)
    merged: Dict[str, tuple] = {}
    for theirs in heard:
        for name, desc in (theirs or {}).items():
            merged.setdefault(name, desc)
    return merged


def unwrap_pairs(pairs, group, rank: int):
    """``reshard_many_``'s pairs with DTensors as local tensors, and their layouts (None in a
    pair) read from the DTensors, exchanged when some rank lacks them."""
    if not isinstance(pairs, Mapping):
        return pairs
    items = {n: p for n, p in pairs.items() if isinstance(p, (tuple, list)) and len(p) == 4}
    if not any(is_dtensor(t) for p in items.values() for t in p[:2]) and all(
        p[2] is not None and p[3] is not None for p in items.values()
    ):
        return pairs
    needed = any(p[2] is None or p[3] is None for p in items.values())
    descs: Dict[str, tuple] = {}
    if needed:
        mine = {}
        for name, p in items.items():
            for side, t in (("src", p[0]), ("dst", p[1])):
                mine[f"{side}:{name}"] = describe(t) if is_dtensor(t) else None
        descs = gather_layouts(mine, group)
    out = dict(pairs)
    for name, p in items.items():
        layouts = []
        for side, t, given in (("src", p[0], p[2]), ("dst", p[1], p[3])):
            if given is not None:
                layouts.append(given)
            elif is_dtensor(t):
                layouts.append(layout_of(t, group))
            elif f"{side}:{name}" in descs:
                layouts.append(layout_of(descs[f"{side}:{name}"], group))
            else:
                label = f"{name}: " if name else ""
                raise ArgumentError(
                    f"{label}{side}_layout: None, and no rank holds a DTensor of it: give the layout"
                )
        out[name] = (local_of(p[0]), local_of(p[1]), layouts[0], layouts[1])
    return out


def unwrap_refit(refit: Refit, tensors, rank: int, side: str, group):
    """A Refit's ``src`` or ``dst`` with DTensors as local tensors; a DTensor whose box on this
    rank is not the refit's is refused naming it."""
    if tensors is None or not isinstance(tensors, Mapping):
        return tensors
    if not any(is_dtensor(t) for t in tensors.values()):
        return tensors
    names = set(refit.names)
    out = {}
    for name, t in tensors.items():
        if is_dtensor(t) and name in names:
            theirs = layout_of(t, group)
            ours = refit.layouts(name)[0 if side == "src" else 1]
            if theirs.local_region(rank) != ours.local_region(rank):
                raise ArgumentError(
                    f"{name}: the DTensor holds {theirs.local_region(rank)} (offset, extent) on "
                    f"rank {rank} ({theirs.spec}), but the refit's {side} layout holds "
                    f"{ours.local_region(rank)} ({ours.spec})"
                )
        out[name] = local_of(t)
    return out


def state_dict_of(obj) -> Optional[Mapping[str, object]]:
    """A module's parameters and buffers by name, or a mapping as it is (None stays None)."""
    if obj is None or isinstance(obj, Mapping):
        return obj
    if isinstance(obj, torch.nn.Module):
        return dict(obj.state_dict(keep_vars=True))
    raise ArgumentError(
        f"expected a torch.nn.Module or a mapping of names to DTensors, got {type(obj).__name__}"
    )


def state_dict_pairs(src, dst, group) -> Dict[str, tuple]:
    """The pairs of a refit from one state dict of DTensors to another, every layout read from
    the DTensors (exchanged, as no rank holds both sides of every tensor)."""
    src, dst = state_dict_of(src), state_dict_of(dst)
    mine: Dict[str, Optional[tuple]] = {}
    problem = None
    for side, tensors in (("src", src), ("dst", dst)):
        for name, t in (tensors or {}).items():
            if not is_dtensor(t):
                problem = problem or (
                    f"{name}: {side} holds a {type(t).__name__}, not a DTensor: give its layout "
                    "in reshard_many_'s pairs"
                )
                continue
            mine[f"{side}:{name}"] = describe(t)
    # a rank's problem travels with its tensors, so that every rank raises, none waits
    mine["!problem"] = None if problem is None else (problem, dist.get_rank(group))
    descs = gather_layouts(mine, group)
    if "!problem" in descs:
        text, where = descs.pop("!problem")
        if problem == text:
            raise ArgumentError(text)
        raise AgreementError(f"nothing was moved: rank {where}: {text}")
    src_names = {k[4:] for k in descs if k.startswith("src:")}
    dst_names = {k[4:] for k in descs if k.startswith("dst:")}
    if src_names != dst_names:
        missing = sorted(src_names ^ dst_names)[0]
        which = "the source" if missing in dst_names else "the destination"
        raise ArgumentError(f"{missing}: no rank holds it in {which}: both sides must name the same tensors")
    pairs = {}
    for name in sorted(src_names):
        pairs[name] = (
            local_of((src or {}).get(name)),
            local_of((dst or {}).get(name)),
            layout_of(descs[f"src:{name}"], group),
            layout_of(descs[f"dst:{name}"], group),
        )
    return pairs
