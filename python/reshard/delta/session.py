"""Delta refit of torch tensors: :class:`DeltaSession` keeps, across calls, what each source
rank last sent of every transfer (its base, in the wire dtype) and the version each
destination rank's shards hold; a refit then sends every transfer as the blocks that changed
against that base (:mod:`reshard.delta.codec`), or dense where the destination does not hold
the base.

A call runs in three exchanges on the group: the fence, an all-gather of a few integers per
rank (whether its arguments are good, the version its shards hold, the version of its bases,
the version it refits, a digest of the job), so that every rank knows before any data moves
who gets what dense and why, and every rank raises alike on a bad argument or a disagreement;
then the size of every message, point to point; then the messages, point to point, while each
rank copies the regions it holds on both sides (:mod:`reshard.delta.refit`); a staged
refit runs the same into a staging beside the live shards (:mod:`reshard.delta.stage`).
"""

from __future__ import annotations

import dataclasses

from typing import Dict, Optional, Tuple

import torch

from .._core import ArgumentError
from ..transfer.checks import group_cache, group_key
from . import stage as _stage
from .refit import DeltaReport, check_version, refit_live
from .stage import CommitReport, StageReport


@dataclasses.dataclass
class SessionState:
    """What a :class:`DeltaSession` keeps between refits, read and written by the modules of
    :mod:`reshard.delta` that run them (exchange, refit, stage); a caller reads the session's
    properties instead."""

    #: name -> identity of the destination tensor last refit: other tensors under a name
    #: (another model's) do not hold the session's version, so they get everything dense.
    destinations: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    #: The staging tensors by name, allocated once and kept across versions.
    spare: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: A staged version whose decision this rank never heard, or None.
    in_doubt: Optional[object] = None
    #: The epoch at which the staging and the live shards were alike, or None.
    spare_epoch: Optional[int] = None
    #: The version of the bases kept, or None.
    sent: Optional[int] = None
    #: The version the live destination shards serve, or None.
    serving: Optional[int] = None
    #: The staged version (its shadows, version and epoch), or None.
    stage: Optional[object] = None
    #: Changes to the live shards: a staging prepared before one is stale.
    epoch: int = 0
    #: name -> (sender's piece key -> (version, the region as sent)).
    bases: Dict[str, Dict[tuple, Tuple[int, torch.Tensor]]] = dataclasses.field(default_factory=dict)


