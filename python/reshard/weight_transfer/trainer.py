"""The trainer's side, on every trainer rank: a separate job's ranks meet the workers in one
group and send their shards' overlaps, driving each round through vLLM's weight-sync client
and the server's own routes."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import secrets
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

from .. import engine as _engine
from ..transfer.checks import torch_dtype
from .._core import ArgumentError, Refit, ReshardError
from .colocated import ColocatedClient
from .info import OPEN_ROUND, OUTBOX, ReshardTrainerInitInfo, group_name, introduce

logger = logging.getLogger(__name__)


def _local_sources(source, refit: Refit, trainers: int) -> Dict[str, torch.Tensor]:
    """This trainer rank's tensors by name, read as they are: a module's DTensors (FSDP2, TP)
    as their local shards, never gathered, each checked against the refit's training layout
    (box by box, on every trainer rank); a source of local shards (``iter_local``) as given."""
    from .. import dtensor as _dt

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

        from ..transfer.job_group import job_group, store_of

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
        self.group = job_group(store, self.rank, ranks.world, transport, group_name(secret), limit)
        heard = introduce(self.group, ranks.world, {"side": "train", "rank": self.rank})
        engine = heard[ranks.train_ranks]
        self.refit = Refit(
            config, info.train, engine["infer"], train_dtype=dtype, infer_dtype=engine["dtype"]
        )
        if info.delta or info.staged:
            from ..torch import DeltaSession

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
            from ..torch import Delta

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
                full = full.detach().to(torch_dtype(self.refit.layouts(name)[0])).contiguous()
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
        OUTBOX["src"] = dict(self.source.iter_local())
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
            OUTBOX["src"] = None
        return {"version": self.version}

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.group is not None and self.group is not dist.group.WORLD:
            dist.destroy_process_group(self.group)
        self.group = None


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
