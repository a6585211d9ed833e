"""The torch executor over gloo, several processes on loopback: against DTensor.redistribute
on one mesh, and from 4 training ranks to 2 inference ranks, element by element."""

import random

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from reshard.transfer import bucket  # noqa: E402
from conftest import random_placements, random_shape, run_ranks  # noqa: E402


def numbered(shape, dtype):
    """A global tensor whose every element differs from its neighbours (within the dtype)."""
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.int64).reshape(shape)
    if dtype == torch.bool:
        return values % 3 == 1
    if dtype in (torch.bfloat16, torch.float16):
        return (values % 251).to(dtype)
    return values.to(dtype)


def against_redistribute(rank, world, cases):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    def torch_place(text):
        return Replicate() if text == "R" else Shard(int(text[2:-1]))

    rng = random.Random(1234)  # every rank draws the same cases
    compared = 0
    for case in range(cases):
        mesh_shape = rng.choice([(4,), (2, 2), (1, 4), (4, 1)])
        shape = random_shape(rng, max_dim=11)
        src_text = random_placements(rng, len(mesh_shape), len(shape), negative=False)
        dst_text = random_placements(rng, len(mesh_shape), len(shape), negative=False)
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
        mesh = init_device_mesh("cpu", mesh_shape)
        full = numbered(shape, dtype)
        dt = distribute_tensor(full, mesh, [torch_place(p) for p in src_text])
        src = reshard.Layout.from_dtensor(dt)
        assert src == reshard.Layout(shape, dtype, mesh_shape, range(4), src_text)
        assert src.local_shape(rank) == tuple(dt.to_local().shape)
        out = dt.redistribute(mesh, [torch_place(p) for p in dst_text])
        dst = reshard.Layout(shape, dtype, mesh_shape, mesh.mesh.flatten().tolist(), out.placements)
        assert dst == reshard.Layout.from_dtensor(out)
        mine = torch.full(dst.local_shape(rank), 7, dtype=dtype)
        rt.reshard_(dt.to_local(), mine, src, dst)
        assert torch.equal(mine, rt.local_tensor(dst, rank, full)), (
            case,
            shape,
            mesh_shape,
            src_text,
            dst_text,
        )
        assert torch.equal(mine, out.to_local()), (case, shape, mesh_shape, src_text, dst_text)
        compared += 1
    assert compared == cases


def test_equals_dtensor_redistribute():
    run_ranks(against_redistribute, 4, 40)


