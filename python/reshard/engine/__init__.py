"""An inference engine's own parameters as a :class:`reshard.Refit`'s destinations.

vLLM and SGLang hold a model's weights under their own names and shapes, per tensor-parallel
rank:

================================================  ==============================================
engine parameter (Qwen3, Qwen3-MoE)               the refit's parameters it holds
================================================  ==============================================
``model.embed_tokens.weight`` ``[V'/tp, H]``      ``model.embed_tokens.weight``, vocab padded
``lm_head.weight`` ``[V'/tp, H]``                 ``lm_head.weight``, vocab padded
``...self_attn.qkv_proj.weight``                  ``q_proj``, ``k_proj``, ``v_proj`` (dim 0)
``...mlp.gate_up_proj.weight``                    ``gate_proj``, ``up_proj`` (dim 0)
``...mlp.experts.w13_weight`` ``[E, 2I/tp, H]``   the experts' ``gate_proj``, ``up_proj`` (dim 1)
``...mlp.experts.w2_weight`` ``[E, H, I/tp]``     the experts' ``down_proj``
``...weight_scale_inv`` (fp8, block scales)       the weight's scales (``weight_scale`` with
                                                  ``scale_name="weight_scale"``, as
                                                  compressed-tensors checkpoints name them)
every other parameter                             the same name, its shard's shape
================================================  ==============================================

vLLM (0.33) keeps the routed experts one module deeper than SGLang:
``...mlp.experts.routed_experts.w13_weight`` and ``...routed_experts.w2_weight``.

Both engines pad the vocabulary to a multiple of 64 (``vocab_pad``) before splitting it over
the tensor-parallel ranks evenly, so rank ``r`` of ``tp`` holds rows ``[r V'/tp, (r+1) V'/tp)``
of the padded table (``V' = ceil(V / 64) 64``), the rows past ``V`` unused; where that is the
``torch.chunk`` split the refit moves (Qwen3's 151936 rows over 1, 2, 4 or 8 ranks), the rows
land in place, otherwise each rank's rows arrive in a scratch shard first and move once more
between the engine's ranks. SGLang names its parameters as vLLM does for these models.

:func:`engine_params` lists what an inference rank holds (to build an engine's buffers or to
compare with its ``named_parameters()``); :func:`refit_engine_` runs a refit into them.
"""

from __future__ import annotations

import weakref
from typing import Dict, Mapping, Optional, Tuple

import torch

from .._core import ArgumentError, Layout, Refit
from ..transfer.checks import group_rank, torch_dtype
from . import table
from .table import ENGINES

__all__ = [
    "ENGINES",
    "engine_params",
    "refit_engine_",
    "prepare_engine_",
    "commit_engine_",
    "abort_engine_",
    "resolve_engine_",
]

# A delta refit's scratch shards of the vocab tables, by session: (the version they hold,
# {name: shard}). A delta writes only what changed, so they live as long as the session.
_SCRATCH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_params(
    refit: Refit,
    rank: int,
    engine: str = "vllm",
    *,
    vocab_pad: int = 64,
    scale_name: str = "weight_scale_inv",
) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """What inference ``rank`` of ``refit`` holds in ``engine``: name -> (shape, dtype), in
    the refit's order (an empty dict on a rank that holds none): the engine's own
    ``named_parameters()``, as vLLM 0.33 and SGLang 0.5.23 build them (the engine tests check
    it against their model classes)."""
    table.check_engine(engine, scale_name, vocab_pad)
    fused = refit.fused(rank)
    member_of = {m: buffer for buffer, ms in fused.items() for m, *_ in ms}
    out: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for name in refit.names:
        layout = refit.layouts(name)[1]
        shape = layout.local_shape(rank)
        if shape is None:
            continue
        dtype = torch_dtype(layout)
        if name in member_of:
            buffer = member_of[name]
            if buffer not in out:
                ms = fused[buffer]
                whole = list(shape)
                whole[ms[0][1]] = sum(extent for *_, extent in ms)
                out[buffer] = (tuple(whole), dtype)
            continue
        if name in table.VOCAB:
            split = table.padded(layout, rank, vocab_pad)
            if split is not None:
                shape = (split[2], *shape[1:])
        out[table.engine_name(name)] = (tuple(shape), dtype)
    for _weight, (scale, scale_shape) in table.scale_params(refit, rank, scale_name).items():
        out[scale] = scale_shape
    return {table.engine_key(name, engine): value for name, value in out.items()}


