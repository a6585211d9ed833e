"""One delta refit of torch tensors on a process group, as :class:`reshard.torch.DeltaSession`
runs it: the fence (an all-gather of a few integers per rank: whether its arguments are good,
the version its shards hold, the version of its bases, the version it refits, a digest of the
job), so that every rank knows before any data moves who gets what dense and why, and every
rank raises alike on a bad argument or a disagreement; then the size of every message, point
to point; then the messages, point to point, while each rank copies the regions it holds on
both sides. The session object is duck-typed here: its bases, versions and options.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from .. import dtensor as _dt
from .._core import AgreementError, ArgumentError, Refit, ReshardError, VersionError
from ..quant import inflight as _inflight
from ..transfer.bucket import check_entry, plan_of
from ..transfer.checks import agree, check_tensor, collective, group_rank, job_fingerprint
from . import codec as _codec
from . import exchange as _exchange

_OK, _HELD, _BASE, _VERSION, _DIGEST, _NEWEST = range(6)
_MAX_VERSION = (1 << 63) - 1


@dataclass
class DeltaReport:
    """What one delta refit did, on the rank that ran it: the fencing (the same on every rank)
    and this rank's statistics (as a sender, except ``bytes_received`` and ``checked``)."""

    #: The version this refit brought the destination shards to.
    version: int
    #: The version the delta was computed against (the newest base of any rank), None on the
    #: first refit.
    base: Optional[int]
    #: Destination ranks that got all their regions dense, with the reason.
    fenced: Dict[int, str] = field(default_factory=dict)
    #: Source ranks that sent dense for want of a base at ``base``, with the reason.
    unbased: Dict[int, str] = field(default_factory=dict)
    #: Bytes this rank sent (headers, masks, offsets and values), and what the same transfers
    #: cost dense (their regions in the wire dtype).
    bytes_sent: int = 0
    bytes_dense: int = 0
    bytes_received: int = 0
    #: Elements that differ from the base, over the regions this rank sent against a base.
    changed: int = 0
    #: The blocks of this rank's regions by how they went ("unchanged", "offsets", "bitmask",
    #: "dense"; a region sent dense as a whole counts its blocks as dense).
    blocks: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(_codec.ENCODINGS, 0))
    #: This rank's sent regions by how they went: against a base, or dense.
    regions_delta: int = 0
    regions_dense: int = 0
    #: Memory this rank keeps for bases after the call (one copy of its outgoing regions in the
    #: wire dtype with ``keep_base=True``; nothing otherwise).
    base_bytes: int = 0
    #: Received regions whose checksum was compared after applying (``checksum=True``).
    checked: int = 0


def _device_of(given, src, dst, group) -> torch.device:
    """The device of the call's tensors (the fence's too, as NCCL wants)."""
    tensors = []
    if isinstance(given, Mapping):
        tensors += [t for item in given.values() if isinstance(item, (tuple, list)) for t in item[:2]]
    for side in (src, dst):
        if isinstance(side, Mapping):
            tensors += list(side.values())
    for t in tensors:
        if isinstance(t, torch.Tensor):
            # a CUDA tensor on another GPU than the current one is refused at the fence,
            # which runs on the current one
            return torch.device("cuda", torch.cuda.current_device()) if t.device.type == "cuda" else t.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_version(what: str, version) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= _MAX_VERSION:
        raise ArgumentError(f"{what}: {version!r:.40} is invalid: a version is an integer in 0..2^63-1")
    return version


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's memory on this rank: a DTensor's local tensor, any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def destinations(given, dst) -> Dict[str, torch.Tensor]:
    """This rank's destination tensors by name as the caller gave them: the pairs'
    ``dst_local``, or a Refit's ``dst`` (fused buffers as such). What is not a tensor is left
    to the refit's own checks."""
    if isinstance(given, Refit):
        items = dst.items() if isinstance(dst, Mapping) else ()
        return {n: t for n, t in items if isinstance(t, torch.Tensor)}
    if not isinstance(given, Mapping):
        return {}
    out = {}
    for name, item in given.items():
        if isinstance(item, (tuple, list)) and len(item) == 4 and isinstance(item[1], torch.Tensor):
            out[name] = item[1]
    return out


def identity(t: torch.Tensor) -> tuple:
    """Which memory a tensor is, and how it is laid out there: two tensors alike are one."""
    m = local(t)
    return (m.device, m.data_ptr(), tuple(m.shape), tuple(m.stride()), m.dtype)


