"""One rank of a refit into SGLang's own model through its custom weight loader, checked against
SGLang's own loader.

Run as ``python sglang_worker.py CASES_JSON TMP`` under ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` (``launch.py`` starts the ranks); the cases share one model config (SGLang
brings its parallel runtime up once a process). Every rank is both a trainer rank (its shard of
the checkpoint, by the case's training layout) and an SGLang tensor-parallel rank.

For each case and step: SGLang's ``load_weights`` from the full checkpoint gives the oracle; the
parameters are scrambled; then SGLang's own weight-update code runs the refit: the scheduler's
``SchedulerWeightUpdaterManager`` opens ``begin_weight_update``, takes an
``UpdateWeightsFromTensorReqInput`` whose ``load_format`` is ``reshard.sglang_loader.load``
(listed in the server's ``custom_weight_loader``), deserializes this rank's payload, and the
model runner's ``WeightUpdater.update_weights_from_tensor`` unwraps each
``LocalSerializedTensor`` to this rank's trainer shard and calls the loader; then
``end_weight_update``. The parameters must equal the oracle byte for byte (padding rows
included) in the same storage. Stand-ins replace only what a served engine adds around that
code: the TP worker's list of runners, the cache flush and the weight-version record.
"""

import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import sglang_engine  # noqa: E402
from oracle import against_the_loader, bits, check_the_table, checkpoint, shards, write_config  # noqa: E402

from reshard import Refit, sglang_loader  # noqa: E402


def weight_updates(model, model_config, rank: int):
    """SGLang's scheduler-side weight-update manager over this rank's model runner."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_model, get_parallel

    runner = SimpleNamespace()
    runner.weight_updater = WeightUpdater(
        tp_rank=get_parallel().tp_rank,
        device="cpu",
        gpu_id=rank,
        model_config=model_config,
        custom_weight_loaders=get_model().custom_weight_loader,
        get_model=lambda: model,
        update_model_fields=lambda **_: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: runner,
    )

    class Worker:
        model_runner = runner
        deserialize_own_rank = TpModelWorker.deserialize_own_rank

        def weight_update_runners(self):
            return [("target", runner)]

    versions = []
    scheduler = SimpleNamespace(record_weight_version_change=lambda new_version: versions.append(new_version))
    return SchedulerWeightUpdaterManager(
        tp_worker=Worker(),
        draft_worker=None,
        memory_saver_adapter=None,
        flush_cache=lambda **_: True,
        is_fully_idle=lambda **_: True,
        scheduler=scheduler,
    )


def serialize_shard(tensor: torch.Tensor) -> bytes:
    """``MultiprocessingSerializer.serialize`` of a CPU tensor by torch's own reducer: SGLang
    patches it process-wide to name the device by its GPU's UUID, which assumes a CUDA tensor."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    torch_own = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    pickler.dispatch_table[torch.Tensor] = torch_own
    pickler.dump(tensor)
    return buf.getvalue()


def payload(src: dict, world: int):
    """The request's ``serialized_named_tensors`` as a colocated trainer makes them: each rank
    serializes its shards (shared memory here; CUDA IPC handles on GPUs), the ranks gather them,
    each name becomes a ``LocalSerializedTensor`` of every rank's shard, and the list is
    serialized once per TP rank as SGLang's ``Engine.update_weights_from_tensor`` does."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer

    mine = {n: serialize_shard(t) for n, t in src.items()}
    every = [None] * world
    dist.all_gather_object(every, mine)
    names = list(every[0])
    assert all(list(e) == names for e in every), "the ranks hold shards of different tensors"
    named = [(n, LocalSerializedTensor(values=[e[n] for e in every])) for n in names]
    return [MultiprocessingSerializer.serialize(named) for _ in range(world)]


def request(src: dict, world: int):
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=payload(src, world),
        load_format=sglang_loader.LOADER,
        flush_cache=False,
    )


def refit_through_sglang(manager, src: dict, world: int) -> None:
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

    assert manager.begin_weight_update(BeginWeightUpdateReqInput()).success
    out = manager.update_weights_from_tensor(request(src, world))
    assert out.success, out.message
    assert manager.end_weight_update(EndWeightUpdateReqInput()).success


def run_case(case: dict, model, model_config, manager, rank: int, world: int, config_dir: str) -> None:
    dtype = case.get("dtype", "bfloat16")
    args = dict(
        model=str(Path(config_dir) / "config.json"),
        train=case["train"],
        infer=f"tp={world}",
        colocated=True,
        train_dtype="f32",
        infer_dtype=dtype,
    )
    refit = Refit(**args)
    check_the_table(refit, model, rank, "sglang")
    sglang_loader._JOB.clear()
    os.environ.pop(sglang_loader.ENV, None)
    if case.get("from_env"):  # as a scheduler process SGLang spawned would find it
        os.environ[sglang_loader.ENV] = json.dumps(args)
    else:
        sglang_loader.configure(refit)

    def inputs(step):
        full = checkpoint(refit, seed=step)
        return full, shards(refit, rank, full)

    checked = against_the_loader(
        case["name"], model, rank, inputs, lambda src: refit_through_sglang(manager, src, world)
    )
    print(
        f"rank {rank}: {case['name']} exact through SGLang's custom weight loader ({checked} parameters)",
        flush=True,
    )


def refused_outside_bracket(manager, model, rank: int, world: int) -> None:
    """SGLang's scheduler refuses the request outside begin/end, the loader never called."""
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    out = manager.update_weights_from_tensor(request({}, world))
    assert not out.success and "begin_weight_update" in out.message, out
    assert all(torch.equal(bits(p), bits(before[n])) for n, p in params.items())
    print(f"rank {rank}: refused outside begin/end", flush=True)


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tmp = Path(sys.argv[2])
    config = cases[0]["config"]
    assert all(c["config"] == config for c in cases), "one model config a process"
    config_dir = write_config(tmp / "model", config)
    _, model_config, model = sglang_engine.build(
        config_dir,
        world,
        rank,
        dtype=cases[0].get("dtype", "bfloat16"),
        custom_weight_loader=[sglang_loader.LOADER],
    )
    manager = weight_updates(model, model_config, rank)
    refused_outside_bracket(manager, model, rank, world)
    for case in cases:
        run_case(case, model, model_config, manager, rank, world, config_dir)
    dist.barrier()


if __name__ == "__main__":
    main()
