"""The GPU smoke test of the Python path: two processes, one CUDA device each (the process's
current device, set to its rank), joined by NCCL, move CUDA tensors with every path of
:mod:`reshard.torch`, and every destination is compared bit for bit with a reference
computed on the CPU (the shard of the global tensor; for fp8, the Rust kernels' quantization
of the global tensor on a one-rank gloo group).

- ``reshard_`` into Parameters that require grad (they keep it, and get no ``grad_fn``),
  with and without checksums; a tensor on the other GPU refused on both ranks;
- ``reshard_many_`` of a small model in several buckets, float casts included, twice;
- FSDP2's DTensors (``fully_shard``) into an engine's tensor-parallel DTensors, where torch
  has ``fully_shard``;
- a delta refit over three versions, and one with checksums;
- a staged refit (``DeltaSession.prepare`` / ``commit``): the live shards unchanged until
  the commit;
- a refit quantized in flight into fp8e4m3 (``quant="block:128x128"``), where torch casts
  to fp8 on the device.

It runs only where torch sees at least two CUDA devices and has NCCL; elsewhere it is
skipped. ``python/tests/gpu_check.sh`` runs it alone, verbosely, on a machine with GPUs.
"""

import datetime
import os

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import free_port  # noqa: E402

_DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _why_skipped():
    if _DEVICES < 2:
        return f"needs 2 CUDA devices ({'none' if _DEVICES == 0 else f'only {_DEVICES}'} here)"
    if not dist.is_nccl_available():
        return "needs NCCL (this torch.distributed has none)"
    return None


pytestmark = pytest.mark.skipif(_why_skipped() is not None, reason=_why_skipped() or "")

WORLD = 2
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _entry(rank, world, port, device_type, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if device_type == "cuda":
        torch.cuda.set_device(rank)  # the caller's duty: its local rank's device
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        device = torch.device("cpu")
        if device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        # NCCL makes the group's communicator on its first collective: one every rank joins
        dist.all_reduce(torch.ones(1, device=device))
        fn(rank, world, device, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(fn, *args, device_type="cuda"):
    """``fn(rank, world, device, *args)`` on two processes: NCCL and one CUDA device each
    (``device_type="cpu"``: gloo and the CPU, to try this file's own logic elsewhere)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(WORLD, free_port(), device_type, fn, args), nprocs=WORLD, join=True)


# ------------------------------------------------------------------------------------------
# references and comparisons, on the CPU


def _bits(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(_INTS[t.element_size()])


def _same(got, want, what=""):
    """``got`` (any device) holds ``want`` (CPU) bit for bit."""
    local = got.to_local() if hasattr(got, "to_local") else got
    assert tuple(local.shape) == tuple(want.shape), (what, tuple(local.shape), tuple(want.shape))
    assert local.dtype == want.dtype, (what, local.dtype, want.dtype)
    assert torch.equal(_bits(local), _bits(want)), f"{what}: not bit for bit the CPU reference"


def _full(shape, dtype, seed):
    """A global tensor of varied magnitudes, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape, generator=gen).float())
    return x.to(dtype)


def _expected(layout, rank, full):
    return rt.local_tensor(layout, rank, full).clone()


def _param(t):
    return torch.nn.Parameter(t, requires_grad=True)


def _untouched_by_autograd(p, what=""):
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.is_leaf, what
    assert p.grad_fn is None and p.grad is None, what


# the model: name -> (shape, source dtype, destination dtype, source placement, destination)
MODEL = {
    "embed.weight": ((96, 32), torch.bfloat16, torch.bfloat16, "S(0)", "S(1)"),
    "layer.qkv.weight": ((72, 32), torch.bfloat16, torch.bfloat16, "S(1)", "S(0)"),
    "layer.mlp.weight": ((45, 31), torch.float32, torch.float32, "S(0)", "S(1)"),  # uneven shards
    "layer.norm.weight": ((32,), torch.float32, torch.float32, "R", "R"),
    "head.weight": ((40, 32), torch.float32, torch.bfloat16, "S(0)", "R"),  # a float cast
    "head.bias": ((1,), torch.float16, torch.float16, "R", "S(0)"),  # rank 1's shard is empty
}
_NAMES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}


def _model(rank, device, fulls, params=True):
    """This rank's pairs of the model from the global tensors ``fulls``: sources on
    ``device`` (Parameters that require grad, as a trainer's), destinations zeroed
    (Parameters that require grad too, with ``params``)."""
    pairs = {}
    for name, (shape, s_dtype, d_dtype, s_place, d_place) in MODEL.items():
        src = reshard.Layout(shape, _NAMES[s_dtype], 2, [0, 1], [s_place])
        dst = reshard.Layout(shape, _NAMES[d_dtype], 2, [0, 1], [d_place])
        s = _param(_expected(src, rank, fulls[name]).to(device))
        d = torch.zeros(dst.local_shape(rank), dtype=d_dtype, device=device)
        pairs[name] = (s, _param(d) if params else d, src, dst)
    return pairs


