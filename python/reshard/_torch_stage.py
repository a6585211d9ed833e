"""Staged refit of a :class:`reshard._torch_delta_session.DeltaSession`: a new version moves
into staging beside the live destination shards, which keep serving the old one, and is
copied onto them only once every rank has it whole.

An inference engine serves from its live shards while the next version arrives, and a refit
that fails on one rank half-way must leave every rank on the old version: a plain refit writes
the live shards in place, so a failure there leaves a mix of versions. :func:`prepare` runs the
refit into a shadow of each destination tensor instead (a copy of the live tensor, so that a
delta against the version the live shards hold applies to it as it would to them), then every
rank votes; :func:`commit` is then local (every rank already knows every rank is prepared), a
copy per tensor, and the only pause of the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist

from ._core import Refit, ReshardError
from ._torch_delta_refit import DeltaReport, _check_version, _device_of, _group_rank, _refit


@dataclass
class StageReport:
    """What :meth:`DeltaSession.prepare` did on this rank: the version staged, what the live
    shards serve meanwhile, and the refit into the staging."""

    #: The version now staged on every rank.
    version: int
    #: The version the live shards serve, onto which the staging was prepared (None: none yet).
    onto: Optional[int]
    #: Memory of this rank's staging: one tensor per destination tensor, as large as it.
    staging_bytes: int
    #: Whether the library allocated the staging (False: the caller's ``staging=`` tensors).
    allocated: bool
    #: The delta refit into the staging (bytes sent against dense, fencing).
    refit: DeltaReport
    #: Seconds of the whole call, the vote included.
    seconds: float


@dataclass
class CommitReport:
    """What :meth:`DeltaSession.commit` did on this rank."""

    #: The version the live shards now serve.
    version: int
    #: The version they served before.
    previous: Optional[int]
    #: Bytes copied from the staging onto the live shards.
    bytes_copied: int
    #: Seconds of the copy: the engine's pause.
    seconds: float


@dataclass
class _Stage:
    version: int
    onto: Optional[int]
    epoch: int  # the session's count of changes to the live shards, when prepared
    live: Dict[str, torch.Tensor]
    shadows: Dict[str, torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's memory on this rank is its local tensor


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


def _bytes(tensors) -> int:
    """The bytes of these tensors' memory on this rank."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def staging_bytes(given, dst) -> int:
    """The bytes a staging of these destination tensors takes on this rank."""
    return _bytes(destinations(given, dst).values())


def _check_staging(staging, live: Dict[str, torch.Tensor]) -> None:
    if not isinstance(staging, Mapping):
        raise ReshardError(f"staging: expected a mapping of names to tensors, got {type(staging).__name__}")
    extra = sorted(set(staging) - set(live), key=str)
    if extra:
        raise ReshardError(f"staging: {extra[0]!r} is not one of this rank's destination tensors")
    for name, t in live.items():
        s = staging.get(name)
        if s is None:
            raise ReshardError(f"staging: {name}: missing (every destination tensor of this rank needs one)")
        if not isinstance(s, torch.Tensor):
            raise ReshardError(f"staging: {name}: expected a tensor, got {type(s).__name__}")
        for what in ("shape", "dtype", "device"):
            if getattr(s, what) != getattr(t, what):
                theirs, ours = (
                    tuple(x) if what == "shape" else x for x in (getattr(s, what), getattr(t, what))
                )
                raise ReshardError(f"staging: {name}: {what} is {theirs}, but the destination's is {ours}")
        if _local(s).numel() and _local(s).data_ptr() == _local(t).data_ptr():
            raise ReshardError(f"staging: {name}: is the live tensor itself, not a staging beside it")


def _with(given, dst, shadows):
    """The call's arguments with the shadows in place of the live destination tensors."""
    if isinstance(given, Refit):
        return given, {**dst, **shadows} if isinstance(dst, Mapping) else dst
    if not isinstance(given, Mapping):
        return given, dst
    out = {}
    for name, item in given.items():
        out[name] = (item[0], shadows[name], item[2], item[3]) if name in shadows else item
    return out, dst


