"""Configs and parallelism a Refit refuses, each saying what to write instead."""

import json

import pytest

from reshard import Refit, ReshardError

MOE = {
    "model_type": "qwen3_moe",
    "transformers_version": "5.0.0",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "dtype": "float32",
}


def _path(tmp_path, **changes):
    config = {k: v for k, v in dict(MOE, **changes).items() if v != "absent"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("count", [{}, {"num_experts": None}, {"num_local_experts": None}])
def test_a_moe_config_without_experts_is_refused_not_read_as_dense(tmp_path, count):
    with pytest.raises(ReshardError, match=r"`num_experts` is missing: .*add `\"num_experts\": N`"):
        Refit(_path(tmp_path, **count), "fsdp=2", "tp=2")
    refit = Refit(_path(tmp_path, num_local_experts=4), "fsdp=2", "tp=2")
    assert "model.layers.0.mlp.experts.down_proj" in refit.names


@pytest.mark.parametrize(
    "train, hint",
    [
        ("dp=2,fsdp=4", "write dp=4,fsdp=4, or fsdp alone"),
        ("dp=6,fsdp=4", "write dp=12,fsdp=4, or fsdp=2"),
        ("ep=2", "write ep=2,dp=2"),
        ("tp=4,world=6", "write world=4 or world=8"),
        ("tp=2,dp=2,world=8", "write dp=4, or world=4"),
        ("tp=3", "write tp=2 or tp=4"),
        ("tp=2,sp=2", "expected tp, cp, ep, etp, dp, pp, fsdp, world"),
    ],
)
def test_refused_parallelism_says_what_to_write(tmp_path, train, hint):
    path = _path(tmp_path, num_local_experts=4)
    with pytest.raises(ReshardError) as refused:
        Refit(path, train, "tp=2")
    assert hint in str(refused.value), str(refused.value)
    fix = str(refused.value).split("(write ")[-1].split(" or")[0].rstrip(",)")
    if "=" in fix and "expected" not in fix:
        Refit(path, fix, "tp=2")  # what it says to write is accepted
