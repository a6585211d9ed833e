"""reshard as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "reshard"}'``.

The package registers it in every vLLM process through its ``vllm.general_plugins`` entry
point (:func:`register`). Each refit is a :func:`reshard.engine.refit_engine_` by the map
vLLM's own loader gives (recorded from it once), fused parameters (``qkv_proj``,
``gate_up_proj``, ``w13``/``w2``) included; optionally a delta refit (only what changed
moves) and a staged one (the new weights wait beside the live ones until every rank voted;
an abort leaves the old weights).

Two ways to run it:

- **A separate trainer job** refits a running ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``)
  through vLLM's own trainer API, on every trainer rank::

      trainer = WeightTransferTrainerFactory.trainer_init(
          ReshardTrainerInitInfo(rank=r, train="fsdp=2"),
          client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
      trainer.send_weights()

  Trainer rank 0 opens a rendezvous (address, a port the system picks, a per-job secret) and
  passes it in the init info; the trainer's ranks and every worker then form one group across
  the two jobs (:mod:`reshard.transfer.job_group`; gloo for CPU tensors, NCCL for CUDA ones),
  neither job's own groups changed, and only the overlapping regions move. The trainer's
  tensors are read as they are (an FSDP2 module's DTensors as their local shards, never
  gathered). The worker refits *the model as served* (:mod:`reshard.vllm_served`): the
  regions land in a mirror of the model in its loader's format, and vLLM's post-load step is
  redone from it for every layer, the results copied into the live tensors in place. Staged,
  the prepare runs while the server serves (on a thread of each worker); then the server is
  paused, the job decides, every worker commits or none does, its prefix cache is reset and
  it resumes: :attr:`ReshardTrainer.reports` holds each round's times and pause.
- **Colocated**: the trainer runs in the processes of vLLM's workers
  (``distributed_executor_backend="external_launcher"``), every process a trainer rank and a
  worker, and :class:`ColocatedClient` calls the worker's engine in the same process.

One round, from the trainer: ``start_weight_update``, ``update_weights({"version": v})``
(``"phase": "prepare"`` then ``"commit"`` or ``"abort"`` when staged), ``finish_weight_update``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclasses_fields
from typing import Any, ClassVar, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import engine as _engine
from ._core import ArgumentError, Refit, ReshardError

BACKEND = "reshard"
logger = logging.getLogger(__name__)
PHASES = ("refit", "prepare", "commit", "abort", "broadcast")
#: The refusal of an init while the last trainer's round is open (it was killed inside it).
OPEN_ROUND = "reshard: a weight update of the last trainer is still open (end it with /finish_weight_update)"
BACKENDS = ("gloo", "nccl")

# The trainer's local shards of this process, for the worker of this process (colocated): set
# by ReshardTrainer.send_weights for the length of one round.
_OUTBOX: Dict[str, Optional[Dict[str, torch.Tensor]]] = {"src": None}


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """What a worker needs to take part in refits (JSON-serialisable)."""

    #: The trainer's parallelism, as :class:`reshard.Refit` reads it (``"fsdp=8"``, ``"tp=2"``).
    train: str
    #: The checkpoint's ``config.json`` (default: the served model's).
    config: Optional[str] = None
    #: The trainer's dtype (default: the engine's).
    train_dtype: Optional[str] = None
    #: Send only what changed since the last refit (a :class:`reshard.torch.DeltaSession`).
    delta: bool = False
    #: Refit in two phases: prepare (beside the live weights), then commit or abort.
    staged: bool = False
    #: Check every message's CRC.
    checksum: bool = False
    #: A separate trainer job: where its rank 0 opened the job's rendezvous (None: colocated).
    master_address: Optional[str] = None
    master_port: Optional[int] = None
    #: The job's secret: only the workers told it meet the trainer at the rendezvous.
    secret: Optional[str] = None
    #: The data plane across the two jobs: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
    backend: str = "gloo"
    #: Seconds any rank waits for another before it gives up (the job's ``RESHARD_TIMEOUT``).
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_init_info(asdict(self))


def check_init_info(info: Dict[str, Any]) -> None:
    """Refuses a bad init info, naming the field (before anything is joined or moved)."""
    train = info.get("train")
    if not isinstance(train, str) or not train:
        raise ArgumentError(f"train: {train!r:.60} is invalid: the trainer's parallelism, e.g. 'fsdp=2'")
    for key in ("delta", "staged", "checksum"):
        if not isinstance(info.get(key, False), bool):
            raise ArgumentError(f"{key}: {info.get(key)!r:.40} is invalid: true or false")
    for key in ("config", "train_dtype", "secret", "master_address"):
        value = info.get(key)
        if value is not None and not isinstance(value, str):
            raise ArgumentError(f"{key}: {value!r:.40} is invalid: a string or null")
    if info.get("backend", "gloo") not in BACKENDS:
        raise ArgumentError(f"backend: {info.get('backend')!r:.40} is not one of {', '.join(BACKENDS)}")
    port = info.get("master_port")
    if info.get("master_address") is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ArgumentError(f"master_port: {port!r:.40} is invalid: a TCP port (1-65535)")
        if not info.get("secret"):
            raise ArgumentError("secret: a separate trainer job names its secret")
    elif port is not None:
        raise ArgumentError(f"master_port: {port!r:.40} without master_address")
    limit = info.get("timeout_s", 60.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < 1e6:
        raise ArgumentError(f"timeout_s: {limit!r:.40} is invalid: a positive number of seconds")


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """One step of a round: the weights' version (increasing) and the phase."""

    version: int
    phase: str = "refit"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ArgumentError(f"phase: {self.phase!r:.40} is not one of {', '.join(PHASES)}")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ArgumentError(f"version: {self.version!r:.40} is invalid: a non-negative integer")


