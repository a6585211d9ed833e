"""The engines' table: what each parameter of a :class:`reshard.Refit` is called and how it is
split in vLLM and SGLang (the table in :mod:`reshard.engine`): the engine's names of unfused
parameters and fp8 scales, the refit's name of an engine parameter, and the padded vocabulary
split with the rows it moves once more between the engine's ranks.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .._core import ArgumentError, Layout, Refit
from ..transfer.checks import TORCH_DTYPES

#: The parameters whose vocabulary the engines pad.
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")

ENGINES = ("vllm", "sglang")

#: Where vLLM (0.33 and later) keeps a MoE layer's routed experts: FusedMoE's ``w13_weight``
#: and ``w2_weight`` (and their scales) under ``.mlp.experts.routed_experts``; SGLang keeps
#: them under ``.mlp.experts``.
_EXPERTS, _ROUTED = ".mlp.experts.", ".mlp.experts.routed_experts."


def engine_key(name: str, engine: str) -> str:
    """``engine``'s name of a parameter the table names as SGLang does."""
    if engine == "vllm" and _EXPERTS in name:
        head, tail = name.rsplit(_EXPERTS, 1)
        if tail.startswith(("w13_", "w2_")):
            return head + _ROUTED + tail
    return name


def engine_name(name: str) -> str:
    """The engine's name of a refit's unfused parameter."""
    for down in (".mlp.experts.down_proj.weight", ".mlp.experts.down_proj"):
        if name.endswith(down):
            return name[: -len(down)] + ".mlp.experts.w2_weight"
    return name


def check_engine(engine: str, scale_name: str, vocab_pad: int) -> None:
    if engine not in ENGINES:
        raise ArgumentError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if scale_name not in ("weight_scale_inv", "weight_scale"):
        raise ArgumentError(f"scale_name: {scale_name!r} is neither weight_scale_inv nor weight_scale")
    if isinstance(vocab_pad, bool) or not isinstance(vocab_pad, int) or vocab_pad < 1:
        raise ArgumentError(f"vocab_pad: {vocab_pad!r} is not a positive integer")


def padded(layout: Layout, rank: int, vocab_pad: int) -> Optional[Tuple[int, int, int]]:
    """``(first, real, per)``: the padded split of the vocab rows on ``rank``: the first row it
    holds, how many real rows, the rows of its shard; None where dim 0 is not split alone."""
    vocab = layout.shape[0]
    dims = [i for i, p in enumerate(layout.placements) if p.is_shard()]
    if not dims:
        return None
    if any(p.dim != 0 for p in (layout.placements[i] for i in dims)) or len(dims) != 1:
        raise ArgumentError(f"{layout.spec}: the engines split the vocabulary over one mesh axis, on dim 0")
    axis = dims[0]
    tp = layout.mesh[axis]
    padded = -(-vocab // vocab_pad) * vocab_pad
    if padded % tp:
        raise ArgumentError(f"vocab_pad: the padded vocabulary {padded} does not split over tp={tp} ranks")
    per = padded // tp
    position = list(layout.ranks).index(rank)
    stride = 1
    for n in layout.mesh[axis + 1 :]:
        stride *= n
    index = (position // stride) % tp
    first = min(index * per, vocab)
    return first, min(per, vocab - first), per


def scale_params(refit: Refit, rank: int, scale_name: str) -> Dict[str, Tuple[str, tuple]]:
    """The fp8 scale shards an inference rank holds: weight (or fused buffer) -> (engine's
    scale name, (shape, dtype))."""
    if refit.quant is None:
        return {}
    from .. import quant_scale_dtype, quant_scale_shape

    dtype = TORCH_DTYPES[quant_scale_dtype(refit.quant)]
    out = {}
    fused = refit.scale_fused(rank)
    member_of = {m for ms in fused.values() for m, *_ in ms}
    for buffer, ms in fused.items():
        first = quant_scale_shape(refit.layouts(ms[0][0])[1], rank, refit.quant)
        shape = list(first)
        shape[ms[0][1]] = sum(extent for *_, extent in ms)
        out[buffer] = (_rename_scale(buffer, scale_name), (tuple(shape), dtype))
    for weight, (scale, _) in refit.scales.items():
        if weight in member_of:
            continue
        shape = quant_scale_shape(refit.layouts(weight)[1], rank, refit.quant)
        if shape is not None:
            out[weight] = (_rename_scale(engine_name(scale), scale_name), (tuple(shape), dtype))
    return out


def _rename_scale(name: str, scale_name: str) -> str:
    if scale_name == "weight_scale" and name.endswith("weight_scale_inv"):
        return name[: -len("_inv")]
    return name


def refit_name(refit_names, name: str, scale_name: str) -> str:
    """The refit's name of an engine's parameter (its own where they agree)."""
    name = name.replace(_ROUTED, _EXPERTS)
    if name.endswith(".mlp.experts.w2_weight"):
        prefix = name[: -len(".mlp.experts.w2_weight")]
        for down in (".mlp.experts.down_proj", ".mlp.experts.down_proj.weight"):
            if prefix + down in refit_names:
                return prefix + down
    if scale_name == "weight_scale" and name.endswith("weight_scale"):
        return name + "_inv"
    if name.endswith(".mlp.experts.w2_weight_scale_inv") or name.endswith(".mlp.experts.w2_weight_scale"):
        return name if name.endswith("_inv") else name + "_inv"
    return name


def _replica_peers(layout: Layout, rank: int) -> List[int]:
    """The ranks of ``rank``'s replica of a vocab-split layout, by their vocab shard."""
    axis = next(i for i, p in enumerate(layout.placements) if p.is_shard())
    ranks = list(layout.ranks)
    stride = 1
    for n in layout.mesh[axis + 1 :]:
        stride *= n
    position = ranks.index(rank)
    base = position - ((position // stride) % layout.mesh[axis]) * stride
    return [ranks[base + i * stride] for i in range(layout.mesh[axis])]


def vocab_moves(refit: Refit, vocab_pad: int):
    """The pieces of the vocab tables the refit's split leaves on another engine rank than
    the padded split wants: (name, piece name, source rank, its first row, destination rank,
    its first row, rows), the same on every rank."""
    names = set(refit.names)
    out = []
    for name in VOCAB:
        if name not in names:
            continue
        layout = refit.layouts(name)[1]
        if not any(p.is_shard() for p in layout.placements):
            continue
        for r in layout.ranks:
            first, real, _ = padded(layout, r, vocab_pad)
            offset, extent = layout.local_region(r)
            if (offset[0], extent[0]) == (first, real) or real == 0:
                continue
            for s in _replica_peers(layout, r):
                (s_first, *_), (s_rows, *_) = layout.local_region(s)
                lo, hi = max(first, s_first), min(first + real, s_first + s_rows)
                if lo < hi:
                    out.append((name, f"{name}@{lo}:{s}>{r}", s, lo - s_first, r, lo - first, hi - lo))
    return out
