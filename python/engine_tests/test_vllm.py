"""A refit into vLLM's own model classes (built on the CPU over gloo) equals vLLM's own loader
run on the full checkpoint, byte for byte, padding rows included, in the same storage.

Runs in a virtual environment with vLLM from PyPI (``.ci/run`` makes it); skipped without."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from launch import run  # noqa: E402
from oracle import LLAMA, QWEN3, QWEN3_MOE, QWEN3_TIED, case  # noqa: E402


DENSE = [
    case("qwen3 from fsdp", QWEN3, "fsdp={w}"),
    case("qwen3 tied from tp, lm_head aliased", QWEN3_TIED, "tp=2", tie=True),
    case("llama from fsdp", LLAMA, "fsdp={w}"),
    case("qwen3 tied from FSDP2 state_dict", QWEN3_TIED, "fsdp={w}", fsdp2=True),
]
MOE = [
    case("qwen3-moe from fsdp", QWEN3_MOE, "fsdp={w}"),
    case("qwen3-moe from tp", QWEN3_MOE, "tp=2"),
    case("qwen3-moe from FSDP2 state_dict (gate_up_proj)", QWEN3_MOE, "fsdp={w}", fsdp2=True),
]


def _at(cases, world, **kw):
    return [dict(c, train=c["train"].format(w=world), **kw) for c in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_dense(tmp_path, world):
    out = run(world, _at(DENSE, world), tmp_path)
    assert out.count(" exact ") == world * len(DENSE), out


@pytest.mark.parametrize("world", [2, 4])
def test_moe(tmp_path, world):
    out = run(world, _at(MOE, world), tmp_path)
    assert out.count(" exact ") == world * len(MOE), out


def test_moe_expert_parallel(tmp_path):
    out = run(2, _at(MOE[:1], 2, ep=True), tmp_path)
    assert out.count(" exact ") == 2, out


BACKEND = [
    case("backend plain", QWEN3, "fsdp=2", mode={}),
    case("backend delta", QWEN3, "fsdp=2", mode={"delta": True}),
    case("backend staged", QWEN3, "fsdp=2", mode={"staged": True}),
    case("backend staged delta", QWEN3_MOE, "fsdp=2", mode={"staged": True, "delta": True}),
]


def test_weight_transfer_backend(tmp_path):
    out = run(2, BACKEND[:3], tmp_path / "dense")
    assert out.count("through vLLM's weight-transfer API") == 2 * 3, out
    out = run(2, BACKEND[3:], tmp_path / "moe")
    assert out.count("through vLLM's weight-transfer API") == 2, out


def test_cli_selects_the_backend():
    """vLLM's own argument parser and config take ``{"backend": "reshard"}``, and its
    factories make the package's classes once the plugins (entry points) are loaded."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--weight-transfer-config", '{"backend": "reshard"}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.weight_transfer_config.backend == "reshard"
    load_general_plugins()
    from reshard.vllm_backend import ReshardTrainer, ReshardWeightTransferEngine

    assert WeightTransferEngineFactory._registry["reshard"]() is ReshardWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["reshard"]() is ReshardTrainer
