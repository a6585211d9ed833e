"""A float cast in flight from Python: ``reshard_`` and ``reshard_many_`` with a destination
layout of another float dtype (f32 master weights into bf16, f64 into f16, bf16 into f32)
land every value as torch's own ``.to()`` of the source, on random layouts."""

import random

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import random_mesh, random_placements, random_shape, run_ranks  # noqa: E402

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
PAIRS = [("f32", "bf16"), ("f64", "f16"), ("bf16", "f32"), ("f32", "f16")]


def full(shape, dtype, seed):
    """Values of varied magnitude with fractional parts, so that every cast rounds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    scale = 2.0 ** torch.randint(-12, 12, shape, generator=g).double()
    return (x * scale).to(dtype)


def layout(rng, shape, dtype, world):
    """A random layout of ``shape`` over some of the ``world`` ranks, in any order."""
    mesh = random_mesh(rng, world)
    size = 1
    for d in mesh:
        size *= d
    ranks = rng.sample(range(world), size)
    return reshard.Layout(shape, dtype, mesh, ranks, random_placements(rng, len(mesh), len(shape)))


def casts(rank, world):
    rng = random.Random(7)
    for case in range(12):
        src_name, dst_name = PAIRS[case % len(PAIRS)]
        shape = random_shape(rng)
        src, dst = layout(rng, shape, src_name, world), layout(rng, shape, dst_name, world)
        whole = full(shape, DTYPES[src_name], case)
        s = rt.local_tensor(src, rank, whole)
        s = None if s is None else s.clone()
        d = None
        if dst.local_shape(rank) is not None:
            d = torch.zeros(dst.local_shape(rank), dtype=DTYPES[dst_name])
        if case % 2:
            rt.reshard_(s, d, src, dst)
        else:
            rt.reshard_many_({f"t{case}": (s, d, src, dst)})
        if d is not None:
            want = rt.local_tensor(dst, rank, whole.to(DTYPES[dst_name]))
            assert torch.equal(d, want), (case, src, dst)


def test_float_casts_land_as_torch_casts():
    run_ranks(casts, 4)


def refused(rank, world):
    src = reshard.Layout((8, 4), "i32", 4, range(4), ["S(0)"])
    dst = reshard.Layout((8, 4), "f32", 2, [0, 1], ["S(1)"])
    s = torch.zeros(src.local_shape(rank), dtype=torch.int32)
    d = torch.zeros(dst.local_shape(rank), dtype=torch.float32) if rank < 2 else None
    with pytest.raises(reshard.ReshardError, match="only float dtypes"):
        rt.reshard_(s, d, src, dst)


def test_integer_conversions_are_refused_on_every_rank():
    run_ranks(refused, 4, timeout=120)
