"""reshard as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "reshard"}'``.

The package registers it in every vLLM process through its ``vllm.general_plugins`` entry
point (:func:`register`). Each refit is a :func:`reshard.engine.refit_engine_` into the live
parameters, in place (their storage is unchanged, so CUDA graphs stay valid), fused ones
(``qkv_proj``, ``gate_up_proj``, ``w13``/``w2``) included, where vLLM's own loader would put
each slice (recorded from it once); optionally a delta refit (only what changed moves) and a
staged one (the new weights wait beside the live ones until every rank voted; an abort
leaves the old weights).

The trainer's ranks and vLLM's workers are one ``torch.distributed`` job: the trainer runs in
the processes of vLLM's workers (``distributed_executor_backend="external_launcher"``, as
colocated RL frameworks run vLLM), every process a trainer rank and a worker. The trainer's
side (:class:`ReshardTrainer`) hands its local shards to the worker of its own process and
drives the round through the client it is given (:class:`ColocatedClient` calls the worker's
engine in the same process, as vLLM's worker methods do).

One round, from the trainer: ``start_weight_update``, ``update_weights({"version": v})``
(``"phase": "prepare"`` then ``"commit"`` or ``"abort"`` when staged), ``finish_weight_update``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import ClassVar, Dict, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import engine as _engine
from ._core import ArgumentError, Refit

BACKEND = "reshard"
PHASES = ("refit", "prepare", "commit", "abort")

# The trainer's local shards of this process, for the worker of this process: set by
# ReshardTrainer.send_weights for the length of one round.
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


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """One step of a round: the weights' version (increasing) and the phase."""

    version: int
    phase: str = "refit"


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
        self.reports: list = []

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        import torch.distributed as dist

        from .torch import DeltaSession

        if not dist.is_initialized():
            raise ArgumentError("reshard: torch.distributed is not initialized in this worker")
        config = init_info.config or os.path.join(self.model_config.model, "config.json")
        tp = self.parallel_config.tensor_parallel_size
        if self.parallel_config.pipeline_parallel_size != 1:
            raise ArgumentError(
                f"pipeline_parallel_size: {self.parallel_config.pipeline_parallel_size}; "
                "reshard's vLLM backend refits tensor- and expert-parallel workers"
            )
        world = dist.get_world_size()
        infer = f"tp={tp}" if world == tp else f"dp={world // tp},tp={tp}"
        dtype = str(self.model_config.dtype).removeprefix("torch.")
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

    def start_weight_update(self) -> None:
        if self.refit is None:
            raise ArgumentError("reshard: init_weight_transfer_engine was not called")

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if update_info.phase not in PHASES:
            raise ArgumentError(f"phase: {update_info.phase!r} is not one of {', '.join(PHASES)}")
        if isinstance(update_info.version, bool) or not isinstance(update_info.version, int):
            raise ArgumentError(f"version: {update_info.version!r} is not an integer")
        src = _OUTBOX["src"]
        info, version = self.info, update_info.version
        if update_info.phase == "refit":
            if info.staged:
                raise ArgumentError("phase: refit, but the engine was set up staged (prepare, then commit)")
            from .torch import Delta

            delta = None if self.session is None else Delta(self.session, version=version)
            report = _engine.refit_engine_(self.refit, src, self.model, checksum=info.checksum, delta=delta)
        elif not info.staged:
            raise ArgumentError(f"phase: {update_info.phase}, but the engine was not set up staged")
        elif update_info.phase == "prepare":
            report = _engine.prepare_engine_(self.refit, src, self.model, self.session, version)
        elif update_info.phase == "commit":
            report = _engine.commit_engine_(self.session, version)
        else:
            report = _engine.abort_engine_(self.session, version)
        self.reports.append(report)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.device(self.device).type == "cuda":  # the writes done before the worker returns
            torch.cuda.synchronize(self.device)

    def finish_weight_update(self) -> None:
        pass  # written in place: nothing to finalize

    def shutdown(self) -> None:
        self.refit, self.session = None, None


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: the worker's :class:`ReshardInitInfo` fields."""

    backend: ClassVar[str] = BACKEND
    train: str = ""
    config: Optional[str] = None
    train_dtype: Optional[str] = None
    delta: bool = False
    staged: bool = False
    checksum: bool = False

    def worker_info(self) -> dict:
        out = asdict(self)
        out.pop("rank")
        return out


class ReshardTrainer(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """The trainer's side, on every trainer rank: its local shards go to the worker of its
    own process, and the round runs through the client."""

    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None) -> "ReshardTrainer":
        if not init_info.train:
            raise ArgumentError("train: the trainer's parallelism is required (e.g. 'fsdp=2')")
        client.init_weight_transfer_engine(init_info.worker_info())
        out = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        out.info = init_info
        out.version = 0
        return out

    def send_weights(self, version: Optional[int] = None, commit: bool = True) -> None:
        """One round: the weights of ``source`` (this rank's local shards) as ``version``
        (the next one by default). Staged, ``commit`` False aborts after the prepare."""
        if self.source is None:
            raise ArgumentError("source: the trainer was set up without a WeightSource")
        self.version = self.version + 1 if version is None else version
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
