"""Model configs as transformers 5 writes them, and Refit.check against a model's tensors."""

import json

import pytest
import torch

import reshard.torch
import reshard.torch as rt
from conftest import run_ranks
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
    with pytest.raises(
        ReshardError, match=r"model.layers.0.mlp.experts.up_proj.weight is a parameter .* none was given"
    ):
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
    with pytest.raises(
        ReshardError,
        match=r"shape \[1000, 256\], but the refit .* has \[500, 256\] on the train side on rank 0",
    ):
        refit.check(src, side="train", rank=0)


def test_fsdp_alone_and_refusals_say_what_to_write(tmp_path):
    path = _config(tmp_path, dtype="bfloat16")
    assert Refit(path, "fsdp=4", "tp=2").train_ranks == 4
    with pytest.raises(ReshardError, match=r"write dp=4,fsdp=4"):
        Refit(path, "dp=2,fsdp=4", "tp=2")


def test_check_takes_a_transformers_5_trainers_names(tmp_path):
    refit = Refit(_config(tmp_path, dtype="bfloat16"), "fsdp=2", "tp=2")
    assert "model.layers.0.mlp.experts.down_proj" in refit.names
    trainer = _whole(refit)
    trainer.pop("model.layers.0.mlp.experts.gate_proj.weight")
    trainer.pop("model.layers.0.mlp.experts.up_proj.weight")
    # a trainer under transformers 5 holds gate and up as one [E, 2I, H] parameter
    trainer["model.layers.0.mlp.experts.gate_up_proj"] = torch.empty(
        4, 256, 256, dtype=torch.bfloat16, device="meta"
    )
    refit.check(trainer)
    trainer["model.layers.0.mlp.experts.gate_up_proj"] = torch.empty(
        4, 128, 256, dtype=torch.bfloat16, device="meta"
    )
    with pytest.raises(
        ReshardError, match=r"gate_up_proj: shape \[4, 128, 256\], but the refit .* has \[4, 256, 256\]"
    ):
        refit.check(trainer)


def _v5_refit(rank, world, path, misread):
    from test_refit import values

    refit = Refit(path, "fsdp=2", "tp=2")
    src, dst = {}, {}
    train_fused = refit.fused(rank, "train")
    infer_fused = refit.fused(rank)
    train_fused = {b: ms for b, ms in train_fused.items() if b.endswith(".mlp.experts.gate_up_proj")}
    in_train = {m for ms in train_fused.values() for m, *_ in ms}
    in_infer = {m for ms in infer_fused.values() for m, *_ in ms}
    for name in refit.rank_names(rank):
        s_layout, d_layout = refit.layouts(name)
        if rank in s_layout.ranks and name not in in_train:
            src[name] = values(refit, name, s_layout, rank)
        if rank in d_layout.ranks and name not in in_infer:
            dst[name] = torch.zeros(d_layout.local_shape(rank), dtype=rt.torch_dtype(d_layout))
    # the trainer's own gate_up_proj: its gate shard, then its up shard
    for buffer, ms in train_fused.items():
        src[buffer] = torch.cat([values(refit, m, refit.layouts(m)[0], rank) for m, *_ in ms], dim=ms[0][1])
    for buffer, ms in infer_fused.items():
        first = refit.layouts(ms[0][0])[1]
        shape = list(first.local_shape(rank))
        shape[ms[0][1]] = sum(extent for *_, extent in ms)
        dst[buffer] = torch.zeros(shape, dtype=rt.torch_dtype(first))
    if rank < 2:
        assert any(b.endswith(".mlp.experts.gate_up_proj") for b in src)
    if misread and rank == 0:
        # a trainer whose model the config does not describe: a dense MLP in layer 0
        src["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(256, 256, dtype=torch.bfloat16)
    if misread:
        with pytest.raises(ReshardError, match=r"model.layers.0.mlp.gate_proj.weight is neither a parameter"):
            rt.reshard_many_(refit, src=src, dst=dst)
        for tensor in dst.values():
            assert not tensor.any(), "no byte moved"
        return
    rt.reshard_many_(refit, src=src, dst=dst)
    for buffer, ms in infer_fused.items():
        for member, dim, offset, extent in ms:
            want = values(refit, member, refit.layouts(member)[1], rank)
            assert torch.equal(dst[buffer].narrow(dim, offset, extent), want), member
    for name, tensor in dst.items():
        if name not in infer_fused:
            assert torch.equal(tensor, values(refit, name, refit.layouts(name)[1], rank)), name


def test_a_transformers_5_trainer_refits_by_its_own_names(tmp_path):
    run_ranks(_v5_refit, 4, _config(tmp_path, dtype="bfloat16"), False)


def test_a_misread_config_moves_no_bytes(tmp_path):
    run_ranks(_v5_refit, 4, _config(tmp_path, dtype="bfloat16"), True, timeout=60)