def identities(tensors: Mapping[str, torch.Tensor]) -> Dict[str, tuple]:
    return {name: identity(t) for name, t in tensors.items()}


def _other_destinations(session, now: Dict[str, tuple]) -> bool:
    """Whether this rank's destination tensors are not the ones the session last refit
    (another model's under the same names, say): such a destination does not hold the
    session's version, so it gets everything dense."""
    return any(session.state.destinations.get(name, ident) != ident for name, ident in now.items())


@dataclass
class _Job:
    """One rank's part of one refit, read from the arguments."""

    pairs: dict
    names: List[str]
    plans: list
    previous: Optional[dict]
    fingerprint: list


def _read(session, given, src, dst, previous, rank: int, world: int) -> _Job:
    """Checks this rank's arguments: the pairs as the plain path reads them, with float casts
    turned into moves in the wire dtype; raises :class:`ReshardError` naming what is wrong."""
    if isinstance(given, Refit) and given.quant is not None:
        raise ArgumentError(
            f"delta: the refit quantizes into fp8 ({given.quant}), which a delta refit does not "
            "move; refit it without delta"
        )
    if isinstance(given, Mapping):
        for name, item in given.items():
            if not isinstance(item, (tuple, list)) or len(item) != 4:
                continue  # read() names it
            src_dtype, dst_dtype = (str(getattr(layout, "dtype", "")) for layout in item[2:])
            if dst_dtype.startswith("fp8") and not src_dtype.startswith("fp8"):
                raise ArgumentError(
                    f"delta: {name}: dst_layout is {dst_dtype}, and a delta refit does not "
                    "quantize into fp8; refit such tensors without delta"
                )
    if previous is not None and not isinstance(previous, Mapping):
        got = type(previous).__name__
        raise ArgumentError(f"previous: expected a mapping of names to tensors, got {got}")
    if isinstance(given, Refit):  # DTensors (FSDP2's parameters): their local tensors, boxes checked
        src, dst, previous = (
            _dt.unwrap_refit(given, tensors, rank, side, session.group)
            for tensors, side in ((src, "src"), (dst, "dst"), (previous, "src"))
        )
    bucket = 1 << 30  # read's check of the plain path's option; a delta refit has no buckets
    pairs, names, entries, moves, _ = _inflight.read(given, rank, bucket, src, dst, None, None, None, None)
    if entries or moves:
        raise ArgumentError(f"delta: {sorted({**entries, **moves})[0]}: fp8 tensors are not refit by delta")
    prev_pairs = None
    if previous is not None:
        if isinstance(given, Refit):
            prev_pairs = _inflight.read(given, rank, bucket, previous, dst, None, None, None, None)[0]
        else:
            extra = sorted(set(previous) - set(given))
            if extra:
                raise ArgumentError(f"previous: {extra[0]!r} is not one of the tensors")
            raw = {n: (previous.get(n), item[1], item[2], item[3]) for n, item in given.items()}
            prev_pairs = _inflight.read(raw, rank, bucket, None, None, None, None, None, None)[0]
    plans = []
    for name in names:
        _, _, src_layout, dst_layout = pairs[name]
        plan = plan_of(name, src_layout, dst_layout, rank, world)
        check_entry(name, *pairs[name], plan, rank)
        if prev_pairs is not None and prev_pairs[name][0] is not None:
            label = f"{name}: " if name else ""
            check_tensor(label, "previous", prev_pairs[name][0], src_layout, plan.src_shape, rank)
        plans.append(plan)
    options = dict(checksum=session.checksum, anchor=session.anchor, bucket_bytes=session.bucket_bytes)
    fingerprint = job_fingerprint("delta refit", pairs, names, **options)
    return _Job(pairs, names, plans, prev_pairs, fingerprint)


def _digest(fingerprint) -> int:
    raw = hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def _fence(session, job, ok: bool, version: int, digest: int, device, world: int):
    """Every rank's fence fields, through one all-gather of a few integers per rank."""
    if job is not None and job.previous is not None:
        base = session.last  # the caller's previous tensors are the last refit's
    else:
        base = session.state.sent if session.keep_base else None
    mine = [
        int(ok),
        -1 if session.held is None else session.held,
        -1 if base is None else base,
        version,
        digest,
        -1 if session.newest is None else session.newest,
    ]
    gathered = [torch.zeros(len(mine), dtype=torch.int64, device=device) for _ in range(world)]
    with collective(session.group, "a delta refit's fence"):
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group=session.group)
    return torch.stack(gathered).tolist()  # one host sync for every rank's fields


