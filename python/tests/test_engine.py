"""An engine's own parameters as a Refit's destinations: vLLM's and SGLang's names, fused
buffers and padded vocabulary, against parameter lists written from their model definitions."""

import json

import pytest
import torch

import reshard.torch as rt
from conftest import run_ranks
from reshard import Refit, ReshardError
from reshard.engine import engine_params, refit_engine_

QWEN3 = {
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
QWEN3_MOE = dict(
    QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    transformers_version="5.0.0",
    moe_intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
)

# vLLM's Qwen3ForCausalLM (and SGLang's) on one rank of tp=2, its named_parameters(): the
# vocabulary padded to 1024 rows and split evenly, q/k/v and gate/up fused, the heads split.
VLLM_QWEN3_TP2 = {
    "model.embed_tokens.weight": (512, 64),
    "model.layers.0.self_attn.qkv_proj.weight": ((64 + 32 + 32) // 2, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 32),
    "model.layers.0.self_attn.q_norm.weight": (16,),
    "model.layers.0.self_attn.k_norm.weight": (16,),
    "model.layers.0.mlp.gate_up_proj.weight": (2 * 128 // 2, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (512, 64),
}
# Qwen3MoeForCausalLM: the router replicated, the experts in FusedMoE's w13 [E, 2I/tp, H]
# and w2 [E, H, I/tp]
VLLM_QWEN3_MOE_TP2 = {
    k: v
    for k, v in VLLM_QWEN3_TP2.items()
    if ".mlp.gate_up_proj" not in k and ".mlp.down_proj" not in k
}
VLLM_QWEN3_MOE_TP2.update(
    {
        "model.layers.0.mlp.gate.weight": (4, 64),
        "model.layers.0.mlp.experts.w13_weight": (4, 2 * 32 // 2, 64),
        "model.layers.0.mlp.experts.w2_weight": (4, 64, 32 // 2),
    }
)


def _path(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("config, want", [(QWEN3, VLLM_QWEN3_TP2), (QWEN3_MOE, VLLM_QWEN3_MOE_TP2)])
def test_engine_params_are_vllms(tmp_path, config, want):
    refit = Refit(_path(tmp_path, config), "fsdp=2", "tp=2")
    for rank in (2, 3):
        for engine in ("vllm", "sglang"):
            got = engine_params(refit, rank, engine)
            assert {k: v[0] for k, v in got.items()} == want
            assert all(dtype == torch.float32 for _, dtype in got.values())
    assert engine_params(refit, 0) == {}
    # no padding past the table when asked (vocab_pad=1): torch.chunk's split
    assert engine_params(refit, 2, vocab_pad=1)["lm_head.weight"][0] == (500, 64)
    with pytest.raises(ReshardError, match=r"engine: 'trt' is not one of vllm, sglang"):
        engine_params(refit, 2, "trt")
    with pytest.raises(ReshardError, match=r"vocab_pad: 0 is not a positive integer"):
        engine_params(refit, 2, vocab_pad=0)


def test_fp8_scale_names(tmp_path):
    refit = Refit(_path(tmp_path, QWEN3), "fsdp=2", "tp=2", infer_quant="fp8-block:16x16")
    vllm = engine_params(refit, 2)
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in vllm
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in vllm
    compressed = engine_params(refit, 2, scale_name="weight_scale")
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" in compressed
    assert not any(k.endswith("_inv") for k in compressed)
    assert vllm["model.layers.0.self_attn.o_proj.weight"][1] == torch.float8_e4m3fn


def _engine_refit(rank, world, path, vocab):
    refit = Refit(path, "fsdp=2", "tp=2")
    torch.manual_seed(0)
    full = {}
    for name in refit.names:
        full[name] = torch.randn(refit.layouts(name)[0].shape)
    src = None
    if rank < 2:
        src = {n: rt.local_tensor(refit.layouts(n)[0], rank, full[n]) for n in refit.rank_names(rank)}
        src = {n: t for n, t in src.items() if t is not None}
        # a transformers 5 trainer holds the experts' gate and up as one parameter
        gate = "model.layers.0.mlp.experts.gate_proj.weight"
        if gate in src:
            up = src.pop(gate.replace("gate_proj", "up_proj"))
            src["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat([src.pop(gate), up], dim=1)
    engine = None
    if rank >= 2:
        params = engine_params(refit, rank)
        engine = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in params.items()}
    for _ in range(2):  # the second refit reruns the programs
        refit_engine_(refit, src, engine)
    if engine is None:
        return
    tp_index = rank - 2
    per = -(-vocab // 64) * 64 // 2
    for table in ("model.embed_tokens.weight", "lm_head.weight"):
        lo, hi = min(tp_index * per, vocab), min((tp_index + 1) * per, vocab)
        assert torch.equal(engine[table][: hi - lo], full[table][lo:hi]), table
        assert not engine[table][hi - lo :].any(), "the padding is left alone"
    attn = "model.layers.0.self_attn."
    q, k, v = (
        rt.local_tensor(refit.layouts(attn + f"{x}_proj.weight")[1], rank, full[attn + f"{x}_proj.weight"])
        for x in "qkv"
    )
    assert torch.equal(engine[attn + "qkv_proj.weight"], torch.cat([q, k, v]))
    if "model.layers.0.mlp.experts.w2_weight" in engine:
        down = "model.layers.0.mlp.experts.down_proj"
        want = rt.local_tensor(refit.layouts(down)[1], rank, full[down])
        assert torch.equal(engine["model.layers.0.mlp.experts.w2_weight"], want)
    # an engine parameter of the wrong padded shape is refused, naming it
    bad = dict(engine, **{"lm_head.weight": torch.zeros(per - 1, 64)})
    padded = r"lm_head.weight: shape \[\d+, 64\], but vllm pads the vocabulary"
    with pytest.raises(ReshardError, match=padded):
        refit_engine_(refit, None, bad)


@pytest.mark.parametrize("vocab", [1000, 1024])
def test_refit_into_vllm_parameters(tmp_path, vocab):
    # 1000 rows: the padded split (512 + 488) is not torch.chunk's (500 + 500), so the rows
    # move once more between the engine's ranks; 1024 rows land in place
    path = _path(tmp_path, dict(QWEN3_MOE, vocab_size=vocab))
    run_ranks(_engine_refit, 4, path, vocab, timeout=60)


def _check_tables(refit, engine, full, rank, vocab):
    per = -(-vocab // 64) * 64 // 2
    lo, hi = min((rank - 2) * per, vocab), min((rank - 1) * per, vocab)
    for table in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(engine[table][: hi - lo], full[table][lo:hi]), table
    norm = "model.norm.weight"
    assert torch.equal(engine[norm], full[norm])


def _engine_delta(rank, world, path):
    from reshard import engine as engine_module

    refit = Refit(path, "fsdp=2", "tp=2")
    torch.manual_seed(0)
    full = {name: torch.randn(refit.layouts(name)[0].shape) for name in refit.names}
    src = engine = None
    if rank < 2:  # views of the whole tensors: a change to them is a training step
        src = {n: rt.local_tensor(refit.layouts(n)[0], rank, full[n]) for n in refit.rank_names(rank)}
        src = {n: t for n, t in src.items() if t is not None}
    else:
        engine = {n: torch.zeros(s, dtype=d) for n, (s, d) in engine_params(refit, rank).items()}
    session = rt.DeltaSession()
    first = refit_engine_(refit, src, engine, session=session)
    assert first.base is None and first.fenced
    if engine is not None:
        _check_tables(refit, engine, full, rank, 1000)
    # row 505 lands in rank 3's scratch shard and moves on to rank 2: the scratch is kept
    full["lm_head.weight"][505] += 1
    full["model.norm.weight"][0] += 1
    second = refit_engine_(refit, src, engine, session=session)
    assert second.base == 1 and second.fenced == {}
    if rank < 2:
        assert second.bytes_sent < second.bytes_dense / 10
    else:
        _check_tables(refit, engine, full, rank, 1000)
    # a rank whose scratch shard is new (dropped here) gets its regions dense
    if rank == 2:
        engine_module._SCRATCH.pop(session)
    full["lm_head.weight"][3] -= 1
    third = refit_engine_(refit, src, engine, session=session)
    assert list(third.fenced) == [2], third.fenced
    if engine is not None:
        _check_tables(refit, engine, full, rank, 1000)


def test_refit_into_vllm_parameters_by_delta(tmp_path):
    run_ranks(_engine_delta, 4, _path(tmp_path, QWEN3), timeout=60)