def refit_engine_(
    refit: Optional[Refit],
    src: Optional[Mapping[str, torch.Tensor]],
    engine,
    group=None,
    *,
    loader: Optional[torch.nn.Module] = None,
    engine_kind: str = "vllm",
    vocab_pad: int = 64,
    scale_name: str = "weight_scale_inv",
    recorded: Optional[bool] = None,
    **options,
):
    """:func:`reshard.torch.reshard_many_` of the trainer's tensors into an engine's own
    parameters, written in place; ``src`` is this rank's training shards by the checkpoint's
    names (DTensors too; a tied ``lm_head.weight`` that aliases the embedding is left out).
    Every rank of ``group`` calls it; ``engine`` is None on a rank that holds none, ``src``
    None on a rank that trains nothing.

    ``refit`` None: the training side is what the trainer ranks hold
    (:mod:`reshard.engine.trained`): every tensor's name, global shape, dtype and layout
    read from its DTensor (FSDP2, tensor parallelism, HSDP, ``_StridedShard``), a plain
    tensor being a whole one (replicas where several ranks hold it). No model family and no
    config: the engine side is its recorded loader (below). ``refit`` a :class:`Refit`: the
    training layouts are its, and the trainer's tensors are checked against them.

    ``engine`` is the engine's model (a vLLM or SGLang ``torch.nn.Module``), or its
    ``dict(named_parameters())`` with the model as ``loader``: where each slice of each
    checkpoint tensor lands is then recorded from the model's own ``load_weights``, run once
    on probe data (:mod:`reshard.engine.loader_map`), and the parameters end exactly as that loader
    leaves them, padding included. Any architecture its loader loads refits this way; the
    engine tests ran Qwen2, Mistral, Phi-3, Gemma 2 and 3, OLMo 2, Granite, GPT-NeoX, Cohere,
    StableLM, GLM, Llama with biases, Qwen2-MoE and DeepSeek-V2 into vLLM 0.33's classes with
    ``refit=None``, besides the four families a :class:`Refit` knows (docs/src/engines.md).

    ``recorded=True`` takes the recorded loader's path on a rank whose ``engine`` is None
    too (a trainer rank of a job whose engine ranks pass their model): every rank of the group
    must take the same path, and only the ranks with an engine can tell which it is.

    Without a model, ``engine`` is a ``dict`` of the parameters that :func:`engine_params`
    lists (the vLLM and SGLang names of the model families it knows, fp8 scales included).

    ``options`` go to ``reshard_many_``: with ``delta=`` (``True``, a
    :class:`reshard.torch.Delta` or a :class:`reshard.torch.DeltaSession`) it is a delta
    refit, and returns its :class:`reshard.torch.DeltaReport` (None otherwise); the vocab
    rows that move once more between the engine's ranks go dense, from scratch shards kept
    with the session."""
    from .. import torch as rt

    table.check_engine(engine_kind, scale_name, vocab_pad)
    rank, _ = group_rank(group)
    if rank < 0:
        return None
    if recorded is None:
        recorded = refit is None or isinstance(engine, torch.nn.Module) or loader is not None
    if recorded:
        return _refit_recorded(refit, src, engine, loader, group, rank, options)
    names = set(refit.names)
    moves = table.vocab_moves(refit, vocab_pad)
    staged = {name for name, *_ in moves}
    session = _session(group, options) if moves else None
    kept = _SCRATCH.get(session) if session is not None else None
    if kept is not None and kept[0] != session.held:
        kept = None  # the scratch does not hold the version the session says this rank holds
    dst, scratch, tables = None, {}, {}
    if engine is not None:
        dst = {}
        for name, tensor in engine.items():
            tensor = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            refit_name = table.refit_name(names, name, scale_name)
            layout = refit.layouts(refit_name)[1] if refit_name in names else None
            if refit_name in table.VOCAB and layout is not None and layout.local_shape(rank) is not None:
                split = table.padded(layout, rank, vocab_pad)
                if split is not None:
                    tables[refit_name] = tensor
                    if tuple(tensor.shape[:1]) != (split[2],):
                        raise ArgumentError(
                            f"{name}: shape {list(tensor.shape)}, but {engine_kind} pads the "
                            f"vocabulary to {split[2]} rows on rank {rank} (vocab_pad={vocab_pad})"
                        )
                    if refit_name in staged:
                        shape = tuple(layout.local_shape(rank))
                        old = kept[1].get(refit_name) if kept is not None else None
                        if old is None or (tuple(old.shape), old.dtype, old.device) != (
                            shape,
                            tensor.dtype,
                            tensor.device,
                        ):
                            old, kept = torch.empty(shape, dtype=tensor.dtype, device=tensor.device), None
                        scratch[refit_name] = tensor = old
                    else:
                        tensor = tensor[: split[1]]
            dst[refit_name] = tensor
    if session is not None:
        if kept is None and scratch:
            session.restore(None)  # a new scratch holds nothing: this rank's regions go dense
        _SCRATCH.pop(session, None)
    report = rt.reshard_many_(refit, group=group, src=src, dst=dst, **options)
    if session is not None:
        _SCRATCH[session] = (session.held, scratch)
    if not moves:
        return report
    pairs = {}
    for name, piece, s, s_row, r, r_row, rows in moves:
        layout = refit.layouts(name)[1]
        shape = (rows, *layout.shape[1:])
        src_t = scratch[name][s_row : s_row + rows] if rank == s else None
        dst_t = tables[name][r_row : r_row + rows] if rank == r else None
        pairs[piece] = (
            src_t,
            dst_t,
            Layout(shape, layout.dtype, 1, [s], ["R"]),
            Layout(shape, layout.dtype, 1, [r], ["R"]),
        )
    rt.reshard_many_(pairs, group=group)
    return report