def _group_name(secret: str) -> str:
    return "reshard-vllm-" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def _introduce(group, world: int, mine: Dict[str, Any]) -> List[Dict[str, Any]]:
    """What every rank of a new job tells the others once: the engine's side says its
    parallelism and dtype, from which the trainer makes the same refit."""
    import torch.distributed as dist

    heard: List[Any] = [None] * world
    dist.all_gather_object(heard, mine, group=group)
    return heard


class _Job:
    """A worker's part of a job with a separate trainer: the group across the two jobs (joined
    on a thread, so that ``/init_weight_transfer_engine`` answers at once), the refit and the
    served model's mirror."""

    def __init__(
        self, info: ReshardInitInfo, refit: Refit, rank: int, served, infer: str, dtype: str
    ) -> None:
        self.info, self.refit, self.rank, self.served = info, refit, rank, served
        self.infer, self.dtype = infer, dtype
        self.group = None
        self.error: Optional[BaseException] = None
        self.session = None
        self.prepare: Optional[threading.Thread] = None
        self.prepared: Optional[BaseException] = None
        self.joined = threading.Thread(target=self._join, name="reshard-join", daemon=True)
        self.joined.start()

    def _join(self) -> None:
        from .transfer.job_group import job_group, store_of

        try:
            limit = datetime.timedelta(seconds=self.info.timeout_s)
            store = store_of(self.info.master_address, int(self.info.master_port), False, limit)
            world = self.refit.world
            self.group = job_group(
                store, self.rank, world, self.info.backend, _group_name(self.info.secret), limit
            )
            _introduce(
                self.group,
                world,
                {"side": "infer", "rank": self.rank, "infer": self.infer, "dtype": self.dtype},
            )
        except BaseException as e:  # noqa: B036 - reported by the next call
            logger.warning("reshard: joining the trainer's job failed: %s", e)
            self.error = e

    def group_or_raise(self):
        self.joined.join(self.info.timeout_s + 5)
        if self.joined.is_alive():
            raise ReshardError(
                f"reshard: the trainer's ranks did not join at {self.info.master_address}:"
                f"{self.info.master_port} within {self.info.timeout_s:g} s"
            )
        if self.error is not None:
            raise ReshardError(f"reshard: joining the trainer's job failed: {self.error}") from self.error
        return self.group

    def close(self) -> None:
        import torch.distributed as dist

        if self.prepare is not None:
            self.prepare.join(self.info.timeout_s + 5)
        if self.group is not None and self.group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a broken group is dropped all the same
                pass
        self.group = None


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """The worker's side: refits the live model in place."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.refit: Optional[Refit] = None
        self.info: Optional[ReshardInitInfo] = None
        self.session = None
        self.job: Optional[_Job] = None
        self.reports: list = []
        #: A round is open (started, not finished): a trainer killed inside one leaves it so.
        self.open = False

    def parse_init_info(self, init_dict):
        try:
            return super().parse_init_info(init_dict)
        except ValueError as e:
            raise ArgumentError(str(e)) from e

    def parse_update_info(self, update_dict):
        try:
            return super().parse_update_info(update_dict)
        except ValueError as e:
            raise ArgumentError(str(e)) from e

    def _infer(self) -> str:
        tp = self.parallel_config.tensor_parallel_size
        if self.parallel_config.pipeline_parallel_size != 1:
            raise ArgumentError(
                f"pipeline_parallel_size: {self.parallel_config.pipeline_parallel_size}; "
                "reshard's vLLM backend refits tensor- and expert-parallel workers"
            )
        return tp

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        import torch.distributed as dist

        from .torch import DeltaSession

        tp = self._infer()
        config = init_info.config or os.path.join(self.model_config.model, "config.json")
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        if init_info.master_address is None:  # colocated: the trainer is in this process
            if not dist.is_initialized():
                raise ArgumentError("reshard: torch.distributed is not initialized in this worker")
            world = dist.get_world_size()
            infer = f"tp={tp}" if world == tp else f"dp={world // tp},tp={tp}"
            self.refit = Refit(
                config,
                init_info.train,
                infer,
                colocated=True,
                train_dtype=init_info.train_dtype or dtype,
                infer_dtype=dtype,
            )
            self.info = init_info
            if init_info.delta or init_info.staged:
                self.session = DeltaSession(checksum=init_info.checksum)
            return
        if self.parallel_config.data_parallel_size != 1:
            raise ArgumentError(
                f"data_parallel_size: {self.parallel_config.data_parallel_size}; a separate trainer "
                "refits one engine (data_parallel_size 1) of tensor- and expert-parallel workers"
            )
        if self.open:  # refused alike on every worker, so that the trainer can end it first
            raise ArgumentError(OPEN_ROUND)
        from .vllm_served import served_model

        refit = Refit(
            config,
            init_info.train,
            f"tp={tp}",
            train_dtype=init_info.train_dtype or dtype,
            infer_dtype=dtype,
        )
        served = served_model(self.model, self.model_config.dtype)
        if self.job is not None:  # a new trainer: the old job is over
            self.job.close()
        self.refit, self.info, self.session = refit, init_info, None
        os.environ["RESHARD_TIMEOUT"] = str(init_info.timeout_s)
        rank = refit.train_ranks + dist.get_rank() if dist.is_initialized() else refit.train_ranks
        self.job = _Job(init_info, refit, rank, served, f"tp={tp}", dtype)

    def start_weight_update(self) -> None:
        if self.refit is None:
            raise ArgumentError("reshard: init_weight_transfer_engine was not called")
        self.open = True

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if self.refit is None:
            raise ArgumentError("reshard: init_weight_transfer_engine was not called")
        info, phase = self.info, update_info.phase
        if phase == "broadcast":
            if self.job is None:
                raise ArgumentError("phase: broadcast needs a separate trainer job")
            self.reports.append(self._broadcast(update_info))
            return
        if phase == "refit" and info.staged:
            raise ArgumentError("phase: refit, but the engine was set up staged (prepare, then commit)")
        if phase != "refit" and not info.staged:
            raise ArgumentError(f"phase: {phase}, but the engine was not set up staged")
        if self.job is None:
            self.reports.append(self._colocated(update_info))
        else:
            self.reports.append(self._served(update_info))

    def _colocated(self, update_info: ReshardUpdateInfo):
        src, info, version = _OUTBOX["src"], self.info, update_info.version
        phase = update_info.phase
        if phase == "refit":
            from .torch import Delta

            delta = None if self.session is None else Delta(self.session, version=version)
            return _engine.refit_engine_(self.refit, src, self.model, checksum=info.checksum, delta=delta)
        if phase == "prepare":
            return _engine.prepare_engine_(self.refit, src, self.model, self.session, version)
        if phase == "commit":
            return _engine.commit_engine_(self.session, version)
        return _engine.abort_engine_(self.session, version)

    def _served(self, update_info: ReshardUpdateInfo):
        from .torch import Delta, DeltaSession

        job, version, phase = self.job, update_info.version, update_info.phase
        group = job.group_or_raise()
        mirror = job.served.mirror
        if job.session is None and (job.info.delta or job.info.staged):
            job.session = DeltaSession(group, checksum=job.info.checksum)
        started = time.monotonic()
        if phase == "refit":
            delta = None if job.session is None else Delta(job.session, version=version)
            report = _engine.refit_engine_(
                self.refit, None, mirror, group, checksum=job.info.checksum, delta=delta, recorded=True
            )
            job.served.derive()
            return {
                "phase": phase,
                "version": version,
                "seconds": time.monotonic() - started,
                "report": report,
            }
        if phase == "prepare":
            if job.prepare is not None and job.prepare.is_alive():
                raise ArgumentError(f"phase: prepare of version {version} while another prepare runs")
            job.prepared = None

            def prepare() -> None:
                try:
                    _engine.prepare_engine_(self.refit, None, mirror, job.session, version, group)
                except BaseException as e:  # noqa: B036 - reported by the commit
                    job.prepared = e

            # the prepare runs while the server serves: the engine's loop goes on stepping
            job.prepare = threading.Thread(target=prepare, name="reshard-prepare", daemon=True)
            job.prepare.start()
            return {"phase": phase, "version": version, "seconds": 0.0}
        if job.prepare is not None:
            job.prepare.join()
            job.prepare = None
        if phase == "abort":
            return {"phase": phase, "version": _engine.abort_engine_(job.session, version)}
        if job.prepared is not None:
            error, job.prepared = job.prepared, None
            raise error
        report = self._commit_alike(job, version)
        return {"phase": phase, "version": version, "seconds": time.monotonic() - started, "report": report}

    def _commit_alike(self, job: "_Job", version: int):
        """The job's decision, then every worker of this server serving the same version: a
        worker in doubt (the decision's coordinator, trainer rank 0, was lost before it told
        this worker) learns from the others, over the workers' own group, whether any of them
        committed, and does as they did; none did: it keeps the old weights."""
        import torch.distributed as dist

        from ._core import InDoubtError

        report, doubt, failure = None, False, None
        try:
            report = _engine.commit_engine_(job.session, version)
        except InDoubtError as e:
            doubt, failure = True, e
        except BaseException as e:  # noqa: B036 - raised once the workers agree
            failure = e
        committed = failure is None
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1 if committed else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the workers' own group, every worker
            if doubt and int(flag.item()) == 1:
                _engine.resolve_engine_(job.session, True)
                committed, failure = True, None
                logger.warning("reshard: in doubt about version %s: another worker committed it", version)
        if doubt and not committed:
            _engine.resolve_engine_(job.session, False)
        if committed:
            job.served.derive()
        if failure is not None:
            raise failure
        return report

    def _broadcast(self, update_info: ReshardUpdateInfo):
        """The gather+broadcast refit, for comparison (what vLLM's nccl backend does): every
        checkpoint tensor whole from trainer rank 0 to every worker, loaded by vLLM's own
        layerwise reload (``load_weights``, then the post-load step). Dense checkpoints whose
        names are the loader's; the mirror no longer holds what serves, so the next reshard
        round of the job is dense."""
        import torch.distributed as dist
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        job = self.job
        group = job.group_or_raise()
        started = time.monotonic()
        root = dist.get_global_rank(group, 0)

        def tensors():
            for name in self.refit.names:
                layout = self.refit.layouts(name)[0]
                full = torch.empty(layout.shape, dtype=_torch_dtype(layout.dtype), device=self.device)
                dist.broadcast(full, src=root, group=group)
                yield name, full

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(tensors())
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        if job.session is not None:
            job.session.restore(None)
        return {"phase": "broadcast", "version": update_info.version, "seconds": time.monotonic() - started}

    def update_weights(self, update_info: dict) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.open = False  # the worker ends the round on a failed update, as vLLM's does
            raise
        if torch.device(self.device).type == "cuda":  # the writes done before the worker returns
            torch.cuda.synchronize(self.device)

    def finish_weight_update(self) -> None:
        self.open = False  # written in place: nothing to finalize

    def shutdown(self) -> None:
        if self.job is not None:
            self.job.close()
        self.refit, self.session, self.job = None, None, None


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: the worker's :class:`ReshardInitInfo` fields, and where the
    trainer's rank 0 opens the job's rendezvous (a separate trainer job)."""

    backend: ClassVar[str] = BACKEND
    train: str = ""
    config: Optional[str] = None
    train_dtype: Optional[str] = None
    delta: bool = False
    staged: bool = False
    checksum: bool = False
    #: The address trainer rank 0 binds and the workers reach (default ``MASTER_ADDR``, else
    #: loopback); the port is the system's pick.
    master_address: Optional[str] = None
    #: The data plane across the jobs (default: ``nccl`` for CUDA tensors, else ``gloo``).
    transport: Optional[str] = None
    #: The engine's parallelism (``"tp=2"``; default: asked of the server, ``/get_world_size``).
    infer: Optional[str] = None
    timeout_s: float = 60.0

    def worker_info(self) -> dict:
        out = asdict(self)
        for key in ("rank", "transport", "infer"):
            out.pop(key, None)
        return out


def _local_sources(source, refit: Refit, trainers: int) -> Dict[str, torch.Tensor]:
    """This trainer rank's tensors by name, read as they are: a module's DTensors (FSDP2, TP)
    as their local shards, never gathered, each checked against the refit's training layout
    (box by box, on every trainer rank); a source of local shards (``iter_local``) as given."""
    from . import dtensor as _dt

    if hasattr(source, "iter_local"):
        return dict(source.iter_local())
    module = getattr(source, "_module", None)
    if module is None:
        raise ArgumentError(
            f"source: {type(source).__name__} gives full tensors only: pass a ModuleSource of the "
            "trainer's module, or a source with iter_local()"
        )
    out = {}
    names = set(refit.names)
    for name, p in module.named_parameters():
        # a fused buffer (transformers' experts' gate_up_proj) stands for its members, which
        # the refit checks; a name the refit does not know is refused there, naming it
        want = refit.layouts(name)[0] if name in names else None
        if _dt.is_dtensor(p) and want is not None:
            have = _dt.layout_of(p)
            boxes = [(have.local_region(r), want.local_region(r)) for r in range(trainers)]
            if any(str(a) != str(b) for a, b in boxes):
                raise ArgumentError(
                    f"source: {name} is laid out as {have.spec} over the trainer's ranks, but the "
                    f"refit's train parallelism lays it out as {want.spec}"
                )
            out[name] = p.detach().to_local()
        elif _dt.is_dtensor(p):
            out[name] = p.detach().to_local()
        else:
            out[name] = p.detach()
    return out


class _Server:
    """The routes of a ``vllm serve`` around a round that are not the client's four
    (``/pause``, ``/resume``, ``/reset_prefix_cache``, ``/get_world_size``); nothing for a
    client that has no server address."""

    def __init__(self, client) -> None:
        self.url = getattr(client, "base_url", None)
        self.timeout = getattr(client, "timeout", 300)

    def post(self, path: str, **params) -> None:
        if self.url is None:
            return
        import requests

        requests.post(f"{self.url}/{path}", params=params, timeout=self.timeout).raise_for_status()

    def world(self, include_dp: bool) -> Optional[int]:
        if self.url is None:
            return None
        import requests

        answer = requests.get(
            f"{self.url}/get_world_size", params={"include_dp": str(include_dp).lower()}, timeout=self.timeout
        )
        answer.raise_for_status()
        return int(answer.json()["world_size"])


class _Call:
    """An HTTP call to the server on a thread of trainer rank 0, while every trainer rank runs
    its side of the same collective (the worker answers only once the collective is done)."""

    def __init__(self, fn, *args) -> None:
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: B036 - raised by result()
            self.error = e

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _why(error: BaseException) -> str:
    """An error of a call to the server, with what the server said (its message names the
    field or the parameter)."""
    said = getattr(getattr(error, "response", None), "text", None)
    return f"{type(error).__name__}: {error}" + (f": {said}" if said else "")


#: Tries of ``/init_weight_transfer_engine`` after a trainer was killed mid-round (see
#: :func:`_init_after_a_lost_trainer`).
INIT_TRIES = 3


def _init_after_a_lost_trainer(client, info: dict) -> str:
    """``init_weight_transfer_engine`` with ``info``; returns the job's secret.

    A trainer killed inside a round leaves it open on the server (the workers refuse the next
    init alike, saying so: the round is finished, then the init tried again), or leaves a
    failed call behind: vLLM's multiprocessing executor raises at the first worker whose call
    failed and leaves the others' answers to be read as the next call's, so the next call of
    a server with several workers may fail with the last one's error. A failed init is tried
    again (up to :data:`INIT_TRIES` times), each time as a new job with a secret of its own,
    so that a worker that joined a failed try waits on a group no one else joins."""
    for attempt in range(INIT_TRIES):
        info = dict(info, secret=secrets.token_hex(16))
        try:
            client.init_weight_transfer_engine(info)
            return info["secret"]
        except Exception as e:  # noqa: BLE001 - raised after the last try
            if attempt == INIT_TRIES - 1:
                raise
            if OPEN_ROUND in str(getattr(getattr(e, "response", None), "text", "")) + str(e):
                logger.warning("reshard: the last trainer's round is still open on the server: ending it")
                try:
                    client.finish_weight_update()
                except Exception:  # noqa: BLE001 - the executor's leftover answer, read here
                    pass
            else:
                logger.warning("reshard: the server refused the init (%s): trying again", e)
    raise AssertionError("unreachable")


def _base_init(cls, **kw):
    """The keyword arguments ``TrainerWeightTransferEngine.__init__`` takes in this vLLM
    (0.32: client, source, is_sender; 0.33 adds rank)."""
    accepted = inspect.signature(TrainerWeightTransferEngine.__init__).parameters
    return {k: v for k, v in kw.items() if k in accepted}


class ReshardTrainer(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """The trainer's side, on every trainer rank: a separate job's ranks meet the workers in
    one group and send their shards' overlaps; colocated, the shards go to the worker of the
    trainer's own process and the round runs through the client."""

    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None) -> "ReshardTrainer":
        if not init_info.train:
            raise ArgumentError("train: the trainer's parallelism is required (e.g. 'fsdp=2')")
        kw = _base_init(cls, client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        out = cls(**kw)
        out.info = init_info
        out.rank = init_info.rank
        out.version = 0
        out.reports: List[Dict[str, Any]] = []
        out.group = None
        out.refit = None
        out.session = None
        out.server = _Server(client)
        if isinstance(client, ColocatedClient):
            client.init_weight_transfer_engine(init_info.worker_info())
            return out
        out._join_job()
        return out

    # ---- a separate trainer job ----

    def _config(self) -> str:
        if self.info.config:
            return self.info.config
        module = getattr(self.source, "_module", None)
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_json_string"):
            raise ArgumentError(
                "config: the trainer's module has no Hugging Face config; name its config.json"
            )
        directory = tempfile.mkdtemp(prefix="reshard-trainer-")
        path = os.path.join(directory, "config.json")
        with open(path, "w") as f:
            f.write(config.to_json_string())
        return path

    def _join_job(self) -> None:
        import torch.distributed as dist

        from .transfer.job_group import job_group, store_of

        info = self.info
        limit = datetime.timedelta(seconds=info.timeout_s)
        os.environ["RESHARD_TIMEOUT"] = str(info.timeout_s)
        trainers = dist.get_world_size() if dist.is_initialized() else 1
        offer: List[Any] = [None] * 6
        if self.is_sender:
            problem = None
            try:
                addr = info.master_address or os.environ.get("MASTER_ADDR") or "127.0.0.1"
                store = store_of(addr, 0, True, limit)
                infer = info.infer
                if infer is None:
                    tp, everything = self.server.world(False), self.server.world(True)
                    if tp is None:
                        raise ArgumentError(
                            "infer: the engine's parallelism ('tp=2'), for a client without a URL"
                        )
                    if everything != tp:
                        raise ArgumentError(
                            f"infer: the server runs {everything // tp} data-parallel engines"
                        )
                    infer = f"tp={tp}"
                dtype = info.train_dtype or _source_dtype(self.source)
                worker = dict(info.worker_info(), master_address=addr, master_port=int(store.port))
                worker["train_dtype"] = dtype
                worker["backend"] = info.transport or ("nccl" if _on_cuda(self.source) else "gloo")
                self._store = store
                # the worker checks the info and starts joining on a thread: it answers at once
                secret = _init_after_a_lost_trainer(self.client, worker)
            except BaseException as e:  # noqa: B036 - told to every trainer rank, then raised
                problem = e
                addr = secret = infer = dtype = worker = None
            offer = [
                addr,
                None if worker is None else worker["master_port"],
                secret,
                infer,
                dtype,
                None if problem is None else _why(problem),
            ]
            offer.append(None if worker is None else worker["backend"])
        else:
            offer.append(None)
        if trainers > 1:
            dist.broadcast_object_list(offer, src=0)
        addr, port, secret, infer, dtype, problem, transport = offer
        if problem is not None:
            raise ReshardError(f"reshard: the server refused the refit's init: {problem}")
        config = self._config()
        ranks = Refit(config, info.train, infer, train_dtype=dtype)
        if ranks.train_ranks != trainers:
            raise ArgumentError(
                f"train: {info.train!r} has {ranks.train_ranks} ranks, but the trainer runs {trainers}"
            )
        store = self._store if self.is_sender else store_of(addr, int(port), False, limit)
        self.group = job_group(store, self.rank, ranks.world, transport, _group_name(secret), limit)
        heard = _introduce(self.group, ranks.world, {"side": "train", "rank": self.rank})
        engine = heard[ranks.train_ranks]
        self.refit = Refit(
            config, info.train, engine["infer"], train_dtype=dtype, infer_dtype=engine["dtype"]
        )
        if info.delta or info.staged:
            from .torch import DeltaSession

            self.session = DeltaSession(self.group, checksum=info.checksum)

    def send_weights(self, version: Optional[int] = None, commit: bool = True) -> Dict[str, Any]:
        """One round: the weights of ``source`` (this rank's tensors, read as they are) as
        ``version`` (the next one by default). Staged, ``commit`` False aborts after the
        prepare. Returns the round's report (also kept in :attr:`reports`): its seconds, and
        for a staged round the prepare's and the pause's."""
        if self.source is None:
            raise ArgumentError("source: the trainer was set up without a WeightSource")
        self.version = self.version + 1 if version is None else version
        if self.group is None:
            return self._send_colocated(commit)
        src = _local_sources(self.source, self.refit, self.refit.train_ranks)
        v, times = self.version, {"started": time.monotonic()}
        report: Dict[str, Any] = {"version": v, "staged": self.info.staged}
        if not self.info.staged:
            from .torch import Delta

            delta = None if self.session is None else Delta(self.session, version=v)
            with self._paused(times):
                self._with_workers(
                    {"version": v},
                    lambda: _engine.refit_engine_(
                        self.refit,
                        src,
                        None,
                        self.group,
                        checksum=self.info.checksum,
                        delta=delta,
                        recorded=True,
                    ),
                )
        else:
            # the prepare: a round of its own, which the workers answer at once (their prepare
            # runs on a thread while they serve), so that a trainer killed in its own prepare
            # leaves no round open
            if self.is_sender:
                self.client.start_weight_update()
                try:
                    self.client.update_weights({"version": v, "phase": "prepare"})
                finally:
                    self.client.finish_weight_update()
            _engine.prepare_engine_(self.refit, src, None, self.session, v, self.group)
            report["prepare_s"] = time.monotonic() - times["started"]
            # the job's decision and the commit, the server paused
            decide = _engine.commit_engine_ if commit else _engine.abort_engine_
            with self._paused(times):
                self._with_workers(
                    {"version": v, "phase": "commit" if commit else "abort"}, lambda: decide(self.session, v)
                )
        return self._report(report, times)

    def broadcast_weights(self, version: Optional[int] = None) -> Dict[str, Any]:
        """The gather+broadcast refit over the same group, for comparison (what vLLM's nccl
        backend does): every tensor gathered whole (``full_tensor()``) and broadcast from
        trainer rank 0 to every worker, which loads it through vLLM's own reload. Dense
        checkpoints only; returns the round's report as :meth:`send_weights` does."""
        import torch.distributed as dist

        if self.group is None:
            raise ArgumentError("broadcast_weights: needs a separate trainer job")
        module = getattr(self.source, "_module", None)
        if module is None:
            raise ArgumentError("source: broadcast_weights reads a ModuleSource's module")
        self.version = self.version + 1 if version is None else version
        params = dict(module.named_parameters())
        times = {"started": time.monotonic()}

        def broadcast() -> None:
            root = dist.get_global_rank(self.group, 0)
            for name in self.refit.names:
                p = params[name]
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                full = full.detach().to(_torch_dtype(self.refit.layouts(name)[0].dtype)).contiguous()
                dist.broadcast(full, src=root, group=self.group)

        with self._paused(times):
            self._with_workers({"version": self.version, "phase": "broadcast"}, broadcast)
        if self.session is not None:
            self.session.restore(None)  # the workers' mirrors no longer hold what they serve
        return self._report({"version": self.version, "broadcast": True}, times)

    @contextlib.contextmanager
    def _paused(self, times: Dict[str, float]):
        """The server paused (``/pause?mode=keep``) and a round open on it, by trainer rank 0;
        then the round finished, the prefix cache reset and the server resumed, whatever
        happened. Every rank notes when the pause began (``times["paused"]``)."""
        opened = False
        try:
            if self.is_sender:
                self.server.post("pause", mode="keep")
            times["paused"] = time.monotonic()
            if self.is_sender:
                self.client.start_weight_update()
                opened = True
            yield
        finally:
            if self.is_sender and "paused" in times:
                try:
                    if opened:
                        self.client.finish_weight_update()
                    self.server.post("reset_prefix_cache")
                finally:
                    self.server.post("resume")

    def _with_workers(self, update: Dict[str, Any], body) -> None:
        """``body``, this rank's side of a collective of the whole job, while trainer rank 0
        asks the workers to run theirs (``/update_weights``, answered once they are done)."""
        call = _Call(self.client.update_weights, update) if self.is_sender else None
        try:
            body()
        finally:
            if call is not None:
                call.result()

    def _report(self, report: Dict[str, Any], times: Dict[str, float]) -> Dict[str, Any]:
        now = time.monotonic()
        report["pause_s"] = now - times["paused"]
        report["seconds"] = now - times["started"]
        self.reports.append(report)
        return report

    def _send_colocated(self, commit: bool) -> Dict[str, Any]:
        _OUTBOX["src"] = dict(self.source.iter_local())
        try:
            self.client.start_weight_update()
            try:
                if self.info.staged:
                    self.client.update_weights({"version": self.version, "phase": "prepare"})
                    phase = "commit" if commit else "abort"
                    self.client.update_weights({"version": self.version, "phase": phase})
                else:
                    self.client.update_weights({"version": self.version})
            finally:
                self.client.finish_weight_update()
        finally:
            _OUTBOX["src"] = None
        return {"version": self.version}

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.group is not None and self.group is not dist.group.WORLD:
            dist.destroy_process_group(self.group)
        self.group = None


def _torch_dtype(name: str) -> torch.dtype:
    from .transfer.checks import TORCH_DTYPES

    return TORCH_DTYPES[name]


def _source_tensors(source):
    module = getattr(source, "_module", None)
    if module is not None:
        return [p for _, p in module.named_parameters()]
    if hasattr(source, "iter_local"):
        return [t for _, t in source.iter_local()]
    return []


def _source_dtype(source) -> Optional[str]:
    tensors = _source_tensors(source)
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else None


def _on_cuda(source) -> bool:
    tensors = _source_tensors(source)
    return bool(tensors) and tensors[0].device.type == "cuda"


class ColocatedClient:
    """vLLM's weight-sync client for a worker in this process: calls its engine as the
    worker's ``init_weight_transfer_engine`` / ``update_weights`` methods do."""

    def __init__(self, engine: WeightTransferEngine) -> None:
        self.engine = engine
        self.active = False
        self.finished_versions: list = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("a weight update is already active")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info) -> None:
        if not self.active:
            raise RuntimeError("no weight update is active")
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self, weight_version=None) -> None:
        if self.active:
            self.engine.finish_weight_update()
        self.active = False
        self.finished_versions.append(weight_version)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the backend's two sides."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ReshardTrainer)


