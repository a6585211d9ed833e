"""What the two sides of the backend tell each other: the init and update infos (checked on
construction, naming the field), the phases, and the job's group name."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .._core import ArgumentError

BACKEND = "reshard"
logger = logging.getLogger(__name__)
PHASES = ("refit", "prepare", "commit", "abort", "broadcast")
#: The refusal of an init while the last trainer's round is open (it was killed inside it).
OPEN_ROUND = "reshard: a weight update of the last trainer is still open (end it with /finish_weight_update)"
BACKENDS = ("gloo", "nccl")

#: The trainer's local shards of this process, for the worker of this process (colocated): set
#: by ReshardTrainer.send_weights for the length of one round.
OUTBOX: Dict[str, Optional[Dict[str, torch.Tensor]]] = {"src": None}


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


def group_name(secret: str) -> str:
    """The name of the job's group: the secret's digest, so that two jobs never meet."""
    return "reshard-vllm-" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def introduce(group, world: int, mine: Dict[str, Any]) -> List[Dict[str, Any]]:
    """What every rank of a new job tells the others once: the engine's side says its
    parallelism and dtype, from which the trainer makes the same refit."""
    import torch.distributed as dist

    heard: List[Any] = [None] * world
    dist.all_gather_object(heard, mine, group=group)
    return heard


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
