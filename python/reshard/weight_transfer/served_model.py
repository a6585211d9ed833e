"""A served vLLM model beside the model as its loader built it.

A model that ``vllm serve`` runs is not the model its loader filled: after loading, vLLM's
post-load step (``process_weights_after_loading``) repacks and derives (the CPU build hands
its linear layers' weights to oneDNN and leaves empty parameters behind; MLA layers add
``W_UV`` / ``W_UK_T``; fp8 methods requantize). A refit by the loader's map cannot write into
what serves, and running the loader again on the served model fails.

:class:`ServedModel` keeps, beside the live model, a *mirror* in the loader's format, made
from the metadata vLLM itself records for its reloads (``record_metadata_for_reloading``,
the parameters as ``initialize_model`` made them, their ``weight_loader`` included): every
module shallow-copied, its parameters and buffers its own. The refit lands in the mirror by
the loader's recorded map (so it is exactly what ``load_weights`` would write), and
:meth:`ServedModel.derive` then does what vLLM's own layerwise reload does for each layer:
the layer's post-load step on the new loader-format tensors, and the results copied into the
live tensors in place (their storage unchanged) or, for what is no tensor (a repacked
kernel's handle), set on the live layer. The mirror is the staging: the live model changes
only in :meth:`derive`.

A served model whose post-load step cannot be followed this way (a layer without recorded
metadata that holds parameters, a processed tensor whose shape or dtype differs from the live
one, a model-level post-load hook) is refused at :class:`ServedModel`'s construction, naming
the parameter.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

from .._core import ArgumentError

# Module attributes that are the module's structure, never a post-load result.
_STRUCTURE = {
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "training",
    "_reshard_method_state",
}
# What a quantization method keeps between post-load steps (set aside while one runs again).
_METHOD_STATE = ("moe_kernel",)


def _reload_api() -> SimpleNamespace:
    """vLLM's reload metadata and the post-load dispatch it follows (vLLM 0.32, 0.33)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    return SimpleNamespace(
        recorded=LAYERWISE_INFO,
        materialize=materialize_meta_tensor,
        restore_refs=restore_layer_refs,
        quantize_base=QuantizeMethodBase,
        deferred=is_deferred_attention_layer,
    )