# The routes whose bodies the backend reads, with the body's field and the info class.
_CHECKED = {
    "/init_weight_transfer_engine": ("init_info", ReshardInitInfo),
    "/update_weights": ("update_info", ReshardUpdateInfo),
}


def _refusal(body: Any, field_name: str, cls) -> Optional[str]:
    """Why a request's body is no ``cls`` (None: it is one)."""
    if not isinstance(body, dict) or field_name not in body:
        return f"{field_name}: missing from the request's body"
    infos = body[field_name]
    for info in infos if isinstance(infos, list) else [infos]:
        if not isinstance(info, dict):
            return f"{field_name}: {info!r:.60} is not an object"
        known = {f.name for f in dataclasses_fields(cls)}
        unknown = sorted(set(info) - known)
        if unknown:
            fields = ", ".join(sorted(known))
            return f"{field_name}.{unknown[0]}: not a field of {cls.__name__} (fields: {fields})"
        try:
            cls(**info)
        except TypeError as e:
            return f"{field_name}: {e}"
        except ArgumentError as e:
            return f"{field_name}.{e}"
    return None


#: Seconds a ``/pause`` holds the server without a ``/resume`` before the server resumes
#: itself (``RESHARD_PAUSE_LEASE``; default 120): a trainer killed between the two must not
#: leave it paused.
DEFAULT_PAUSE_LEASE = 120.0
_PAUSES = {"n": 0}


