"""A whole-model refit from Python: reshard.Refit's layouts and fused buffers, and
reshard_many_ with a rank's own tensors by name, checked against the source model."""

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import cli_binary, run_ranks  # noqa: E402


def values(refit, name, layout, rank):
    """``rank``'s shard of parameter ``name`` of the source model, computed from its global
    coordinates alone: element ``i`` (row-major) of parameter ``k`` holds a small integer
    that depends on ``i`` and ``k``, exact in every float dtype, so that a byte from the
    wrong place or the wrong tensor shows."""
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
    return ((index * 2654435761 + k * 40503) % 251 - 125).to(rt.torch_dtype(layout))


def qwen_refit(rank, world):
    refit = reshard.Refit("qwen3-0.6b", train="tp=2,pp=2", infer="tp=2")
    assert (refit.train_ranks, refit.infer_ranks, refit.infer_base) == (4, 2, 4)
    src, dst = {}, {}
    fused = refit.fused(rank)
    members = {m for ms in fused.values() for m, *_ in ms}
    for name in refit.rank_names(rank):
        s_layout, d_layout = refit.layouts(name)
        if rank in s_layout.ranks:
            src[name] = values(refit, name, s_layout, rank)
        if rank in d_layout.ranks and name not in members:
            dst[name] = torch.zeros(d_layout.local_shape(rank), dtype=rt.torch_dtype(d_layout))
    # vLLM's fused buffers, written in place: the members' shards side by side
    for buffer, ms in fused.items():
        first = refit.layouts(ms[0][0])[1]
        shape = list(first.local_shape(rank))
        dim = ms[0][1]
        shape[dim] = sum(extent for _, _, _, extent in ms)
        dst[buffer] = torch.zeros(shape, dtype=rt.torch_dtype(first))
    if rank >= 4:
        assert fused, "the inference ranks hold fused buffers"
        assert any(b.endswith("qkv_proj.weight") for b in fused)

    rt.reshard_many_(refit, src=src, dst=dst)

    checked = 0
    for buffer, ms in fused.items():
        for member, dim, offset, extent in ms:
            want = values(refit, member, refit.layouts(member)[1], rank)
            assert torch.equal(dst[buffer].narrow(dim, offset, extent), want), member
            checked += 1
    for name, tensor in dst.items():
        if name in fused:
            continue
        assert torch.equal(tensor, values(refit, name, refit.layouts(name)[1], rank)), name
        checked += 1
    if rank >= 4:
        # every inference parameter of the model, on both inference ranks
        assert checked == len(refit.names), (checked, len(refit.names))


def test_qwen3_refit_over_six_processes():
    run_ranks(qwen_refit, 6)


def test_refit_describes_the_model():
    refit = reshard.Refit("qwen3-0.6b", train="tp=2,pp=2", infer="tp=2")
    assert len(refit) == len(refit.names) == 310
    src, dst = refit.layouts("model.layers.0.self_attn.o_proj.weight")
    assert [str(p) for p in src.placements] == ["S(1)"] and src.ranks == (0, 1)
    assert dst.ranks == (4, 5)
    # the second pipeline stage holds the last layers
    last = [n for n in refit.names if n.startswith("model.layers.27.")]
    assert last and all(refit.layouts(n)[0].ranks == (2, 3) for n in last)
    assert set(refit.rank_names(4)) == set(refit.names)
    assert "model.layers.0.self_attn.q_proj.weight" not in refit.rank_names(2)
    qkv = refit.fused(4)["model.layers.0.self_attn.qkv_proj.weight"]
    assert [m.rsplit(".", 2)[1] for m, *_ in qkv] == ["q_proj", "k_proj", "v_proj"]
    assert qkv[1][2] == qkv[0][3]  # k follows q
    assert refit.fused(0) == {}
    assert "model.layers.0.mlp.linear_fc1.weight" in refit.fused(0, "train")


def test_refit_totals_match_the_command_line():
    import json
    import subprocess

    refit = reshard.Refit("qwen3-0.6b", train="tp=2,pp=2", infer="tp=2")
    totals = refit.totals()
    binary = cli_binary()
    if binary is None:
        pytest.skip("the reshard binary is not built")
    out = subprocess.run(
        [binary, "refit", "--model", "qwen3-0.6b", "--train", "tp=2,pp=2", "--infer", "tp=2", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    cli = json.loads(out.stdout)
    for key in ("model", "tensors", "params", "weight_bytes", "reshard", "gather_broadcast"):
        assert totals[key] == cli[key], key


def test_bad_refits_raise_the_command_lines_errors():
    with pytest.raises(reshard.ReshardError, match="no-such-model"):
        reshard.Refit("no-such-model", train="tp=1", infer="tp=1")
    with pytest.raises(reshard.ReshardError, match="tp"):
        reshard.Refit("qwen3-0.6b", train="tp=0", infer="tp=1")
    refit = reshard.Refit("qwen3-0.6b", train="tp=1", infer="tp=1")
    with pytest.raises(reshard.ReshardError, match="not a parameter"):
        refit.layouts("model.nothing")
