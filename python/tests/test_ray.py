"""reshard.ray on a local Ray cluster: two trainer actors and two engine actors form one
job, and the driver runs refits; the engines' shards equal the trainers' tensors."""

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from reshard import ReshardError  # noqa: E402
from reshard.ray import RefitJob, ReshardActor  # noqa: E402

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


def _full(refit, step):
    torch.manual_seed(0)
    return {n: torch.randn(refit.layouts(n)[0].shape) + step for n in refit.names}


class Trainer(ReshardActor):
    def __init__(self, path, rank):
        from reshard import Refit
        from reshard.torch import local_tensor

        self.refit, self.rank, self.step = Refit(path, "fsdp=2", "tp=2"), rank, 0
        self._local = local_tensor

    def reshard_source(self):
        full = _full(self.refit, self.step)
        names = self.refit.rank_names(self.rank)
        out = {n: self._local(self.refit.layouts(n)[0], self.rank, full[n]) for n in names}
        return {n: t for n, t in out.items() if t is not None}

    def train_step(self):
        self.step += 1


class Engine(ReshardActor):
    def __init__(self, path, rank, kind):
        from reshard import Refit
        from reshard.engine import engine_params

        self.refit, self.rank = Refit(path, "fsdp=2", "tp=2"), rank
        if kind == "vllm":
            params = engine_params(self.refit, rank)
            self.tensors = {n: torch.zeros(s, dtype=d) for n, (s, d) in params.items()}
        else:
            self.tensors = {
                n: torch.zeros(self.refit.layouts(n)[1].local_shape(rank))
                for n in self.refit.rank_names(rank)
            }

    def reshard_destination(self):
        return self.tensors

    def holds(self, step, name):
        from reshard.torch import local_tensor

        want = local_tensor(self.refit.layouts(name)[1], self.rank, _full(self.refit, step)[name])
        got = self.tensors[name]
        return torch.equal(got, want) if name in self.tensors else None


@pytest.fixture(scope="module")
def cluster():
    # the actors' classes live in this module: the workers import it from here
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@pytest.mark.parametrize("kind", [None, "vllm"])
def test_a_job_over_two_actor_pools(cluster, tmp_path, kind):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    trainer_cls = ray.remote(num_cpus=1)(Trainer)
    engine_cls = ray.remote(num_cpus=1)(Engine)
    trainers = [trainer_cls.remote(str(path), r) for r in range(2)]
    engines = [engine_cls.remote(str(path), 2 + r, kind) for r in range(2)]
    with pytest.raises(ReshardError, match=r"engines: 1 actors, but infer='tp=2' has 2 ranks"):
        RefitJob(trainers, engines[:1], str(path), "fsdp=2", "tp=2")
    # the bound is generous: four actors that import torch on a loaded 2-core machine take
    # tens of seconds to join; a hang still ends in the bound
    job = RefitJob(trainers, engines, str(path), "fsdp=2", "tp=2", engine=kind, timeout_s=180)
    try:
        for step in range(2):
            seconds = job.refit()
            assert len(seconds) == 4
            name = "model.norm.weight" if kind else "model.layers.0.self_attn.k_proj.weight"
            assert ray.get([e.holds.remote(step, name) for e in engines]) == [True, True]
            ray.get([t.train_step.remote() for t in trainers])
    finally:
        job.close()
    for actor in trainers + engines:
        ray.kill(actor)
