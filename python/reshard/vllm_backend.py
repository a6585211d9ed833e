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
  gathered). The worker refits *the model as served* (:mod:`reshard.weight_transfer.served_model`): the
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

from .weight_transfer.colocated import ColocatedClient
from .weight_transfer.info import (
    BACKEND,
    PHASES,
    ReshardInitInfo,
    ReshardTrainerInitInfo,
    ReshardUpdateInfo,
    check_init_info,
)
from .weight_transfer.routes import check_requests
from .weight_transfer.trainer import ReshardTrainer
from .weight_transfer.worker import ReshardWeightTransferEngine

__all__ = [
    "BACKEND",
    "PHASES",
    "ColocatedClient",
    "ReshardInitInfo",
    "ReshardTrainer",
    "ReshardTrainerInitInfo",
    "ReshardUpdateInfo",
    "ReshardWeightTransferEngine",
    "check_init_info",
    "check_requests",
    "register",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the backend's two sides."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ReshardTrainer)