def _bare_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` shallow-copied, with dicts of parameters, buffers and children of its own."""
    out = copy.copy(module)
    out._parameters = {}
    out._buffers = {}
    out._modules = {}
    out._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    return out


def _seeded(tensor: torch.Tensor, live: Optional[torch.Tensor]) -> torch.Tensor:
    """A mirror tensor made from vLLM's metadata, holding what the live one holds where that
    is in the same format (a norm's weight), zeros where the post-load step replaced it."""
    with torch.no_grad():
        if live is not None and tuple(live.shape) == tuple(tensor.shape) and live.dtype == tensor.dtype:
            tensor.copy_(live)
        else:
            tensor.zero_()
    return tensor


def _own_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` of the same class, with its attributes (``weight_loader``, ...)."""
    out = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=False)
        out.__class__ = tensor.__class__
    out.__dict__.update(getattr(tensor, "__dict__", {}))
    return out


class ServedModel:
    """The live model of a vLLM worker and its mirror in the loader's format (see the module's
    documentation). ``mirror`` is an ``nn.Module`` whose ``load_weights`` and parameters are
    the loader's: a refit by the recorded loader map writes into it; :meth:`derive` carries
    what it holds into the live model."""

    def __init__(self, model: torch.nn.Module, act_dtype: torch.dtype) -> None:
        self._api = _reload_api()
        self.live = model
        self.act_dtype = act_dtype
        if "process_weights_after_loading" in vars(type(model)):
            raise ArgumentError(
                f"model: {type(model).__name__} has a model-level post-load step "
                "(process_weights_after_loading) that a refit cannot follow"
            )
        self._layers: List[Tuple[str, torch.nn.Module, torch.nn.Module]] = []
        self._made: Dict[int, torch.nn.Module] = {}  # a layer reached twice is mirrored once
        self.mirror = self._mirror(model, "")
        # the layers' post-load results, kept alive while the live layers use them
        self._kept: Dict[str, torch.nn.Module] = {}
        self.derive(apply=False)  # refuses at once what cannot be followed

    def _mirror(self, live: torch.nn.Module, prefix: str) -> torch.nn.Module:
        api = self._api
        if id(live) in self._made:
            return self._made[id(live)]
        out = _bare_copy(live)
        self._made[id(live)] = out
        for name, child in live._modules.items():
            out._modules[name] = None if child is None else self._mirror(child, f"{prefix}{name}.")
        info = api.recorded.get(live)
        params, buffers = info.restore_metadata if info is not None else ({}, {})
        device = info.restore_device if info is not None else torch.device("cpu")
        own = {n for n, t in live._parameters.items() if t is not None}
        if info is None and own:
            raise ArgumentError(
                f"{prefix}{sorted(own)[0]}: vLLM recorded no loader format for this layer "
                f"({type(live).__name__}): its post-load step cannot be followed"
            )
        with device:
            for name, meta in params.items():
                out._parameters[name] = _seeded(
                    api.restore_refs(api.materialize(meta), out), live._parameters.get(name)
                )
            for name, meta in buffers.items():
                out._buffers[name] = _seeded(
                    api.restore_refs(api.materialize(meta), out), live._buffers.get(name)
                )
        for name, tensor in live._parameters.items():
            if name not in out._parameters and tensor is not None:
                out._parameters[name] = _own_clone(tensor)  # kept live by vLLM's reload (bias, ...)
        for name, tensor in live._buffers.items():
            if name not in out._buffers and tensor is not None:
                out._buffers[name] = tensor.detach().clone()
        # a layer is derived again when the refit can change it: it, or a layer below it
        # (MLA's attention reads its kv_b_proj), holds parameters; buffers alone (a rotary
        # cache) are what the layer made itself, and stay as they are
        if any(True for _ in out.parameters()):
            self._layers.append((prefix.rstrip("."), live, out))
        return out

    def _processed(self, live: torch.nn.Module, mirror: torch.nn.Module) -> torch.nn.Module:
        """``live``'s post-load step, as vLLM's ``process_weights_after_loading`` runs it, on a
        copy of the layer holding copies of the mirror's loader-format tensors."""
        api = self._api
        proc = _bare_copy(live)
        proc._modules = dict(mirror._modules)
        for name, tensor in mirror._parameters.items():
            proc._parameters[name] = _own_clone(tensor)
        for name, tensor in mirror._buffers.items():
            proc._buffers[name] = tensor.detach().clone()
        method = getattr(proc, "quant_method", None)
        kept = {}
        with torch.no_grad():
            if isinstance(method, api.quantize_base):
                # the step runs as it ran when the server loaded the model: what the method
                # keeps between calls (a fused-MoE kernel, which skips the CPU's prepacking on
                # a second call) is set aside, and its new value is the layer's from now on
                kept = {k: getattr(method, k) for k in _METHOD_STATE if getattr(method, k, None) is not None}
                for key in kept:
                    setattr(method, key, None)
                try:
                    method.process_weights_after_loading(proc)
                finally:
                    proc._reshard_method_state = {k: getattr(method, k, None) for k in kept}
                    for key, value in kept.items():
                        setattr(method, key, value)
                if hasattr(proc, "update_param_tp_status"):
                    proc.update_param_tp_status()
            if api.deferred(proc):
                proc.process_weights_after_loading(self.act_dtype)
        return proc

    def derive(self, apply: bool = True) -> int:
        """Every layer's post-load step from the mirror, carried into the live model (in place
        where the result is a tensor the live layer holds). With ``apply`` False nothing live
        changes: the steps run and each result is checked against the live layer, and one
        that cannot be carried is refused naming the parameter. Returns the layers derived."""
        plans = []
        for name, live, mirror in self._layers:
            before = dict(vars(live))
            proc = self._processed(live, mirror)
            copies, sets = [], []
            for kind in ("_parameters", "_buffers"):
                for key, new in getattr(proc, kind).items():
                    old = getattr(live, kind).get(key)
                    where = f"{name}.{key}" if name else key
                    if new is None:
                        continue
                    if old is None or tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
                        shape = None if old is None else (list(old.shape), old.dtype)
                        raise ArgumentError(
                            f"{where}: the post-load step makes {list(new.shape)} {new.dtype} from "
                            f"the loader's format, but the served layer holds {shape}: "
                            "it cannot be refit in place"
                        )
                    copies.append((old, new))
            for key, value in vars(proc).items():
                if key in _STRUCTURE or before.get(key, _MISSING) is value:
                    continue
                if isinstance(value, torch.Tensor) and isinstance(before.get(key), torch.Tensor):
                    old = before[key]
                    if tuple(old.shape) == tuple(value.shape) and old.dtype == value.dtype:
                        copies.append((old, value))
                        continue
                sets.append((key, value))
            plans.append((name, live, proc, copies, sets))
        if not apply:
            return len(plans)
        with torch.no_grad():
            for name, live, proc, copies, sets in plans:
                for old, new in copies:
                    old.data.copy_(new)
                for key, value in sets:
                    setattr(live, key, value)
                method = getattr(live, "quant_method", None)
                for key, value in getattr(proc, "_reshard_method_state", {}).items():
                    setattr(method, key, value)
                self._kept[name] = proc
        return len(plans)


_MISSING = object()


def served_model(model: torch.nn.Module, act_dtype: torch.dtype) -> Optional[ServedModel]:
    """The :class:`ServedModel` of a worker's model (cached on the model)."""
    known = getattr(model, "_reshard_served", None)
    if isinstance(known, ServedModel):
        return known
    made = ServedModel(model, act_dtype)
    model._reshard_served = made
    return made
