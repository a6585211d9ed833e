"""reshard as a verl checkpoint engine: the trainer's local shards (verl's shard export) go
straight into the rollout workers' buffers, point to point, nothing gathered on either side.

Selected in verl's config as::

    actor_rollout_ref.rollout.checkpoint_engine.backend=reshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=reshard.verl_backend

verl imports the module on every worker before it builds the engine, and the import registers
:class:`ReshardCheckpointEngine` in ``CheckpointEngineRegistry`` under ``"reshard"``. Its
keyword arguments come from ``checkpoint_engine.engine_kwargs.reshard`` (the same on both
sides), ``bucket_size`` from ``update_weights_bucket_megabytes``.

The round is verl's: ``prepare`` on every worker (the master, actor rank 0, opens the store
the job's process group meets at), ``build_topology`` (actor workers are the job's ranks
``0..A-1``, rollout workers ``A..A+R-1``), ``init_process_group`` (the job's group, one
process group across trainer and rollout processes, beside each process's own default group;
built once and kept unless ``rebuild_group``), then ``send_weights`` on the actor workers and
``receive_weights`` on the rollout ones, then ``finalize``.

``send_weights`` takes, on every actor worker:

* verl's shard export, ``(name, local shard, ShardSpec)`` as
  ``engine.get_per_tensor_param_shard()`` yields it (or the training engine itself, whose
  export is then read): each ShardSpec (mesh, placements, full shape; or an explicit
  ``place``) becomes a :class:`reshard.Layout` of the trainer's ranks in the job's group, and
  the local shard moves as it is;
* or ``(name, tensor)`` pairs, as verl's ``get_per_tensor_param()`` yields them: full tensors,
  replicated on every trainer rank (a DTensor is read as its mesh and placements say).

verl 0.9's actor worker (``update_weights``) hands a checkpoint engine the training engine only
for ``delta_sharded``, and ``get_per_tensor_param()`` (gathered) to every other backend: this
one takes that too, and moves the shards where the worker passes ``self.actor.engine`` (or its
``get_per_tensor_param_shard()`` export) instead.

Tensors go in buckets of about ``bucket_size`` bytes of full tensor. Per bucket, every rank of
the job exchanges the bucket's descriptions (one ``all_gather_object``) and derives the same
source and destination layouts from them; one :func:`reshard.torch.reshard_many_` then moves
every region from a trainer rank that holds it into the rollout ranks' new buffers, in place.

The rollout side's layout is replicated on every rollout rank (``receive_weights`` yields
``(name, full tensor)``, the ``"named_tensors"`` contract verl's server adapters load), or,
with ``rollout_tp`` and ``rollout_shard_dims`` (a regular expression on the name: the tensor
dim), split over each group of ``rollout_tp`` consecutive rollout ranks, each rank receiving
and yielding only its own shard under the tensor's name (for a consumer that loads shards).

A ShardSpec the layouts cannot express (a converter, a Partial placement, blocks that are no
DTensor split) is refused with :class:`reshard.ArgumentError` naming the parameter, on every
rank of the job alike, before any byte of its bucket moves (earlier buckets have arrived).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import time
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from . import dtensor as _dt
from ._core import AgreementError, ArgumentError, Layout, Replicate, ReshardError, Shard
from . import _verl_specs as specs
from .torch import reshard_many_, torch_dtype
from .transfer.job_group import job_group

BACKEND = "reshard"

__all__ = ["BACKEND", "ReshardCheckpointEngine"]


@CheckpointEngineRegistry.register(BACKEND)
class ReshardCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over reshard (see the module's docstring).

    Args:
        bucket_size: bytes of full tensor per exchange (verl's ``update_weights_bucket_megabytes``).
        is_master: this worker opens the job's store (verl sets it on actor rank 0).
        rebuild_group: make the job's group anew at every round (and drop it in ``finalize``).
        master_addr: the address the master's store listens on (default: the Ray node's
            address, else ``MASTER_ADDR``, else 127.0.0.1).
        backend: the job group's torch.distributed backend (default: ``"cpu:gloo,cuda:nccl"``
            where CUDA is available, else ``"gloo"``); the master's choice holds for all.
        rollout_tp: rollout ranks per replica, which split the tensors of ``rollout_shard_dims``.
        rollout_shard_dims: regular expression on a tensor's name (``re.search``) to the tensor
            dim its rollout shards split; the first that matches counts.
        rollout_dtype: float dtype the rollout side receives floats in (default: the trainer's).
        checksum: every message carries CRC-32C sums of its regions (:func:`reshard.torch.reshard_`).
        timeout_s: how long the job's group waits for a peer.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 1 << 30,
        is_master: bool = False,
        rebuild_group: bool = False,
        master_addr: Optional[str] = None,
        backend: Optional[str] = None,
        rollout_tp: int = 1,
        rollout_shard_dims: Optional[Mapping[str, int]] = None,
        rollout_dtype: Any = None,
        checksum: bool = False,
        timeout_s: float = 1800.0,
    ) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ArgumentError(f"bucket_size: {bucket_size!r} is not a positive number of bytes")
        if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1:
            raise ArgumentError(f"rollout_tp: {rollout_tp!r} is not a positive integer")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.rebuild_group = bool(rebuild_group)
        self.master_addr = master_addr
        self.backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        self.rollout_tp = rollout_tp
        self.rollout_shard_dims = _shard_rules(rollout_shard_dims)
        self.rollout_dtype = _float_dtype_name(rollout_dtype)
        self.checksum = bool(checksum)
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.actor_world_size: Optional[int] = None
        self.group = None
        self._store = None
        self._addr: Optional[str] = None
        self._key: Optional[tuple] = None
        self._job: Optional[_Job] = None

    # ---- verl's round: prepare, build_topology, init_process_group, finalize ----

    def prepare(self) -> Dict[str, Any]:
        """The master opens the store the job's group meets at and says where it is."""
        if not self.is_master:
            return {"master": None}
        if self._store is None:
            self._addr = self.master_addr or _node_address()
            self._store = dist.TCPStore(
                self._addr, 0, is_master=True, wait_for_workers=False, timeout=self.timeout
            )
        return {"master": {"addr": self._addr, "port": int(self._store.port), "backend": self.backend}}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: List[Dict[str, Any]]
    ) -> Tuple[Dict[str, List[Any]], Dict[str, List[Any]]]:
        """Actor workers are the job's ranks ``0..A-1``, rollout workers ``A..A+R-1``."""
        actors, rollouts = int(actor_wg_world_size), int(rollout_world_size)
        if actors < 1 or rollouts < 1:
            raise ArgumentError(
                f"build_topology: {actors} actor and {rollout_world_size} rollout workers; "
                "a refit needs at least one of each"
            )
        if len(metadata) != actors + rollouts:
            raise ArgumentError(
                f"metadata: {len(metadata)} entries for {actors} actor and {rollouts} rollout workers"
            )
        masters = [m["master"] for m in metadata[:actors] if isinstance(m, Mapping) and m.get("master")]
        if len(masters) != 1:
            raise ArgumentError(
                f"metadata: {len(masters)} actor workers are the master (is_master=True); exactly one must be"
            )
        world = actors + rollouts
        common = {"world_size": world, "actor_world_size": actors, "master": masters[0]}
        actor_kwargs = {"rank": list(range(actors)), **{k: [v] * actors for k, v in common.items()}}
        rollout_kwargs = {
            "rank": list(range(actors, world)),
            **{k: [v] * rollouts for k, v in common.items()},
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(
        self, rank: int, world_size: int, actor_world_size: int, master: Mapping[str, Any]
    ) -> None:
        """Joins the job's group (kept from the last round where it is the same job), and
        learns who is who and what the rollout side asks for (one ``all_gather_object``)."""
        key = (master["addr"], int(master["port"]), master["backend"], int(actor_world_size), int(world_size))
        if self._key == key and self.rank == rank:
            return
        self._drop_group()
        if self.is_master and self._store is not None:
            store = self._store
        else:
            store = dist.TCPStore(master["addr"], int(master["port"]), is_master=False, timeout=self.timeout)
        name = "reshard-verl-{}-{}-{}-{}".format(*key[:2], *key[3:])
        world_rank = dist.get_rank() if dist.is_initialized() else None  # in the trainer's own world
        self.group = job_group(store, rank, world_size, master["backend"], name, self.timeout)
        self.rank, self.world_size, self.actor_world_size = rank, world_size, actor_world_size
        self._key = key
        self._job = None
        device = _transfer_device(master["backend"])
        mine = {
            "world_rank": world_rank,
            "rollout_tp": self.rollout_tp,
            "rollout_shard_dims": [(p.pattern, d) for p, d in self.rollout_shard_dims],
            "rollout_dtype": self.rollout_dtype,
        }
        heard: List[Any] = [None] * world_size
        dist.all_gather_object(heard, mine, group=self.group)
        # a first collective on the transfer device makes its communicator before any
        # point-to-point batch that not every rank joins (NCCL wants it so)
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)
        try:
            self._job = _Job(heard, rank, actor_world_size, device)
        except ReshardError:  # alike on every rank: all of them make the group anew next time
            self._drop_group()
            raise

    def finalize(self) -> None:
        """With ``rebuild_group``, the job's group (and the master's store) go."""
        if self.rebuild_group:
            self._drop_group()
            self._store = None

    # ---- the transfer ----

    async def send_weights(self, weights, global_steps: Optional[int] = None) -> Dict[str, float]:
        """Sends the weights of this actor worker: verl's ``(name, local shard, ShardSpec)``
        export (or the training engine, whose shard export is read), or ``(name, tensor)``
        pairs of full tensors. Every actor worker gives the same names in the same order.

        Where the export itself raises, the other ranks of the job learn it (they raise
        :class:`reshard.AgreementError` instead of waiting) and this one raises it."""
        job = self._ready()
        if not job.is_actor:
            raise ArgumentError(f"send_weights: rank {self.rank} of the job is a rollout worker")
        if hasattr(weights, "get_per_tensor_param_shard"):
            weights, _ = weights.get_per_tensor_param_shard()
        start, tensors, nbytes = time.time(), 0, 0
        bucket: List[Tuple[str, tuple, Optional[torch.Tensor]]] = []
        filled = 0
        items = _items(weights)
        while True:
            try:
                item = await items.__anext__()
            except StopAsyncIteration:
                break
            except Exception as e:  # the export failed: the job hears it, then this rank raises it
                try:
                    await self._in_thread(self._send_bucket, [], True, f"{type(e).__name__}: {e}")
                except AgreementError:
                    pass
                raise
            name, desc, local = specs.describe(item)
            size = specs.full_bytes(desc)
            if bucket and filled + size > self.bucket_size:
                await self._in_thread(self._send_bucket, bucket, False)
                bucket, filled = [], 0
            bucket.append((name, desc, local))
            filled += size
            tensors += 1
            nbytes += size
        await self._in_thread(self._send_bucket, bucket, True)
        return {
            "checkpoint_engine/reshard_tensors": float(tensors),
            "checkpoint_engine/reshard_mbytes": nbytes / (1 << 20),
            "checkpoint_engine/reshard_seconds": time.time() - start,
        }

    async def receive_weights(
        self, global_steps: Optional[int] = None
    ) -> AsyncIterator[Tuple[str, torch.Tensor]]:
        """Yields ``(name, tensor)`` as each bucket arrives: full tensors (or this rank's
        shard, where ``rollout_shard_dims`` splits one), in new buffers the caller keeps."""
        job = self._ready()
        if job.is_actor:
            raise ArgumentError(f"receive_weights: rank {self.rank} of the job is an actor worker")
        last = False
        while not last:
            received, last = await self._in_thread(self._receive_bucket)
            for name, tensor in received:
                yield name, tensor

    def _send_bucket(self, bucket, last: bool, failed: Optional[str] = None) -> None:
        job = self._job
        said = {
            "names": [n for n, _, _ in bucket],
            "descs": [d for _, d, _ in bucket],
            "last": last,
            "failed": failed,
        }
        entries, _ = job.agree(self._gather(said))
        locals_ = {n: t for n, _, t in bucket}
        pairs = {}
        for name, src_layout, dst_layout, _ in entries:
            pairs[name] = (job.source(locals_[name], src_layout), None, src_layout, dst_layout)
        self._move(pairs)

    def _receive_bucket(self) -> Tuple[List[Tuple[str, torch.Tensor]], bool]:
        job = self._job
        entries, last = job.agree(self._gather(None))
        pairs, out = {}, []
        for name, src_layout, dst_layout, slots in entries:
            shape = dst_layout.local_shape(job.rank)
            dst = torch.empty(shape, dtype=torch_dtype(dst_layout), device=job.device)
            pairs[name] = (None, dst, src_layout, dst_layout)
            if slots is None:
                out.append((name, dst))
            else:  # the identity split of a stacked parameter: slot e is full[e]
                out.extend((hf_name, dst[e].view(hf_shape)) for e, (hf_name, hf_shape) in enumerate(slots))
        self._move(pairs)
        return out, last

    def _gather(self, said) -> List[Any]:
        heard: List[Any] = [None] * self.world_size
        dist.all_gather_object(heard, said, group=self.group)
        return heard

    def _move(self, pairs) -> None:
        if pairs:  # every rank knows alike whether a bucket is empty
            reshard_many_(pairs, group=self.group, bucket_bytes=self.bucket_size, checksum=self.checksum)

    async def _in_thread(self, fn, *args):
        """Runs a blocking exchange off the event loop, on this thread's CUDA device."""
        cuda = torch.cuda.current_device() if self._job.device.type == "cuda" else None

        def run():
            if cuda is not None:
                torch.cuda.set_device(cuda)
            return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(None, run)

    def _ready(self) -> "_Job":
        if self._job is None:
            raise ArgumentError("init_process_group: not called (or failed) on this worker")
        return self._job

    def _drop_group(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.group, self._key, self._job = None, None, None
        self.rank = self.world_size = self.actor_world_size = None


class _Job:
    """What every rank of the job knows alike after ``init_process_group``: which ranks are
    the trainer's (and their ranks in the trainer's own world), and the rollout side's layout
    rules; from them and a bucket's descriptions, every rank derives the same layouts."""

    def __init__(self, heard: List[Mapping[str, Any]], rank: int, actors: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.actors = list(range(actors))
        self.rollouts = list(range(actors, len(heard)))
        self.is_actor = rank < actors
        # a trainer world rank that two actor workers report (two worlds) names no one
        self.job_rank_of: Dict[int, Optional[int]] = {}
        for r in self.actors:
            world_rank = heard[r]["world_rank"]
            if world_rank is not None:
                self.job_rank_of[world_rank] = None if world_rank in self.job_rank_of else r
        said = [
            (h["rollout_tp"], tuple(map(tuple, h["rollout_shard_dims"])), h["rollout_dtype"])
            for h in (heard[r] for r in self.rollouts)
        ]
        for r, theirs in zip(self.rollouts, said):
            if theirs != said[0]:
                raise AgreementError(
                    f"rollout_tp, rollout_shard_dims, rollout_dtype: rollout ranks {self.rollouts[0]} "
                    f"and {r} of the job were set up differently ({said[0]} and {theirs})"
                )
        self.tp, rules, self.dtype = said[0]
        self.rules = [(re.compile(p), int(d)) for p, d in rules]
        if len(self.rollouts) % self.tp:
            raise ArgumentError(
                f"rollout_tp: {self.tp} does not divide the {len(self.rollouts)} rollout workers"
            )

    def agree(self, heard: List[Any]) -> Tuple[List[tuple], bool]:
        """The bucket every actor rank described, as ``(name, src layout, dst layout, slots)``,
        and whether it is the last; raises alike on every rank where it cannot be moved."""
        for r in self.actors:
            if heard[r]["failed"] is not None:
                raise AgreementError(
                    f"nothing was moved: trainer rank {r}'s export raised {heard[r]['failed']}"
                )
        first = heard[self.actors[0]]
        for r in self.actors[1:]:
            theirs = heard[r]
            if theirs["last"] != first["last"] or theirs["names"] != first["names"]:
                ours, other = first["names"], theirs["names"]
                at = min(len(ours), len(other))
                at = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), at)
                end = "(the end of the export)"
                raise AgreementError(
                    f"nothing was moved: trainer ranks {self.actors[0]} and {r} of the job export other "
                    f"tensors, at position {at} of a bucket: {ours[at] if at < len(ours) else end} and "
                    f"{other[at] if at < len(other) else end} (every trainer rank gives the same names "
                    "in the same order)"
                )
        twice = next((n for i, n in enumerate(first["names"]) if n in first["names"][:i]), None)
        if twice is not None:
            raise ArgumentError(f"{twice}: the export gives it twice")
        entries = []
        for i, name in enumerate(first["names"]):
            src_layout, slots = self._source_layout(name, [heard[r]["descs"][i] for r in self.actors])
            entries.append((name, src_layout, self._destination_layout(name, src_layout, slots), slots))
        return entries, first["last"]

    def source(self, local: Optional[torch.Tensor], layout: Layout) -> Optional[torch.Tensor]:
        """This trainer rank's shard of ``layout``, shaped as the layout's box (a flat export
        is viewed so) and on the transfer device; a shard that does not fit is left as it is,
        for reshard to refuse on every rank."""
        shape = layout.local_shape(self.rank)
        if shape is None or local is None:  # a rank outside the tensor's mesh sends none of it
            return None
        if local.numel() == specs.numel(shape) and tuple(local.shape) != tuple(shape):
            local = local.reshape(shape)
        if local.device.type != self.device.type:
            local = local.to(self.device)
        return local

    def _source_layout(self, name: str, descs: List[tuple]) -> Tuple[Layout, Optional[tuple]]:
        for desc in descs:  # the first trainer rank's refusal, on every rank of the job
            if desc[0] == "refuse":
                raise ArgumentError(desc[1])
        if len({(d[0], d[1], d[2], d[-1]) for d in descs}) != 1 or (
            descs[0][0] == "mesh" and len(set(descs)) != 1
        ):
            raise AgreementError(
                f"{name}: nothing was moved: the trainer ranks describe it differently "
                f"({'; '.join(sorted(set(map(specs.short, descs))))})"
            )
        kind, shape, dtype, slots = descs[0][0], descs[0][1], descs[0][2], descs[0][-1]
        try:
            if kind == "whole":
                return Layout(shape, dtype, [len(self.actors)], self.actors, [Replicate()]), slots
            if kind == "mesh":
                _, _, _, mesh, ranks, placements, _ = descs[0]
                unknown = [r for r in ranks if self.job_rank_of.get(r) is None]
                if unknown:
                    raise ArgumentError(
                        f"ShardSpec.mesh: rank {unknown[0]} of the trainer's world is no (single) actor "
                        "worker of this job"
                    )
                job_ranks = tuple(self.job_rank_of[r] for r in ranks)
                return _dt.layout_of((shape, dtype, mesh, job_ranks, placements), None), slots
            boxes = [(r, d[3], d[4], d[5]) for r, d in zip(self.actors, descs)]
            return specs.box_layout(shape, dtype, boxes), slots
        except ReshardError as e:  # the layout's own refusal, named after the parameter
            raise type(e)(f"{name}: {e}") from None

    def _destination_layout(self, name: str, src: Layout, slots: Optional[tuple]) -> Layout:
        dtype = src.dtype
        if self.dtype is not None and torch_dtype(src).is_floating_point:
            dtype = self.dtype
        dim = next((d for pattern, d in self.rules if pattern.search(name)), None)
        ranks = self.rollouts
        if dim is None or self.tp == 1:
            return Layout(src.shape, dtype, [len(ranks)], ranks, [Replicate()])
        if slots is not None:
            raise ArgumentError(
                f"{name}: rollout_shard_dims splits it, but its ShardSpec.hf_slots stack several HF "
                "tensors: a stacked parameter is received whole"
            )
        if not -len(src.shape) <= dim < len(src.shape):
            raise ArgumentError(
                f"{name}: rollout_shard_dims: dim {dim} of a tensor of shape {list(src.shape)}"
            )
        dim %= len(src.shape)
        return Layout(src.shape, dtype, [len(ranks) // self.tp, self.tp], ranks, [Replicate(), Shard(dim)])


async def _items(weights):
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _shard_rules(rules) -> List[Tuple["re.Pattern[str]", int]]:
    if rules is None:
        return []
    if not isinstance(rules, Mapping):
        raise ArgumentError(
            f"rollout_shard_dims: {type(rules).__name__} is not a mapping of name patterns to tensor dims"
        )
    out = []
    for pattern, dim in rules.items():
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ArgumentError(f"rollout_shard_dims: {pattern!r}: {dim!r} is not a tensor dim")
        try:
            out.append((re.compile(pattern), dim))
        except (re.error, TypeError) as e:
            raise ArgumentError(f"rollout_shard_dims: {pattern!r} is no regular expression ({e})") from None
    return out


def _float_dtype_name(dtype) -> Optional[str]:
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    name = {
        "bf16": "bfloat16",
        "f16": "float16",
        "fp16": "float16",
        "f32": "float32",
        "fp32": "float32",
        "f64": "float64",
    }.get(name, name)
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ArgumentError(f"rollout_dtype: {dtype!r} is not a float dtype")
    return str(found).replace("torch.", "")


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


def _transfer_device(backend: str) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
