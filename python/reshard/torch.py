"""Reshard torch tensors with ``torch.distributed`` point-to-point.

Every rank of the process group calls :func:`reshard_` (or :func:`reshard_many_` for a whole
model) with its own local tensors (None where it holds no shard). Each rank computes its part
of the plan alone, from the layouts, and keeps it as a program per set of names, layouts and
options (a refit every step reruns it); packs what it sends to each peer into one flat buffer,
exchanges all buffers in one ``batch_isend_irecv``, copies the regions it holds on both sides
locally meanwhile, and unpacks. CPU tensors are packed and unpacked in Rust
(:class:`reshard._core.Packing`, one call per bucket and direction), tensors on other devices
with one batched torch copy per message. The same call runs over gloo on CPU and NCCL on GPU,
inside one process group or between two (training and inference ranks of one world).

Rank numbers in layouts are ranks of ``group`` (the global world when ``group`` is None).

With ``checksum=True`` every packed message ends with the CRC-32C of each region it holds,
summed by the sender after packing; the receiver sums what arrived and raises
:class:`reshard.ChecksumError` naming the transfer (sender, receiver, offset, extent) before it
unpacks anything. The sums are taken in CPU memory: on a GPU, each message is copied to the
host for them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import dtensor as _dt
from ._core import Layout, Refit, ReshardError
from .delta.session import DeltaReport, DeltaSession, module_session, refit_many
from .delta.stage import CommitReport, StageReport
from .quant import inflight as _inflight
from .quant import prequantized as _prequantized
from .quant.inflight import scale_tensor
from .transfer import arguments as _args
from .transfer.bucket import Bucket, LocalPlan, check_entry, free_staging, plan_of
from .transfer.checks import (
    agree,
    control_device,
    digest_of,
    group_cache,
    group_key,
    group_rank,
    job_fingerprint,
    torch_dtype,
)

__all__ = [
    "reshard_",
    "reshard_many_",
    "reshard_state_dict_",
    "Quant",
    "Delta",
    "dtensor_layout",
    "torch_dtype",
    "local_tensor",
    "free_staging",
    "scale_tensor",
    "DEFAULT_BUCKET_BYTES",
    "DeltaSession",
    "DeltaReport",
    "StageReport",
    "CommitReport",
]

#: Whether CPU tensors are packed by the Rust program (:class:`reshard._core.Packing`);
#: otherwise by batched torch copies, as tensors on other devices always are.
_NATIVE = True

#: Tensors are exchanged in buckets of about this many bytes of global tensor (a tensor larger
#: than a bucket gets a bucket of its own), to bound the staging memory of a whole-model refit.
DEFAULT_BUCKET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Quant:
    """The fp8 options of :func:`reshard_many_` (``quant=Quant(...)``; a string ``quant`` is
    ``Quant(method=quant)``).

    ``method`` is the scaling scheme of the tensors quantized in flight (``"block:128x128"``,
    ``"block:128x128:ue8m0"``, ``"mx:32"``, ``"channel"`` or ``"tensor"``; see
    :func:`reshard_`), ``scales`` their destination scale shards by name (None where the rank
    holds no shard; :func:`scale_tensor` allocates one) and ``scale_dtype`` the scales' dtype
    (``"e8m0"``: uint8 biased exponents; f32 otherwise). ``src_scales`` are the source scale
    shards by name of the tensors already quantized (fp8 sources, their destination scales in
    ``scales`` too). Nothing is checked here: :func:`reshard_many_` checks the options on
    every rank, and refuses a bad one on all of them."""

    method: Optional[str] = None
    scales: Optional[Mapping[str, Optional[torch.Tensor]]] = None
    scale_dtype: Optional[str] = None
    src_scales: Optional[Mapping[str, Optional[torch.Tensor]]] = None


@dataclasses.dataclass(frozen=True)
class Delta:
    """The options of a delta refit by :func:`reshard_many_` (``delta=Delta(...)``;
    ``delta=True`` is ``Delta()``, ``delta=session`` is ``Delta(session=session)``): only the
    blocks that changed since the last refit move.

    ``session`` is the :class:`DeltaSession` that refits (None: the module's session of the
    process group and ``model``), ``version`` the version this refit brings (None: the
    session's last one plus one), ``previous`` this rank's source tensors at the last refit's
    version, by name (for a session made with ``keep_base=False``), and ``model`` a name the
    caller gives the model refit by the module's session (a policy and a frozen reference with
    the same parameter names are two models, each with its own bases and versions; not with a
    ``session``, which is one model's already). Nothing is checked here: :func:`reshard_many_`
    checks the options on every rank, and refuses a bad one on all of them."""

    session: Optional[DeltaSession] = None
    version: Optional[int] = None
    previous: Optional[Mapping[str, torch.Tensor]] = None
    model: Optional[str] = None


#: The flat keywords :func:`reshard_many_` took before its options came in groups: each is
#: folded into the field of the same name of :class:`Quant` or :class:`Delta`.
QUANT_FIELDS = ("scales", "scale_dtype", "src_scales")
DELTA_FIELDS = ("session", "version", "previous", "model")


def option_groups(
    quant, delta, flat: Mapping[str, Any], where: str = "reshard_many_"
) -> Tuple[Quant, Optional[Delta], Optional[str]]:
    """:func:`reshard_many_`'s ``quant`` and ``delta`` as their groups, the flat keywords
    ``flat`` (:data:`QUANT_FIELDS`, :data:`DELTA_FIELDS`) folded into them: ``(quant, delta,
    problem)``, where ``delta`` is None for a call that is no delta refit and ``problem`` is
    the message of a bad option (None when all are good), which the caller refuses on every
    rank. Another keyword raises :class:`TypeError` on this rank, as Python does for a
    keyword that a function does not take."""
    for key in flat:
        if key not in QUANT_FIELDS and key not in DELTA_FIELDS:
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
    problems: List[str] = []
    if isinstance(quant, Quant):
        group, spelled = quant, "in quant=Quant({}=...)"
    else:
        group, spelled = Quant(), "in quant"
        if quant is not None and not isinstance(quant, str):
            problems.append(
                f"quant: {quant!r:.40} ({type(quant).__name__}) is not a scheme (a str such as "
                "'block:128x128') nor a reshard.torch.Quant"
            )
        else:
            group = Quant(method=quant)
    quant_group = _folded(group, QUANT_FIELDS, flat, spelled, problems)

    delta_group: Optional[Delta] = None
    spelled = "in delta=Delta({}=...)"
    if isinstance(delta, Delta):
        delta_group = delta
    elif isinstance(delta, DeltaSession):
        delta_group, spelled = Delta(session=delta), "as delta=<a DeltaSession>"
    elif isinstance(delta, int):  # True and False (and 1 and 0)
        delta_group = Delta() if delta else None
    elif delta is not None:
        problems.append(
            f"delta: {delta!r:.40} ({type(delta).__name__}) is not True, False, a "
            "reshard.torch.Delta nor a reshard.torch.DeltaSession"
        )
    if delta_group is None:
        given = [k for k in DELTA_FIELDS if flat.get(k) is not None]
        if flat.get("session") is not None:  # a session alone makes a delta refit, as it did
            delta_group = Delta()
        elif given:
            problems.append(
                "version, previous, model: given only with delta (delta=True, a reshard.torch.Delta "
                "or a reshard.torch.DeltaSession)"
            )
    if delta_group is not None:
        delta_group = _folded(delta_group, DELTA_FIELDS, flat, spelled, problems)
    return quant_group, delta_group, (problems[0] if problems else None)


def _folded(group, fields: Sequence[str], flat: Mapping[str, Any], spelled: str, problems: List[str]):
    """``group`` with the flat keywords of its ``fields`` that were given (not None) in it; one
    given both ways is a problem, and the group's own value stays."""
    given: Dict[str, Any] = {}
    for key in fields:
        value = flat.get(key)
        if value is None:
            continue
        if getattr(group, key) is not None:
            problems.append(f"{key}: given twice, as {key}= and {spelled.format(key)}; give it once")
        else:
            given[key] = value
    return dataclasses.replace(group, **given) if given else group


def delta_session(group, options: Mapping[str, Any]) -> Optional[DeltaSession]:
    """The :class:`DeltaSession` that ``reshard_many_(..., group=group, **options)`` refits
    with (with ``delta=True`` and no session, the module's one of the group, ``model``,
    ``checksum`` and ``bucket_bytes``), or None: not a delta refit, or no session there."""
    flat = {k: v for k, v in options.items() if k in QUANT_FIELDS or k in DELTA_FIELDS}
    _, delta, _ = option_groups(options.get("quant"), options.get("delta"), flat)
    if delta is None:
        return None
    if delta.session is not None:
        return delta.session if isinstance(delta.session, DeltaSession) else None
    model = delta.model if isinstance(delta.model, str) else None
    checksum = options.get("checksum", False)
    return module_session(group, checksum, options.get("bucket_bytes", DEFAULT_BUCKET_BYTES), model)


def local_tensor(layout: Layout, rank: int, global_tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The part of ``global_tensor`` that ``rank`` holds in ``layout`` (a view), or None."""
    region = layout.local_region(rank)
    if region is None:
        return None
    return global_tensor[_slices(*region)]


def _slices(offset: Sequence[int], extent: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, extent))


def reshard_(
    src_local: Optional[torch.Tensor],
    dst_local: Optional[torch.Tensor],
    src_layout: Optional[Layout] = None,
    dst_layout: Optional[Layout] = None,
    group=None,
    checksum: bool = False,
    *,
    quant: Optional[str] = None,
    scale: Optional[torch.Tensor] = None,
    scale_dtype: Optional[str] = None,
    src_scale: Optional[torch.Tensor] = None,
) -> None:
    """Fill ``dst_local`` (this rank's shard in ``dst_layout``) from the source shards.

    Every rank of ``group`` calls it with its own tensors: ``src_local`` is this rank's
    shard in ``src_layout`` (None if it holds none), ``dst_local`` its shard in
    ``dst_layout`` (None if it receives none), both of the layouts' shape and dtype and on the
    device the process group's backend uses. ``dst_local`` may be strided but must not share
    memory with ``src_local``. Raises :class:`reshard.ArgumentError` on bad input, before any
    byte moves. Every call also checks, through the group, that every rank was given the
    same layouts (and tensor names) and that every rank's arguments passed its checks: a rank
    with other layouts, tensors that do not fit them or any other bad argument (a ``scale``
    without ``quant``, say) makes every rank raise before any byte moves, instead of the
    others waiting for the backend's timeout: that rank its own
    :class:`reshard.ArgumentError`, every other rank :class:`reshard.AgreementError` naming
    the rank and its error (or, for ranks that run different jobs, the field that differs).
    The first call with given layouts exchanges the whole job through the group; later calls
    with the same layouts (a refit every step) exchange a few integers only (one
    ``all_reduce`` on the backend's device: whether every rank's checks passed, and a digest
    of its job), and the messages where a rank failed (see :mod:`reshard.transfer.arguments`).

    ``dst_layout`` may have another float dtype than ``src_layout`` (f64, f32, bf16, f16):
    the source ranks convert as torch's ``.to()`` does, and the wire carries the destination
    dtype.

    With NCCL, ``batch_isend_irecv`` wants the group's communicator to exist before a batch
    that not every rank of the group joins: run one collective on the group first (a barrier).

    With ``checksum=True`` (on every rank alike), each message carries the CRC-32C of every
    transfer it holds, and a receiver raises :class:`reshard.ChecksumError` naming a transfer
    that arrived changed (sender, receiver, offset, extent), before it unpacks any message.

    With ``quant`` (``"block:128x128"``, ``"block:128x128:ue8m0"``, ``"mx:32"``, ``"channel"``
    or ``"tensor"``), ``dst_layout`` is fp8 (``fp8e4m3`` or ``fp8e5m2``) and the source f64,
    f32, bf16 or f16: the senders quantize while they pack (the wire carries
    fp8), source ranks whose shards share a block first exchange their partial amax, and each
    destination rank's scales are written into ``scale``, its scale shard (shape
    :func:`reshard.quant_scale_shape`, f32, or uint8 biased exponents with
    ``scale_dtype="e8m0"``; :func:`scale_tensor` allocates one). Destination shard boundaries
    must fall on block boundaries. A NaN or infinity in a source raises on every rank, naming
    the block, before any value moves: :class:`reshard.ArgumentError` on its rank,
    :class:`reshard.AgreementError` on the others.
    CPU tensors are quantized by Rust kernels, others by torch operations on their device,
    bit for bit alike. ``checksum`` covers the fp8 values, the scales and the partial amax.

    An fp8 source is already quantized: with ``quant``, its scale shard ``src_scale`` (the
    same shape rule on the source side) and the values move together into ``dst_local`` and
    ``scale``, unchanged; a shard boundary on either side that cuts a block is an error.

    ``src_local`` and ``dst_local`` may be DTensors (FSDP2's ``fully_shard`` parameters,
    ``_StridedShard`` of FSDP2 x TP included): their local tensors move, and a layout left
    None is read from the DTensor (:func:`dtensor_layout`), exchanged through the group from
    a rank that holds it. Leave a layout None on every rank or on none.
    """
    reshard_many_(
        {"": (src_local, dst_local, src_layout, dst_layout)},
        group=group,
        checksum=checksum,
        quant=Quant(
            method=quant,
            scales=None if quant is None and scale is None else {"": scale},
            scale_dtype=scale_dtype,
            src_scales=None if src_scale is None else {"": src_scale},
        ),
    )


@torch.no_grad()  # destinations are written in place, Parameters that require grad included
def reshard_many_(
    pairs: Union[Mapping[str, Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Layout, Layout]], Refit],
    group=None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    checksum: bool = False,
    *,
    src: Optional[Mapping[str, torch.Tensor]] = None,
    dst: Optional[Mapping[str, torch.Tensor]] = None,
    quant: Union[None, str, Quant] = None,
    delta: Union[None, bool, Delta, DeltaSession] = None,
    **flat,
) -> Optional[DeltaReport]:
    """:func:`reshard_` for many tensors at once (a whole model): ``pairs`` maps a name to
    ``(src_local, dst_local, src_layout, dst_layout)``. The options come in groups: the plain
    call takes none of them, ``quant=Quant(...)`` moves tensors into fp8, ``delta=Delta(...)``
    makes the call a delta refit.

    ``pairs`` may also be a :class:`reshard.Refit` (a model with both sides' parallelism),
    and ``src`` and ``dst`` this rank's own tensors by name: its training shards, and its
    inference shards, where a vLLM fused buffer (``...qkv_proj.weight``) stands for its
    members (``Refit.fused(rank)``), written in place. Ranks of the group pass what they hold
    (``Refit.rank_names(rank)``) and nothing else. On every call, before any byte moves,
    every rank's tensors are compared with the refit (names, shapes, dtypes, as
    :meth:`reshard.Refit.check` does), and a difference on one rank raises on all: a config
    that does not describe the model moves nothing.

    Every rank passes the same names (in any order). The tensors' messages to each peer are
    packed into one buffer per peer and exchanged in one ``batch_isend_irecv`` per bucket of
    about ``bucket_bytes`` of global tensor data, so two ranks exchange a bounded, equal number
    of messages however many tensors there are. ``checksum`` as for :func:`reshard_`.

    Destination tensors may be ``torch.nn.Parameter`` s that require grad: every path (plain,
    quantized, delta, staged) writes them under ``torch.no_grad()``, so they keep
    ``requires_grad`` and get no ``grad_fn``. CUDA tensors must be on this process's current
    CUDA device (``torch.cuda.set_device(local_rank)``); one on another device is refused on
    every rank before any byte moves, naming the argument and both devices.

    Tensors whose ``dst_layout`` has another float dtype (f64, f32, bf16, f16: a
    ``Refit(train_dtype=...)``) are converted by their source ranks before they move, as
    torch's ``.to()`` converts them, so the wire carries the destination dtype.

    ``quant=Quant(method, scales=..., scale_dtype=..., src_scales=...)`` (a :class:`Quant`;
    ``quant="block:128x128"`` is ``Quant(method="block:128x128")``): tensors whose
    ``dst_layout`` is fp8 (and source is not) are quantized in flight as ``method`` says (see
    :func:`reshard_`), their scale shards given by name in ``scales`` (None where the rank
    holds no shard); they move after the others, in one batch for all. Already-quantized
    tensors (fp8 sources, given in ``scales`` too) take their source scale shards by name in
    ``src_scales``, and move with the plain tensors.
    With a :class:`reshard.Refit` that has fp8 weights (``infer_quant``), the method is the
    refit's and the scale shards come in ``dst`` under the engine's names
    (``X.weight_scale_inv``, fused ones as ``qkv_proj.weight_scale_inv``; see
    :attr:`reshard.Refit.scales` and :meth:`reshard.Refit.scale_fused`).

    ``delta=Delta(session, version=..., previous=..., model=...)`` (a :class:`Delta`;
    ``delta=True`` is ``Delta()``, ``delta=session`` is ``Delta(session=session)``): the call
    is a delta refit, ``session.refit(pairs, version, src=src, dst=dst, previous=previous)``,
    which sends only the blocks that changed since the session's last refit where the
    destination holds it, and returns its :class:`DeltaReport`. Without a session it uses one
    session per process group, ``model`` (a name the caller gives: a policy and a frozen
    reference with the same parameter names are two models, each with its own bases and
    versions), ``checksum`` and ``bucket_bytes``, kept in this module as long as the group;
    make a :class:`DeltaSession` to choose ``anchor`` and ``keep_base``, or to forget. A
    session refit into other destination tensors than the last time sends them dense, so even
    one model name shared by two models stays exact (and sends dense). fp8 quantized tensors
    (``quant``) are refused there.

    The flat keywords of earlier versions still work, folded into the groups: ``scales``,
    ``scale_dtype`` and ``src_scales`` into ``quant``, ``session``, ``version``, ``previous``
    and ``model`` into ``delta`` (``session=s`` alone is ``delta=s``). One given both flat and
    in its group raises :class:`reshard.ArgumentError` naming both; any other keyword raises
    :class:`TypeError`. A bad option is refused on every rank, before any byte moves, naming
    the option and its value."""
    quant, delta, problem = option_groups(quant, delta, flat)
    rank, world = group_rank(group)
    if rank < 0:
        return None  # not a member of the group: nothing to send or receive
    if delta is not None:
        return refit_many(
            pairs,
            group,
            checksum,
            bucket_bytes,
            delta.session,
            delta.version,
            src,
            dst,
            delta.previous,
            delta.model,
            problem,
            quant=quant.method,
            scales=quant.scales,
            scale_dtype=quant.scale_dtype,
            src_scales=quant.src_scales,
        )
    if problem is not None:
        _args.refuse(problem, pairs, group, rank)
    given = pairs
    scale_dtype = quant.scale_dtype
    try:
        if isinstance(pairs, Refit):  # DTensors: their local tensors, their boxes checked
            src = _dt.unwrap_refit(pairs, src, rank, "src", group)
            dst = _dt.unwrap_refit(pairs, dst, rank, "dst", group)
        else:  # DTensors: their local tensors, and their layouts where a pair gives None
            pairs = given = _dt.unwrap_pairs(pairs, group, rank)
        pairs, names, entries, moves, method = _inflight.read(
            pairs, rank, bucket_bytes, src, dst, quant.method, quant.scales, scale_dtype, quant.src_scales
        )
    except ReshardError as e:
        _args.refuse(e, given, group, rank)  # on every rank, as the checks below
    if moves:  # already quantized: values and scales move with the plain tensors
        pairs, names = _prequantized.plan(moves, pairs, names, group, method, scale_dtype, rank, world)
    if names or not (entries or moves):
        _reshard_plain(pairs, names, group, bucket_bytes, checksum, rank, world)
    if entries:
        _inflight.reshard(entries, group, method, scale_dtype, rank, world, checksum, native=_NATIVE)
    return None


def dtensor_layout(dt, group=None) -> Layout:
    """The :class:`reshard.Layout` of a DTensor, ranks of ``group``: ``Layout.from_dtensor``,
    and FSDP2 x TP's ``_StridedShard`` as plain shards over a permuted rank list."""
    return _dt.layout_of(dt, group)


def reshard_state_dict_(src, dst, group=None, **options) -> None:
    """Refits one model's DTensors into another's, every layout read from the DTensors: on
    each rank ``src`` is its source module or state dict (a trainer's FSDP2 model, None
    where it holds none), ``dst`` its destination one (an engine's), written in place. Both
    sides name the same tensors; ``options`` as for :func:`reshard_many_` (``checksum=True``,
    ``delta=Delta(model="policy")``)."""
    rank, _ = group_rank(group)
    if rank < 0:
        return
    reshard_many_(_dt.state_dict_pairs(src, dst, group), group=group, **options)


def _reshard_plain(pairs, names, group, bucket_bytes: int, checksum: bool, rank: int, world: int) -> None:
    """:func:`reshard_many_` of tensors of one dtype on both sides."""
    key = (
        group_key(group),  # the process group itself: one destroyed and made again plans anew
        rank,
        world,
        bucket_bytes,
        bool(checksum),
        tuple((name, pairs[name][2], pairs[name][3]) for name in names),
    )
    program = _PROGRAMS.get(key)
    if program is not None:
        _PROGRAMS.move_to_end(key)
        fingerprint, digest = program.fingerprint, program.digest
    else:
        fingerprint = job_fingerprint(
            "reshard_many_", pairs, names, bucket_bytes=bucket_bytes, checksum=bool(checksum)
        )
        digest = digest_of(fingerprint)

    def prepare() -> _Program:
        if program is not None:  # a later call: only its tensors are checked
            program.check(pairs, rank)
            return program
        plans = []
        for name in names:
            _, _, src_layout, dst_layout = pairs[name]
            plan = plan_of(name, src_layout, dst_layout, rank, world)
            check_entry(name, *pairs[name], plan, rank)
            plans.append(plan)
        return _Program(names, pairs, plans, bucket_bytes, fingerprint, digest, rank)

    # every call, the first and a refit every step alike, is refused on every rank before
    # any byte moves: one all_reduce of a few integers, more only where a rank failed
    device = control_device(group, (t for n in names for t in pairs[n][:2]))
    program = agree(fingerprint, prepare, group, rank, digest=digest, device=device)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = program
        if len(_PROGRAMS) > _PROGRAMS_MAX:
            _PROGRAMS.popitem(last=False)
    program.run(pairs, group, checksum)


class _Program:
    """A reshard of many tensors on this rank, computed once per (group, names, layouts,
    options): the plans, cut into buckets, each with its copying program. A later call with
    the same ones (a refit every step) only checks the tensors and runs it."""

    def __init__(
        self,
        names: List[str],
        pairs,
        plans: List[LocalPlan],
        bucket_bytes: int,
        fingerprint,
        digest: str,
        rank: int,
    ) -> None:
        self.names = names
        self.rank = rank
        # what the group agrees on at every call, computed once
        self.fingerprint = fingerprint
        self.digest = digest
        self.layouts = [(pairs[n][2], pairs[n][3]) for n in names]
        self.plans = plans
        self.buckets: List[Bucket] = []
        # buckets are cut from global sizes, which every rank knows alike
        members: List[int] = []
        filled = 0
        for i, (src_layout, _) in enumerate(self.layouts):
            size = src_layout.elem_bytes
            for n in src_layout.shape:
                size *= n
            if members and filled + size > bucket_bytes:
                self.buckets.append(self._bucket(members))
                members, filled = [], 0
            members.append(i)
            filled += size
        if members:
            self.buckets.append(self._bucket(members))

    def _bucket(self, members: List[int]) -> Bucket:
        return Bucket(
            members, [self.plans[i] for i in members], [self.layouts[i] for i in members], self.rank
        )

    def check(self, pairs, rank: int) -> None:
        """The tensors of this call fit the shards, as on the first call."""
        for name, plan in zip(self.names, self.plans):
            check_entry(name, *pairs[name], plan, rank)

    def run(self, pairs, group, checksum: bool) -> None:
        items = [pairs[n] for n in self.names]
        device = next(
            (t.device for item in items for t in item[:2] if t is not None),
            torch.device("cpu"),
        )
        for bucket in self.buckets:
            tensors = [t for i in bucket.members for t in items[i][:2]]
            bucket.exchange(tensors, group, device, checksum, _NATIVE)


# The programs of the latest calls, oldest first (a job refits the same model every step).
_PROGRAMS: "collections.OrderedDict[tuple, _Program]" = group_cache(collections.OrderedDict())
_PROGRAMS_MAX = 16
