"""The arguments of :func:`reshard.torch.reshard_many_` (and so of ``reshard_``), read on each
rank before the ranks agree on the job.

A rank's arguments can be wrong on that rank alone: a ``scale`` given without ``quant``, a
malformed pair, a Refit's fused buffer of the wrong shape, a name that no tensor has. Raising
there, on that rank only, would leave the others waiting in the group's agreement for a rank
that gave up, until the backend's timeout. So a rank whose arguments are bad takes part in the
agreement the others run on every call (:func:`reshard.transfer.checks.agree`), as a rank whose
tensors do not fit its shards does: every rank raises before any byte moves, the bad one its
own :class:`reshard.ArgumentError`, the others :class:`reshard.AgreementError` naming it. On
layouts the group has agreed on before (a refit every step), that agreement is one
``all_reduce`` of a few integers; the messages go through the group only when a rank failed.
"""

from __future__ import annotations

import functools
from typing import Dict, Mapping, NoReturn, Tuple, Union

import torch

from .._core import ArgumentError, Layout, Refit, ReshardError
from . import cast as _cast
from .checks import agree, control_device, member_narrowed


def read(pairs, rank: int, bucket_bytes, src, dst, quant, scales):
    """Checks this rank's arguments: ``(pairs, quant, scales)``, a Refit's parameters and
    scale shards taken from ``src`` and ``dst``, float casts converted at their sources
    (:func:`reshard.quant.inflight.read` then sorts them by how they move). Raises
    :class:`ArgumentError` naming the argument that is wrong."""
    for what, given in (("scales", scales), ("src", src), ("dst", dst)):
        if given is not None and not isinstance(given, Mapping):
            raise ArgumentError(f"{what}: expected a mapping of names to tensors, got {type(given).__name__}")
    if isinstance(pairs, Refit):
        if pairs.quant is not None:
            if quant is not None and quant != pairs.quant:
                raise ArgumentError(f"quant: {quant} differs from the refit's {pairs.quant}")
            if scales is not None:
                raise ArgumentError("scales: with a reshard.Refit, the scale shards come in dst")
            quant = pairs.quant
            dst, scales = _refit_scales(pairs, dst, rank)
        pairs = _refit_pairs(pairs, src, dst, rank)
    elif src is not None or dst is not None:
        raise ArgumentError("src, dst: given only with a reshard.Refit (pairs carry their tensors)")
    elif not isinstance(pairs, Mapping):
        raise ArgumentError(
            f"pairs: expected a mapping of names or a reshard.Refit, got {type(pairs).__name__}"
        )
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, float)) or not bucket_bytes > 0:
        raise ArgumentError(f"bucket_bytes: {bucket_bytes!r:.40} is invalid: it must be a positive number")
    for name, item in pairs.items():
        if not isinstance(name, str):
            raise ArgumentError(f"pairs: names are strings, got {name!r:.40} ({type(name).__name__})")
        if not isinstance(item, (tuple, list)) or len(item) != 4:
            raise ArgumentError(
                f"{name}: expected (src_local, dst_local, src_layout, dst_layout), got {item!r:.80}"
            )
        for what, layout in (("src_layout", item[2]), ("dst_layout", item[3])):
            if not isinstance(layout, Layout):
                label = f"{name}: " if name else ""
                raise ArgumentError(f"{label}{what}: expected a reshard.Layout, got {type(layout).__name__}")
    # float casts (f32 -> bf16): converted by their source ranks, then moved in one dtype
    pairs = _cast.cast_at_source(pairs, sorted(pairs))
    return pairs, quant, scales


def _refit_scales(refit, dst, rank: int):
    """Splits a rank's inference tensors into the weights (and other parameters) and the
    scale shards of the fp8 weights, by weight name; a fused scale buffer stands for its
    members' scales (each a view of its slice)."""
    dst = dict(dst or {})
    by_scale = {scale: weight for weight, (scale, _) in refit.scales.items()}
    scales = {}
    for buffer, members in refit.scale_fused(rank).items():
        tensor = dst.pop(buffer, None)
        if tensor is None:
            continue
        part = "{member}'s scales lie"
        scales.update(member_narrowed("dst", buffer, tensor, rank, members, "fused scale buffer", part))
    for name in list(dst):
        if name in by_scale:
            scales[by_scale[name]] = dst.pop(name)
    return dst, scales