def train_to_infer(rank, world):
    # disjoint sides of one world: training ranks 0..4 hold row shards, inference ranks 4..6
    # column shards; uneven shapes
    for shape, dtype in [((37, 23), torch.bfloat16), ((9, 2, 5), torch.float32)]:
        full = numbered(shape, dtype)
        src = reshard.Layout(shape, dtype, 4, range(4), [reshard.Shard(0)])
        dst = reshard.Layout(shape, dtype, 2, [4, 5], [reshard.Shard(1)])
        s = rt.local_tensor(src, rank, full)
        s = None if s is None else s.clone()
        d = None if rank < 4 else torch.zeros(dst.local_shape(rank), dtype=dtype)
        for i in range(2):
            rt.reshard_(s, d, src, dst)
            if d is not None:
                assert torch.equal(d, rt.local_tensor(dst, rank, full))
                d.zero_()
            if i == 0:
                info = bucket.local_plan.cache_info()
                planned = info.hits + info.misses
        # the second call ran the cached program: not even a plan lookup
        info = bucket.local_plan.cache_info()
        assert info.hits + info.misses == planned

    # the same 4 -> 2 inside a subgroup that leaves rank 0 out: layouts number the group's
    # ranks (group rank g is global rank g + 1); a 2x2 [R, S(1)] source with replicas, a
    # destination colocated with it, on ranks listed out of order, into strided tensors
    group = dist.new_group([1, 2, 3, 4, 5])
    shape = (6, 11)
    full = numbered(shape, torch.int64)
    src = reshard.Layout(shape, "i64", (2, 2), range(4), ["R", "S(1)"])
    dst = reshard.Layout(shape, "i64", 3, [4, 2, 0], ["S(0)"])
    g = rank - 1
    s = None if rank == 0 or g > 3 else rt.local_tensor(src, g, full).clone()
    d = None
    if rank != 0 and dst.local_shape(g) is not None:
        d = torch.zeros(tuple(reversed(dst.local_shape(g))), dtype=torch.int64).t()  # not contiguous
    rt.reshard_(s, d, src, dst, group=group)
    if d is not None:
        assert torch.equal(d, rt.local_tensor(dst, g, full))

    # a whole model: several tensors of several dtypes, batched per peer, in several buckets
    layouts = {
        "embed": ((50, 8), torch.bfloat16, (4, ["S(0)"]), (2, ["S(1)"])),
        "norm": ((8,), torch.float32, ((2, 2), ["S(0)", "R"]), (2, ["R"])),
        "experts": ((3, 4, 5), torch.int32, ((2, 2), ["S(2)", "S(0)"]), (2, ["S(1)"])),
        "mask": ((7, 3), torch.bool, (4, ["S(1)"]), ((1, 2), ["R", "S(0)"])),
    }
    pairs, want = {}, {}
    for name, (shape, dtype, (sm, sp), (dm, dp)) in layouts.items():
        full = numbered(shape, dtype)
        src = reshard.Layout(shape, dtype, sm, range(4), sp)
        dst = reshard.Layout(shape, dtype, dm, [5, 4], dp)
        s = rt.local_tensor(src, rank, full)
        pairs[name] = (
            None if s is None else s.clone(),
            None if rank < 4 else torch.zeros(dst.local_shape(rank), dtype=dtype),
            src,
            dst,
        )
        want[name] = rt.local_tensor(dst, rank, full)
    batches = []
    post = dist.batch_isend_irecv

    def recording(ops):
        batches.append([(op.op.__name__, op.peer) for op in ops])
        return post(ops)

    dist.batch_isend_irecv = recording
    for bucket_bytes in (rt.DEFAULT_BUCKET_BYTES, 64):
        batches.clear()
        rt.reshard_many_(dict(reversed(pairs.items())) if rank % 2 else pairs, bucket_bytes=bucket_bytes)
        # one message per peer and direction in a batch; one batch when everything fits
        assert all(len(set(b)) == len(b) for b in batches)
        if bucket_bytes == rt.DEFAULT_BUCKET_BYTES:
            assert len(batches) == 1
            assert len(batches[0]) == (2 if rank < 4 else 4)
        else:
            assert len(batches) > 1
        for name, (_, d, _, _) in pairs.items():
            if d is not None:
                assert torch.equal(d, want[name]), name
                d.zero_()

    dist.batch_isend_irecv = post

    # bad input is refused on every rank before any byte moves, so nobody waits
    shape = (8, 8)
    src = reshard.Layout(shape, "f32", 4, range(4), ["S(0)"])
    dst = reshard.Layout(shape, "f32", 2, [4, 5], ["S(1)"])
    wrong = torch.zeros(3, 3, dtype=torch.float32)
    with pytest.raises(reshard.ReshardError) as e:
        rt.reshard_(wrong if rank < 4 else None, wrong if rank >= 4 else None, src, dst)
    # every rank here has bad input, and says its own
    side = "src" if rank < 4 else "dst"
    expected_shape = "(2, 8)" if rank < 4 else "(8, 4)"
    assert str(e.value).startswith(
        f"{side}_local: rank {rank} holds a shard of shape {expected_shape} (f32)"
    ), str(e.value)
    assert "the tensor given has shape (3, 3) and dtype float32" in str(e.value)
    with pytest.raises(reshard.ReshardError, match="shape: the sides disagree"):
        rt.reshard_(None, None, src, reshard.Layout((8, 4), "f32", 2, [4, 5], ["S(1)"]))
    with pytest.raises(
        reshard.ReshardError,
        match=r"dst_layout: rank 6 of mesh=2 ranks=5..7 place=S\(1\) is not in the process group \(size 6\)",
    ):
        rt.reshard_(None, None, src, reshard.Layout(shape, "f32", 2, [5, 6], ["S(1)"]))
    with pytest.raises(reshard.ReshardError, match=r"w: dst_local: rank \d is not part of this layout"):
        rt.reshard_many_(
            {
                "w": (
                    torch.zeros(1),
                    torch.zeros(1),
                    reshard.Layout((1,), "f32", 1, [rank], ["R"]),
                    reshard.Layout((1,), "f32", 1, [(rank + 1) % world], ["R"]),
                )
            }
        )


def test_four_training_ranks_to_two_inference_ranks():
    run_ranks(train_to_infer, 6)


