"""Model configs as transformers 5 writes them, and Refit.check against a model's tensors."""

import json

import pytest
import torch

import reshard.torch
from reshard import Refit, ReshardError

# Qwen3MoeConfig(num_experts=4, ...).save_pretrained(d) under transformers 5, written by hand:
# num_local_experts, no dtype, nulls where a key is unset
QWEN3_MOE_V5 = {
    "architectures": None,
    "model_type": "qwen3_moe",
    "transformers_version": "5.0.0",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": None,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": None,
    "tie_word_embeddings": None,
    "rope_scaling": None,
}


def _config(tmp_path, **changes):
    config = dict(QWEN3_MOE_V5, **changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_missing_dtype_is_refused_unless_given(tmp_path):
    path = _config(tmp_path)
    with pytest.raises(ReshardError, match=r"`dtype` is missing: .*train_dtype="):
        Refit(path, "fsdp=2", "tp=2")
    refit = Refit(path, "fsdp=2", "tp=2", train_dtype=torch.float32)
    assert refit.train_ranks == 2
    assert refit.layouts("model.embed_tokens.weight")[0].dtype == "f32"
    assert refit.layouts("model.embed_tokens.weight")[1].dtype == "f32"
    # the experts are there, not a dense MLP
    assert "model.layers.0.mlp.experts.gate_proj.weight" in refit.names
    assert "model.layers.0.mlp.gate.weight" in refit.names
    assert "model.layers.0.mlp.gate_proj.weight" not in refit.names


def test_a_null_required_key_is_named(tmp_path):
    path = _config(tmp_path, hidden_size=None, dtype="bfloat16")
    with pytest.raises(ReshardError, match=r"`hidden_size` is null"):
        Refit(path, "tp=1", "tp=1")


def _whole(refit, side="train"):
    """Every parameter of ``refit`` as a meta tensor of its global shape and dtype."""
    out = {}
    for name in refit.names:
        src, dst = refit.layouts(name)
        layout = src if side == "train" else dst
        out[name] = torch.empty(layout.shape, dtype=getattr(torch, _TORCH[layout.dtype]), device="meta")
    return out


_TORCH = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def test_check_names_the_first_difference(tmp_path):
    refit = Refit(_config(tmp_path, dtype="float32"), "fsdp=2", "tp=2")
    tensors = _whole(refit)
    refit.check(tensors)
    refit.check(_whole(refit, "infer"), side="infer")
    # a trainer whose model has no experts in layer 0 (a config read as dense)
    dense = dict(tensors)
    del dense["model.layers.0.mlp.experts.up_proj.weight"]
    with pytest.raises(ReshardError, match=r"model.layers.0.mlp.experts.up_proj.weight is a parameter .* none was given"):
        refit.check(dense)
    dense["model.layers.0.mlp.up_proj.weight"] = torch.empty(512, 256, device="meta")
    with pytest.raises(ReshardError, match=r"model.layers.0.mlp.up_proj.weight is neither a parameter"):
        refit.check(dense)
    wrong = dict(tensors, **{"model.norm.weight": torch.empty(255, device="meta")})
    with pytest.raises(ReshardError, match=r"model.norm.weight: shape \[255\], but the refit .* has \[256\]"):
        refit.check(wrong)
    bf16 = dict(tensors, **{"model.norm.weight": torch.empty(256, dtype=torch.bfloat16, device="meta")})
    with pytest.raises(ReshardError, match=r"model.norm.weight: dtype bf16, .* holds f32 .*train_dtype"):
        refit.check(bf16)


def test_check_takes_fused_buffers_and_local_shards(tmp_path):
    refit = Refit(_config(tmp_path, dtype="bfloat16"), "fsdp=2", "tp=2")
    engine = _whole(refit, "infer")
    gate = engine.pop("model.layers.0.mlp.experts.gate_proj.weight")
    engine.pop("model.layers.0.mlp.experts.up_proj.weight")
    engine["model.layers.0.mlp.experts.w13_weight"] = torch.empty(
        4, 2 * gate.shape[1], 256, dtype=torch.bfloat16, device="meta"
    )
    refit.check(engine, side="infer")
    # rank 0's training shards: FSDP over 2 ranks halves dim 0
    src = {}
    for name in refit.rank_names(0):
        layout = refit.layouts(name)[0]
        shard = reshard.torch.local_tensor(layout, 0, torch.empty(layout.shape, dtype=torch.bfloat16))
        if shard is not None:
            src[name] = shard
    refit.check(src, side="train", rank=0)
    src["model.embed_tokens.weight"] = torch.empty(1000, 256, dtype=torch.bfloat16)
    with pytest.raises(ReshardError, match=r"shape \[1000, 256\], but the refit .* has \[500, 256\] on the train side on rank 0"):
        refit.check(src, side="train", rank=0)


def test_fsdp_alone_and_refusals_say_what_to_write(tmp_path):
    path = _config(tmp_path, dtype="bfloat16")
    assert Refit(path, "fsdp=4", "tp=2").train_ranks == 4
    with pytest.raises(ReshardError, match=r"write dp=4,fsdp=4"):
        Refit(path, "dp=2,fsdp=4", "tp=2")
