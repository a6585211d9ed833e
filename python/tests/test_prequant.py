"""Already-quantized tensors (``reshard_(fp8, fp8, ..., quant=..., scale=..., src_scale=...)``)
over gloo processes: the values and the scales of random layouts compared with slices of the
whole tensors, and the refusals named before any byte moves."""

import random

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402
from test_quant import block_shape, blocks_touching, layout, varied  # noqa: E402

FP8 = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def whole(shape, scheme, scale_dtype, seed):
    """A whole fp8 tensor (every byte pattern, NaN ones too: the values move as bytes) and its
    scale tensor (f32, or uint8 biased exponents for e8m0)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    grid = [-(-n // b) for n, b in zip(shape, block_shape(scheme, shape))]
    if scale_dtype == "e8m0":
        scales = torch.randint(0, 256, grid, generator=g, dtype=torch.uint8)
    else:
        scales = torch.rand(grid, generator=g) * 2.0 ** torch.randint(-20, 4, grid, generator=g)
    return values, scales


def shards(lay, rank, scheme, values, scales, fp8):
    """This rank's value shard and scale shard of the whole tensors (None, None if it holds none)."""
    region = lay.local_region(rank)
    if region is None:
        return None, None
    offset, extent = region
    v = values[tuple(slice(o, o + n) for o, n in zip(offset, extent))].clone().view(FP8[fp8])
    s = scales[blocks_touching(offset, extent, block_shape(scheme, list(lay.shape)))].clone()
    return v, s