def checksummed(rank, world):
    # 4 training ranks (row shards) to 2 inference ranks (column shards), and a whole model
    shape = (37, 23)
    full = numbered(shape, torch.bfloat16)
    src = reshard.Layout(shape, "bf16", 4, range(4), ["S(0)"])
    dst = reshard.Layout(shape, "bf16", 2, [4, 5], ["S(1)"])
    s = rt.local_tensor(src, rank, full)
    s = None if s is None else s.clone()
    d = None if rank < 4 else torch.zeros(dst.local_shape(rank), dtype=torch.bfloat16)
    rt.reshard_(s, d, src, dst, checksum=True)
    if d is not None:
        assert torch.equal(d, rt.local_tensor(dst, rank, full))
    pairs = {
        "a": (s, None if d is None else torch.zeros_like(d), src, dst),
        "b": (s, None if d is None else torch.zeros_like(d), src, dst),
    }
    rt.reshard_many_(pairs, checksum=True, bucket_bytes=64)
    if d is not None:
        for name in pairs:
            assert torch.equal(pairs[name][1], d), name

    # a byte changed on the way: rank 1 flips one byte of the rows it sends to rank 5 after
    # summing them, and rank 5 refuses the transfer, naming it, before it unpacks anything
    seal = bucket.Message.seal

    def corrupt(message, buffer):
        seal(message, buffer)
        if any(piece.dst == 5 for _, piece, _ in message.parts):
            buffer[3] ^= 0x40

    if rank == 1:
        bucket.Message.seal = corrupt
    if d is not None:
        d.zero_()
    try:
        if rank == 5:
            with pytest.raises(reshard.ReshardError) as e:
                rt.reshard_(s, d, src, dst, checksum=True)
            assert str(e.value).startswith(
                "rank 5: checksum mismatch in the transfer from rank 1 to rank 5 at offset "
                "[10, 12] extent 10x11: sent with crc32c 0x"
            ), str(e.value)
            assert not d.any(), "a region was unpacked"
        else:
            rt.reshard_(s, d, src, dst, checksum=True)
            if d is not None:
                assert torch.equal(d, rt.local_tensor(dst, rank, full))
    finally:
        bucket.Message.seal = seal


def test_checksums_pass_and_name_a_changed_transfer():
    run_ranks(checksummed, 6)


def test_crc32c_refuses_what_it_cannot_read_in_place():
    t = torch.arange(10, dtype=torch.uint8)
    assert reshard._core.crc32c(t, [(0, 0), (0, 10)])[0] == 0
    # the CRC-32C check value
    check = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert reshard._core.crc32c(check, [(0, 9)]) == [0xE3069283]
    with pytest.raises(reshard.ReshardError, match=r"piece \(5, 6\) lies outside the tensor's 10 bytes"):
        reshard._core.crc32c(t, [(5, 6)])
    with pytest.raises(reshard.ReshardError, match="expected a contiguous 1-D torch.uint8 tensor"):
        reshard._core.crc32c(t.to(torch.int32), [(0, 1)])
    with pytest.raises(reshard.ReshardError, match="not contiguous"):
        reshard._core.crc32c(t[::2], [(0, 1)])


def in_place(rank, world, native):
    # 2 training ranks (row shards) to 2 inference ranks (column shards): every region of the
    # large tensors is one run of its destination shard and at least IN_PLACE_BYTES, so a
    # message of several regions travels as one operation per region, each received straight
    # into its tensor; a transposed destination takes the region through the staging buffer,
    # and small tensors' regions travel together between them
    rt._NATIVE = native
    shapes = {
        "big0": (1024, 512),
        "small": (64, 8),
        "big1": (1024, 512),
        "odd": (48, 40),
        "big2": (1024, 512),
    }
    rows, cols = 1024, 512
    assert (rows // 2) * (cols // 2) * 4 >= bucket.IN_PLACE_BYTES
    landed = []
    view = bucket.Message.view

    def counted(message, part, tensors):
        got = view(message, part, tensors)
        landed.append(got is not None)
        return got

    bucket.Message.view = counted
    try:
        for checksum in (False, True):
            pairs, wants = {}, {}
            for i, (name, shape) in enumerate(shapes.items()):
                full = numbered(shape, torch.float32) + 1000 * i
                s_layout = reshard.Layout(shape, "f32", 2, [0, 1], ["S(0)"])
                d_layout = reshard.Layout(shape, "f32", 2, [2, 3], ["S(1)"])
                s = rt.local_tensor(s_layout, rank, full)
                d = None
                if rank >= 2:
                    local = d_layout.local_shape(rank)
                    # big2's destination is a transposed view: not contiguous
                    d = torch.zeros(local[::-1]).t() if name == "big2" else torch.zeros(local)
                    wants[name] = rt.local_tensor(d_layout, rank, full)
                pairs[name] = (None if s is None else s.clone(), d, s_layout, d_layout)
            rt.reshard_many_(pairs, checksum=checksum)
            for name, want in wants.items():
                assert torch.equal(pairs[name][1], want), (name, checksum, native)
    finally:
        bucket.Message.view = view
        rt._NATIVE = True
    if rank >= 2:
        # without checksums: big0 and big1 in place from each source, big2 staged
        assert landed.count(True) == 4 and landed.count(False) == 2, landed
    else:
        assert landed == []


@pytest.mark.parametrize("native", [True, False])
def test_large_regions_are_received_in_place(native):
    run_ranks(in_place, 4, native)
