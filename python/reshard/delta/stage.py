"""Staged refit of a :class:`reshard.delta.session.DeltaSession`: a new version moves
into staging beside the live destination shards, which keep serving the old one, and is
copied onto them only once the whole job has decided to commit it.

An inference engine serves from its live shards while the next version arrives, and a refit
that fails on one rank half-way must leave every rank on the old version: a plain refit writes
the live shards in place, so a failure there leaves a mix of versions. :func:`prepare` runs the
refit into a shadow of each destination tensor instead (filled from the live tensor, so that a
delta against the version the live shards hold applies to it as it would to them), then every
rank votes through the job's control plane (:mod:`reshard.transfer.control`). :func:`commit`
and :func:`abort` are the runtime's two-phase decision: each rank votes (commit, once its live
tensors are checked again; abort), rank 0 decides for all, with presumed abort, and only then
does any rank write its live shards, a copy per tensor: the engine's only pause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

from .._core import (
    AbortedError,
    ArgumentError,
    InDoubtError,
    PeerLostError,
    Refit,
    ReshardError,
    VersionError,
)
from ..transfer import control as _control
from ..transfer.checks import group_rank
from .refit import (
    DeltaReport,
    check_version,
    destinations,
    identities,
    local,
    refit_delta,
)


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
    # the live tensors' memory and layout when prepared: a commit checks them again
    identities: Dict[str, tuple]


def _bytes(tensors) -> int:
    """The bytes of these tensors' memory on this rank."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def staging_bytes(given, dst) -> int:
    """The bytes a staging of these destination tensors takes on this rank."""
    return _bytes(destinations(given, dst).values())


def _span(t: torch.Tensor):
    """The bytes of memory a tensor's elements lie in: (device, first, end)."""
    m = local(t)
    if m.numel() == 0:
        return None
    last = sum((n - 1) * st for n, st in zip(m.shape, m.stride()) if n > 0)
    first = m.data_ptr()
    return (m.device, first, first + (last + 1) * m.element_size())


def _check_staging(staging, live: Dict[str, torch.Tensor]) -> None:
    """The caller's staging: one tensor per destination tensor, of its shape, dtype and
    device, and sharing memory with no live tensor and no other staging (a staging that is a
    live weight would be written while the engine serves it)."""
    if not isinstance(staging, Mapping):
        raise ArgumentError(f"staging: expected a mapping of names to tensors, got {type(staging).__name__}")
    extra = sorted(set(staging) - set(live), key=str)
    if extra:
        raise ArgumentError(f"staging: {extra[0]!r} is not one of this rank's destination tensors")
    for name, t in live.items():
        s = staging.get(name)
        if s is None:
            raise ArgumentError(f"staging: {name}: missing (every destination tensor of this rank needs one)")
        if not isinstance(s, torch.Tensor):
            raise ArgumentError(f"staging: {name}: expected a tensor, got {type(s).__name__}")
        for what in ("shape", "dtype", "device"):
            if getattr(s, what) != getattr(t, what):
                theirs, ours = (
                    tuple(x) if what == "shape" else x for x in (getattr(s, what), getattr(t, what))
                )
                raise ArgumentError(f"staging: {name}: {what} is {theirs}, but the destination's is {ours}")
    spans = []
    for kind, tensors in (("live tensor", live), ("staging", staging)):
        for name, t in tensors.items():
            span = _span(t)
            if span is not None:
                spans.append((span[0].type, span[0].index, span[1], span[2], kind, name))
    spans.sort(key=lambda x: (x[0], -1 if x[1] is None else x[1], x[2]))
    # a sweep by start, keeping the span that reaches furthest: any overlap of a staging with
    # another span shows against it (live tensors may overlap each other: views of one buffer)
    reach = None  # ((device type, index), end, kind, name)
    for dev_type, dev_index, first, end, kind, name in spans:
        device = (dev_type, dev_index)
        if reach is not None and reach[0] == device and first < reach[1] and "staging" in (kind, reach[2]):
            stage, other = (name, (reach[2], reach[3])) if kind == "staging" else (reach[3], (kind, name))
            if other[0] == "staging":
                raise ArgumentError(
                    f"staging: {stage}: shares memory with the staging of {other[1]} "
                    "(each destination tensor needs a staging of its own)"
                )
            what = (
                "is the live tensor itself"
                if other[1] == stage
                else f"shares memory with the live tensor {other[1]!r}"
            )
            raise ArgumentError(f"staging: {stage}: {what}, not a staging beside it")
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, kind, name)


