"""Where an engine's own weight loader puts every slice of every checkpoint tensor.

No table per architecture: the loader is run once on probe data. Each parameter of the rank is
swapped for an int64 tensor of -1 (on the CPU, so the device holds nothing more), each
checkpoint tensor is given as the codes ``1 + base + flat index`` of its elements, and the
loader runs as it would on real weights (fused members, padding, replicated kv heads, experts
all included). Afterwards every element of every parameter says which checkpoint element it
holds (a code above 0), that the loader zeroed it (0: the vocabulary's padding rows), or that
no checkpoint tensor fills it (-1: refused, naming the parameter). The parameters get their
own tensors back (same storage), so recording changes nothing of the model.

The codes are cut into boxes (:class:`Piece`: a box of a checkpoint tensor at a box of a
parameter, the same elements in the same order), which is all a refit needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .._core import ArgumentError

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, extent)

# Rows of a box checked against their expected codes at once: bounds the recording's memory.
_CHECK_ELEMENTS = 1 << 22
# The most pieces one checkpoint tensor may make in one parameter: more is a loader that
# permutes elements (a transpose, a gather), which a refit of boxes does not express.
MAX_PIECES = 256


@dataclass(frozen=True)
class Piece:
    """A box of checkpoint tensor ``name`` (``offset``, ``extent``) that the loader puts at box
    (``at``, ``size``) of engine parameter ``param``: the same elements in the same row-major
    order, the two extents equal but for dims of size 1."""

    name: str
    offset: Tuple[int, ...]
    extent: Tuple[int, ...]
    param: str
    at: Tuple[int, ...]
    size: Tuple[int, ...]


@dataclass(frozen=True)
class RankMap:
    """What one rank's loader does with a checkpoint: its pieces, the boxes it sets to zero,
    and its parameters' shapes and dtypes (by name)."""

    pieces: Tuple[Piece, ...]
    zeros: Tuple[Tuple[str, Tuple[int, ...], Tuple[int, ...]], ...]
    params: Dict[str, Tuple[Tuple[int, ...], str]]


_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)(?:\.weight)?$")
# transformers 5's stacked experts with gate and up in one tensor, [E, 2 I, H]
_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj(?:\.weight)?$")


def as_checkpoint(name: str, tensor: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """``tensor`` as a checkpoint on disk holds it: stacked routed experts (``[E, out, in]``,
    as trainers hold them) one tensor per expert (``...experts.{e}.gate_proj.weight``), the
    names every engine's loader reads; transformers 5's ``experts.gate_up_proj``
    (``[E, 2 I, H]``) as each expert's ``gate_proj`` (the first ``I`` rows) and ``up_proj``;
    any other tensor as it is."""
    if tensor.dim() == 3:
        fused = _GATE_UP.match(name)
        if fused is not None and tensor.shape[1] % 2 == 0:
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{fused.group(1)}.{e}.gate_proj.weight", tensor[e, :half]
                yield f"{fused.group(1)}.{e}.up_proj.weight", tensor[e, half:]
            return
    stacked = _STACKED.match(name) if tensor.dim() == 3 else None
    if stacked is None:
        yield name, tensor
        return
    prefix, proj = stacked.groups()
    for e in range(tensor.shape[0]):
        yield f"{prefix}.{e}.{proj}.weight", tensor[e]


def record(
    model: torch.nn.Module,
    checkpoint: Mapping[str, Sequence[int]],
    load: Optional[Callable[[Iterable[Tuple[str, torch.Tensor]]], object]] = None,
) -> RankMap:
    """Runs ``model``'s loader (``load``, default ``model.load_weights``) once on probe data
    for ``checkpoint`` (name -> full shape) and returns where each element landed."""
    load = load if load is not None else getattr(model, "load_weights", None)
    if load is None:
        raise ArgumentError(f"model: a {type(model).__name__} has no load_weights; give load=")
    names = list(checkpoint)
    shapes = [tuple(int(n) for n in checkpoint[name]) for name in names]
    bases = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in shapes])
    params = dict(model.named_parameters())
    info = {name: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in params.items()}

    fed: List[str] = []

    def probes() -> Iterator[Tuple[str, torch.Tensor]]:
        for i, (name, shape) in enumerate(zip(names, shapes)):
            first = int(bases[i]) + 1
            codes = torch.arange(first, first + int(bases[i + 1] - bases[i])).view(shape)
            for given, probe in as_checkpoint(name, codes):
                fed.append(given)
                yield given, probe

    saved = {}
    try:
        for name, p in params.items():
            saved[name] = (p.data, p.requires_grad)
            p.requires_grad_(False)
            p.data = torch.full(tuple(p.shape), -1, dtype=torch.int64)
        with torch.no_grad():
            try:
                load(probes())
            except (KeyError, ValueError, AssertionError, IndexError, RuntimeError, AttributeError) as e:
                last = f" at {fed[-1]}" if fed else ""
                raise ArgumentError(
                    f"the engine's loader ({type(model).__name__}.load_weights) refused the trainer's "
                    f"tensors{last}: {type(e).__name__}: {str(e)[:300]} (a name or shape the loader "
                    "does not take: export the tensors as the engine's checkpoint names them)"
                ) from None
        codes = {name: p.data.numpy() for name, p in params.items()}
    finally:
        for name, (data, grad) in saved.items():
            params[name].data = data
            params[name].requires_grad_(grad)

    pieces: List[Piece] = []
    zeros = []
    unfilled = []
    for param, code in codes.items():
        if code.dtype != np.int64:
            raise ArgumentError(f"{param}: the loader replaced the parameter's tensor ({code.dtype})")
        missing = int((code == -1).sum())
        if missing:
            unfilled.append((param, missing, code.size))
            continue
        for at, size in _mask_boxes(code == 0):
            zeros.append((param, at, size))
        filled = code[code > 0]
        if filled.size == 0:
            continue
        ids = np.unique(np.searchsorted(bases, filled - 1, side="right") - 1)
        for i in ids:
            lo, hi = int(bases[i]), int(bases[i + 1])
            found: List[Piece] = []
            _pieces(code, lo, hi, names[i], shapes[i], param, found)
            pieces += found
    if unfilled:
        raise ArgumentError(_unfilled(unfilled, names))
    return RankMap(tuple(pieces), tuple(zeros), info)


