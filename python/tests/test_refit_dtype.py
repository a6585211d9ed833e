"""A refit with a precision change from Python: reshard.Refit(train_dtype=, infer_dtype=)
lays out each side in its own dtype, and reshard_many_ moves f32 master weights into bf16
(or f16) inference buffers, every value equal to torch's own cast of the source."""

import json

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402

TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def values(refit, name, layout, rank, train):
    """``rank``'s box of parameter ``name``: f64 values with fractional parts and varied
    magnitude, from global coordinates alone, held in the training dtype ``train``; the
    inference side expects them cast from there as torch casts them."""
    region = layout.local_region(rank)
    if region is None:
        return None
    offset, extent = region
    shape = layout.shape
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        coords = torch.arange(offset[d], offset[d] + extent[d], dtype=torch.int64) * stride
        index = index + coords.view([-1 if e == d else 1 for e in range(len(shape))])
        stride *= shape[d]
    k = refit.names.index(name)
    index = index.expand(tuple(extent))
    v = ((index * 2654435761 + k * 40503) % 100003 - 50001).to(torch.float64) / 977.0
    held = v.to(train)
    return held.to(rt.torch_dtype(layout))


def cast_refit(rank, world, path, train_dtype, infer_dtype):
    refit = reshard.Refit(path, train="tp=2", infer="tp=2", train_dtype=train_dtype, infer_dtype=infer_dtype)
    train = getattr(torch, {"f32": "float32", "f64": "float64"}[str(train_dtype)])
    src, dst = {}, {}
    fused = refit.fused(rank)
    members = {m for ms in fused.values() for m, *_ in ms}
    for name in refit.rank_names(rank):
        s_layout, d_layout = refit.layouts(name)
        if rank in s_layout.ranks:
            src[name] = values(refit, name, s_layout, rank, train)
            assert src[name].dtype == train
        if rank in d_layout.ranks and name not in members:
            dst[name] = torch.zeros(d_layout.local_shape(rank), dtype=rt.torch_dtype(d_layout))
    for buffer, ms in fused.items():
        first = refit.layouts(ms[0][0])[1]
        shape = list(first.local_shape(rank))
        dim = ms[0][1]
        shape[dim] = sum(extent for _, _, _, extent in ms)
        dst[buffer] = torch.zeros(shape, dtype=rt.torch_dtype(first))

    rt.reshard_many_(refit, src=src, dst=dst)

    checked = 0
    for buffer, ms in fused.items():
        for member, dim, offset, extent in ms:
            want = values(refit, member, refit.layouts(member)[1], rank, train)
            assert torch.equal(dst[buffer].narrow(dim, offset, extent), want), member
            checked += 1
    for name, tensor in dst.items():
        if name in fused:
            continue
        want = values(refit, name, refit.layouts(name)[1], rank, train)
        assert tensor.dtype != train and torch.equal(tensor, want), name
        checked += 1
    if rank >= 2:
        assert checked == len(refit.names), (checked, len(refit.names))


def test_f32_into_bf16_over_four_processes(tiny):
    run_ranks(cast_refit, 4, tiny, "f32", None)


def test_f64_into_f16_over_four_processes(tiny):
    run_ranks(cast_refit, 4, tiny, "f64", torch.float16)


def test_refit_sides_hold_their_dtypes(tiny):
    refit = reshard.Refit(tiny, train="tp=2", infer="tp=2", train_dtype=torch.float32)
    src, dst = refit.layouts("model.layers.0.mlp.down_proj.weight")
    assert (src.dtype, dst.dtype) == ("f32", "bf16")
    totals = refit.totals()
    assert (totals["train_dtype"], totals["infer_dtype"]) == ("f32", "bf16")
    plain = reshard.Refit(tiny, train="tp=2", infer="tp=2").totals()
    assert totals["reshard"] == plain["reshard"]
    assert totals["gather_broadcast"]["bytes"] == 2 * plain["gather_broadcast"]["bytes"]
    # fp8 weights quantized from f32, the others in f16
    q = reshard.Refit(
        tiny, train="tp=2", infer="tp=2", train_dtype="f32", infer_dtype="f16", infer_quant="fp8-block:16x16"
    )
    src, dst = q.layouts("model.layers.0.mlp.down_proj.weight")
    assert (src.dtype, dst.dtype) == ("f32", "fp8e4m3")
    assert q.layouts("model.norm.weight")[1].dtype == "f16"


def test_non_float_dtypes_are_refused(tiny):
    with pytest.raises(reshard.ReshardError, match="train_dtype: `i32`: a refit converts between float"):
        reshard.Refit(tiny, train="tp=1", infer="tp=1", train_dtype="i32")
    with pytest.raises(reshard.ReshardError, match="infer_dtype: `torch.float8_e4m3fn`: .*infer_quant"):
        reshard.Refit(tiny, train="tp=1", infer="tp=1", infer_dtype=torch.float8_e4m3fn)
    with pytest.raises(reshard.ReshardError, match="infer_dtype: `f33`: not a dtype"):
        reshard.Refit(tiny, train="tp=1", infer="tp=1", infer_dtype="f33")