def refit_live(session, given, version, src, dst, previous, problem=None) -> DeltaReport:
    """A refit into the live shards: they serve its version after it, and none after one that
    failed while writing them."""
    last, held = session.last, session.held
    try:
        live = destinations(given, dst)
        report = refit_delta(session, given, version, src, dst, previous, problem, live)
    except BaseException:
        if session.last != last or session.held != held:  # data moved, so the shards are a mix
            session.state.serving = None
            session.state.epoch += 1
        raise
    session.state.serving = report.version
    session.state.epoch += 1
    return report


def refit_delta(session, given, version, src, dst, previous, problem=None, live=None) -> DeltaReport:
    """One delta refit of ``session``; ``live`` are the destination tensors whose version the
    session tracks (the live shards, also when the refit writes into a staging beside them)."""
    group = session.group
    rank, world = group_rank(group)
    if rank < 0:
        raise ArgumentError("this process is not a member of the session's group")
    job = None
    own = ArgumentError
    try:
        if problem is not None:
            raise ArgumentError(problem)
        if version is None:
            version = 1 if session.last is None else session.last + 1
        version = check_version("version", version)
        job = _read(session, given, src, dst, previous, rank, world)
    except ReshardError as e:
        problem, own = str(e), type(e)
    device = _device_of(given, src, dst, group)
    digest = 0 if job is None else _digest(job.fingerprint)
    now = identities(live if live is not None else {})
    if problem is None and _other_destinations(session, now):
        session.held = None  # dense for this rank: its tensors do not hold the session's version
    heard = _fence(session, job, problem is None, version if problem is None else 0, digest, device, world)
    if problem is not None:
        raise own(problem)
    for r, fields in enumerate(heard):
        if not fields[_OK]:
            raise AgreementError(
                f"nothing was moved: rank {r} refused its arguments (its own error names them)"
            )
    assert job is not None
    if any(fields[_DIGEST] != digest for fields in heard):
        # names what differs, on every rank; the marker keeps it from any agreement kept
        # from before (it never passes, so it is never kept itself)
        agree(job.fingerprint + [("fence", "disagreed")], lambda: None, group, rank)
        raise AgreementError("the ranks disagree on the job, so nothing was moved")
    for r, fields in enumerate(heard):
        if fields[_VERSION] != version:
            raise AgreementError(
                f"version: rank {r} refits version {fields[_VERSION]} but rank {rank} version "
                f"{version}, so nothing was moved"
            )
    for r, fields in enumerate(heard):
        if fields[_NEWEST] >= version:
            raise VersionError(
                f"version: {version} is not above version {fields[_NEWEST]}, which rank {r} "
                "already refit, staged or restored (versions only increase: a version reused "
                "with other weights would leave a snapshot of it wrong), so nothing was moved"
            )
    session.state.destinations.update(now)
    session.newest = version
    report = _report(session, job, heard, version)
    with torch.no_grad():  # parameters are read and written in place, outside autograd
        _exchange.run(session, job, heard, version, report, device, rank)
    return report


def _report(session, job: _Job, heard, version: int) -> DeltaReport:
    """The fencing of this refit, the same on every rank: who gets what dense, and why."""
    bases = [f[_BASE] for f in heard if f[_BASE] >= 0]
    base = max(bases) if bases else None
    report = DeltaReport(version=version, base=base)
    anchored = session.anchor is not None and version % session.anchor == 0
    dsts, srcs = set(), set()
    for name in job.names:
        srcs.update(job.pairs[name][2].ranks)
        dsts.update(job.pairs[name][3].ranks)
    for d in sorted(dsts):
        held = heard[d][_HELD]
        if anchored:
            report.fenced[d] = f"anchor: version {version} is a multiple of anchor={session.anchor}"
        elif base is None:
            report.fenced[d] = "first refit: no rank holds a base"
        elif held < 0:
            report.fenced[d] = "holds no version (a new or restarted rank)"
        elif held != base:
            report.fenced[d] = f"holds version {held}, but the base is version {base}"
    if base is not None and not anchored:
        for s in sorted(srcs):
            theirs = heard[s][_BASE]
            if theirs != base:
                report.unbased[s] = (
                    "keeps no base" if theirs < 0 else f"its base is version {theirs}, not {base}"
                )
    return report


# The sessions of reshard_many_(..., delta=True), by group and options.