def _pause_lease() -> float:
    raw = os.environ.get("RESHARD_PAUSE_LEASE")
    try:
        value = float(raw) if raw is not None else DEFAULT_PAUSE_LEASE
    except ValueError:
        value = -1.0
    if not 0 < value < 1e7:
        raise ArgumentError(f"RESHARD_PAUSE_LEASE: {raw!r:.40} is invalid: a positive number of seconds")
    return value


async def _lease(app, n: int, seconds: float) -> None:
    """Resumes the server ``seconds`` after the pause numbered ``n`` unless a ``/resume`` (or
    a later pause) came since; the prefix cache is reset first (a commit may have landed)."""
    import asyncio

    await asyncio.sleep(seconds)
    if _PAUSES["n"] != n:
        return
    engine = app.state.engine_client
    logger.warning("reshard: no /resume %.0f s after /pause: the server resumes itself", seconds)
    try:
        await engine.reset_prefix_cache()
    finally:
        await engine.resume_generation()


async def check_requests(request, call_next):
    """An HTTP middleware for ``vllm serve`` (``--middleware reshard.vllm_backend.check_requests``):
    a bad ``/init_weight_transfer_engine`` or ``/update_weights`` body is refused with 400,
    naming the field, before it reaches a worker (vLLM itself answers a worker's refusal with
    500); and a ``/pause`` is a lease: without a ``/resume`` within ``RESHARD_PAUSE_LEASE``
    seconds the server resets its prefix cache and resumes by itself."""
    path = request.url.path
    if request.method == "POST" and path in ("/pause", "/resume"):
        _PAUSES["n"] += 1
        answer = await call_next(request)
        if path == "/pause" and answer.status_code == 200:
            import asyncio

            asyncio.get_running_loop().create_task(_lease(request.app, _PAUSES["n"], _pause_lease()))
        return answer
    checked = _CHECKED.get(path)
    if checked is None or request.method != "POST":
        return await call_next(request)
    from fastapi.responses import JSONResponse

    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except ValueError as e:
        problem = f"the request's body is no JSON: {e}"
    else:
        problem = _refusal(body, *checked)
    if problem is not None:
        return JSONResponse(
            status_code=400, content={"error": {"message": problem, "type": "BadRequestError", "code": 400}}
        )
    return await call_next(request)