def _fulls(step=0):
    out = {}
    for i, (name, (shape, s_dtype, *_)) in enumerate(MODEL.items()):
        out[name] = _full(shape, s_dtype, 100 * step + i)
    return out


def _check_model(pairs, rank, fulls, what):
    for name, (_, d, _, dst) in pairs.items():
        _same(d, _expected(dst, rank, fulls[name].to(MODEL[name][2])), f"{what}: {name}")


# ------------------------------------------------------------------------------------------
# the checks


def parameters(rank, world, device):
    shape = (8, 12)
    src = reshard.Layout(shape, "f32", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(shape, "f32", 2, [0, 1], ["S(1)"])
    full = _full(shape, torch.float32, 1)
    s = _param(_expected(src, rank, full).to(device))
    for checksum in (False, True):
        d = _param(torch.zeros(dst.local_shape(rank), device=device))
        rt.reshard_(s, d, src, dst, checksum=checksum)
        _untouched_by_autograd(d, f"checksum={checksum}")
        _same(d, _expected(dst, rank, full), f"reshard_ checksum={checksum}")
    if device.type != "cuda":
        return
    # rank 0 gives a tensor on the other GPU: refused on both ranks, nothing written
    other = torch.device("cuda", 1 - rank)
    bad = torch.full(dst.local_shape(rank), 7.0, device=other if rank == 0 else device)
    with pytest.raises(reshard.ReshardError) as e:
        rt.reshard_(s, bad, src, dst)
    text = str(e.value)
    if rank == 0:
        assert isinstance(e.value, reshard.ArgumentError), text
        said = "dst_local: rank 0's tensor is on cuda:1, but this process's current cuda device is cuda:0"
        assert said in text, text
    else:
        assert isinstance(e.value, reshard.AgreementError) and "rank 0" in text, text
    assert bool((bad == 7.0).all())
    d = _param(torch.zeros(dst.local_shape(rank), device=device))
    rt.reshard_(s, d, src, dst)  # the group still works
    _same(d, _expected(dst, rank, full), "reshard_ after a refusal")


def model(rank, world, device):
    fulls = _fulls()
    pairs = _model(rank, device, fulls)
    for call in ("first", "second"):  # the second runs the cached program
        for _, d, _, _ in pairs.values():
            d.data.zero_()
        rt.reshard_many_(pairs, bucket_bytes=8192)
        _check_model(pairs, rank, fulls, f"reshard_many_ ({call} call)")
        for name, (_, d, _, _) in pairs.items():
            _untouched_by_autograd(d, name)


def fsdp2(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 16))
    full = {k: v.detach().clone() for k, v in net.state_dict().items()}  # on the CPU
    net.to(device)
    mesh = init_device_mesh(device.type, (world,))
    fully_shard(net, mesh=mesh)
    # the engine: tensor parallel over the same two ranks, its own DTensors
    engine = {}
    for n, v in full.items():
        placement = Shard(0 if n.startswith("0.") else v.ndim - 1)  # column-, then row-parallel
        engine[n] = distribute_tensor(torch.zeros(v.shape, device=device), mesh, [placement])
    for step in (0, 1):
        rt.reshard_state_dict_(net, engine)
        for name, dt in engine.items():
            assert dt.to_local().device == device, name
            _same(dt, _expected(rt.dtensor_layout(dt), rank, full[name] + step), f"FSDP2 step {step}: {name}")
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)


def delta(rank, world, device):
    pairs = _model(rank, device, _fulls())
    checked = rt.DeltaSession(checksum=True)
    checked_pairs = _model(rank, device, _fulls(), params=False)
    for version in (1, 2, 3):
        fulls = _fulls()
        if version > 1:  # a share of the elements changes, the rest stays
            gen = torch.Generator().manual_seed(version)
            for name, full in fulls.items():
                keep = torch.rand(full.shape, generator=gen) < 0.9
                fulls[name] = torch.where(keep, full, _full(full.shape, full.dtype, 1000 + version))
        for p in (pairs, checked_pairs):
            for name, (s, _, src, _) in p.items():
                with torch.no_grad():
                    s.copy_(_expected(src, rank, fulls[name]).to(device))
        report = rt.reshard_many_(pairs, delta=True, version=version, model="gpu-smoke")
        assert report.version == version and report.base == (None if version == 1 else version - 1)
        _check_model(pairs, rank, fulls, f"delta version {version}")
        for name, (_, d, _, _) in pairs.items():
            _untouched_by_autograd(d, name)
        report = checked.refit(checked_pairs, version)
        assert report.version == version
        _check_model(checked_pairs, rank, fulls, f"delta with checksums, version {version}")