def refuse(problem: Union[str, ReshardError], pairs, group, rank: int) -> NoReturn:
    """Raises ``problem`` (this rank's bad argument: an error, or the message of an
    :class:`reshard.ArgumentError`) on this rank and, through the group's agreement that the
    other ranks run on every call, an :class:`reshard.AgreementError` naming this rank on
    every other one."""
    error = ArgumentError(problem) if isinstance(problem, str) else problem

    def prepare():
        raise error

    tensors = []
    if isinstance(pairs, Mapping):
        tensors = [t for item in pairs.values() if isinstance(item, (tuple, list)) for t in item[:2]]
    try:
        # a fingerprint that no group ever agrees on: the refusal reaches every rank
        fingerprint = [("command", "refused"), ("problem", str(error))]
        agree(fingerprint, prepare, group, rank, device=control_device(group, tensors))
    except ReshardError as e:
        raise e from None
    except RuntimeError as e:
        # the group broke while this rank told the others; its own problem comes first
        raise error from e
    raise AssertionError("an agreement on a refused call cannot pass")


def member_views(refit: Refit, tensors: Mapping[str, torch.Tensor], rank: int, side: str, what: str):
    """The parameters' local tensors by name from a rank's own tensors by name, where a
    fused buffer (vLLM's ``qkv_proj``, ``gate_up_proj``, ``w13``) stands for its members:
    each member is the view of its slice of the buffer."""
    fused = _refit_fused(refit, rank, side)
    views: Dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in fused:
            views.update(member_narrowed(what, name, tensor, rank, fused[name]))
        else:
            views[name] = tensor
    return views


@functools.lru_cache(maxsize=16)
def _refit_layouts(refit: Refit) -> Tuple[Tuple[str, Layout, Layout], ...]:
    """Every parameter of ``refit`` with its layouts, read once per refit: the same layout
    objects at every call hash and compare fast as the key of the cached program."""
    return tuple((name, *refit.layouts(name)) for name in refit.names)


@functools.lru_cache(maxsize=64)
def _refit_fused(refit: Refit, rank: int, side: str):
    return refit.fused(rank, side)


def _unknown(what: str, name: str, refit: Refit, rank: int) -> ArgumentError:
    return ArgumentError(
        f"{what}: {name} is neither a parameter of {refit.model} nor a fused "
        f"buffer that rank {rank} holds (see Refit.names and Refit.fused)"
    )


def train_sources(refit: Refit, src, rank: int) -> Dict[str, torch.Tensor]:
    """A training rank's tensors by the refit's parameter names: fused buffers as their
    members' views, and a tensor that is another one under a second name (the tied
    ``lm_head.weight`` of a ``state_dict()``) left out; any other name is refused."""
    srcs = member_views(refit, src or {}, rank, "train", "src")
    names = set(refit.names)
    kept = {n: t for n, t in srcs.items() if n in names}
    for name, tensor in srcs.items():
        if name not in names and not any(_same_memory(t, tensor) for t in kept.values()):
            raise _unknown("src", name, refit, rank)
    return kept


def memory_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same one under two names (a tied ``lm_head.weight``)."""
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.stride())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return memory_key(a) == memory_key(b)


def _refit_pairs(refit: Refit, src, dst, rank: int):
    """Every parameter of ``refit`` as ``reshard_many_``'s pairs, with this rank's tensors."""
    srcs = train_sources(refit, src, rank)
    dsts = member_views(refit, dst or {}, rank, "infer", "dst")
    pairs = {}
    for name, src_layout, dst_layout in _refit_layouts(refit):
        pairs[name] = (srcs.pop(name, None), dsts.pop(name, None), src_layout, dst_layout)
    if dsts:
        raise _unknown("dst", sorted(dsts)[0], refit, rank)
    return pairs
