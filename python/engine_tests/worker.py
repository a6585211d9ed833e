"""One rank of a refit into vLLM's own model, checked against vLLM's own loader.

Run as ``python worker.py CASES_JSON`` under ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` (``launch.py`` starts the ranks). Every rank is both a trainer rank (its shard
of the checkpoint, by the refit's training layout) and a vLLM tensor-parallel rank. For each
case: vLLM's ``load_weights`` from the full checkpoint gives the oracle; the parameters are
then scrambled, refit by reshard from the trainer shards, and must equal the oracle byte for
byte (padding rows included) in the same storage.
"""

import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import vllm_engine  # noqa: E402
from oracle import (  # noqa: E402
    against_the_loader,
    architecture,
    bits,
    check_the_table,
    checkpoint,
    on_disk,
    scramble,
    shards,
    write_config,
)

from reshard import Refit  # noqa: E402
from reshard.engine import refit_engine_  # noqa: E402


def fsdp2_sources(config_dir: str, world: int, seed: int):
    """A transformers model sharded by FSDP2 (fully_shard) over the ranks: its state_dict()
    as it is (DTensors; a tied lm_head.weight aliasing the embedding) and the full tensors."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    trainer = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    state = trainer.state_dict()
    full = {n: t.full_tensor() for n, t in state.items()}
    return state, full


def run_case(case: dict, rank: int, world: int, tmp: Path) -> None:
    config_dir = write_config(tmp / case["name"].replace(" ", "_"), case["config"])
    _, model = vllm_engine.build(
        config_dir, world, rank, dtype=case.get("dtype", "bfloat16"), ep=case.get("ep", False)
    )
    refit = Refit(
        str(Path(config_dir) / "config.json"),
        case["train"],
        f"tp={world}",
        colocated=True,
        train_dtype="f32",
        infer_dtype=case.get("dtype", "bfloat16"),
    )

    check_the_table(refit, model, rank, "vllm", ep=case.get("ep", False))

    def inputs(step):
        if case.get("fsdp2"):
            state, full = fsdp2_sources(config_dir, world, seed=step)
            return full, state
        full = checkpoint(refit, seed=step)
        src = shards(refit, rank, full)
        if case.get("tie") and "model.embed_tokens.weight" in src:
            src["lm_head.weight"] = src["model.embed_tokens.weight"]  # as a state_dict() holds it
        return full, src

    checked = against_the_loader(
        case["name"], model, rank, inputs, lambda src: refit_engine_(refit, src, model)
    )
    print(f"rank {rank}: {case['name']} exact ({checked} parameters)", flush=True)


def saved_checkpoint(trainer, directory: Path):
    """The trainer's model as transformers writes it to disk (its own names and conversions:
    the checkpoint vLLM loads), read back by name on every rank (transformers writes it on
    rank 0 of the default group)."""
    from safetensors.torch import load_file

    trainer.save_pretrained(directory)
    dist.barrier()
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_trained_case(case: dict, rank: int, world: int, tmp: Path) -> None:
    """An architecture with no family code: the trainer is transformers' model of the config
    (FSDP2's DTensors over every rank, or whole tensors on rank 0 alone), the refit takes its
    tensors as they are (``refit_engine_(None, ...)``), and vLLM's own ``load_weights`` of
    the checkpoint transformers saves is the oracle, byte for byte."""
    import transformers

    where = tmp / case["name"].replace(" ", "_")
    config_dir = write_config(where, architecture(case["arch"]))
    from vllm.config import set_current_vllm_config

    cfg, model = vllm_engine.build(config_dir, world, rank, dtype="bfloat16", ep=case.get("ep", False))
    config = transformers.AutoConfig.from_pretrained(config_dir)

    def inputs(step):
        torch.manual_seed(step)
        # vLLM's import of some architectures wraps transformers' model class with its compile
        # decorator, which wants vLLM's config (the trainer runs eagerly all the same)
        with set_current_vllm_config(cfg):
            trainer = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in trainer.parameters():  # biases and norms too, all distinct
                p.normal_(0, 0.02)
        full = saved_checkpoint(trainer, where / f"checkpoint-{step}")
        if case["train"] == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(trainer, mesh=init_device_mesh("cpu", (world,)))
            return full, trainer.state_dict()
        return full, (trainer.state_dict() if rank == 0 else None)

    if "expect" in case:  # a refit that must be refused on every rank, naming the cause
        import re

        from reshard import ReshardError

        if case.get("config_refit"):
            refit = Refit(str(Path(config_dir) / "config.json"), "fsdp=2", f"tp={world}", colocated=True)
            src = shards(refit, rank, checkpoint(refit, seed=0))
        else:
            _, src = inputs(0)
            src = {n: t for n, t in src.items() if n != case.get("drop")}
        try:
            refit_engine_(refit if case.get("config_refit") else None, src, model)
        except ReshardError as e:
            if not re.search(case["expect"], str(e)):
                raise AssertionError(f"{case['name']}: refused, but not as expected: {e}") from e
            print(f"rank {rank}: {case['name']} refused as expected", flush=True)
            return
        raise AssertionError(f"{case['name']}: not refused on rank {rank}")
    checked = against_the_loader(
        case["name"], model, rank, inputs, lambda src: refit_engine_(None, src, model)
    )
    print(f"rank {rank}: {case['name']} exact ({checked} parameters)", flush=True)


def run_backend_case(case: dict, rank: int, world: int, tmp: Path) -> None:
    """The same refit through vLLM's weight-transfer API: the plugin registered from the
    installed package's entry point, both sides made by vLLM's factories from
    ``{"backend": "reshard"}``; plain, delta and staged (commit, then an abort that must
    leave the weights of the commit)."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import (
        WeightSource,
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    from reshard.vllm_backend import ColocatedClient, ReshardTrainerInitInfo

    load_general_plugins()
    config_dir = write_config(tmp / case["name"].replace(" ", "_"), case["config"])
    cfg, model = vllm_engine.build(config_dir, world, rank)
    transfer = WeightTransferConfig(**json.loads('{"backend": "reshard"}'))
    engine = WeightTransferEngineFactory.create_engine(transfer, cfg, torch.device("cpu"), model)
    refit = Refit(str(Path(config_dir) / "config.json"), case["train"], f"tp={world}", colocated=True)

    class Shards(WeightSource):
        def __init__(self, tensors):
            self.tensors = tensors

        @functools.cached_property
        def metadata(self):
            return []

        def iter_local(self):
            return iter(self.tensors.items())

    params = dict(model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    source = Shards({})
    info = ReshardTrainerInitInfo(rank=rank, train=case["train"], train_dtype="f32", **case["mode"])
    client = ColocatedClient(engine)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    steps = [(0, True), (1, True), (2, not case["mode"].get("staged"))]
    served = None
    for seed, commit in steps:
        full = checkpoint(refit, seed=seed)
        if commit:
            with torch.no_grad():
                model.load_weights(on_disk(full))
            served = {n: p.detach().clone() for n, p in params.items()}
            scramble(params)
            if case["mode"].get("delta") and seed > 0:
                with torch.no_grad():  # the delta applies to what the engine held
                    model.load_weights(on_disk(checkpoint(refit, seed=seed - 1)))
        before = {n: p.detach().clone() for n, p in params.items()}
        source.tensors = shards(refit, rank, full)
        trainer.send_weights(commit=commit)
        want = served if commit else before
        for n, p in params.items():
            assert p.data_ptr() == ptrs[n], f"{n}: storage changed"
            assert torch.equal(bits(p), bits(want[n])), (
                f"{case['name']} step {seed}: {n} differs on rank {rank}"
            )
    print(
        f"rank {rank}: {case['name']} exact through vLLM's weight-transfer API ({engine.reports[-1]!r:.60})",
        flush=True,
    )


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tmp = Path(sys.argv[2])
    for case in cases:
        if "arch" in case:
            run_trained_case(case, rank, world, tmp)
        else:
            (run_backend_case if "mode" in case else run_case)(case, rank, world, tmp)
    dist.barrier()


if __name__ == "__main__":
    main()