def staged(rank, world, device):
    pairs = _model(rank, device, _fulls())
    session = rt.DeltaSession()
    for version in (1, 2):
        fulls = _fulls(version)
        for name, (s, _, src, _) in pairs.items():
            with torch.no_grad():
                s.copy_(_expected(src, rank, fulls[name]).to(device))
        before = {name: d.detach().cpu().clone() for name, (_, d, _, _) in pairs.items()}
        report = session.prepare(pairs, version)
        assert report.version == version
        for name, (_, d, _, dst) in pairs.items():
            _same(d, before[name], f"live {name} while version {version} is staged")
            want = _expected(dst, rank, fulls[name].to(MODEL[name][2]))
            _same(session.staging[name], want, f"staging {name}, version {version}")
        session.commit(version)
        assert session.serving == version
        _check_model(pairs, rank, fulls, f"staged version {version}, committed")
        for name, (_, d, _, _) in pairs.items():
            _untouched_by_autograd(d, name)


QUANT = "block:128x128"
# name -> (shape, source placement, destination placement): the second's source shards cut
# its blocks (their partial amax cross ranks), the destination's never do
FP8 = {"w_in": ((256, 512), "S(0)", "S(1)"), "w_out": ((384, 256), "S(0)", "R")}


def fp8(rank, world, device):
    # the reference: each tensor quantized whole by the Rust kernels on a one-rank gloo group
    alone = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    pairs, scales, want = {}, {}, {}
    for i, (name, (shape, s_place, d_place)) in enumerate(FP8.items()):
        full = _full(shape, torch.bfloat16, 50 + i)
        whole = reshard.Layout(shape, "fp8e4m3", 1, [0], ["R"])
        q = torch.zeros(shape, dtype=torch.float8_e4m3fn)
        q_scale = rt.scale_tensor(whole, 0, QUANT)
        whole_src = reshard.Layout(shape, "bf16", 1, [0], ["R"])
        rt.reshard_(full, q, whole_src, whole, alone, quant=QUANT, scale=q_scale)
        src = reshard.Layout(shape, "bf16", 2, [0, 1], [s_place])
        dst = reshard.Layout(shape, "fp8e4m3", 2, [0, 1], [d_place])
        offset, extent = dst.local_region(rank)
        grid = reshard.quant_scale_shape(dst, rank, QUANT)
        blocks = tuple(slice(o // 128, o // 128 + n) for o, n in zip(offset, grid))
        want[name] = (_expected(dst, rank, q), q_scale[blocks].clone())
        d = torch.zeros(extent, dtype=torch.float8_e4m3fn, device=device)
        scales[name] = rt.scale_tensor(dst, rank, QUANT, device=device)
        pairs[name] = (_expected(src, rank, full).to(device), d, src, dst)
    # a plain tensor beside them moves in the same call
    src = reshard.Layout((64, 32), "bf16", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout((64, 32), "bf16", 2, [0, 1], ["S(1)"])
    full = _full((64, 32), torch.bfloat16, 7)
    out = torch.zeros(dst.local_shape(rank), dtype=torch.bfloat16, device=device)
    pairs["norm"] = (_expected(src, rank, full).to(device), out, src, dst)
    for checksum in (False, True):
        rt.reshard_many_(pairs, quant=QUANT, scales=scales, checksum=checksum)
        for name, (values, scale) in want.items():
            _same(pairs[name][1], values, f"fp8 values of {name}, checksum={checksum}")
            _same(scales[name], scale, f"fp8 scales of {name}, checksum={checksum}")
        _same(out, _expected(dst, rank, full), "the plain tensor beside them")
        out.zero_()
        for name in want:
            pairs[name][1].zero_()
            scales[name].zero_()


# ------------------------------------------------------------------------------------------
# the tests


def test_reshard_into_parameters_that_require_grad_and_a_tensor_on_the_other_gpu():
    _run(parameters)


def test_reshard_many_of_a_small_model():
    _run(model)


def test_fsdp2_dtensors_into_an_engines_dtensors():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("torch.distributed.fsdp.fully_shard is not in this torch")
    _run(fsdp2)


def test_delta_refit():
    _run(delta)


def test_staged_refit_prepare_and_commit():
    _run(staged)


def test_fp8_quantized_refit():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    try:
        torch.ones(1, device="cuda").to(torch.float8_e4m3fn).to(torch.float32)
    except RuntimeError as e:
        pytest.skip(f"this torch does not cast to fp8 on the device: {e}")
    _run(fp8)
