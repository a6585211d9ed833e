"""DTensors in and out: layouts read from real torch DTensors (FSDP2's fully_shard, FSDP2 x
TP's _StridedShard), checked against their local tensors and full_tensor()."""

import random

import pytest
import torch

import reshard.torch as rt
from conftest import run_ranks
from reshard import Layout, ReshardError


def _strided_layouts(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    rng = random.Random(7)
    meshes = [(2, 2), (4, 1), (1, 4), (2, 1, 2)]
    refused = 0
    for trial in range(24):
        dims = meshes[trial % len(meshes)]
        mesh = init_device_mesh("cpu", dims)
        shape = [rng.randint(1, 13) for _ in range(rng.randint(1, 3))]
        if trial % 3 == 0:
            shape[0] = 4 * rng.randint(1, 3)  # even: always boxes
        if len(dims) == 2:
            placements = [_StridedShard(0, split_factor=dims[1]), Shard(0)]
        else:
            placements = [Replicate(), _StridedShard(0, split_factor=dims[2]), Shard(0)]
        if len(shape) > 1 and rng.random() < 0.5:
            placements[0] = Shard(len(shape) - 1)  # another dim on the first axis
            placements[-2:] = [_StridedShard(0, split_factor=dims[-1]), Shard(0)]
        torch.manual_seed(trial)
        full = torch.randn(shape)
        dist.broadcast(full, 0)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
        try:
            layout = rt.dtensor_layout(dt)
        except ReshardError as e:
            assert "not one contiguous piece" in str(e) or "are not boxes" in str(e), e
            refused += 1
            continue
        assert torch.equal(dt.full_tensor(), full)
        assert Layout.from_dtensor(dt) == layout
        local = rt.local_tensor(layout, rank, full)
        assert torch.equal(dt.to_local(), local), (shape, placements, layout)
    assert refused < 24


def test_strided_shard_layouts_match_torch_on_random_meshes():
    run_ranks(_strided_layouts, 4)


def _fsdp_tp_refit(rank, world):
    for colocated in (False, True):
        _fsdp_tp_refit_once(rank, colocated)


def _fsdp_tp_refit_once(rank, colocated):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20, bias=True), torch.nn.ReLU(), torch.nn.Linear(20, 12))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: tuple(type(p).__name__ for p in v.placements) for n, v in model.state_dict().items()}
    assert placements["0.weight"] == ("_StridedShard", "Shard"), placements
    # the engine: tensor parallel over two ranks, its own DTensors
    engine_ranks = [0, 1] if colocated else [2, 3]
    engine_mesh = DeviceMesh("cpu", engine_ranks)
    engine = None
    if rank in engine_ranks:
        engine = {
            n: distribute_tensor(
                torch.zeros_like(v), engine_mesh, [Shard(0 if n.startswith("0") else v.ndim - 1)]
            )
            for n, v in full.items()
        }
    rt.reshard_state_dict_(model, engine)
    for name, dt in model.state_dict().items():
        assert torch.equal(dt.full_tensor(), full[name]), name
    if engine is not None:
        for name, dt in engine.items():
            layout = rt.dtensor_layout(dt)
            assert torch.equal(dt.to_local(), rt.local_tensor(layout, rank, full[name])), name
    # a training step, then the same call again (no layout exchange but the descriptions)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    rt.reshard_state_dict_(model, engine)
    if engine is not None:
        for name, dt in engine.items():
            layout = rt.dtensor_layout(dt)
            assert torch.equal(dt.to_local(), rt.local_tensor(layout, rank, full[name] + 1.0)), name
    dist.barrier()


def test_fsdp2_tp_state_dict_refits_bitwise():
    # the engine on other ranks than the trainer's, then on some of the same
    run_ranks(_fsdp_tp_refit, 4, timeout=60)


def _dtensor_pairs(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    torch.manual_seed(1)
    model = torch.nn.Linear(6, 10)
    full = model.weight.detach().clone()
    train_mesh = DeviceMesh("cpu", [0, 1])
    engine_mesh = DeviceMesh("cpu", [2, 3])
    if rank < 2:
        fully_shard(model, mesh=train_mesh)
    out = distribute_tensor(torch.zeros(10, 6), engine_mesh, [Replicate()]) if rank >= 2 else None
    # reshard_ with DTensors on the ranks that hold them, the layouts exchanged
    rt.reshard_(model.weight if rank < 2 else None, out)
    if out is not None:
        assert torch.equal(out.to_local(), full)
    # a Refit-free many-tensor call with one layout given and the other read
    dst_layout = Layout((10, 6), "f32", 2, [2, 3], ["S(1)"])
    mine = torch.zeros(dst_layout.local_shape(rank)) if rank >= 2 else None
    rt.reshard_many_({"w": (model.weight if rank < 2 else None, mine, None, dst_layout)})
    if mine is not None:
        assert torch.equal(mine, rt.local_tensor(dst_layout, rank, full))
    # a rank whose state dict holds a plain tensor: every rank raises, none waits
    bad = {"weight": torch.zeros(10, 6)} if rank == 3 else None
    with pytest.raises(ReshardError, match=r"weight: dst holds a Tensor, not a DTensor"):
        rt.reshard_state_dict_({"weight": model.weight} if rank < 2 else None, bad)


def test_dtensors_as_pairs_and_a_plain_tensor_refused_everywhere():
    run_ranks(_dtensor_pairs, 4, timeout=60)


def _refit_dtensors(rank, world, path):
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    from reshard import Refit

    refit = Refit(path, "fsdp=2", "tp=2")
    meshes = {"train": DeviceMesh("cpu", [0, 1]), "infer": DeviceMesh("cpu", [2, 3])}
    torch.manual_seed(0)
    full = {n: torch.randn(refit.layouts(n)[0].shape) for n in refit.names}

    def dtensors(side, wrong=None):
        if rank not in (meshes[side].mesh.tolist()):
            return None
        out = {}
        for n in refit.names:
            layout = refit.layouts(n)[0 if side == "train" else 1]
            placements = [Shard(p.dim) if p.is_shard() else Replicate() for p in layout.placements]
            placements = [Replicate()] if n == wrong else placements
            tensor = full[n] if side == "train" else torch.zeros_like(full[n])
            out[n] = distribute_tensor(tensor, meshes[side], placements, src_data_rank=None)
        return out

    # rank 0's embedding is whole, not its FSDP shard: every rank raises, nothing moves
    engine = dtensors("infer")
    src = dtensors("train", wrong="model.embed_tokens.weight" if rank == 0 else None)
    with pytest.raises(ReshardError, match=r"model.embed_tokens.weight: the DTensor holds"):
        rt.reshard_many_(refit, src=src, dst=engine)
    if engine is not None:
        assert not any(t.to_local().any() for t in engine.values())
    rt.reshard_many_(refit, src=dtensors("train"), dst=engine)
    if engine is not None:
        for n, dt in engine.items():
            assert torch.equal(dt.to_local(), rt.local_tensor(refit.layouts(n)[1], rank, full[n])), n


def test_a_refit_takes_dtensors_and_refuses_a_wrong_box_everywhere(tmp_path):
    from test_engine import QWEN3, _path

    run_ranks(_refit_dtensors, 4, _path(tmp_path, QWEN3), timeout=60)