_LAYER = re.compile(r"\.(\d+)\.")


def _unfilled(unfilled, names: Sequence[str]) -> str:
    """Why parameters are left unfilled, naming the side: a tensor the trainer lacks (another
    layer has it, or the trainer holds nothing of the parameter's module) is the trainer's;
    a parameter whose module the trainer feeds but the loader leaves empty is the engine's."""
    given = set(names)
    lacking, engines = [], []
    for param, missing, size in unfilled:
        what = f"{param} ({missing} of {size} elements)"
        layer = _LAYER.search(param)
        absent = []
        if layer is not None:
            for name in names:
                other = _LAYER.search(name)
                if other is None or other.group(1) == layer.group(1):
                    continue
                if name[: other.start()] != param[: layer.start()]:
                    continue
                mine = name[: other.start()] + f".{layer.group(1)}." + name[other.end() :]
                if mine not in given and mine not in absent:
                    absent.append(mine)
        parts = param.split(".")
        module, leaf = ".".join(parts[:-2]), parts[-1]
        related = [n for n in names if module and n.startswith(module + ".") and n.endswith("." + leaf)]
        if absent and missing < size:
            lacking.append(f"{what}: the trainer holds no {', '.join(absent[:3])}, which other layers have")
        elif absent or not related:
            detail = ", ".join(absent[:3]) if absent else (f"{module}.*.{leaf}" if module else param)
            detail = "no " + detail
            lacking.append(f"{what}: the trainer holds {detail}")
        else:
            engines.append(f"{what}, though the trainer gives {', '.join(related[:3])}")
    parts = []
    if lacking:
        parts.append(
            "the trainer's tensors leave engine parameters unfilled: "
            + "; ".join(lacking[:4])
            + (f"; and {len(lacking) - 4} more" if len(lacking) > 4 else "")
        )
    if engines:
        parts.append(
            "the engine's loader fills no value into "
            + "; ".join(engines[:4])
            + (f"; and {len(engines) - 4} more" if len(engines) > 4 else "")
        )
    return "; ".join(parts) + ": a refit cannot derive where these parameters' weights come from"


def _bounding(mask: np.ndarray) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    if not mask.any():
        return None
    lo, hi = [], []
    for axis in range(mask.ndim):
        other = tuple(a for a in range(mask.ndim) if a != axis)
        hit = np.flatnonzero(mask.any(axis=other) if other else mask)
        lo.append(int(hit[0]))
        hi.append(int(hit[-1]) + 1)
    return tuple(lo), tuple(hi)


def _slices(lo, hi) -> Tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(lo, hi))


def _halves(lo, hi):
    axis = max(range(len(lo)), key=lambda a: hi[a] - lo[a])
    mid = (lo[axis] + hi[axis]) // 2
    return (lo, hi[:axis] + (mid,) + hi[axis + 1 :]), (lo[:axis] + (mid,) + lo[axis + 1 :], hi)


