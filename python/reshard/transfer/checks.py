"""What every part of the torch executor checks alike: the torch dtype of a layout, a rank's
tensors against its shards, and the agreement of the group on the job before any byte moves
(the command line's plan agreement, for torch). Below the executor (:mod:`reshard.torch`) and
its helpers, which all use it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import time
import weakref
from typing import Callable, Dict, List, MutableMapping, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from .._core import AgreementError, ArgumentError, Layout, PeerLostError, ReshardError

TORCH_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in [
        ("bool", "bool"),
        ("u8", "uint8"),
        ("i8", "int8"),
        ("fp8e4m3", "float8_e4m3fn"),
        ("fp8e5m2", "float8_e5m2"),
        ("bf16", "bfloat16"),
        ("f16", "float16"),
        ("i16", "int16"),
        ("u16", "uint16"),
        ("f32", "float32"),
        ("i32", "int32"),
        ("u32", "uint32"),
        ("f64", "float64"),
        ("i64", "int64"),
        ("u64", "uint64"),
    ]
    if hasattr(torch, attr)
}


def torch_dtype(layout: Layout) -> torch.dtype:
    """The torch dtype of a layout's elements."""
    try:
        return TORCH_DTYPES[layout.dtype]
    except KeyError:
        raise ArgumentError(
            f"dtype {layout.dtype} has no torch equivalent in torch {torch.__version__}"
        ) from None


def check_tensor(
    name: str, what: str, tensor, layout: Layout, shape: Optional[Tuple[int, ...]], rank: int
) -> None:
    """A rank in the layout gives a tensor of its shard's shape and dtype; others give None."""
    if shape is None:
        if tensor is not None:
            raise ArgumentError(
                f"{name}{what}: rank {rank} is not part of this layout ({layout.spec}), "
                "yet a tensor was given for it (pass None)"
            )
        return
    dtype = torch_dtype(layout)
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentError(
            f"{name}{what}: rank {rank} holds a shard of shape {shape} ({layout.dtype}) in "
            f"{layout.spec}, but {type(tensor).__name__} was given instead of a tensor"
        )
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ArgumentError(
            f"{name}{what}: rank {rank} holds a shard of shape {shape} ({layout.dtype}) in "
            f"{layout.spec}, but the tensor given has shape {tuple(tensor.shape)} and dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}"
        )
    check_device(name, what, tensor.device, current_index(tensor.device), rank)


def current_index(device: torch.device) -> Optional[int]:
    """The index of this process's current device of ``device``'s kind, which its tensors of
    that kind must be on: ``torch.cuda.current_device()`` for CUDA (the caller sets it to its
    local rank); None for the CPU and kinds without one."""
    if device.type == "cuda":
        return torch.cuda.current_device()
    return None


def check_device(name: str, what: str, device: torch.device, current: Optional[int], rank: int) -> None:
    """A tensor of this rank on ``device`` is on this process's current device of its kind
    (``current``, :func:`current_index`; None: any): NCCL runs a rank's operations on its
    current device, so a tensor on another GPU would be read or written by the wrong stream,
    or make the group's communicator on a device no peer uses. Raises
    :class:`ArgumentError` naming the argument, the tensor's device and the expected one."""
    if current is None or device.index == current:  # a tensor's CUDA device has its index
        return
    raise ArgumentError(
        f"{name}{what}: rank {rank}'s tensor is on {device}, but this process's current "
        f"{device.type} device is {device.type}:{current}; each rank's tensors belong on its own "
        "device (torch.cuda.set_device(local_rank) before the call)"
    )


def check_ranks(name: str, what: str, layout: Layout, world: int) -> None:
    beyond = [r for r in layout.ranks if r >= world]
    if beyond:
        raise ArgumentError(
            f"{name}{what}: rank {beyond[0]} of {layout.spec} is not in the process group (size {world})"
        )


def job_fingerprint(command: str, pairs, names: List[str], **options) -> List[Tuple[str, str]]:
    """What this rank is about to run, as (field, value) pairs in a fixed order: every rank
    of the group must run alike (the command line's plan agreement, for torch)."""
    fields = [("command", command)]
    fields += [(k, repr(v)) for k, v in sorted(options.items())]
    for name in names:
        label = f"{name}: " if name else ""
        for what, layout in (("src_layout", pairs[name][2]), ("dst_layout", pairs[name][3])):
            shape = ",".join(str(n) for n in layout.shape)
            fields.append((f"{label}{what}", f"{layout.spec} shape={shape} dtype={layout.dtype}"))
    return fields


