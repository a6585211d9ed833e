"""One worker of ``test_verl.py``: a trainer rank (FSDP2 over a tiny Qwen3, verl's own
``apply_fsdp2`` and shard export) or a rollout rank, each in a torch.distributed world of its
own, as verl runs them, and a "reshard" checkpoint engine from verl's registry between them.

The driver (the test) plays verl's CheckpointEngineManager: it reads every worker's
``prepare()`` metadata, calls the engine class's ``build_topology`` and hands each worker its
``init_process_group`` arguments, through files in the run's directory.

Rounds (every worker runs them in this order):
  0. verl's shard export into replicated rollout buffers;
  1. a bucket holding a block placement that is no DTensor split: refused on every rank;
  2. trainer rank 1's export raises midway: it raises that, every other rank AgreementError;
  3. full (name, tensor) pairs, as verl's get_per_tensor_param() yields them, on the same group;
  4. the shard export into a rollout split over tp=2 (a second engine, a group of its own).
"""

import asyncio
import os
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

BUCKET = 64 << 10  # bytes of full tensor: the embedding alone fills one, the rest share a few
SHARD_DIMS = {r"(q|k|v|gate|up)_proj\.weight$": 0, r"(o|down)_proj\.weight$": 1, r"embed_tokens|lm_head": 0}
MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1001,  # odd: FSDP2 cuts the embedding 501 + 500 rows
    tie_word_embeddings=False,
)


def put(path: Path, obj) -> None:
    part = path.with_suffix(".part")
    part.write_bytes(pickle.dumps(obj))
    os.replace(part, path)


def wait_for(path: Path, timeout: float = 300):
    end = time.time() + timeout
    while not path.exists():
        if time.time() > end:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.05)
    return pickle.loads(path.read_bytes())


class Worker:
    def __init__(self, role: str, index: int, tmp: Path, world_port: int) -> None:
        self.role, self.index, self.tmp = role, index, tmp
        self.me = f"{role}{index}"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=index, world_size=2)
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        import_external_libs("reshard.verl_backend")  # what checkpoint_engine.custom_backend_module does
        self.registry = CheckpointEngineRegistry

    def engine(self, **kwargs):
        if self.role == "trainer":  # verl's actor worker: the master is its rank 0
            kwargs["is_master"] = dist.get_rank() == 0
        return self.registry.new("reshard", bucket_size=BUCKET, **kwargs)

    def join(self, engine, rnd: int) -> None:
        put(self.tmp / f"meta-{rnd}-{self.me}.pkl", engine.prepare())
        engine.init_process_group(**wait_for(self.tmp / f"kw-{rnd}-{self.me}.pkl"))


class Trainer(Worker):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM, Qwen3Config
        from verl.utils.fsdp_utils import apply_fsdp2
        from verl.workers.engine.fsdp import transformer_impl

        torch.manual_seed(0)  # the same full model on both ranks, before FSDP2 cuts it
        model = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=["fsdp"])
        apply_fsdp2(model, {"mesh": mesh}, {})
        transformer_impl.get_device_id = lambda: "cpu"  # verl's engine assumes an accelerator
        self.model = model
        self.fsdp = transformer_impl.FSDPEngine

    def export(self):
        """verl's FSDPEngine.get_per_tensor_param_shard on this model."""
        engine = SimpleNamespace(module=self.model, _is_offload_param=False)
        engine._uses_fsdp2_cpu_offload_policy = False
        gen, _ = self.fsdp.get_per_tensor_param_shard(engine)
        return gen

    def full_pairs(self):
        """verl's full export: each parameter gathered (a collective), in bf16."""
        for name, p in self.model.state_dict().items():
            yield name, p.full_tensor().to(torch.bfloat16)

    def run(self) -> None:
        oracle = {n: t.clone() for n, t in self.full_pairs()}  # the oracle, gathered by torch
        if self.index == 0:
            torch.save(oracle, self.tmp / "oracle.pt")
        engine = self.engine()

        self.join(engine, 0)
        metrics = asyncio.run(engine.send_weights(self.export(), global_steps=1))
        put(self.tmp / f"metrics-{self.me}.pkl", metrics)
        engine.finalize()

        self.join(engine, 1)
        put(self.tmp / f"refusal-{self.me}.pkl", outcome(engine.send_weights(self.bad_export())))
        engine.finalize()

        self.join(engine, 2)
        put(self.tmp / f"failure-{self.me}.pkl", outcome(engine.send_weights(self.failing_export())))
        engine.finalize()

        self.join(engine, 3)
        asyncio.run(engine.send_weights(self.full_pairs(), global_steps=3))
        engine.finalize()

        split = self.engine(rollout_tp=2, rollout_shard_dims=SHARD_DIMS)
        self.join(split, 4)
        asyncio.run(split.send_weights(self.export(), global_steps=4))
        split.finalize()

    def bad_export(self):
        """A good tensor, then one whose blocks cut two dims at once (no DTensor split)."""
        from verl.workers.engine.spec import BlockPlacement, ShardSpec

        yield "model.norm.weight", torch.ones(64, dtype=torch.bfloat16), None
        block = BlockPlacement((2, 3), (2 * self.index, 3 * self.index), (4, 6))
        spec = ShardSpec(full_shape=(4, 6), place=block, gather_group=dist.group.WORLD)
        yield "bad.weight", torch.zeros(6, dtype=torch.bfloat16), spec

    def failing_export(self):
        """The shard export, which fails on rank 1 after a few tensors (rank 0's goes on)."""
        for i, item in enumerate(self.export()):
            if i == 5 and self.index == 1:
                raise RuntimeError("the export failed here")
            yield item


def outcome(coro) -> str:
    try:
        asyncio.run(coro)
    except Exception as e:  # what the round raised, for the driver to check
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
    return "no error"


class Rollout(Worker):
    async def take(self, engine):
        return {name: t.clone() async for name, t in engine.receive_weights(global_steps=0)}

    def run(self) -> None:
        engine = self.engine()
        self.join(engine, 0)
        torch.save(asyncio.run(self.take(engine)), self.tmp / f"recv-0-{self.me}.pt")
        engine.finalize()

        self.join(engine, 1)
        put(self.tmp / f"refusal-{self.me}.pkl", outcome(self.take(engine)))
        engine.finalize()

        self.join(engine, 2)
        put(self.tmp / f"failure-{self.me}.pkl", outcome(self.take(engine)))
        engine.finalize()

        self.join(engine, 3)
        torch.save(asyncio.run(self.take(engine)), self.tmp / f"recv-3-{self.me}.pt")
        engine.finalize()

        split = self.engine(rollout_tp=2, rollout_shard_dims=SHARD_DIMS)
        self.join(split, 4)
        torch.save(asyncio.run(self.take(split)), self.tmp / f"recv-4-{self.me}.pt")
        split.finalize()


if __name__ == "__main__":
    role, index, tmp, port = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    worker = (Trainer if role == "trainer" else Rollout)(role, index, tmp, port)
    worker.run()
    dist.barrier()
    print(f"{worker.me} done")
