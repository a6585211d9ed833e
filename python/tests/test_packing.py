"""The packing program (reshard._core.Packing) that copies CPU tensors' regions into messages
and back in Rust, against torch's own slicing: every dtype, strided tensors (transposed, slices
of wider arrays, every other element), vLLM-style fused buffers, empty shards; and whole-model
reshards of many tensors through it, against the torch copies GPU tensors take."""

import random

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from reshard.transfer.bucket import STAGING  # noqa: E402
from reshard.transfer.checks import TORCH_DTYPES  # noqa: E402
from conftest import random_placements, random_shape, run_ranks  # noqa: E402

DTYPES = list(TORCH_DTYPES.values())


def raw(t):
    """A tensor's bytes in row-major order of its elements (copied into a fresh tensor: a
    contiguous tensor may keep any stride on a dim of size 1, which view() refuses)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def random_bytes(rng, shape, dtype):
    n = 1
    for d in shape:
        n *= d
    size = torch.empty((), dtype=dtype).element_size()
    top = 2 if dtype == torch.bool else 256  # a bool byte is 0 or 1
    data = torch.tensor([rng.randrange(top) for _ in range(n * size)], dtype=torch.uint8)
    return data.view(dtype).reshape(shape)


def strided(shape, dtype, how):
    """A zeroed tensor of ``shape`` whose memory is laid out as ``how`` says."""
    if how == "contiguous" or not shape:
        return torch.zeros(shape, dtype=dtype)
    if how == "transposed":
        return torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape))))
    if how == "slice":  # a box of a wider dense array, as a fused buffer's member is
        wide = list(shape)
        wide[-1] += 3
        return torch.zeros(wide, dtype=dtype)[..., 2 : 2 + shape[-1]]
    if how == "every_other":
        wide = list(shape)
        wide[-1] *= 2
        return torch.zeros(wide, dtype=dtype)[..., ::2]
    raise ValueError(how)


def random_box(rng, shape):
    offset, extent = [], []
    for n in shape:
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        offset.append(a)
        extent.append(b - a)
    return offset, extent


def slices(offset, extent):
    return tuple(slice(o, o + n) for o, n in zip(offset, extent))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("how", ["contiguous", "transposed", "slice", "every_other"])
def test_pack_unpack_and_local_copies_equal_torch_slicing(dtype, how):
    rng = random.Random(hash((str(dtype), how)) & 0xFFFF)
    for _ in range(6):
        shapes = [random_shape(rng, max_ndim=3, max_dim=9) for _ in range(4)]
        elem = torch.empty((), dtype=dtype).element_size()
        # slots 0..4 are sources (filled), 4..8 destinations (zeroed, strided)
        sources = []
        for s in shapes:
            t = strided(s, dtype, how)
            t.copy_(random_bytes(rng, s, dtype))
            sources.append(t)
        dests = [strided(s, dtype, how) for s in shapes]
        slots = [(list(s), elem) for s in shapes] * 2
        # two messages over random boxes of the sources, regions 16-byte aligned
        messages = []
        for _ in range(2):
            pieces, at = [], 0
            for _ in range(rng.randint(0, 5)):
                k = rng.randrange(4)
                offset, extent = random_box(rng, shapes[k])
                n = elem
                for e in extent:
                    n *= e
                at = (at + 15) // 16 * 16
                pieces.append((k, offset, extent, at))
                at += n
            messages.append((at, pieces))
        locals_ = []
        for k in range(4):
            offset, extent = random_box(rng, shapes[k])
            locals_.append((k, offset, 4 + k, offset, extent))
        packing = reshard._core.Packing(
            slots,
            messages,
            [(size, [(4 + k, o, e, at) for k, o, e, at in pieces]) for size, pieces in messages],
            locals_,
        )
        tensors = sources + dests
        buffers = [torch.zeros(size, dtype=torch.uint8) for size, _ in messages]
        packing.pack(tensors, buffers)
        for (_, pieces), buffer in zip(messages, buffers):
            for k, offset, extent, at in pieces:
                want = raw(sources[k][slices(offset, extent)])
                assert torch.equal(buffer[at : at + want.numel()], want)
        packing.copy_locals(tensors)
        packing.unpack(buffers, tensors)
        for k in range(4):
            want = torch.zeros(shapes[k], dtype=dtype)
            for _, pieces in messages:
                for j, offset, extent, _ in pieces:
                    if j == k:
                        want[slices(offset, extent)] = sources[k][slices(offset, extent)]
            _, offset, _, _, extent = locals_[k]
            want[slices(offset, extent)] = sources[k][slices(offset, extent)]
            assert torch.equal(raw(dests[k]), raw(want)), (shapes[k], how)


def test_fused_members_are_written_in_place_and_nothing_else():
    # vLLM's experts' w13: [experts, 2 * inter, hidden], gate then up along dim 1; and qkv
    # along dim 0: each member is a narrow() view of the fused buffer
    w13 = torch.zeros(3, 10, 4, dtype=torch.bfloat16)
    gate, up = w13.narrow(1, 0, 4), w13.narrow(1, 4, 6)
    qkv = torch.zeros(9, 5, dtype=torch.float16)
    q, k, v = qkv.narrow(0, 0, 5), qkv.narrow(0, 5, 2), qkv.narrow(0, 7, 2)
    members = [gate, up, q, k, v]
    fills = [torch.arange(m.numel()).reshape(m.shape).to(m.dtype) + 1 for m in members]
    pieces, at = [], 0
    for i, m in enumerate(members):
        at = (at + 15) // 16 * 16
        pieces.append((i, [0] * m.dim(), list(m.shape), at))
        at += m.numel() * m.element_size()
    buffer = torch.zeros(at, dtype=torch.uint8)
    for (_, _, _, start), f in zip(pieces, fills):
        buffer[start : start + f.numel() * f.element_size()] = raw(f)
    slots = [(list(m.shape), m.element_size()) for m in members]
    reshard._core.Packing(slots, [], [(at, pieces)], []).unpack([buffer], members)
    assert torch.equal(w13, torch.cat([fills[0], fills[1]], dim=1))
    assert torch.equal(qkv, torch.cat(fills[2:], dim=0))


def test_bad_tensors_and_programs_are_refused():
    Packing = reshard._core.Packing
    with pytest.raises(reshard.ReshardError, match=r"lies outside slot 0's shape \[4, 4\]"):
        Packing([([4, 4], 4)], [(64, [(0, [2, 0], [3, 4], 0)])], [], [])
    with pytest.raises(reshard.ReshardError, match=r"lies outside the message's 16 bytes"):
        Packing([([4, 4], 4)], [(16, [(0, [0, 0], [1, 4], 4)])], [], [])
    with pytest.raises(reshard.ReshardError, match="slot 1 holds no tensor"):
        Packing([([4, 4], 4), None], [(64, [(1, [0, 0], [1, 4], 0)])], [], [])
    p = Packing([([4, 4], 4)], [(16, [(0, [0, 0], [1, 4], 0)])], [], [])
    buffer = torch.zeros(16, dtype=torch.uint8)
    wrong = r"tensors\[0\]: expected a tensor of shape \[4, 4\] with 4"
    with pytest.raises(reshard.ReshardError, match=wrong):
        p.pack([torch.zeros(4, 3)], [buffer])
    with pytest.raises(reshard.ReshardError, match="got None"):
        p.pack([None], [buffer])
    with pytest.raises(reshard.ReshardError, match=r"buffers\[0\]: expected a contiguous 1-D torch.uint8"):
        p.pack([torch.zeros(4, 4)], [torch.zeros(8, dtype=torch.uint8)])
    with pytest.raises(reshard.ReshardError, match="expected 1 buffers, got 2"):
        p.pack([torch.zeros(4, 4)], [buffer, buffer])
    local = Packing([([4], 4), ([4], 4)], [], [], [(0, [0], 1, [0], [4])])
    t = torch.zeros(8)
    with pytest.raises(reshard.ReshardError, match="share memory"):
        local.copy_locals([t[:4], t[2:6]])


def numbered(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.int64).reshape(shape)
    if dtype == torch.bool:
        return values % 3 == 1
    if dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() == 1:
        return (values % 7).to(torch.float32).to(dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return (values % 251).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return (values % 1000).to(torch.int32).to(dtype)
    return values.to(dtype)


def many_tensors(rank, world):
    # 160 tensors of every dtype and random layouts (empty shards among them), from ranks
    # 0..2 to ranks 1..4 (rank 1 on both sides: local copies), into strided destinations,
    # in several buckets; each run twice (the second from the cached program), through the
    # Rust packing and through torch copies
    rng = random.Random(99)  # every rank draws the same tensors
    pairs, want = {}, {}
    for i in range(160):
        shape = random_shape(rng, max_ndim=3, max_dim=9)
        dtype = rng.choice(DTYPES)
        src = reshard.Layout(shape, dtype, 2, [0, 1], random_placements(rng, 1, len(shape)))
        dst = reshard.Layout(shape, dtype, 3, [3, 1, 2], random_placements(rng, 1, len(shape)))
        full = numbered(shape, dtype)
        s = rt.local_tensor(src, rank, full)
        d = dst.local_shape(rank)
        how = rng.choice(["contiguous", "transposed", "slice", "every_other"])
        mine = None if d is None else strided(d, dtype, how)
        pairs[f"t{i}"] = (None if s is None else s.clone(), mine, src, dst)
        want[f"t{i}"] = rt.local_tensor(dst, rank, full)
    for native in (True, False):
        rt._NATIVE = native
        for _ in range(2):
            rt.reshard_many_(pairs, bucket_bytes=4096)
            for name, (_, d, _, _) in pairs.items():
                if d is not None:
                    assert torch.equal(raw(d), raw(want[name])), (name, native)
                    d.zero_()
    rt._NATIVE = True
    rt.reshard_many_(pairs, checksum=True)
    for name, (_, d, _, _) in pairs.items():
        if d is not None:
            assert torch.equal(raw(d), raw(want[name])), name
            d.zero_()
    # the staging arenas, once released, are allocated afresh
    rt.free_staging()
    assert not vars(STAGING)
    rt.reshard_many_(pairs)
    for name, (_, d, _, _) in pairs.items():
        if d is not None:
            assert torch.equal(raw(d), raw(want[name])), name


def test_many_tensors_of_every_dtype_into_strided_destinations():
    run_ranks(many_tensors, 4)
