"""A bad argument on some ranks (a scale without quant, a malformed pair, a fused buffer of the
wrong shape) makes every rank raise, through the group, before any byte moves: the bad ranks
with their own message, the others naming the first bad rank. None waits for a peer that gave
up. The group's collectives time out after TIMEOUT seconds, so that a rank left waiting fails
the test instead of hanging it; a passing run never comes near it."""

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402
from test_quant import TINY_MOE  # noqa: E402

# generous: processes that start and import torch on a loaded machine join well within it
TIMEOUT = 120

SHAPE = (8, 8)


def _tensors(rank, src, dst):
    s, d = src.local_shape(rank), dst.local_shape(rank)
    return (
        None if s is None else torch.ones(s, dtype=rt.torch_dtype(src)),
        None if d is None else torch.zeros(d, dtype=rt.torch_dtype(dst)),
    )


def refused_everywhere(rank, bad, call, own):
    """``call()`` raises on every rank: ``own`` on each rank of ``bad``, and on the others
    the message of the first bad rank, named."""
    with pytest.raises(reshard.ReshardError) as e:
        call()
    message = str(e.value)
    if rank in bad:
        assert message.startswith(own), message
    else:
        assert message.startswith(f"nothing was moved: rank {min(bad)}: {own}"), message


def one_rank_bad(rank, world):
    src = reshard.Layout(SHAPE, "f32", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(SHAPE, "f32", 2, [2, 3], ["S(1)"])
    s, d = _tensors(rank, src, dst)
    pair = (s, d, src, dst)
    scale = torch.zeros(1, 1)

    # the destination ranks give their scale shards but quant is forgotten; the source
    # ranks, which hold no destination shard, pass None
    refused_everywhere(
        rank,
        {2, 3},
        lambda: rt.reshard_(s, d, src, dst, scale=scale if d is not None else None),
        "scale, scale_dtype: given only with quant",
    )
    refused_everywhere(
        rank,
        {1},
        lambda: rt.reshard_(s, d, src, dst, scale_dtype="e8m0" if rank == 1 else None),
        "scale, scale_dtype: given only with quant",
    )
    refused_everywhere(
        rank,
        {0, 1},
        lambda: rt.reshard_(s, d, src, dst, src_scale=scale if s is not None else None),
        "src_scale: given only with quant",
    )
    refused_everywhere(
        rank,
        {3},
        lambda: rt.reshard_many_({"w": pair}, bucket_bytes=0 if rank == 3 else 1 << 20),
        "bucket_bytes: 0 is invalid: it must be a positive number",
    )
    refused_everywhere(
        rank,
        {0},
        lambda: rt.reshard_many_({"w": pair[:3] if rank == 0 else pair}),
        "w: expected (src_local, dst_local, src_layout, dst_layout)",
    )
    refused_everywhere(
        rank,
        {2},
        lambda: rt.reshard_many_({"w": (s, d, src, dst.spec if rank == 2 else dst)}),
        "w: dst_layout: expected a reshard.Layout, got str",
    )
    refused_everywhere(
        rank,
        {1},
        lambda: rt.reshard_many_({"w": pair}, src={} if rank == 1 else None),
        "src, dst: given only with a reshard.Refit",
    )
    refused_everywhere(
        rank,
        {3},
        lambda: rt.reshard_many_({"w": pair}, quant="block:4x4", scales=scale if rank == 3 else None),
        "scales: expected a mapping of names to tensors, got Tensor",
    )
    refused_everywhere(
        rank,
        {0},
        lambda: rt.reshard_many_({"w": pair}, quant="block:4x4", scales={"v": None} if rank == 0 else None),
        "scales: 'v' is not one of the tensors",
    )
    refused_everywhere(
        rank,
        {1},
        lambda: rt.reshard_many_(
            {"w": pair}, quant="block:4x4", src_scales={"v": None} if rank == 1 else None
        ),
        "src_scales: 'v' is not one of the tensors quantized as quant says",
    )
    # rank 2 alone has an fp8 destination, and no quant
    fp8 = reshard.Layout(SHAPE, "fp8e4m3", 2, [2, 3], ["S(1)"])
    mine = fp8 if rank == 2 else dst
    refused_everywhere(
        rank,
        {2},
        lambda: rt.reshard_(s, _tensors(rank, src, mine)[1], src, mine),
        "dst_layout: dtype fp8e4m3 needs quant",
    )
    # rank 0 alone asks for w's scales: w is quantized there, plain elsewhere
    refused_everywhere(
        rank,
        {0},
        lambda: rt.reshard_many_({"w": pair}, quant="block:4x4", scales={"w": None} if rank == 0 else None),
        "w: quant block:4x4: the destination dtype is f32",
    )

    # the group still works, and moves the data
    rt.reshard_(s, d, src, dst)
    if d is not None:
        assert bool((d == 1).all())


def test_a_bad_argument_on_some_ranks_raises_on_every_rank():
    run_ranks(one_rank_bad, 4, timeout=TIMEOUT)


def option_groups(rank, world):
    """The options in groups (``quant=Quant(...)``, ``delta=Delta(...)``) and the earlier flat
    keywords folded into them: one given both ways, or a group of the wrong kind, is refused
    on every rank before any byte moves; an unknown keyword is Python's TypeError."""
    src = reshard.Layout(SHAPE, "f32", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(SHAPE, "f32", 2, [2, 3], ["S(1)"])
    s, d = _tensors(rank, src, dst)
    pair = (s, d, src, dst)
    scale = {"w": None}

    # a keyword that is no option: raised on each rank, as Python raises it, nothing agreed
    with pytest.raises(TypeError, match="reshard_many_\\(\\) got an unexpected keyword argument 'scale'"):
        rt.reshard_many_({"w": pair}, quant="block:4x4", scale=torch.zeros(1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'sessions'"):
        rt.reshard_many_({"w": pair}, delta=True, sessions=None)

    # on every rank, the same field flat and in its group: every rank raises its own error
    for call in (
        lambda: rt.reshard_many_({"w": pair}, delta=rt.Delta(model="policy"), model="reference"),
        lambda: rt.reshard_many_({"w": pair}, quant=rt.Quant("block:4x4", scales=scale), scales=scale),
    ):
        with pytest.raises(reshard.ArgumentError) as e:
            call()
        assert "given twice, as " in str(e.value) and not str(e.value).startswith("nothing"), str(e.value)
    if d is not None:
        assert not bool(d.any()), "nothing was moved"

    # on one rank: the others hear of it; a delta refit's fence names the rank (its own
    # error names the option), a plain call's agreement the rank and its error
    with pytest.raises(reshard.ReshardError) as e:
        flat = "reference" if rank == 1 else None
        rt.reshard_many_({"w": pair}, delta=rt.Delta(model="policy"), model=flat)
    if rank == 1:
        assert isinstance(e.value, reshard.ArgumentError), repr(e.value)
        assert str(e.value) == "model: given twice, as model= and in delta=Delta(model=...); give it once"
    else:
        assert isinstance(e.value, reshard.AgreementError), repr(e.value)
        assert str(e.value).startswith("nothing was moved: rank 1 refused its arguments"), str(e.value)
    refused_everywhere(
        rank,
        {2},
        lambda: rt.reshard_many_(
            {"w": pair},
            quant=rt.Quant("block:4x4", scale_dtype="e8m0"),
            scale_dtype="e8m0" if rank == 2 else None,
        ),
        "scale_dtype: given twice, as scale_dtype= and in quant=Quant(scale_dtype=...); give it once",
    )
    refused_everywhere(
        rank,
        {3},
        lambda: rt.reshard_many_({"w": pair}, delta="yes" if rank == 3 else None),
        "delta: 'yes' (str) is not True, False, a reshard.torch.Delta nor a reshard.torch.DeltaSession",
    )
    refused_everywhere(
        rank,
        {0},
        lambda: rt.reshard_many_({"w": pair}, quant=("block:4x4",) if rank == 0 else None),
        "quant: ('block:4x4',) (tuple) is not a scheme",
    )
    refused_everywhere(
        rank,
        {0, 1},
        lambda: rt.reshard_many_({"w": pair}, version=2 if rank < 2 else None),
        "version, previous, model: given only with delta",
    )

    # the group still works, and moves the data
    rt.reshard_many_({"w": pair}, quant=rt.Quant())
    if d is not None:
        assert bool((d == 1).all())


def test_options_in_groups_refused_alike_on_every_rank():
    run_ranks(option_groups, 4, timeout=TIMEOUT)


def later_call(rank, world):
    # rank 2 holds no shard: ranks 0 and 1 move the data without it
    src = reshard.Layout(SHAPE, "i32", 1, [0], ["R"])
    dst = reshard.Layout(SHAPE, "i32", 1, [1], ["R"])
    s, d = _tensors(rank, src, dst)
    rt.reshard_(s, d, src, dst)
    if d is not None:
        d.zero_()
    # the group has agreed on these layouts: a later call exchanges a few integers only, and
    # still, rank 2's bad argument raises on every rank before any byte moves, instead of
    # one rank raising while the others move the data or wait for it
    refused_everywhere(
        rank,
        {2},
        lambda: rt.reshard_(s, d, src, dst, scale=torch.zeros(1) if rank == 2 else None),
        "scale, scale_dtype: given only with quant",
    )
    if d is not None:
        assert not bool(d.any()), "nothing was moved"
    rt.reshard_(s, d, src, dst)
    if d is not None:
        assert bool((d == 1).all())


def test_a_bad_argument_on_a_later_call_raises_on_every_rank():
    run_ranks(later_call, 3, timeout=TIMEOUT)


def refit_tensors(refit, rank):
    """Every tensor ``rank`` holds of ``refit``: its training shards by name, and its
    inference shards with vLLM's fused buffers and the fp8 weights' scale shards."""
    src, dst = {}, {}
    fused, scale_fused = refit.fused(rank), refit.scale_fused(rank)
    members = {m for ms in fused.values() for m, *_ in ms}
    in_scale_buffers = {m for ms in scale_fused.values() for m, *_ in ms}
    for name in refit.names:
        s_layout, d_layout = refit.layouts(name)
        if s_layout.local_shape(rank) is not None:
            src[name] = torch.zeros(s_layout.local_shape(rank), dtype=rt.torch_dtype(s_layout))
        if d_layout.local_shape(rank) is None:
            continue
        if name in refit.scales and name not in in_scale_buffers:
            dst[refit.scales[name][0]] = rt.scale_tensor(d_layout, rank, refit.quant)
        if name not in members:
            dst[name] = torch.zeros(d_layout.local_shape(rank), dtype=rt.torch_dtype(d_layout))
    for buffer, ms in fused.items():
        first = refit.layouts(ms[0][0])[1]
        shape = list(first.local_shape(rank))
        shape[ms[0][1]] = sum(e for *_, e in ms)
        dst[buffer] = torch.zeros(shape, dtype=rt.torch_dtype(first))
    for buffer, ms in scale_fused.items():
        shape = list(reshard.quant_scale_shape(refit.layouts(ms[0][0])[1], rank, refit.quant))
        shape[ms[0][1]] = sum(e for *_, e in ms)
        dst[buffer] = torch.zeros(shape)
    return src, dst


def refit_bad(rank, world, config):
    refit = reshard.Refit(config, train="tp=2", infer="tp=2", infer_quant="fp8-block:16x16")
    src, dst = refit_tensors(refit, rank)
    base = refit.infer_base

    refused_everywhere(
        rank,
        {1},
        lambda: rt.reshard_many_(refit, src={**src, "bogus": torch.zeros(1)} if rank == 1 else src, dst=dst),
        f"src: bogus is neither a parameter of {refit.model} nor a fused buffer that rank 1 holds",
    )
    refused_everywhere(
        rank,
        {base + 1},
        lambda: rt.reshard_many_(refit, src=src, dst=dst, quant="block:32x32" if rank == base + 1 else None),
        "quant: block:32x32 differs from the refit's block:16x16",
    )
    refused_everywhere(
        rank,
        {base},
        lambda: rt.reshard_many_(refit, src=src, dst=dst, scales={} if rank == base else None),
        "scales: with a reshard.Refit, the scale shards come in dst",
    )
    # one inference rank's fused buffer is short of one element along the fused dim
    buffer, members = sorted(refit.fused(base + 1).items())[0]
    short = dict(dst)
    if rank == base + 1:
        dim = members[0][1]
        short[buffer] = dst[buffer].narrow(dim, 0, dst[buffer].shape[dim] - 1)
    refused_everywhere(
        rank,
        {base + 1},
        lambda: rt.reshard_many_(refit, src=src, dst=short),
        f"dst: {buffer}: rank {base + 1}'s fused buffer has shape",
    )
    # another gives a list for a fused scale buffer
    scales, _ = sorted(refit.scale_fused(base).items())[0]
    refused_everywhere(
        rank,
        {base},
        lambda: rt.reshard_many_(refit, src=src, dst={**dst, scales: [1.0]} if rank == base else dst),
        f"dst: {scales}: expected a tensor, got list",
    )

    # the group still works
    rt.reshard_many_(refit, src=src, dst=dst)


def test_a_bad_refit_argument_on_one_rank_raises_on_every_rank(tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MOE))
    run_ranks(refit_bad, 4, str(config), timeout=TIMEOUT)
