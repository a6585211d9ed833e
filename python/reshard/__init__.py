"""Reshard a distributed tensor between two DTensor layouts, point to point.

Every destination rank receives exactly the regions of the source shards that overlap its
own shard, from a rank that holds them, instead of an all-gather followed by a broadcast.

    >>> import reshard
    >>> src = reshard.Layout((8, 8), "bf16", mesh=2, ranks=None, placements=["S(0)"])
    >>> dst = reshard.Layout((8, 8), "bf16", mesh=4, ranks=range(2, 6), placements=[reshard.Shard(1)])
    >>> plan = reshard.plan(src, dst)
    >>> len(plan.transfers), plan.totals["bytes_remote"], plan.totals["gather_broadcast_bytes"]
    (8, 128, 640)
    >>> sorted(plan.for_rank(2).recvs)[0]
    Transfer(src=0, dst=2, offset=[0, 0], extent=[4, 2], bytes=16)
    >>> src
    Layout(shape=(8, 8), dtype='bf16', mesh=(2,), ranks=range(0, 2), placements=[Shard(0)])

Layouts, plans and errors come from the Rust core (``reshard._core``). ``reshard.torch``
moves torch tensors with ``torch.distributed`` point-to-point; it imports torch, this module
does not.

Every error is a :class:`ReshardError` (a ``ValueError``), and of one subclass that says its
kind: :class:`ArgumentError` (a bad argument, tensor or layout), :class:`AgreementError` (the
ranks disagree, or another rank refused: nothing was moved), :class:`ChecksumError` (a
transfer arrived changed), :class:`PeerLostError` (a peer died, closed its link or timed out),
:class:`InDoubtError` (a rank voted prepared and lost the coordinator before the decision),
:class:`VersionError` (a version reused, out of order, not staged or stale) and
:class:`AbortedError` (the job decided to abort a staged version); what fits none of them
(an internal failure, a malformed transfer) is a plain :class:`ReshardError`.
"""

from ._core import (
    DEFAULT_MIN_SPLIT_BYTES,
    AbortedError,
    AgreementError,
    ArgumentError,
    ChecksumError,
    InDoubtError,
    Layout,
    PeerLostError,
    Plan,
    RankPlan,
    Refit,
    Replicate,
    ReshardError,
    Shard,
    Transfer,
    VersionError,
    __version__,
    plan,
    quant_scale_dtype,
    quant_scale_shape,
    rank_plan,
    rank_program,
)

__all__ = [
    "DEFAULT_MIN_SPLIT_BYTES",
    "AbortedError",
    "AgreementError",
    "ArgumentError",
    "ChecksumError",
    "InDoubtError",
    "Layout",
    "PeerLostError",
    "Plan",
    "RankPlan",
    "Refit",
    "Replicate",
    "ReshardError",
    "Shard",
    "Transfer",
    "VersionError",
    "__version__",
    "plan",
    "quant_scale_dtype",
    "quant_scale_shape",
    "rank_plan",
    "rank_program",
]