class DeltaSession:
    """Refits that send only what changed, across calls on one process group.

    Every rank of ``group`` makes one session and calls :meth:`refit` with the same pairs as
    :func:`reshard.torch.reshard_many_` takes (a mapping of names to ``(src_local, dst_local,
    src_layout, dst_layout)``, or a :class:`reshard.Refit` with ``src`` and ``dst``), float
    casts included (an f32 source into a bf16 destination: the base is what was sent, in bf16,
    so a change that vanishes in bf16 sends nothing). Quantizing into fp8 (``quant``, an fp8
    destination of another source) is refused; fp8 already quantized on both sides moves as
    its bytes, by delta too.

    The first refit is dense. Each later one sends, for every transfer, the blocks of 4096
    elements that differ bit for bit from what this rank sent of it last time (new values,
    never differences), choosing per block the smallest of unchanged, offsets, bitmask or
    dense, provided the destination rank holds that version; a destination that holds another
    one (restarted, :meth:`forget`, :meth:`restore` of an older snapshot, a new replica) gets
    its regions dense in the same call, and the :class:`DeltaReport` says which ranks and why.

    ``anchor=N`` sends everything dense at every version that is a multiple of ``N``.
    Tensors move in buckets of about ``bucket_bytes`` of global tensor (as in
    :func:`reshard.torch.reshard_many_`), each bucket's messages built, exchanged and applied
    before the next: the staging memory of a call is about a bucket's outgoing and incoming
    messages (as large as its dense regions on a dense refit).
    ``checksum=True`` sends the CRC-32C of every new region, and the receiver compares it with
    its region after applying: a shard changed behind the session's back raises
    :class:`reshard.ReshardError` on that rank (which then holds no version, so the next refit
    sends it dense), never a silently wrong weight.

    Memory: with ``keep_base=True`` (the default) a source rank keeps one copy of each of its
    outgoing regions in the wire dtype (``DeltaReport.base_bytes``); with ``keep_base=False``
    it keeps nothing, and the caller passes ``previous=`` (its source tensors at the last
    refit's version, as ``src`` or the pairs' sources are given) to send a delta, or sends
    dense without it. Bases live on the tensors' device.

    Staged: :meth:`prepare` refits into a staging beside the live destination shards (which
    an engine keeps serving from) and returns once every rank holds the new version whole;
    :meth:`commit` then copies it onto the live shards, and :meth:`abort` drops it. A refit
    that fails on one rank so leaves every rank on the old version, and the engine pauses
    only for the copy.
    """

    def __init__(
        self,
        group=None,
        *,
        checksum: bool = False,
        anchor: Optional[int] = None,
        keep_base: bool = True,
        bucket_bytes: int = 1 << 30,
    ) -> None:
        if anchor is not None and (isinstance(anchor, bool) or not isinstance(anchor, int) or anchor < 1):
            raise ArgumentError(f"anchor: {anchor!r:.40} is invalid: it must be a positive integer or None")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ArgumentError(
                f"bucket_bytes: {bucket_bytes!r:.40} is invalid: it must be a positive integer"
            )
        self.bucket_bytes = bucket_bytes
        self.group = group
        self.checksum = bool(checksum)
        self.anchor = anchor
        self.keep_base = bool(keep_base)
        #: The version this rank's destination shards hold (None: unknown, so dense).
        self.held: Optional[int] = None
        #: The version of the last refit this rank took part in.
        self.last: Optional[int] = None
        #: The highest version this rank has refit, staged or restored: the next one must be
        #: above it on every rank (versions only increase).
        self.newest: Optional[int] = None
        #: What the session keeps between refits for the modules that run them.
        self.state = SessionState()

    @property
    def serving(self) -> Optional[int]:
        """The version this rank's live destination shards serve: the last one a
        :meth:`refit` or :meth:`commit` brought them to, or :meth:`restore` said (None before
        the first, or after a refit that failed while writing them)."""
        return self.state.serving

    @property
    def staged(self) -> Optional[int]:
        """The version :meth:`prepare` staged and no :meth:`commit` or :meth:`abort` has
        ended yet, or None."""
        return None if self.state.stage is None else self.state.stage.version

    @property
    def staging(self) -> Dict[str, torch.Tensor]:
        """The staged version's tensors by destination name (empty when nothing is staged)."""
        return {} if self.state.stage is None else dict(self.state.stage.shadows)

    @property
    def base_bytes(self) -> int:
        """Memory this rank keeps for bases, in bytes."""
        return sum(t.numel() * t.element_size() for per in self.state.bases.values() for _, t in per.values())

    def forget(self) -> None:
        """Drops this rank's bases and held version, as a restarted rank has neither: the next
        refit sends everything it sends dense and gets everything it receives dense; a staged
        version is dropped too (a restarted rank has none)."""
        self.state.stage = None
        self.state.in_doubt = None
        self.state.bases.clear()
        self.state.sent = None
        self.held = None
        self.state.destinations.clear()

    def restore(self, version: Optional[int]) -> None:
        """Says that this rank's destination shards now hold ``version`` (they were loaded from
        a snapshot of it; None: unknown), and serve it: a version staged before no longer
        commits."""
        self.held = None if version is None else check_version("version", version)
        self.state.serving = self.held
        self.state.epoch += 1
        if self.held is not None and (self.newest is None or self.newest < self.held):
            self.newest = self.held

    def refit(
        self, pairs, version: Optional[int] = None, *, src=None, dst=None, previous=None
    ) -> DeltaReport:
        """Brings every destination shard to ``version`` (the last refit's plus one when
        None; every rank passes the same), sending only what changed where the destination
        holds the base. Returns this rank's :class:`DeltaReport`. Raises
        :class:`reshard.ReshardError` on every rank, before any data moves, when a rank's
        arguments are bad or the ranks disagree on the job or the version, or when
        ``version`` is not above every version a rank has refit, staged or restored before
        (:class:`reshard.VersionError`: versions only increase). A rank whose destination
        tensors are not the ones the session refit last (another model's under the same
        names) gets everything dense, so a session shared by two models stays exact. A refit of some of
        the tensors brings the rank to ``version`` all the same: those left out go dense the
        next time they are refit (their bases are older than the version held). The shards
        serve ``version`` after it (:attr:`serving`); a version staged before no longer
        commits."""
        return refit_live(self, pairs, version, src, dst, previous)

    reshard_many_ = refit

    def prepare(
        self, pairs, version: Optional[int] = None, *, src=None, dst=None, previous=None, staging=None
    ) -> StageReport:
        """The first phase of a staged refit: moves ``version`` into a staging beside the
        destination tensors given (the live shards, which keep serving and are never written),
        as :meth:`refit` would into them, then every rank votes, through the job's control
        plane, whether its staging is whole. Returns this rank's :class:`StageReport` once
        every rank is prepared; otherwise every rank drops its staging and raises naming the
        ranks that were not, and the live shards serve what they served everywhere.

        ``staging=None`` allocates one copy of each destination tensor on the first prepare
        and keeps it for the next versions (``staging_bytes``); ``staging=`` gives the
        caller's tensors by destination name (each of the destination's shape, dtype and
        device, none sharing memory with a live tensor or another staging), which are first
        filled from the live shards: a delta applies to what they hold. While a version is
        staged, a second prepare is refused."""
        return _stage.prepare(self, pairs, version, src, dst, previous, staging)

    def commit(self, version: Optional[int] = None) -> CommitReport:
        """The second phase, a decision of the whole job: this rank checks that its live
        tensors are still those staged onto (same memory, shape and dtype) and votes to
        commit; every rank learns one decision, through the job's control plane. On commit,
        every rank copies the staged version onto its live shards in place (the engine's only
        pause) and returns its :class:`CommitReport`. On abort (a rank called :meth:`abort`,
        or could not commit), no rank writes anything, the staging is dropped everywhere and
        this call raises :class:`reshard.AbortedError` naming the ranks and why. A rank that
        voted and lost the job's rank 0 before the decision raises
        :class:`reshard.InDoubtError` and keeps its staging: :meth:`resolve` applies what the
        job decided once a later job learns it. Refused (on every rank alike) when nothing
        is staged or ``version`` is not the staged one."""
        return _stage.commit(self, version)

    def abort(self, version: Optional[int] = None) -> Optional[int]:
        """Votes against the staged version (``version``, if given, must be it) in the job's
        decision: no rank commits it, every rank drops it (the ranks that called
        :meth:`commit` raise :class:`reshard.AbortedError`), the live shards keep serving
        theirs, and the next refit sends them dense where the senders' bases moved on to the
        version dropped. Returns the version dropped (None: nothing was staged)."""
        return _stage.abort(self, version)

    def resolve(self, commit: bool) -> Optional[int]:
        """Ends a decision this rank is in doubt about (:class:`reshard.InDoubtError`), as the
        job decided it: ``commit=True`` when any rank applied the commit, ``False`` when any
        aborted (or none knows: no living rank committed). On this rank alone. Returns the
        version the live shards then serve."""
        return _stage.resolve(self, commit)

    def staging_bytes(self, pairs, *, dst=None) -> int:
        """The bytes :meth:`prepare` with these arguments allocates on this rank for its
        staging, known before anything moves (the size of this rank's destination tensors)."""
        return _stage.staging_bytes(pairs, dst)


