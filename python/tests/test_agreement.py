"""Ranks given different layouts are refused on every rank, through the process group, before
any byte moves (instead of waiting for the backend's timeout)."""

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402


def _tensors(rank, src, dst, dtype):
    s = src.local_shape(rank)
    d = dst.local_shape(rank)
    return (
        None if s is None else torch.ones(s, dtype=dtype),
        None if d is None else torch.zeros(d, dtype=dtype),
    )


def reordered_destination(rank, world):
    shape = (8, 8)
    src = reshard.Layout(shape, "f32", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(shape, "f32", 2, [2, 3], ["S(1)"])
    if rank == 2:
        dst = reshard.Layout(shape, "f32", 2, [3, 2], ["S(1)"])
    s, d = _tensors(rank, src, dst, torch.float32)
    with pytest.raises(reshard.ReshardError) as e:
        rt.reshard_(s, d, src, dst)
    message = str(e.value)
    assert "rank 2 runs dst_layout mesh=2 ranks=3,2" in message, message
    assert "rank 0 runs dst_layout mesh=2 ranks=2..4" in message, message

    # the group stays usable, and agreeing ranks then move the data
    dst = reshard.Layout(shape, "f32", 2, [2, 3], ["S(1)"])
    s, d = _tensors(rank, src, dst, torch.float32)
    rt.reshard_(s, d, src, dst)
    if d is not None:
        assert bool((d == 1).all())


def test_a_reordered_destination_is_refused_on_every_rank():
    run_ranks(reordered_destination, 4)


def bad_tensor_on_one_rank(rank, world):
    shape = (6, 4)
    src = reshard.Layout(shape, "i32", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(shape, "i32", 2, [2, 3], ["S(1)"])
    s, d = _tensors(rank, src, dst, torch.int32)
    if rank == 3:
        d = torch.zeros((6, 3), dtype=torch.int32)  # the wrong shape
    with pytest.raises(reshard.ReshardError) as e:
        rt.reshard_many_({"w": (s, d, src, dst)})
    if rank == 3:
        assert str(e.value).startswith("w: dst_local: rank 3 holds"), str(e.value)
    else:
        assert "nothing was moved: rank 3: w: dst_local" in str(e.value), str(e.value)


def test_bad_input_on_one_rank_is_raised_on_every_rank():
    run_ranks(bad_tensor_on_one_rank, 4)


def missing_tensor(rank, world):
    shape = (4, 4)
    src = reshard.Layout(shape, "bf16", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(shape, "bf16", 2, [0, 1], ["S(1)"])
    pairs = {}
    for name in ("a", "b"):
        pairs[name] = (*_tensors(rank, src, dst, torch.bfloat16), src, dst)
    if rank == 1:
        del pairs["b"]
    with pytest.raises(reshard.ReshardError) as e:
        rt.reshard_many_(pairs)
    assert "rank 1 runs b: src_layout (none)" in str(e.value), str(e.value)


def test_a_tensor_missing_on_one_rank_is_named():
    run_ranks(missing_tensor, 2)