def _mask_boxes(mask: np.ndarray, origin: Tuple[int, ...] = ()) -> List[Box]:
    """``mask``'s true elements as boxes (offset, extent), offsets from ``origin``."""
    origin = origin or (0,) * mask.ndim
    bound = _bounding(mask)
    if bound is None:
        return []
    lo, hi = bound
    if mask[_slices(lo, hi)].all():
        return [(tuple(o + a for o, a in zip(origin, lo)), tuple(b - a for a, b in zip(lo, hi)))]
    out = []
    for a, b in _halves(lo, hi):
        sub = mask[_slices(a, b)]
        out += _mask_boxes(sub, tuple(o + x for o, x in zip(origin, a)))
    return out


def _squeezed(shape) -> Tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _pieces(code, lo_code, hi_code, name, shape, param, out: List[Piece], origin=None) -> None:
    """The pieces of checkpoint tensor ``name`` (codes ``(lo_code, hi_code]``) in ``code``."""
    origin = origin or (0,) * code.ndim
    mask = (code > lo_code) & (code <= hi_code)
    bound = _bounding(mask)
    if bound is None:
        return
    lo, hi = bound
    box = code[_slices(lo, hi)]
    if mask[_slices(lo, hi)].all():
        piece = _as_piece(box, lo_code, name, shape)
        if piece is not None:
            offset, extent = piece
            at = tuple(o + a for o, a in zip(origin, lo))
            out.append(Piece(name, offset, extent, param, at, tuple(box.shape)))
            return
        slabs = _slabs(box, lo_code, name, shape, param, tuple(o + a for o, a in zip(origin, lo)))
        if slabs is not None:
            out += slabs
            return
    if len(out) >= MAX_PIECES:
        raise ArgumentError(
            f"{param}: the engine's loader puts {name} there in more than {MAX_PIECES} pieces "
            "(its elements permuted: a transpose or a gather), which a refit does not derive"
        )
    for a, b in _halves(lo, hi):
        shifted = tuple(o + x for o, x in zip(origin, a))
        _pieces(code[_slices(a, b)], lo_code, hi_code, name, shape, param, out, shifted)


def _slabs(box, lo_code, name, shape, param, at) -> Optional[List[Piece]]:
    """``box`` cut into slabs one element thick along one axis (the last that works), each a
    piece: a loader that transposes puts a checkpoint row in a column. None where no axis
    does."""
    for axis in reversed(range(box.ndim)):
        if not 1 < box.shape[axis] <= MAX_PIECES:
            continue
        found = []
        for i in range(box.shape[axis]):
            slab = np.take(box, [i], axis=axis)
            piece = _as_piece(slab, lo_code, name, shape)
            if piece is None:
                break
            where = tuple(a + (i if d == axis else 0) for d, a in enumerate(at))
            found.append(Piece(name, piece[0], piece[1], param, where, tuple(slab.shape)))
        else:
            return found
    return None


def _as_piece(box: np.ndarray, lo_code: int, name: str, shape) -> Optional[Box]:
    """The box of the checkpoint tensor whose elements ``box`` holds in row-major order, or
    None where it holds anything else (a transpose, a gather)."""
    flat = box.reshape(-1)
    first, last = int(flat[0]) - lo_code - 1, int(flat[-1]) - lo_code - 1
    offset = np.unravel_index(first, shape)
    end = np.unravel_index(last, shape)
    extent = tuple(int(e) - int(o) + 1 for o, e in zip(offset, end))
    if any(n <= 0 for n in extent) or int(np.prod(extent, dtype=np.int64)) != flat.size:
        return None
    if _squeezed(extent) != _squeezed(box.shape):
        return None
    strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    rows = box.reshape(extent[0], -1) if extent else flat.reshape(1, 1)
    inner = np.zeros(1, dtype=np.int64)
    for d in range(1, len(extent)):
        inner = (inner[:, None] + np.arange(extent[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    start = lo_code + 1 + sum(int(o) * s for o, s in zip(offset, strides))
    step = max(1, _CHECK_ELEMENTS // max(1, inner.size))
    for r in range(0, rows.shape[0], step):
        n = min(step, rows.shape[0] - r)
        want = (
            start
            + (np.arange(r, r + n, dtype=np.int64) * (strides[0] if extent else 0))[:, None]
            + inner[None, :]
        )
        if not np.array_equal(rows[r : r + n], want):
            return None
    return tuple(int(o) for o in offset), extent
