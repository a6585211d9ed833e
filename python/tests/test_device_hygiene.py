"""What the GPU path relies on, checked on CPU over gloo processes: a tensor on another device
than the process's current one is refused on every rank before any byte moves; destinations
that are Parameters requiring grad are written on every path (plain, quantized, already
quantized, delta, staged), keep ``requires_grad`` and get no ``grad_fn``; and the caches kept
per process group do not outlive it (a group destroyed and made again agrees anew).

The torch operations that run on a GPU run here too: ``reshard.torch._NATIVE = False`` packs
CPU tensors with torch copies and quantizes with :mod:`reshard.quant.ops`, and a delta refit
is forced onto its torch path, as on a device.
"""

import re

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from reshard.transfer import checks as common  # noqa: E402
from reshard.delta import codec  # noqa: E402
from conftest import free_port, run_ranks  # noqa: E402

SHAPE = (8, 8)
SRC = reshard.Layout(SHAPE, "f32", 2, [0, 1], ["S(0)"])
DST = reshard.Layout(SHAPE, "f32", 2, [0, 1], ["S(1)"])
FULL = torch.arange(64, dtype=torch.float32).view(SHAPE) / 8 - 3


def _set_path(torch_ops: bool) -> None:
    """The GPU's copying and quantizing path on CPU tensors (torch operations), or the CPU's
    (the Rust kernels)."""
    rt._NATIVE = not torch_ops
    codec._uses_torch = (lambda tensors, forced: True) if torch_ops else _USES_TORCH


_USES_TORCH = codec._uses_torch


# ------------------------------------------------------------------------------------------
# 1. a tensor on another device than the current one


def test_a_cuda_tensor_on_another_device_than_the_current_one_is_named():
    with pytest.raises(reshard.ArgumentError) as e:
        common.check_device("w: ", "dst_local", torch.device("cuda", 1), 0, 3)
    text = str(e.value)
    assert text.startswith("w: dst_local: rank 3's tensor is on cuda:1, but"), text
    assert "current cuda device is cuda:0" in text, text
    with pytest.raises(reshard.ArgumentError, match="src_local: rank 0's tensor is on cuda:0.*cuda:2"):
        common.check_device("", "src_local", torch.device("cuda", 0), 2, 0)
    # on the current device, or a kind of device without one (the CPU): nothing to say
    common.check_device("w: ", "dst_local", torch.device("cuda", 1), 1, 3)
    common.check_device("w: ", "dst_local", torch.device("cpu"), None, 3)
    assert common.current_index(torch.device("cpu")) is None


def _refused_everywhere(rank, call, what="(src_local|dst_local)"):
    """``call`` raises on every rank: rank 1 its own ArgumentError naming the device, the
    others an AgreementError (or the fence's refusal) naming rank 1."""
    with pytest.raises(reshard.ReshardError) as e:
        call()
    text = str(e.value)
    if rank == 1:
        assert isinstance(e.value, reshard.ArgumentError), text
        said = f"{what}: rank 1's tensor is on cpu, but this process's current cpu device is cpu:7"
        assert re.search(said, text), text
    else:
        assert isinstance(e.value, reshard.AgreementError), text
        assert "rank 1" in text, text


