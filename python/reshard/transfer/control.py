"""The job's control plane for the torch path: the runtime's own (:class:`reshard._core.Control`),
joined once per process group, beside whatever carries the data (gloo, NCCL).

Agreement, the two-phase decision of a staged refit and its timeouts are the runtime's calls,
over its own authenticated links through the group's rank 0: a rank that dies or stalls makes
every other rank's call raise :class:`reshard.PeerLostError` (or, for a rank that voted
prepared and lost rank 0, :class:`reshard.InDoubtError`) within a bounded time, naming it,
however the data plane is blocked. Rank 0 binds a port the system picks and tells the others
its address and a fresh token once, through the group; every later call is the runtime's.

A control plane belongs to one process group and lives as long as it: a group destroyed and
made again gets a new one. After a failure (a rank lost, a decision in doubt) the job is
over: the group's communicator is aborted, and every later call on it raises at once, so that
the process forms a new group instead of waiting on a broken one.

``RESHARD_TIMEOUT`` (seconds, default 60) bounds every wait; ``RESHARD_CONTROL_ADDR`` is the
address rank 0 binds (default ``MASTER_ADDR``, else loopback).
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
import weakref
from typing import List, Optional, Sequence

import torch.distributed as dist

from .._core import ArgumentError, Control, ControlListener, ReshardError
from .checks import end_job, group_rank, lost_rank, peer_lost, register_lost_probe
from .checks import process_group as _process_group

#: Seconds a rank waits for a peer before it names it as lost, when ``RESHARD_TIMEOUT`` is unset.
DEFAULT_TIMEOUT = 60.0

# Per process group: its control plane, or the error that ended its job.
_CONTROLS: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def timeout() -> float:
    """The job's timeout in seconds: ``RESHARD_TIMEOUT``, or :data:`DEFAULT_TIMEOUT`."""
    raw = os.environ.get("RESHARD_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ArgumentError(f"RESHARD_TIMEOUT: {raw!r:.40} is invalid: a positive number of seconds")
    return value


def control(group) -> Control:
    """This rank's control plane of ``group`` (joined on first use, by every rank at once)."""
    rank, world = group_rank(group)  # raises when the job on the group failed before
    pg = _process_group(group)
    known = _CONTROLS.get(pg)
    if isinstance(known, Control):
        return known
    wait = timeout()
    listener = None
    offer: List[object] = [None, None, None]
    if rank == 0:
        addr = os.environ.get("RESHARD_CONTROL_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        listener = ControlListener(addr)
        offer = [addr, listener.port, secrets.token_hex(16)]
    # once per group: where rank 0 listens, and the job's token, from rank 0 to the others
    dist.broadcast_object_list(offer, src=dist.get_global_rank(pg, 0), group=group)
    addr, port, token = offer
    made = Control(rank, world, str(addr), int(port), str(token), wait, listener)
    _CONTROLS[pg] = made
    register_lost_probe(group, made.lost)
    return made


def failed(group, error: BaseException) -> None:
    """Ends the job on ``group`` after ``error`` (a rank lost, a decision in doubt): its
    control plane is dropped, its communicator aborted where the backend can, and every later
    call on the group raises at once."""
    _CONTROLS.pop(_process_group(group), None)
    end_job(group, error)


def wait(works: Sequence[object], peers: Sequence[object], group, what: str) -> None:
    """Waits for the data plane's operations ``works`` (each with its peer, a rank of
    ``group``) for at most the job's timeout: a peer whose connection broke (the backend
    raised), one that never answers, or one the control plane knows to be lost is named in a
    :class:`reshard.PeerLostError`, and the job on ``group`` then fails (:func:`failed`).

    NCCL's operations are polled, so that a rank the control plane knows to be lost ends the
    wait at once; gloo's point-to-point operations complete only inside their own wait, which
    takes the timeout (and gloo sees a killed peer's connection close at once)."""
    works = list(works)
    if len(works) != len(peers):  # NCCL coalesces a batch into one operation
        peers = [f"one of {len(peers)} peers"] * len(works)
    limit = timeout()
    deadline = time.monotonic() + limit
    if dist.get_backend(group) != "nccl":
        for work, peer in zip(works, peers):
            left = max(deadline - time.monotonic(), 1e-3)
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                raise peer_lost(group, f"{what} (waiting on peer rank {peer}, {limit:g} s at most)", e) from e
        return
    pending = list(zip(works, peers))
    pause = 1e-5
    while pending:
        still = []
        for work, peer in pending:
            try:
                if not work.is_completed():
                    still.append((work, peer))
                    continue
                work.wait()
            except RuntimeError as e:
                raise peer_lost(group, f"{what} (waiting on peer rank {peer})", e) from e
        pending = still
        if not pending:
            return
        # rank 0 saw a control link close (that rank will never send), or the time is up
        if lost_rank(group, patience=0) is not None or time.monotonic() > deadline:
            raise peer_lost(group, f"{what} (no word from peer rank {pending[0][1]} in {limit:g} s)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


def decide(group, why_not: Optional[str]):
    """The two-phase decision through the control plane: None (commit) or the ranks that
    were not prepared, with why (abort). A lost peer or a decision in doubt ends the job."""
    ctl = control(group)
    try:
        return ctl.decide(why_not)
    except ReshardError as e:
        failed(group, e)
        raise