# The fingerprints every rank of a group has agreed on, oldest first: a job's later calls
# with the same tensors and layouts (a refit every step) exchange their digest only, not
# the whole fingerprint. Every rank of a group that agreed sees the same calls in the same
# order, so all know alike (and where they do not, the exchange says so).
_AGREED: "collections.OrderedDict[Tuple[object, str], None]" = collections.OrderedDict()
_AGREED_MAX = 4096


def process_group(group):
    """The process group a call runs on: ``group``, or the default group's object when None.
    Caches of the torch path are keyed by it (:func:`group_key`), never by ``group`` itself:
    None names whatever default group exists, and a default group destroyed and made again
    is another job, whose ranks have agreed on nothing yet."""
    return dist.distributed_c10d._get_default_group() if group is None else group


class GroupKey:
    """A process group as the first item of a cache's key: equal only to itself, one per
    live group, and holding the group weakly, so that no cache keeps a group (its
    communicator and threads) alive past ``destroy_process_group``."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, pg) -> None:
        self._ref = weakref.ref(pg)

    def group(self):
        """The process group, or None once it is gone."""
        return self._ref()

    def alive(self, live) -> bool:
        pg = self._ref()
        return pg is not None and pg in live


# The module-level caches whose keys start with a GroupKey (:func:`group_key`), the keys in
# use, and the key of each live process group.
_GROUP_CACHES: List[MutableMapping] = []
_GROUP_KEYS: Set[GroupKey] = set()
_KEY_OF: "weakref.WeakKeyDictionary[object, GroupKey]" = weakref.WeakKeyDictionary()

_Cache = TypeVar("_Cache", bound=MutableMapping)


def group_cache(cache: _Cache) -> _Cache:
    """Registers a module-level mapping whose keys are tuples that start with a
    :func:`group_key`: its entries go when their group is destroyed."""
    _GROUP_CACHES.append(cache)
    return cache


def group_key(group) -> GroupKey:
    """The key of ``group``'s process group (:func:`process_group`: the default group's for
    None) in the caches registered with :func:`group_cache`; first drops every cached entry
    of a group that is no longer in ``torch.distributed``'s world (destroyed), so that the
    next call on a group made again starts afresh (agrees the whole job, plans again)."""
    pg = process_group(group)
    live = dist.distributed_c10d._world.pg_map
    dead = {k for k in _GROUP_KEYS if not k.alive(live)}
    if dead:
        for cache in _GROUP_CACHES:
            for key in [k for k in cache if k[0] in dead]:
                del cache[key]
        _GROUP_KEYS.difference_update(dead)
    key = _KEY_OF.get(pg)
    if key is None or key not in _GROUP_KEYS:
        key = _KEY_OF[pg] = GroupKey(pg)
        _GROUP_KEYS.add(key)
    return key


group_cache(_AGREED)


def _first_difference(ours, theirs) -> Optional[Tuple[str, str, str]]:
    """The first field whose value differs: (field, ours, theirs), "(none)" where absent."""
    mine, other = dict(ours), dict(theirs)
    for field, _ in list(ours) + list(theirs):
        a, b = mine.get(field, "(none)"), other.get(field, "(none)")
        if a != b:
            return field, a, b
    return None


def digest_of(fingerprint) -> str:
    """The digest of a fingerprint (hex, 128 bits): equal on ranks that run the same job."""
    return hashlib.blake2b(repr(fingerprint).encode(), digest_size=16).hexdigest()


def control_device(group, tensors=()) -> torch.device:
    """Where the group's backend takes the few integers of an agreement: the CPU for gloo
    (and for a group whose CPU tensors go through gloo), the device of the call's tensors
    (or devices, among ``tensors``) or the current CUDA device for NCCL. A CUDA tensor's
    agreement runs on the current CUDA device whatever device the tensor is on: a tensor
    on another GPU is refused (:func:`check_device`) through that agreement, which must
    not run on the wrong device itself."""
    backend = str(dist.get_backend(group))
    if backend == "gloo" or "cpu:" in backend:
        return torch.device("cpu")
    for t in tensors:
        device = t.device if isinstance(t, torch.Tensor) else t
        if isinstance(device, torch.device) and device.type != "cpu":
            if device.type == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return device
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _refusal_text(e: BaseException) -> str:
    """A rank's refusal as the other ranks name it."""
    return str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}"