# (process group, model, checksum, bucket_bytes) -> the session of reshard_many_(delta=True)
_SESSIONS: Dict[tuple, DeltaSession] = group_cache({})


def module_session(group, checksum: bool, bucket_bytes, model: Optional[str] = None) -> DeltaSession:
    """The session :func:`reshard.torch.reshard_many_` with ``delta=True`` (and no
    ``session``) refits with: one per process group (a group destroyed and made again gets
    new ones), ``model``, ``checksum`` and ``bucket_bytes``."""
    key = (group_key(group), model, bool(checksum), bucket_bytes)  # a destroyed group's go
    if key not in _SESSIONS:
        _SESSIONS[key] = DeltaSession(group, checksum=checksum, bucket_bytes=bucket_bytes)
    return _SESSIONS[key]


def refit_many(
    pairs,
    group,
    checksum: bool,
    bucket_bytes,
    session,
    version,
    src,
    dst,
    previous,
    model=None,
    problem=None,
    **unsupported,
):
    """:func:`reshard.torch.reshard_many_` with ``delta=`` (a ``reshard.torch.Delta``'s
    fields): a refit of ``session`` (without one, the module's session of ``group``,
    ``model``, ``checksum`` and ``bucket_bytes``). ``problem`` is a bad option found before
    (refused on every rank, as the ones found here), ``unsupported`` the fp8 options, refused
    when given."""
    if model is not None and not isinstance(model, str):
        problem = problem or f"model: expected a name (str), got {type(model).__name__}"
        model = None
    if session is None:
        session = module_session(group, checksum, bucket_bytes, model)
    elif not isinstance(session, DeltaSession):
        raise ArgumentError(f"session: expected a reshard.torch.DeltaSession, got {type(session).__name__}")
    elif model is not None:
        problem = problem or "model: given with a session (a DeltaSession is one model's already)"
    elif group is not None and group is not session.group:
        problem = problem or (
            "group: differs from the session's group (a DeltaSession refits the group it was made with)"
        )
    elif checksum and not session.checksum:
        problem = problem or "checksum: True, but the session was made without (DeltaSession(checksum=True))"
    for what, value in unsupported.items():
        if value is not None and problem is None:
            problem = f"{what}: a delta refit does not quantize into fp8; refit such tensors without delta"
    return refit_live(session, pairs, version, src, dst, previous, problem)