def wrong_device(rank, world):
    s = rt.local_tensor(SRC, rank, FULL).clone()
    d = torch.full(DST.local_shape(rank), -1.0)
    rt.reshard_many_({"w": (s, d, SRC, DST)})  # agreed and cached: the later call is checked too
    assert torch.equal(d, rt.local_tensor(DST, rank, FULL))

    current = common.current_index

    def wrong_on_rank_1(flag):
        # rank 1's tensors are on another device than its "current" one (cpu:7 stands for a
        # GPU other than torch.cuda.current_device())
        common.current_index = (lambda device: 7) if flag and rank == 1 else current

    d.fill_(-1.0)
    wrong_on_rank_1(True)
    _refused_everywhere(rank, lambda: rt.reshard_many_({"w": (s, d, SRC, DST)}))
    _refused_everywhere(rank, lambda: rt.reshard_many_({"v": (s, d, SRC, DST)}))  # a first call
    assert bool((d == -1.0).all())  # nothing was written

    # quantized in flight, and already quantized
    fp8 = reshard.Layout(SHAPE, "fp8e4m3", 2, [0, 1], ["S(1)"])
    q = torch.zeros(fp8.local_shape(rank), dtype=torch.float8_e4m3fn)
    scale = rt.scale_tensor(fp8, rank, "block:4x4")
    _refused_everywhere(rank, lambda: rt.reshard_(s, q, SRC, fp8, quant="block:4x4", scale=scale))
    fp8_src = reshard.Layout(SHAPE, "fp8e4m3", 2, [0, 1], ["S(0)"])
    qs = torch.zeros(fp8_src.local_shape(rank), dtype=torch.float8_e4m3fn)
    s_scale = rt.scale_tensor(fp8_src, rank, "block:4x4")
    _refused_everywhere(
        rank, lambda: rt.reshard_(qs, q, fp8_src, fp8, quant="block:4x4", scale=scale, src_scale=s_scale)
    )
    assert not bool(q.view(torch.uint8).any())

    # a delta refit, plain and staged
    session = rt.DeltaSession()
    _refused_everywhere(rank, lambda: session.refit({"w": (s, d, SRC, DST)}, 1))
    assert bool((d == -1.0).all())
    wrong_on_rank_1(False)
    session.refit({"w": (s, d, SRC, DST)}, 2)  # the group still works
    assert torch.equal(d, rt.local_tensor(DST, rank, FULL))


def test_a_tensor_on_another_device_is_refused_on_every_rank_before_any_byte_moves():
    run_ranks(wrong_device, 2, timeout=60)


# ------------------------------------------------------------------------------------------
# 2. destinations that are Parameters requiring grad


def _param(t):
    return torch.nn.Parameter(t, requires_grad=True)


def _untouched_by_autograd(p):
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.grad_fn is None and p.is_leaf
    assert p.grad is None


def parameters(rank, world, torch_ops):
    _set_path(torch_ops)
    model = {
        "a": (SHAPE, "S(0)", "S(1)"),
        "b": ((6, 5), "S(1)", "R"),
        "c": ((16,), "R", "S(0)"),
    }
    gen = torch.Generator().manual_seed(5)
    fulls, pairs, dsts = {}, {}, {}
    for name, (shape, s_place, d_place) in model.items():
        src = reshard.Layout(shape, "f32", 2, [0, 1], [s_place])
        dst = reshard.Layout(shape, "f32", 2, [0, 1], [d_place])
        fulls[name] = torch.randn(shape, generator=gen)
        s = _param(rt.local_tensor(src, rank, fulls[name]).clone())  # a trainer's, requiring grad too
        dsts[name] = _param(torch.zeros(dst.local_shape(rank)))
        pairs[name] = (s, dsts[name], src, dst)

    def check(version_of=lambda full: full):
        for name, (_, _, _, dst) in pairs.items():
            p = dsts[name]
            _untouched_by_autograd(p)
            assert torch.equal(p.detach(), rt.local_tensor(dst, rank, version_of(fulls[name]))), name

    # plain: the first call, and a later one (the cached program)
    for _ in range(2):
        rt.reshard_many_(pairs, bucket_bytes=200)
        check()
    p = _param(torch.zeros(DST.local_shape(rank)))
    rt.reshard_(pairs["a"][0], p, SRC, DST)
    _untouched_by_autograd(p)
    assert torch.equal(p.detach(), rt.local_tensor(DST, rank, fulls["a"]))

    # quantized in flight into an fp8 Parameter and its scale Parameter
    fp8 = reshard.Layout(SHAPE, "fp8e4m3", 2, [0, 1], ["S(1)"])
    q = _param(torch.zeros(fp8.local_shape(rank), dtype=torch.float8_e4m3fn))
    scale = _param(rt.scale_tensor(fp8, rank, "block:4x4"))
    rt.reshard_(pairs["a"][0], q, SRC, fp8, quant="block:4x4", scale=scale)
    _untouched_by_autograd(q)
    _untouched_by_autograd(scale)
    assert bool(scale.detach().gt(0).all())

    # already quantized: fp8 values and their scales into Parameters
    fp8_src = reshard.Layout(SHAPE, "fp8e4m3", 2, [0, 1], ["S(0)"])
    qs = rt.local_tensor(fp8_src, rank, torch.ones(SHAPE).to(torch.float8_e4m3fn)).clone()
    s_scale = rt.scale_tensor(fp8_src, rank, "block:4x4").fill_(0.5)
    q2 = _param(torch.zeros(fp8.local_shape(rank), dtype=torch.float8_e4m3fn))
    scale2 = _param(rt.scale_tensor(fp8, rank, "block:4x4"))
    rt.reshard_(qs, q2, fp8_src, fp8, quant="block:4x4", scale=scale2, src_scale=s_scale)
    _untouched_by_autograd(q2)
    _untouched_by_autograd(scale2)
    assert bool((q2.detach().to(torch.float32) == 1.0).all()) and bool((scale2.detach() == 0.5).all())

    # delta: the module's session (dense, then a delta), and a session of its own, staged
    for name in dsts:
        dsts[name].data.zero_()
    for version in (1, 2):
        for name, (s, *_rest) in pairs.items():
            with torch.no_grad():
                s.copy_(rt.local_tensor(_rest[1], rank, fulls[name] * version))
        rt.reshard_many_(pairs, delta=rt.Delta(version=version, model="params"))
        check(lambda full, v=version: full * v)
    session = rt.DeltaSession()
    for version in (3, 4):
        for name, (s, *_rest) in pairs.items():
            with torch.no_grad():
                s.copy_(rt.local_tensor(_rest[1], rank, fulls[name] * version))
        session.prepare(pairs, version)
        session.commit(version)
        check(lambda full, v=version: full * v)
    _set_path(False)