def agree(fingerprint, prepare, group, rank: int, *, digest: Optional[str] = None, device=None):
    """Runs ``prepare`` (this rank's local checks and plans) and agrees with the group, on
    every call, before any byte moves: one ``all_reduce`` of four integers on ``device`` (the
    backend's: :func:`control_device` when None) says whether every rank's checks passed and
    whether every rank runs the same job (a 63-bit digest of its ``fingerprint``). A rank
    whose checks failed raises its own error; every other rank raises
    :class:`AgreementError` naming it; ranks that run different jobs all raise
    :class:`AgreementError` naming the first field that differs. The whole fingerprints and
    the failures' messages go through the group (``all_gather_object``) only on the first
    call with a fingerprint, or when a rank failed or the digests differ. ``digest`` (of
    ``fingerprint``, :func:`digest_of`) saves computing it again; then ``fingerprint`` may be
    a function that returns it, called only where it is sent."""
    if digest is None:
        digest = digest_of(fingerprint)
    key = (group_key(group), digest)
    known = key in _AGREED
    try:
        result, refusal = prepare(), None
    except Exception as e:  # this rank's refusal: raised below, once every rank knows of it
        result, refusal = None, e
    word = int(digest[:16], 16) >> 1  # 63 bits: its negation fits an int64 too
    if device is None:
        device = control_device(group)
    flags = torch.tensor([refusal is None, known, word, -word], dtype=torch.int64, device=device)
    with collective(group, "the agreement on the job"):
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    passed, agreed, least, most = (int(v) for v in flags.tolist())
    if passed and agreed and least == -most:
        _AGREED.move_to_end(key)
        return result
    heard = [None] * dist.get_world_size(group)
    problem = None if refusal is None else _refusal_text(refusal)
    with collective(group, "the agreement on the job"):
        dist.all_gather_object(heard, (digest, problem), group=group)
    if refusal is not None:
        raise refusal  # this rank's own error, of its own kind
    for r, (_, their_problem) in enumerate(heard):
        if their_problem is not None:
            raise AgreementError(f"nothing was moved: rank {r}: {their_problem}")
    if any(d != digest for d, _ in heard):
        # rare: the whole fingerprints, to name what differs
        everyone = [None] * len(heard)
        with collective(group, "the agreement on the job"):
            mine = fingerprint() if callable(fingerprint) else fingerprint
            dist.all_gather_object(everyone, mine, group=group)
        for r, theirs in enumerate(everyone):
            diff = _first_difference(everyone[0], theirs)
            if diff is not None:
                field, ours, other = diff
                raise AgreementError(
                    "the ranks disagree on the job, so nothing was moved: "
                    f"rank {r} runs {field} {other}; rank 0 runs {field} {ours}"
                )
    _AGREED[key] = None
    if len(_AGREED) > _AGREED_MAX:
        _AGREED.popitem(last=False)
    return result


def refuse_together(refusal: Optional[BaseException], group, device) -> None:
    """Every rank of the group learns whether one of them failed (``refusal``, None where
    it did not), through one ``all_reduce`` of a flag on ``device`` and, only when one did,
    the messages: the failed rank raises its own error, the others :class:`AgreementError`
    naming it."""
    flag = torch.tensor([refusal is None], dtype=torch.int64, device=device)
    with collective(group, "the check of every rank's arguments"):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if int(flag.item()):
        return
    heard: List[Optional[str]] = [None] * dist.get_world_size(group)
    with collective(group, "the check of every rank's arguments"):
        dist.all_gather_object(heard, None if refusal is None else _refusal_text(refusal), group=group)
    if refusal is not None:
        raise refusal
    for r, theirs in enumerate(heard):
        if theirs is not None:
            raise AgreementError(f"nothing was moved: rank {r}: {theirs}")


# Process groups whose job failed (a rank lost, a decision in doubt), with the error: every
# later call on one raises at once instead of waiting on a broken communicator.
_ENDED: "weakref.WeakKeyDictionary[object, BaseException]" = weakref.WeakKeyDictionary()