def prepare(session, given, version, src, dst, previous, staging) -> StageReport:
    start = time.perf_counter()
    group = session.group
    rank, world = _group_rank(group)
    live = destinations(given, dst)
    shadows: Dict[str, torch.Tensor] = {}
    problem = None
    try:
        if session._stage is not None:
            raise ReshardError(
                f"prepare: version {session._stage.version} is staged: commit or abort it first"
            )
        if staging is not None:
            _check_staging(staging, live)
        with torch.no_grad():
            for name, t in live.items():
                shadow = torch.empty_like(t) if staging is None else staging[name]
                shadow.copy_(t)  # what the live shard holds: the delta's base applies to it
                shadows[name] = shadow
    except (ReshardError, RuntimeError) as e:  # RuntimeError: out of memory for the shadows
        problem = str(e)
        shadows.clear()
    if version is None:
        wanted = 1 if session.last is None else session.last + 1
    else:
        wanted = version
    held, report, failure = session.held, None, None
    given_shadows, dst_shadows = _with(given, dst, shadows)
    try:
        # a rank with a problem refuses at the fence, so every rank raises there alike
        report = _refit(session, given_shadows, version, src, dst_shadows, previous, problem)
    except Exception as e:  # this rank still votes, so that the others do not wait for it
        failure = e
    if report is not None:
        session.held = held  # the shadows hold the new version, the live shards what they held
    # else: a failure after data moved left held at None (a checksum mismatch says the live
    # shard is not the base either), one at the fence left it as it was

    ok = torch.tensor([int(failure is None)], dtype=torch.int64, device=_device_of(given, src, dst, group))
    votes = ok.clone()
    try:
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as e:  # the group broke: this rank's own failure comes first
        if failure is not None:
            raise failure from e
        raise
    if int(votes.item()) == 1:
        assert report is not None
        session._stage = _Stage(report.version, session.serving, session._epoch, live, shadows)
        nbytes = _bytes(live.values())
        seconds = time.perf_counter() - start
        return StageReport(report.version, session.serving, nbytes, staging is None, report, seconds)
    # every rank knows a rank failed: all gather the votes, so that each names the same ranks
    gathered = [torch.zeros_like(ok) for _ in range(world)]
    dist.all_gather(gathered, ok, group=group)
    shadows.clear()
    missing = [r for r, v in enumerate(gathered) if not int(v.item())]
    served = "no version yet" if session.serving is None else f"version {session.serving}"
    message = (
        f"prepare: version {wanted} was staged on no rank: rank(s) {missing} were not prepared "
        f"(each one's own error says why); the live shards still serve {served}"
    )
    if failure is not None and not isinstance(failure, ReshardError):
        raise failure
    if failure is not None:
        raise ReshardError(f"{failure}; {message}") from failure
    raise ReshardError(message)


def commit(session, version) -> CommitReport:
    stage: Optional[_Stage] = session._stage
    if version is not None:
        version = _check_version("version", version)
    if stage is None:
        asked = "" if version is None else f" (version {version} was asked for)"
        raise ReshardError(f"commit: nothing is staged{asked}: prepare a version first")
    if version is not None and version != stage.version:
        raise ReshardError(f"commit: version {version} was asked for, but version {stage.version} is staged")
    if session._epoch != stage.epoch:
        onto = "no version" if stage.onto is None else f"version {stage.onto}"
        now = "no known version" if session.serving is None else f"version {session.serving}"
        raise ReshardError(
            f"commit: version {stage.version} was staged onto shards serving {onto}, but they now "
            f"serve {now} (a refit or restore came in between): abort it and prepare again"
        )
    start = time.perf_counter()
    with torch.no_grad():
        for name, live in stage.live.items():
            live.copy_(stage.shadows[name])
    devices = {_local(t).device for t in stage.live.values() if _local(t).device.type == "cuda"}
    for device in devices:  # the pause ends when the copies have
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    session._stage = None
    previous = session.serving
    session._serving = session.held = stage.version
    session._epoch += 1
    return CommitReport(stage.version, previous, _bytes(stage.live.values()), seconds)


def abort(session, version) -> Optional[int]:
    stage: Optional[_Stage] = session._stage
    if version is not None:
        version = _check_version("version", version)
    if stage is None:
        return None
    if version is not None and version != stage.version:
        raise ReshardError(f"abort: version {version} was asked for, but version {stage.version} is staged")
    session._stage = None
    return stage.version