@pytest.mark.parametrize("torch_ops", [False, True], ids=["rust", "torch-ops"])
def test_parameters_that_require_grad_are_written_outside_autograd(torch_ops):
    run_ranks(parameters, 2, torch_ops, timeout=60)


# ------------------------------------------------------------------------------------------
# 3. a process group destroyed and made again


def _cached_groups():
    """The process groups that the torch path's per-group caches hold entries of."""
    from reshard.delta import session as sessions

    caches = (common._AGREED, rt._PROGRAMS, sessions._SESSIONS)
    return {id(k[0].group()) for cache in caches for k in cache}


def group_made_again(rank, world, port):
    import datetime

    s = rt.local_tensor(SRC, rank, FULL).clone()
    d = torch.zeros(DST.local_shape(rank))
    for _ in range(2):
        rt.reshard_many_({"w": (s, d, SRC, DST)})
        rt.reshard_many_({"w": (s, d, SRC, DST)}, delta=True)
    assert torch.equal(d, rt.local_tensor(DST, rank, FULL))
    old = dist.distributed_c10d._get_default_group()
    assert _cached_groups() == {id(old)}

    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    new = dist.distributed_c10d._get_default_group()
    # rank 1 runs another layout than rank 0: the new group's first call is agreed whole, so
    # every rank is refused (none is taken for agreed on the strength of the old group)
    dst = DST if rank == 0 else reshard.Layout(SHAPE, "f32", 2, [0, 1], ["S(0)"])
    d = torch.full(dst.local_shape(rank), -1.0)
    with pytest.raises(reshard.AgreementError, match="the ranks disagree on the job"):
        rt.reshard_many_({"w": (s, d, SRC, dst)})
    assert bool((d == -1.0).all())
    assert _cached_groups() <= {id(new)}  # the old group's entries went with it
    # the same on a delta refit: the old group's session is not the new one's
    with pytest.raises(reshard.AgreementError):
        rt.reshard_many_({"w": (s, d, SRC, dst)}, delta=True)
    assert bool((d == -1.0).all())

    # agreeing ranks then refit on the new group, the delta one dense (a new session)
    d = torch.zeros(DST.local_shape(rank))
    rt.reshard_many_({"w": (s, d, SRC, DST)})
    assert torch.equal(d, rt.local_tensor(DST, rank, FULL))
    d.zero_()
    report = rt.reshard_many_({"w": (s, d, SRC, DST)}, delta=True)
    assert report.version == 1 and report.base is None
    assert torch.equal(d, rt.local_tensor(DST, rank, FULL))
    assert _cached_groups() == {id(new)}


def test_a_group_destroyed_and_made_again_agrees_anew():
    run_ranks(group_made_again, 2, free_port(), timeout=60)