def _of_group(table: "weakref.WeakKeyDictionary", group):
    """``table``'s entry for ``group``'s process group, or None; a rank outside ``group``
    holds torch's marker (an int) for it, with no job of its own."""
    pg = process_group(group)
    return table.get(pg) if isinstance(pg, dist.ProcessGroup) else None


def end_job(group, error: BaseException) -> None:
    """Marks the job on ``group`` as over after ``error``, and aborts its communicator where
    the backend can: every later call on it raises at once."""
    pg = process_group(group)
    _ENDED[pg] = error
    abort = getattr(pg, "abort", None)
    if abort is not None:
        try:
            abort()
        except Exception:  # gloo aborts nothing: its pending operations fail on their own
            pass


# Per process group, how to ask its control plane which rank it knows to be lost (the
# control plane's own module registers it when it joins).
_LOST_PROBES: "weakref.WeakKeyDictionary[object, Callable[[], Optional[Tuple[int, str]]]]" = (
    weakref.WeakKeyDictionary()
)


def register_lost_probe(group, probe: Callable[[], Optional[Tuple[int, str]]]) -> None:
    _LOST_PROBES[process_group(group)] = probe


def lost_rank(group, patience: float = 1.0) -> Optional[Tuple[int, str]]:
    """The rank the group's control plane knows to be lost, and how, waiting up to
    ``patience`` seconds for rank 0's notice; None without a control plane or a loss."""
    probe = _of_group(_LOST_PROBES, group)
    if probe is None:
        return None
    deadline = time.monotonic() + patience
    while True:
        gone = probe()
        if gone is not None or time.monotonic() > deadline:
            return gone
        time.sleep(0.01)


def peer_lost(group, what: str, cause: Optional[BaseException] = None) -> PeerLostError:
    """The error of a data plane that broke (the backend's ``cause``) or went silent during
    ``what``, naming the lost rank where the control plane knows it; the job on ``group``
    ends there (:func:`end_job`)."""
    me = dist.get_rank(group)
    gone = lost_rank(group)
    who = "a peer is gone" if gone is None else f"peer rank {gone[0]} is gone ({gone[1]})"
    said = "" if cause is None else f": {cause}"
    error = PeerLostError(f"rank {me}: {who} during {what}{said}")
    end_job(group, error)
    return error


@contextlib.contextmanager
def collective(group, what: str):
    """Runs a collective on ``group``: the backend's error (a peer's connection closed, a
    peer silent past the group's timeout) ends the job there, raised as
    :class:`PeerLostError` naming the lost rank where the control plane knows it."""
    try:
        yield
    except RuntimeError as e:
        raise peer_lost(group, what, e) from e


def group_rank(group) -> Tuple[int, int]:
    """This process's rank in ``group`` (the default group when None), and the group's size;
    raises at once when the job on the group failed before."""
    if not dist.is_initialized():
        raise ArgumentError("torch.distributed is not initialized (call init_process_group first)")
    ended = _of_group(_ENDED, group)
    if ended is not None:
        raise PeerLostError(
            f"the job on this process group failed before ({ended}); its communicator was "
            "aborted: destroy the group and make a new one"
        )
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return dist.get_rank(group), dist.get_world_size(group)


def member_narrowed(
    what: str, name: str, tensor, rank: int, members, kind: str = "fused buffer", part: str = "{member} lies"
) -> Dict[str, torch.Tensor]:
    """The views of a fused buffer's members, ``members`` as ``(member, dim, offset, extent)``;
    a buffer that is no tensor, or too small for a member, is refused naming it (``what`` the
    argument, ``kind`` the buffer, ``part`` how a member's place is said)."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentError(f"{what}: {name}: expected a tensor, got {type(tensor).__name__}")
    views = {}
    for member, dim, offset, extent in members:
        if tensor.dim() <= dim or tensor.shape[dim] < offset + extent:
            raise ArgumentError(
                f"{what}: {name}: rank {rank}'s {kind} has shape {tuple(tensor.shape)}, but "
                f"{part.format(member=member)} at {offset}..{offset + extent} of dim {dim}"
            )
        views[member] = tensor.narrow(dim, offset, extent)
    return views
