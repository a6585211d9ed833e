"""An engine's own parameters as a Refit's destinations: vLLM's and SGLang's names, fused
buffers and padded vocabulary (the table itself is checked against their model classes in
python/engine_tests)."""

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


def _path(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("config", [QWEN3, QWEN3_MOE])
def test_engine_params_arguments_and_padding(tmp_path, config):
    # The names, shapes and dtypes themselves are checked against vLLM's and SGLang's own
    # model classes, built at tp=2 and tp=4, in python/engine_tests (check_the_table).
    refit = Refit(_path(tmp_path, config), "fsdp=2", "tp=2")
    for rank in (2, 3):
        vllm, sglang = engine_params(refit, rank, "vllm"), engine_params(refit, rank, "sglang")
        assert [v for v in vllm.values()] == [v for v in sglang.values()]
        renamed = {k.replace(".experts.routed_experts.", ".experts."): v for k, v in vllm.items()}
        assert renamed == sglang  # vLLM keeps the routed experts one module deeper
        assert all(dtype == torch.float32 for _, dtype in vllm.values())
        # the vocabulary padded to a multiple of 64 (1024 rows) and split evenly
        assert vllm["lm_head.weight"][0] == (512, 64)
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
    w2 = "model.layers.0.mlp.experts.routed_experts.w2_weight"
    if w2 in engine:
        down = "model.layers.0.mlp.experts.down_proj"
        want = rt.local_tensor(refit.layouts(down)[1], rank, full[down])
        assert torch.equal(engine[w2], want)
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
    first = refit_engine_(refit, src, engine, delta=session)
    assert first.base is None and first.fenced
    if engine is not None:
        _check_tables(refit, engine, full, rank, 1000)
    # row 505 lands in rank 3's scratch shard and moves on to rank 2: the scratch is kept
    full["lm_head.weight"][505] += 1
    full["model.norm.weight"][0] += 1
    second = refit_engine_(refit, src, engine, delta=rt.Delta(session))
    assert second.base == 1 and second.fenced == {}
    if rank < 2:
        assert second.bytes_sent < second.bytes_dense / 10
    else:
        _check_tables(refit, engine, full, rank, 1000)
    # a rank whose scratch shard is new (dropped here) gets its regions dense
    if rank == 2:
        engine_module._SCRATCH.pop(session)
    full["lm_head.weight"][3] -= 1
    third = refit_engine_(refit, src, engine, session=session)  # the flat keyword, as before
    assert list(third.fenced) == [2], third.fenced
    if engine is not None:
        _check_tables(refit, engine, full, rank, 1000)


def test_refit_into_vllm_parameters_by_delta(tmp_path):
    run_ranks(_engine_delta, 4, _path(tmp_path, QWEN3), timeout=60)


def test_sglang_options_from_the_environment_take_a_delta_group(tmp_path, monkeypatch):
    from reshard import sglang_loader

    job = {"model": _path(tmp_path, QWEN3), "train": "tp=2", "infer": "tp=2", "colocated": True}
    monkeypatch.setenv(
        sglang_loader.ENV, json.dumps({**job, "options": {"delta": {"model": "policy"}, "checksum": True}})
    )
    sglang_loader._JOB.clear()
    try:
        assert sglang_loader._job()["options"] == {"delta": rt.Delta(model="policy"), "checksum": True}
        sglang_loader._JOB.clear()
        monkeypatch.setenv(sglang_loader.ENV, json.dumps({**job, "options": {"delta": {"models": "p"}}}))
        with pytest.raises(ReshardError, match="_REFIT: .*unexpected keyword argument 'models'"):
            sglang_loader._job()
        sglang_loader._JOB.clear()
        monkeypatch.setenv(sglang_loader.ENV, json.dumps({**job, "options": {"delta": True, "model": "p"}}))
        assert sglang_loader._job()["options"] == {"delta": True, "model": "p"}  # flat, as before
    finally:
        sglang_loader._JOB.clear()