def random_moves(seed, count, world):
    """Random layouts of fp8 tensors whose shards, on both sides, hold whole blocks."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        scheme = rng.choice(["block:2x4", "block:4x2:ue8m0", "block:3x5", "mx:32", "channel", "tensor"])
        e8m0 = scheme == "mx:32" or (scheme.endswith("ue8m0") and rng.random() < 0.5)
        scale_dtype = "e8m0" if e8m0 else None
        ndim = rng.choice([2, 2, 3])
        shape = [rng.randint(1, 3) for _ in range(ndim - 2)]
        block = block_shape(scheme, shape + [1, 1])
        if scheme == "mx:32":
            shape += [rng.randint(1, 9), 32 * rng.choice([1, 2, 3, 4])]
        elif scheme in ("channel", "tensor"):
            shape += [rng.randint(1, 9), rng.randint(1, 9)]
        else:
            shape += [block[-2] * rng.randint(1, 6), block[-1] * rng.randint(1, 4)]
        sides = []
        for _ in range(2):
            mesh = rng.choice([(1,), (2,), (3,), (2, 2), (4,)])
            n = 1
            for m in mesh:
                n *= m
            placements = [rng.choice(["R", "S(0)", f"S({ndim - 2})", f"S({ndim - 1})"]) for _ in mesh]
            sides.append((mesh, rng.sample(range(world), n), placements))
        fp8 = rng.choice(list(FP8))
        src = layout(shape, fp8, *sides[0])
        dst = layout(shape, fp8, *sides[1])
        try:
            reshard._core.quantized_scale_layouts(src, dst, scheme, scale_dtype)
        except reshard.ReshardError:
            continue  # a shard that cuts a block: the error test covers it
        out.append((tuple(shape), fp8, scheme, scale_dtype, src, dst, 500 + k))
    return out


def check_move(rank, case, checksum=False):
    shape, fp8, scheme, scale_dtype, src, dst, seed = case
    values, scales = whole(list(shape), scheme, scale_dtype, seed)
    s, s_scale = shards(src, rank, scheme, values, scales, fp8)
    want, want_scale = shards(dst, rank, scheme, values, scales, fp8)
    d = None if want is None else torch.zeros_like(want)
    scale = rt.scale_tensor(dst, rank, scheme, scale_dtype)
    rt.reshard_(
        s,
        d,
        src,
        dst,
        quant=scheme,
        scale=scale,
        src_scale=s_scale,
        scale_dtype=scale_dtype,
        checksum=checksum,
    )
    if want is None:
        assert scale is None
        return 0
    assert torch.equal(d.view(torch.uint8), want.view(torch.uint8)), (case, rank)
    assert tuple(scale.shape) == tuple(want_scale.shape), (case, rank)
    assert torch.equal(scale.view(torch.uint8), want_scale.contiguous().view(torch.uint8)), (case, rank)
    return d.numel()


def randomized(rank, world, native):
    rt._NATIVE = native
    cases = random_moves(3, 80, world)
    assert len(cases) >= 25, len(cases)
    compared = sum(check_move(rank, case, checksum=i % 4 == 0) for i, case in enumerate(cases))
    assert compared > 0
    rt._NATIVE = True


@pytest.mark.parametrize("native", [True, False])
def test_random_layouts_move_values_and_scales_together(native):
    run_ranks(randomized, 4, native)


def many(rank, world):
    """reshard_many_ with an already-quantized tensor, one quantized in flight and a plain
    one, in one call, twice (the second reuses what the first agreed on)."""
    shape = (16, 32)
    scheme = "block:8x16"
    values, scales = whole(list(shape), scheme, None, 9)
    pre_src = layout(shape, "fp8e4m3", (2,), [0, 1], ["S(0)"])
    pre_dst = layout(shape, "fp8e4m3", (2,), [3, 2], ["S(1)"])
    full_w = varied(shape, torch.bfloat16, 4)
    w_src = layout(shape, "bf16", (2,), [0, 1], ["S(1)"])
    w_dst = layout(shape, "fp8e4m3", (2,), [2, 3], ["S(0)"])
    full_n = varied((32,), torch.bfloat16, 5)
    n_src = layout((32,), "bf16", (1,), [1], ["R"])
    n_dst = layout((32,), "bf16", (2,), [2, 3], ["S(0)"])

    s, s_scale = shards(pre_src, rank, scheme, values, scales, "fp8e4m3")
    want, want_scale = shards(pre_dst, rank, scheme, values, scales, "fp8e4m3")
    d = None if want is None else torch.zeros_like(want)
    scale = rt.scale_tensor(pre_dst, rank, scheme)
    w_s = rt.local_tensor(w_src, rank, full_w)
    w_d = None if rank < 2 else torch.zeros(w_dst.local_shape(rank), dtype=torch.float8_e4m3fn)
    w_scale = rt.scale_tensor(w_dst, rank, scheme)
    n_s = rt.local_tensor(n_src, rank, full_n)
    n_d = None if rank < 2 else torch.zeros(n_dst.local_shape(rank), dtype=torch.bfloat16)
    for _ in range(2):
        rt.reshard_many_(
            {
                "pre": (s, d, pre_src, pre_dst),
                "w": (None if w_s is None else w_s.clone(), w_d, w_src, w_dst),
                "n": (None if n_s is None else n_s.clone(), n_d, n_src, n_dst),
            },
            quant=rt.Quant(scheme, scales={"pre": scale, "w": w_scale}, src_scales={"pre": s_scale}),
        )
        if rank >= 2:
            assert torch.equal(d.view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(scale, want_scale)
            assert torch.equal(n_d, rt.local_tensor(n_dst, rank, full_n))
            assert w_d.view(torch.uint8).any()
            d.zero_()
            scale.zero_()


def test_reshard_many_moves_quantized_tensors_beside_others():
    run_ranks(many, 4)


def refusals(rank, world):
    """A shard boundary that cuts a block on either side, source scales of the wrong shape
    or for a source that is not fp8: refused on every rank, naming the tensor, before any
    byte moves."""
    shape = (12, 32)
    scheme = "block:8x16"
    values, scales = whole(list(shape), scheme, None, 2)
    whole_rows = layout(shape, "fp8e4m3", (1,), [0], ["R"])
    cut_rows = layout(shape, "fp8e4m3", (2,), [0, 1], ["S(0)"])  # rows 0..6, 6..12
    dst = layout(shape, "fp8e4m3", (2,), [1, 0], ["S(1)"])
    cut_cols = layout(shape, "fp8e4m3", (4,), [0, 1, 2, 3], ["S(1)"])  # 8 columns each

    def attempt(src, dst, name="w", **kw):
        s, s_scale = shards(src, rank, scheme, values, scales, "fp8e4m3")
        d, scale = shards(dst, rank, scheme, values, scales, "fp8e4m3")
        if d is not None:
            d.zero_()
            scale.zero_()
        s_scale = kw.pop("src_scale", s_scale)
        with pytest.raises(reshard.ReshardError) as e:
            rt.reshard_many_(
                {name: (s, d, src, dst)}, quant=scheme, scales={name: scale}, src_scales={name: s_scale}, **kw
            )
        assert d is None or (not d.view(torch.uint8).any() and not scale.any()), "something moved"
        return str(e.value)

    cut = "cuts a quantization block of 8x16 (boundaries must be multiples of the block size)"
    assert attempt(cut_rows, dst).startswith(f"w: src: a shard boundary at 6 along dim 0 {cut}")
    assert attempt(whole_rows, cut_cols, "b").startswith(f"b: dst: a shard boundary at 8 along dim 1 {cut}")
    # reshard_ names no tensor: the core's word for it stays
    s, s_scale = shards(cut_rows, rank, scheme, values, scales, "fp8e4m3")
    on_3 = layout(shape, "fp8e4m3", (1,), [3], ["R"])
    d = torch.zeros(shape, dtype=torch.float8_e4m3fn) if rank == 3 else None
    with pytest.raises(reshard.ReshardError, match=r"^tensor: src: a shard boundary at 6 along dim 0"):
        scale = rt.scale_tensor(on_3, rank, scheme)
        rt.reshard_(s, d, cut_rows, on_3, quant=scheme, scale=scale, src_scale=s_scale)
    # rank 0 gives a scale shard of the wrong shape: every rank hears of it
    wrong = torch.zeros(3, 3) if rank == 0 else None
    message = attempt(whole_rows, dst, src_scale=wrong) if rank == 0 else attempt(whole_rows, dst)
    if rank == 0:
        assert message.startswith("w: src_scale: rank 0 holds a shard of shape (2, 2) (f32)"), message
    else:
        assert message.startswith("nothing was moved: rank 0: w: src_scale:"), message
    # different fp8 formats on the two sides are no already-quantized move
    e5 = layout(shape, "fp8e5m2", (2,), [1, 0], ["S(1)"])
    s, s_scale = shards(whole_rows, rank, scheme, values, scales, "fp8e4m3")
    d = None if e5.local_region(rank) is None else torch.zeros(e5.local_shape(rank), dtype=torch.float8_e5m2)
    with pytest.raises(reshard.ReshardError, match="tensor: .*fp8e4m3.*fp8e5m2"):
        scale = rt.scale_tensor(e5, rank, scheme)
        rt.reshard_(s, d, whole_rows, e5, quant=scheme, scale=scale, src_scale=s_scale)
    # source scales for a source that is quantized in flight: every rank hears of it
    bf16 = layout(shape, "bf16", (1,), [0], ["R"])
    bf16_local = torch.zeros(shape, dtype=torch.bfloat16) if rank == 0 else None
    d = dst.local_shape(rank)
    d = None if d is None else torch.zeros(d, dtype=torch.float8_e4m3fn)
    with pytest.raises(reshard.ReshardError) as e:
        rt.reshard_(
            bf16_local,
            d,
            bf16,
            dst,
            quant=scheme,
            scale=rt.scale_tensor(dst, rank, scheme),
            src_scale=torch.zeros(2, 2) if rank == 0 else None,
        )
    message = (
        "src_scale: given for a bf16 source; only an fp8 source (already quantized) comes with its scales"
    )
    assert str(e.value) == (message if rank == 0 else f"nothing was moved: rank 0: {message}"), str(e.value)
    with pytest.raises(reshard.ReshardError, match="src_scale: given only with quant"):
        rt.reshard_many_({}, src_scales={"w": None})
    # the group still works afterwards
    s, s_scale = shards(whole_rows, rank, scheme, values, scales, "fp8e4m3")
    want, want_scale = shards(dst, rank, scheme, values, scales, "fp8e4m3")
    d = None if want is None else torch.zeros_like(want)
    scale = rt.scale_tensor(dst, rank, scheme)
    rt.reshard_(s, d, whole_rows, dst, quant=scheme, scale=scale, src_scale=s_scale)
    if want is not None:
        assert torch.equal(d.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_refusals_name_the_tensor_side_dim_boundary_and_block():
    run_ranks(refusals, 4)
