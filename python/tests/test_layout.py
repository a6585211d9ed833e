"""Layouts: construction from every placement form, errors, and shard geometry against
DTensor's own (``compute_local_shape_and_global_offset``)."""

import itertools
import random

import pytest

import reshard
from conftest import random_mesh, random_placements, random_shape


def test_placement_forms_agree():
    torch_placements = pytest.importorskip("torch.distributed.tensor")
    forms = [
        ["S(0)", "R"],
        "S(0),R",
        ["Shard(0)", "Replicate()"],
        [reshard.Shard(0), reshard.Replicate()],
        [torch_placements.Shard(0), torch_placements.Replicate()],
        [reshard.Shard(-2), "r"],
    ]
    layouts = [reshard.Layout((6, 4), "bf16", (2, 3), None, p) for p in forms]
    assert all(x == layouts[0] for x in layouts)
    assert len({hash(x) for x in layouts}) == 1
    layout = layouts[0]
    assert layout.placements == (reshard.Shard(0), reshard.Replicate())
    assert layout.mesh == (2, 3) and layout.ranks == tuple(range(6)) and layout.shape == (6, 4)
    assert layout.spec == "mesh=2x3 ranks=0..6 place=S(0),R"
    assert eval(repr(layout), vars(reshard)) == layout


def test_dtype_forms():
    torch = pytest.importorskip("torch")
    for dtype, name in [
        (torch.bfloat16, "bf16"),
        ("bfloat16", "bf16"),
        (torch.float8_e4m3fn, "fp8e4m3"),
        (torch.bool, "bool"),
        ("i64", "i64"),
        (torch.uint16, "u16"),
    ]:
        assert reshard.Layout((4,), dtype, 2, None, ["S(0)"]).dtype == name


def test_local_region_and_from_spec():
    layout = reshard.Layout.from_spec("mesh=2x4 ranks=8..16 place=R,S(1)", (3, 10), "f32")
    assert layout.ranks == tuple(range(8, 16))
    # 10 over 4: 3, 3, 3, 1; the two rows of the mesh are replicas
    assert layout.local_region(11) == ((0, 9), (3, 1))
    assert layout.local_region(15) == ((0, 9), (3, 1))
    assert layout.local_shape(12) == (3, 3)
    assert layout.local_region(3) is None and layout.local_shape(3) is None
    assert reshard.Layout.from_spec("mesh=4 place=S(0)", (8,), "u8", first_rank=2).ranks == (2, 3, 4, 5)


@pytest.mark.parametrize(
    "args, message",
    [
        (((8, 8), "bf16", 2, None, ["S(2)"]), "Shard(2) is out of range for a 2-D tensor (dims 0..2)"),
        (((8, 8), "bf16", (2, 2), None, ["S(0)"]), "1 placements for a 2-D mesh (one per mesh axis)"),
        (((8, 8), "bf16", 2, [0, 0], ["S(0)"]), "rank 0 appears more than once in ranks"),
        (((8, 8), "bf16", 2, [0, 1, 2], ["S(0)"]), "mesh 2 has 2 positions but ranks lists 3"),
        (((8, 8), "bf16", (2, 0), None, ["S(0)", "R"]), "mesh axis 1 has size 0 (mesh 2x0)"),
        (((8, 8), "complex32", 2, None, ["S(0)"]), "dtype: unknown dtype `complex32`"),
        (((8, -1), "bf16", 2, None, ["S(0)"]), "shape: `-1` is not a non-negative integer"),
        (((8, 8), "bf16", 2, None, ["X(0)"]), "placements: unknown placement `X(0)`"),
        (((8, 8), "bf16", 2, None, [1.5]), "placements: 1.5 is not a placement"),
    ],
)
def test_errors_name_the_value(args, message):
    with pytest.raises(reshard.ReshardError) as e:
        reshard.Layout(*args)
    assert str(e.value).startswith(message)
    assert isinstance(e.value, ValueError)


def test_geometry_matches_dtensor():
    """Local shape and offset of every rank of hundreds of random layouts (uneven, empty,
    nested, negative dims) equal DTensor's."""
    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rng = random.Random(6)
    checked = nested = empty = 0
    for _ in range(400):
        shape = random_shape(rng)
        mesh = random_mesh(rng)
        text = random_placements(rng, len(mesh), len(shape))
        layout = reshard.Layout(shape, "bf16", mesh, None, text)
        dims = [int(p[2:-1]) % len(shape) for p in text if p != "R"]
        nested += len(dims) != len(set(dims))
        torch_placements = [
            tensor_mod.Replicate() if p == "R" else tensor_mod.Shard(int(p[2:-1]) % len(shape)) for p in text
        ]
        for position, coord in enumerate(itertools.product(*[range(d) for d in mesh])):
            want_shape, want_offset = _compute_local_shape_and_global_offset(
                shape, mesh, list(coord), torch_placements
            )
            offset, extent = layout.local_region(layout.ranks[position])
            assert extent == tuple(want_shape), (shape, mesh, text, coord)
            for d in range(len(shape)):
                # DTensor puts an empty shard's offset at the end of the dim; ours sits where
                # its (empty) piece would start. Neither addresses any element.
                if extent[d] > 0:
                    assert offset[d] == want_offset[d], (shape, mesh, text, coord)
                else:
                    empty += 1
            checked += 1
    assert checked > 1000 and nested > 30 and empty > 30


def test_from_dtensor_reads_shape_dtype_mesh_and_order():
    """The DTensor attributes it reads, on a stand-in (a real DTensor needs a process group;
    test_torch checks real ones)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    def fake(order):
        entries = [SimpleNamespace(tensor_dim=0, mesh_dims=order)]
        return SimpleNamespace(
            shape=torch.Size([10, 4]),
            dtype=torch.float16,
            device_mesh=SimpleNamespace(shape=(2, 2), mesh=torch.tensor([[7, 5], [3, 1]])),
            placements=(Shard(0), Shard(0)),
            _spec=SimpleNamespace(shard_order=tuple(entries)),
        )

    layout = reshard.Layout.from_dtensor(fake((0, 1)))
    assert layout == reshard.Layout((10, 4), "f16", (2, 2), [7, 5, 3, 1], ["S(0)", "S(0)"])
    assert layout.local_region(5) == ((3, 0), (2, 4))
    with pytest.raises(
        reshard.ReshardError, match=r"shards tensor dim 0 over mesh axes \[1, 0\] in that order"
    ):
        reshard.Layout.from_dtensor(fake((1, 0)))
    partial = fake((0, 1))
    partial.placements = (Replicate(), torch.distributed.tensor.Partial())
    with pytest.raises(reshard.ReshardError, match=r"Partial\(sum\) is not supported"):
        reshard.Layout.from_dtensor(partial)
