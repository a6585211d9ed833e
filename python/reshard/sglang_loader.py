"""reshard as SGLang's custom weight loader: ``--custom-weight-loader reshard.sglang_loader.load``.

SGLang calls ``load(model, named_tensors)`` on every tensor-parallel rank when an
``update_weights_from_tensor`` request names it as its ``load_format`` (inside a
``begin_weight_update()`` / ``end_weight_update()`` bracket). Each call is one refit
(:func:`reshard.engine.refit_engine_`) into the model's live parameters, in place (their storage
is unchanged, so CUDA graphs stay valid), where SGLang's own ``load_weights`` would put each
slice (recorded from it once), fused ``qkv_proj`` / ``gate_up_proj`` / ``w13_weight`` and the
padded vocabulary included.

How the trainer's shards reach it: ``named_tensors`` are this rank's training shards by the
checkpoint's names (``model.layers.0.mlp.experts.gate_proj.weight`` stacked ``[E, ...]`` as the
trainer holds it), one request with every shard of the job. SGLang's own per-rank payload
carries them: for each name a ``LocalSerializedTensor`` whose ``values[r]`` is the serialized
shard of the trainer rank colocated with engine rank ``r`` (a CUDA IPC handle, no copy), which
SGLang unwraps on rank ``r`` before calling the loader. The trainer's layout is therefore over the
engine's own ranks, and the refit runs over SGLang's ``torch.distributed`` group (the default
one, or ``group=``).

What the job is (the checkpoint's config, the trainer's and the engine's parallelism, dtypes)
is set once per process, before the first request, by :func:`configure`; in the scheduler
processes that SGLang spawns itself, the first call reads it from the environment variable
``RESHARD_SGLANG_REFIT`` instead: a JSON object of :class:`reshard.Refit`'s arguments, with
an optional ``"options"`` object for ``refit_engine_`` (e.g. ``{"delta": true}``, or
``{"delta": {"model": "policy"}}`` for :class:`reshard.torch.Delta`'s fields)::

    RESHARD_SGLANG_REFIT='{"model": "/ckpt/config.json", "train": "fsdp=2", "infer": "tp=2",
                           "colocated": true, "train_dtype": "f32", "infer_dtype": "bf16"}'
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ._core import ArgumentError, Refit
from .engine import refit_engine_

#: The dotted path SGLang's ``--custom-weight-loader`` and ``load_format`` take.
LOADER = "reshard.sglang_loader.load"
#: The environment variable a process that was not configured reads the job from.
ENV = "RESHARD_SGLANG_REFIT"

_JOB: Dict[str, Any] = {}


def configure(refit: Refit, group=None, **options) -> None:
    """Sets the job of this process's refits: ``refit`` (colocated: every rank of ``group``
    both a trainer rank and an engine rank), the ``torch.distributed`` group they run over
    (default: the default group, SGLang's own), and ``refit_engine_``'s ``options``."""
    if not isinstance(refit, Refit):
        raise ArgumentError(f"refit: expected a reshard.Refit, got {type(refit).__name__}")
    _JOB.clear()
    _JOB.update(refit=refit, group=group, options=dict(options))


def _job() -> Dict[str, Any]:
    if not _JOB:
        spec = os.environ.get(ENV)
        if not spec:
            raise ArgumentError(
                f"{LOADER}: no refit configured in this process: call reshard.sglang_loader.configure "
                f"or set {ENV}"
            )
        try:
            args = json.loads(spec)
        except ValueError as e:
            raise ArgumentError(f"{ENV}: {spec!r:.80} is not JSON ({e})") from None
        if not isinstance(args, dict):
            raise ArgumentError(f"{ENV}: expected a JSON object of reshard.Refit's arguments")
        options = args.pop("options", None) or {}
        try:
            refit = Refit(**args)
            if isinstance(options.get("delta"), dict):  # {"delta": {"model": "policy"}}
                from .torch import Delta

                options["delta"] = Delta(**options["delta"])
        except TypeError as e:
            raise ArgumentError(f"{ENV}: {e}") from None
        configure(refit, **options)
    return _JOB


def load(model: torch.nn.Module, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Optional[Any]:
    """SGLang's custom weight loader: refits ``model`` in place from this rank's training
    shards ``named_tensors`` (every rank of the job calls it with its own). Returns what
    ``refit_engine_`` returns (a delta refit's report; SGLang ignores it)."""
    job = _job()
    src = dict(named_tensors)
    return refit_engine_(job["refit"], src, model, job["group"], engine_kind="sglang", **job["options"])
