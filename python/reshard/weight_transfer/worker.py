"""The worker's side: refits the live model of a vLLM worker, colocated with its trainer or
from a separate trainer job (the model as served, :mod:`.served_model`)."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .. import engine as _engine
from ..transfer.checks import torch_dtype
from .._core import ArgumentError, Refit, ReshardError
from .info import (
    OPEN_ROUND,
    OUTBOX,
    ReshardInitInfo,
    ReshardUpdateInfo,
    group_name,
    introduce,
)

logger = logging.getLogger(__name__)


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
        from ..transfer.job_group import job_group, store_of

        try:
            limit = datetime.timedelta(seconds=self.info.timeout_s)
            store = store_of(self.info.master_address, int(self.info.master_port), False, limit)
            world = self.refit.world
            self.group = job_group(
                store, self.rank, world, self.info.backend, group_name(self.info.secret), limit
            )
            introduce(
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

    def _infer(self) -> int:
        """The engine's tensor parallelism; pipeline parallelism is refused."""
        tp = self.parallel_config.tensor_parallel_size
        if self.parallel_config.pipeline_parallel_size != 1:
            raise ArgumentError(
                f"pipeline_parallel_size: {self.parallel_config.pipeline_parallel_size}; "
                "reshard's vLLM backend refits tensor- and expert-parallel workers"
            )
        return tp

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        import torch.distributed as dist

        from ..torch import DeltaSession

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
        from .served_model import served_model

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
        src, info, version = OUTBOX["src"], self.info, update_info.version
        phase = update_info.phase
        if phase == "refit":
            from ..torch import Delta

            delta = None if self.session is None else Delta(self.session, version=version)
            return _engine.refit_engine_(self.refit, src, self.model, checksum=info.checksum, delta=delta)
        if phase == "prepare":
            return _engine.prepare_engine_(self.refit, src, self.model, self.session, version)
        if phase == "commit":
            return _engine.commit_engine_(self.session, version)
        return _engine.abort_engine_(self.session, version)

    def _served(self, update_info: ReshardUpdateInfo):
        from ..torch import Delta, DeltaSession

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

        from .._core import InDoubtError

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
                full = torch.empty(layout.shape, dtype=torch_dtype(layout), device=self.device)
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
