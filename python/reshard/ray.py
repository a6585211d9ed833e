"""One reshard job across two pools of Ray actors: trainers and engines, refits run from the
driver.

RL frameworks place their trainer and their inference engine as Ray actors. A
:class:`RefitJob` joins both pools in one ``torch.distributed`` process group (the trainers
are ranks ``0..T-1`` in the order given, the engines ``T..T+E-1``: the refit's training and
inference ranks), each actor builds the same :class:`reshard.Refit` from the model and the
parallelism, and :meth:`RefitJob.refit` has every actor run its part of one refit at once.

The actors' classes take :class:`ReshardActor` as a base and say what they hold:

* a trainer, ``reshard_source()``: its training shards by the refit's names (a DTensor model's
  ``dict(named_parameters())`` as FSDP2 leaves it, or local tensors);
* an engine, ``reshard_destination()``: the tensors to write, by the refit's names, or with
  ``engine="vllm"`` (or ``"sglang"``) its own ``dict(named_parameters())``
  (:mod:`reshard.engine`).

    job = RefitJob(trainers, engines, "config.json", "fsdp=2", "tp=2", engine="vllm")
    job.refit()          # after every training step: seconds per rank
    job.close()

Every wait is bounded (``timeout_s``): an actor that fails or hangs makes :meth:`refit`
raise, naming it, instead of the driver waiting for ever.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

import ray

from ._core import ArgumentError, PeerLostError, Refit, ReshardError


class ReshardActor:
    """The base of an actor class that takes part in a :class:`RefitJob`."""

    def reshard_call(self, fn, *args):
        """Runs ``fn(self, *args)`` in the actor (the job's steps)."""
        return fn(self, *args)

    def reshard_source(self):
        """A trainer's training shards by name; None on an actor that sends nothing."""
        return None

    def reshard_destination(self):
        """An engine's tensors to write by name; None on an actor that receives nothing."""
        return None


def _address(actor) -> tuple:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _join(actor, rank: int, world: int, address: str, port: int, timeout_s: float, backend: str, refit_args):
    import torch.distributed as dist

    if dist.is_initialized():
        raise ArgumentError(f"rank {rank}: the actor is in a process group already (one job per actor)")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    model, train, infer, options = refit_args
    actor._reshard_job = (rank, Refit(model, train, infer, **options))
    return rank


def _refit(actor, engine: Optional[str], options: Dict[str, Any]) -> float:
    from . import torch as rt
    from .engine import refit_engine_

    rank, refit = actor._reshard_job
    src = actor.reshard_source() if rank < refit.train_ranks else None
    dst = actor.reshard_destination() if rank >= refit.infer_base else None
    start = time.perf_counter()
    if engine is None:
        rt.reshard_many_(refit, src=src, dst=dst, **options)
    else:
        refit_engine_(refit, src, dst, engine_kind=engine, **options)
    return time.perf_counter() - start


def _leave(actor) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    actor._reshard_job = None


class RefitJob:
    """A refit job over ``trainers`` and ``engines`` (Ray actor handles whose classes derive
    from :class:`ReshardActor`): one process group, one :class:`reshard.Refit` of ``model``
    with ``train`` and ``infer`` parallelism (``refit_options``: as :class:`reshard.Refit`
    takes them, ``train_dtype="f32"`` say)."""

    def __init__(
        self,
        trainers: Sequence[Any],
        engines: Sequence[Any],
        model: str,
        train: str,
        infer: str,
        *,
        engine: Optional[str] = None,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        **refit_options,
    ) -> None:
        refit = Refit(model, train, infer, **refit_options)
        if refit.train_ranks != len(trainers):
            raise ArgumentError(
                f"trainers: {len(trainers)} actors, but train={train!r} has {refit.train_ranks} ranks"
            )
        if refit.infer_ranks != len(engines):
            raise ArgumentError(
                f"engines: {len(engines)} actors, but infer={infer!r} has {refit.infer_ranks} ranks"
            )
        if refit.infer_base != refit.train_ranks:
            raise ArgumentError("colocated refits: a trainer actor is also an engine; give disjoint pools")
        if engine is not None and engine not in ("vllm", "sglang"):
            raise ArgumentError(f"engine: {engine!r} is not one of vllm, sglang (or None)")
        self.actors: List[Any] = list(trainers) + list(engines)
        self.engine = engine
        self.timeout_s = timeout_s
        address, port = self._get([self.actors[0].reshard_call.remote(_address)], "finding an address")[0]
        args = (str(model), train, infer, dict(refit_options))
        calls = [
            actor.reshard_call.remote(_join, rank, len(self.actors), address, port, timeout_s, backend, args)
            for rank, actor in enumerate(self.actors)
        ]
        self._get(calls, "joining the process group")

    def _get(self, refs, what: str):
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if pending:
            late = [self.actors[refs.index(r)] for r in pending] if len(refs) == len(self.actors) else pending
            raise PeerLostError(
                f"{what}: {len(pending)} of {len(refs)} actors did not answer in {self.timeout_s} s "
                f"({late[:4]})"
            )
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            # the actor's own error, of its kind (a bad argument, a lost peer, ...)
            cause = getattr(e, "cause", None)
            kind = type(cause) if isinstance(cause, ReshardError) else ReshardError
            raise kind(f"{what}: {e}") from None

    def refit(self, **options) -> List[float]:
        """One refit on every actor at once; each rank's seconds, by rank. ``options`` as
        :func:`reshard.torch.reshard_many_` takes them (``checksum=True``,
        ``delta=reshard.torch.Delta(model="policy")``)."""
        calls = [actor.reshard_call.remote(_refit, self.engine, options) for actor in self.actors]
        return self._get(calls, "refit")

    def close(self) -> None:
        """Leaves the process group on every actor."""
        self._get([actor.reshard_call.remote(_leave) for actor in self.actors], "closing")