def _recorded_pairs(refit, src, engine, loader, group, rank):
    """The recorded refit's :class:`reshard.engine.recorded.Recorded` on this rank (``refit``
    None: the training side read from the trainer's own tensors, :mod:`.trained`); a bad
    argument is refused on every rank."""
    from ..dtensor import unwrap_refit
    from ..transfer import arguments as args
    from . import recorded as er
    from .trained import trained

    model = engine if isinstance(engine, torch.nn.Module) else loader
    if engine is None:
        model = None
    problem = None
    if engine is not None and model is None:
        problem = (
            f"loader: None, and engine is a {type(engine).__name__}: give the engine's model "
            "(whose load_weights is recorded), or a Refit for engine_params' buffers"
        )
    if model is not None and isinstance(engine, Mapping):
        own = dict(model.named_parameters())
        stray = [n for n, t in engine.items() if own.get(n) is not t]
        if stray:
            problem = f"engine: {stray[0]} is not a parameter of the loader's model"
    if refit is None:
        side, local = trained(src, group, rank)
        layouts = dict(side.tensors)
        token = ("trained", side.tensors)
    else:
        if refit.quant is not None:
            problem = problem or "infer_quant: an fp8 refit goes into engine_params' buffers (no loader)"
        layouts = {name: refit.layouts(name)[0] for name in refit.names}
        token, local = refit.model, None
    checkpoint = {name: tuple(layout.shape) for name, layout in layouts.items()}
    emap = er.engine_map(checkpoint, token, None if problem else model, group, rank)
    try:
        if problem is not None:
            raise ArgumentError(problem)
        if refit is not None and src is not None:
            local = args.train_sources(refit, unwrap_refit(refit, src, rank, "src", group), rank)
        recorded = er.recorded_pairs(emap, layouts, local, model, rank)
    except ArgumentError as e:
        args.refuse(e, {}, group, rank)
    return recorded


def _refit_recorded(refit, src, engine, loader, group, rank, options):
    """:func:`refit_engine_` by the engine's recorded loader."""
    from .. import torch as rt

    recorded = _recorded_pairs(refit, src, engine, loader, group, rank)
    session = _session(group, options)
    if session is not None and recorded.fresh:
        session.restore(None)  # a new scratch holds nothing: this rank's regions go dense
    report = rt.reshard_many_(recorded.pairs, group=group, **options)
    recorded.finish()
    return report


def _session(group, options):
    """The :class:`reshard.torch.DeltaSession` a delta refit with these options runs on (the
    module's one of ``group`` and ``model`` with ``delta=True`` alone), or None."""
    from .. import torch as rt

    return rt.delta_session(group, options)


# A staged engine refit's pieces and zeroed boxes, applied after its commit: session -> Recorded.
_STAGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def prepare_engine_(refit: Refit, src, engine, session, version: int, group=None, *, loader=None):
    """The first phase of a staged refit into an engine's model (``engine`` as for
    :func:`refit_engine_`, by its recorded loader): ``session.prepare`` of the refit, the live
    parameters untouched. Returns this rank's :class:`reshard.torch.StageReport`; then
    :func:`commit_engine_` or :func:`abort_engine_` on every rank."""
    from .. import torch as rt

    rank, _ = group_rank(group)
    if rank < 0:
        return None
    if not isinstance(session, rt.DeltaSession):
        raise ArgumentError(f"session: expected a reshard.torch.DeltaSession, got {type(session).__name__}")
    recorded = _recorded_pairs(refit, src, engine, loader, group, rank)
    if recorded.fresh:
        session.restore(None)
    report = session.prepare(recorded.pairs, version)
    _STAGED[session] = recorded
    return report


def commit_engine_(session, version: Optional[int] = None):
    """Commits what :func:`prepare_engine_` staged (a decision of the whole job, see
    :meth:`reshard.torch.DeltaSession.commit`), then writes the pieces that a rank holds
    twice and zeroes the padding, as the engine's loader leaves them."""
    from .._core import InDoubtError

    recorded = _STAGED.pop(session, None)
    try:
        report = session.commit(version)
    except InDoubtError:
        if recorded is not None:
            _STAGED[session] = recorded  # for resolve_engine_
        raise
    if recorded is not None:
        recorded.finish()
    return report


def resolve_engine_(session, commit: bool):
    """Ends a commit this rank is in doubt about (:class:`reshard.InDoubtError` from
    :func:`commit_engine_`) as the job decided it, :meth:`reshard.torch.DeltaSession.resolve`:
    on commit the staged version is applied as :func:`commit_engine_` applies it. Returns the
    version the parameters then hold."""
    recorded = _STAGED.pop(session, None)
    held = session.resolve(commit)
    if commit and recorded is not None:
        recorded.finish()
    return held


def abort_engine_(session, version: Optional[int] = None):
    """Aborts what :func:`prepare_engine_` staged: the live parameters keep their weights."""
    _STAGED.pop(session, None)
    return session.abort(version)
