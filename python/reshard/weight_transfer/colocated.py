"""vLLM's weight-sync client for a worker in the trainer's own process."""

from __future__ import annotations

from vllm.distributed.weight_transfer.base import WeightTransferEngine


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
