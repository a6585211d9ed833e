"""A refit into vLLM's own model classes (built on the CPU over gloo) equals vLLM's own loader
run on the full checkpoint, byte for byte, padding rows included, in the same storage.

Runs in a virtual environment with vLLM from PyPI (``.ci/run`` makes it); skipped without."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from launch import run  # noqa: E402
from oracle import ARCHITECTURES, LLAMA, MOE_ARCHITECTURES, QWEN3, QWEN3_MOE, QWEN3_TIED, case  # noqa: E402


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


DENSE_ARCHITECTURES = [a for a in ARCHITECTURES if a not in MOE_ARCHITECTURES]


def _trained(arches, train, **kw):
    return [dict(kw, name=f"{a} from {train}", arch=a, train=train) for a in arches]


@pytest.mark.parametrize("world, train", [(2, "fsdp2"), (4, "whole")])
def test_architectures_from_the_trainers_own_tensors(tmp_path, world, train):
    """Architectures with no family code, no Refit and no config on the refit's side: the
    trainer's tensors (FSDP2's DTensors, or whole tensors on rank 0) give the training side,
    vLLM's recorded loader the engine side; f32 into bf16, equal to vLLM's own load of the
    checkpoint transformers saves."""
    out = run(world, _trained(DENSE_ARCHITECTURES, train), tmp_path)
    assert out.count(" exact ") == world * len(DENSE_ARCHITECTURES), out


@pytest.mark.parametrize("world, train, ep", [(2, "fsdp2", False), (4, "whole", False), (2, "fsdp2", True)])
def test_moe_architectures_from_the_trainers_own_tensors(tmp_path, world, train, ep):
    out = run(world, _trained(MOE_ARCHITECTURES, train, ep=ep), tmp_path)
    assert out.count(" exact ") == world * len(MOE_ARCHITECTURES), out


def test_refusals_name_the_side_at_fault(tmp_path):
    """A tensor the trainer lacks is named as the trainer's (also where the side comes from
    a config: Llama's family has no MLP bias), on every rank, before anything moves."""
    cases = [
        dict(
            name="qwen2 without one k_proj",
            arch="qwen2",
            train="fsdp2",
            drop="model.layers.1.self_attn.k_proj.weight",
            expect=r"the trainer holds no model\.layers\.1\.self_attn\.k_proj\.weight, which other",
        ),
        dict(
            name="llama with mlp_bias by its config's family",
            arch="llama_biases",
            train="fsdp2",
            config_refit=True,
            expect=r"the trainer holds no model\.layers\.\d\.mlp\.\*\.bias",
        ),
    ]
    out = run(2, cases, tmp_path)
    assert out.count("refused as expected") == 2 * 2, out


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