def _shadows(session, staging, live: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This prepare's staging: the caller's, or the session's own, allocated once and kept
    across versions (a tensor whose shape, dtype or device changed gets a new one)."""
    if staging is not None:
        _check_staging(staging, live)
        return {name: staging[name] for name in live}
    out = {}
    for name, t in live.items():
        spare = session.state.spare.get(name)
        if spare is None or spare.shape != t.shape or spare.dtype != t.dtype or spare.device != t.device:
            spare = torch.empty_like(t)
            session.state.spare[name] = spare
        out[name] = spare
    for name in [n for n in session.state.spare if n not in live]:
        del session.state.spare[name]
    return out


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
    rank, world = group_rank(group)
    live = destinations(given, dst)
    shadows: Dict[str, torch.Tensor] = {}
    problem = None
    try:
        if session.state.in_doubt is not None:
            raise VersionError(
                f"prepare: this rank is in doubt about version {session.state.in_doubt.version} "
                "(resolve() it first, as the job decided)"
            )
        if session.state.stage is not None:
            raise VersionError(
                f"prepare: version {session.state.stage.version} is staged: commit or abort it first"
            )
        shadows = _shadows(session, staging, live)
        # the staging holds what the live shards hold (the delta's base applies to it),
        # unless it is the session's own and a commit left them alike since
        state = session.state
        alike = staging is None and state.spare_epoch == state.epoch and set(shadows) == set(live)
        if not alike:
            with torch.no_grad():
                for name, t in live.items():
                    shadows[name].copy_(t)
    except (ReshardError, RuntimeError) as e:  # RuntimeError: out of memory for the shadows
        problem = str(e)
        shadows.clear()
    session.state.spare_epoch = None  # the staging is about to hold another version
    if version is None:
        wanted = 1 if session.last is None else session.last + 1
    else:
        wanted = version
    held, report, failure = session.held, None, None
    given_shadows, dst_shadows = _with(given, dst, shadows)
    try:
        # a rank with a problem refuses at the fence, so every rank raises there alike
        report = refit_delta(session, given_shadows, version, src, dst_shadows, previous, problem, live)
    except PeerLostError:
        raise  # the job is over (its communicator aborted): no vote to take
    except Exception as e:  # this rank still votes, so that the others do not wait for it
        failure = e
    if report is not None:
        session.held = held  # the shadows hold the new version, the live shards what they held
    # else: a failure after data moved left held at None (a checksum mismatch says the live
    # shard is not the base either), one at the fence left it as it was

    why_not = None if failure is None else f"{type(failure).__name__}: {failure}"
    try:
        not_prepared = _control.decide(group, why_not)
    except InDoubtError as e:
        # nothing was written to the live shards: a vote at prepare commits nothing
        shadows.clear()
        served = "no version yet" if session.serving is None else f"version {session.serving}"
        raise PeerLostError(f"prepare: {e}; the live shards still serve {served}") from e
    except ReshardError as e:
        if failure is not None:
            raise failure from e
        raise
    if not_prepared is None:
        assert report is not None
        session.state.stage = _Stage(
            report.version, session.serving, session.state.epoch, live, shadows, identities(live)
        )
        nbytes = _bytes(live.values())
        seconds = time.perf_counter() - start
        return StageReport(report.version, session.serving, nbytes, staging is None, report, seconds)
    shadows.clear()
    missing = [r for r, _ in not_prepared]
    served = "no version yet" if session.serving is None else f"version {session.serving}"
    reasons = "; ".join(f"rank {r}: {why}" for r, why in not_prepared)
    message = (
        f"prepare: version {wanted} was staged on no rank: rank(s) {missing} were not prepared "
        f"({reasons}); the live shards still serve {served}"
    )
    if failure is not None and not isinstance(failure, ReshardError):
        # the data plane broke (a peer's connection closed): the decision names who was lost
        error = PeerLostError(f"rank {rank}: the data plane failed ({failure}); {message}")
        _control.failed(group, error)
        raise error from failure
    if failure is not None:
        raise type(failure)(f"{failure}; {message}") from failure
    raise AbortedError(message)


def _staged(session, version, call: str) -> Optional[_Stage]:
    """The staged version a commit or abort ends, or a refusal (alike on every rank: a
    prepare stages on every rank or on none)."""
    if version is not None:
        version = check_version("version", version)
    if session.state.in_doubt is not None:
        raise VersionError(
            f"{call}: this rank is in doubt about version {session.state.in_doubt.version}: "
            "resolve() it as the job decided"
        )
    stage: Optional[_Stage] = session.state.stage
    if stage is not None and version is not None and version != stage.version:
        raise VersionError(f"{call}: version {version} was asked for, but version {stage.version} is staged")
    return stage


def _still_live(session, stage: _Stage) -> Optional[str]:
    """Why this rank could not commit ``stage`` now, or None: the live tensors must be the
    ones staged onto (same memory, shape, dtype), serving what they served then."""
    if session.state.epoch != stage.epoch:
        onto = "no version" if stage.onto is None else f"version {stage.onto}"
        now = "no known version" if session.serving is None else f"version {session.serving}"
        return (
            f"version {stage.version} was staged onto shards serving {onto}, but they now "
            f"serve {now} (a refit or restore came in between)"
        )
    now = identities(stage.live)
    for name, before in stage.identities.items():
        if now.get(name) != before:
            label = name or "the destination"
            return (
                f"{label}: the live tensor changed since prepare (its memory, shape or dtype is "
                "not what was staged onto)"
            )
    return None


def commit(session, version) -> CommitReport:
    stage = _staged(session, version, "commit")
    if stage is None:
        asked = "" if version is None else f" (version {version} was asked for)"
        raise VersionError(f"commit: nothing is staged{asked}: prepare a version first")
    why_not = _still_live(session, stage)
    try:
        not_prepared = _control.decide(session.group, why_not)
    except InDoubtError:
        session.state.stage, session.state.in_doubt = None, stage
        raise
    except ReshardError:
        session.state.stage = None
        raise
    if not_prepared is not None:
        session.state.stage = None
        served = "no version yet" if session.serving is None else f"version {session.serving}"
        reasons = "; ".join(f"rank {r}: {why}" for r, why in not_prepared)
        raise AbortedError(
            f"commit: the job aborted version {stage.version} on every rank ({reasons}); "
            f"the live shards still serve {served}"
        )
    return _apply(session, stage)


def _apply(session, stage: _Stage) -> CommitReport:
    start = time.perf_counter()
    with torch.no_grad():
        for name, live in stage.live.items():
            live.copy_(stage.shadows[name])
    devices = {local(t).device for t in stage.live.values() if local(t).device.type == "cuda"}
    for device in devices:  # the pause ends when the copies have
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    session.state.stage = session.state.in_doubt = None
    previous = session.serving
    session.state.serving = session.held = stage.version
    session.state.epoch += 1
    if all(session.state.spare.get(n) is s for n, s in stage.shadows.items()):
        session.state.spare_epoch = session.state.epoch  # the session's staging and the live are alike
    return CommitReport(stage.version, previous, _bytes(stage.live.values()), seconds)


def abort(session, version) -> Optional[int]:
    stage = _staged(session, version, "abort")
    if stage is None:
        return None
    try:
        _control.decide(session.group, f"abort() was called for version {stage.version}")
    finally:
        session.state.stage = None  # this rank voted abort: no rank commits, whatever happens next
    return stage.version


def resolve(session, commit: bool) -> Optional[int]:
    stage: Optional[_Stage] = session.state.in_doubt
    if stage is None:
        raise VersionError("resolve: this rank is in doubt about no version")
    if commit:
        _apply(session, stage)
    else:
        session.state.in_doubt = None
    return session.serving
