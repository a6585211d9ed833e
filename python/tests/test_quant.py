"""Quantizing in flight (``reshard_(..., quant=...)``) over gloo processes, compared bit for
bit with a torch implementation of each scheme written here: the whole tensor quantized
naively, then sliced to each destination rank's shard and scale shard."""

import random

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import reshard  # noqa: E402
import reshard.quant.inflight as tq  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402

FP8 = {"fp8e4m3": (torch.float8_e4m3fn, 448.0, 8), "fp8e5m2": (torch.float8_e5m2, 57344.0, 15)}
SRC = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def block_shape(scheme, shape):
    """The block of each dim, as the issue defines the schemes."""
    n = len(shape)
    if scheme.startswith("block:"):
        r, c = (int(x) for x in scheme.split(":")[1].split("x"))
        return [1] * (n - 2) + [r, c]
    if scheme == "mx:32":
        return [1] * (n - 1) + [32]
    if scheme == "channel":
        return [1] * (n - 1) + [shape[-1]]
    assert scheme == "tensor"
    return list(shape)


def log2_floor(t):
    """floor(log2(t)) of positive finite f32 values, exactly (frexp: t = m 2^e, m in [0.5, 1))."""
    _, e = torch.frexp(t)
    return e.to(torch.int64) - 1


def log2_ceil(t):
    m, e = torch.frexp(t)
    return torch.where(m == 0.5, e - 1, e).to(torch.int64)


def pow2(e):
    """2^e as f32 for integer tensors e in [-127, 127]."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e).to(torch.float32)


def reference(x, scheme, fp8, scale_dtype=None):
    """``x`` (any float dtype) quantized as ``scheme`` into ``fp8``: the fp8 values (as
    uint8) and the scale tensor (f32 or uint8 biased exponents), computed in f32 on the
    whole tensor."""
    torch_fp8, fmax, emax = FP8[fp8]
    x = x.to(torch.float32)
    shape = list(x.shape)
    block = block_shape(scheme, shape)
    grid = [-(-n // b) for n, b in zip(shape, block)]
    # pad every dim to whole blocks with zeros (they change no amax), then one axis per block
    padded = torch.zeros([g * b for g, b in zip(grid, block)], dtype=torch.float32)
    padded[tuple(slice(0, n) for n in shape)] = x
    view = padded.reshape([v for g, b in zip(grid, block) for v in (g, b)])
    inner = tuple(range(1, 2 * len(shape), 2))
    amax = view.abs().amax(dim=inner) if shape else padded.abs()
    ue8m0 = scheme.endswith(":ue8m0")
    # IEEE f32 division of tensor by tensor: torch divides by a Python number as a
    # multiplication by its reciprocal, which rounds differently
    fm = torch.full_like(amax, fmax)
    if scheme == "mx:32":
        e = torch.where(amax == 0, torch.full_like(amax, -127, dtype=torch.int64), log2_floor(amax) - emax)
        e = e.clamp(-127, 127)
        mult, scale, code = pow2(-e), pow2(e), (e + 127).to(torch.uint8)
    elif ue8m0:
        a = amax.clamp(min=1e-4)
        e = log2_ceil(a / fm)
        mult, scale, code = pow2(-e), pow2(e), (e + 127).to(torch.uint8)
    else:
        a = amax.clamp(min=torch.tensor(1e-4, dtype=torch.float32))
        mult, scale, code = fm / a, a / fm, None
    # every element's multiplier: the block's, repeated over the block, cut to the shape
    full = mult
    for d, b in enumerate(block):
        full = full.repeat_interleave(b, dim=d)
    full = full[tuple(slice(0, n) for n in shape)]
    q = (x * full).clamp(-fmax, fmax).to(torch_fp8).view(torch.uint8)
    if scale_dtype == "e8m0" or scheme == "mx:32":
        return q, code
    return q, scale


def varied(shape, dtype, seed):
    """Finite values of varied magnitude: normal values times a per-row power of two in
    2^-8..2^8, with all-zero rows and rows of tiny values near 2^-20, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if len(shape) >= 1 and x.numel():
        rows = x.reshape(-1, shape[-1])
        exps = torch.randint(-8, 9, (rows.shape[0], 1), generator=g).to(torch.float32)
        rows *= torch.pow(2.0, exps)
        for i in range(rows.shape[0]):
            k = (i * 7 + seed) % 11
            if k == 0:
                rows[i] = 0
            elif k == 1:
                rows[i] *= 2.0**-20
    return x.to(dtype)


def blocks_touching(offset, extent, block):
    if 0 in extent:
        return tuple(slice(0, 0) for _ in block)  # an empty shard holds no scale
    return tuple(slice(o // b, -(-(o + n) // b)) for o, n, b in zip(offset, extent, block))


def check_case(rank, case, src_local_of, scale_dtype=None, checksum=False):
    """Runs one reshard on every rank and compares this rank's shard and scales."""
    shape, src_dtype, fp8, scheme, src, dst, seed = case
    full = varied(shape, SRC[src_dtype], seed)
    s = rt.local_tensor(src, rank, full)
    s = None if s is None else src_local_of(s)
    region = dst.local_region(rank)
    d = None if region is None else torch.zeros(region[1], dtype=FP8[fp8][0])
    scale = rt.scale_tensor(dst, rank, scheme, scale_dtype)
    rt.reshard_(s, d, src, dst, quant=scheme, scale=scale, scale_dtype=scale_dtype, checksum=checksum)
    if region is None:
        assert scale is None
        return 0
    q, want_scale = reference(full, scheme, fp8, scale_dtype)
    offset, extent = region
    want = q[tuple(slice(o, o + n) for o, n in zip(offset, extent))]
    got = d.view(torch.uint8)
    assert torch.equal(got, want), (case, rank, (got != want).nonzero()[:4].tolist())
    blocks = blocks_touching(offset, extent, block_shape(scheme, shape))
    assert tuple(scale.shape) == tuple(reshard.quant_scale_shape(dst, rank, scheme))
    ws = want_scale[blocks]
    if ws.dtype == torch.float32:
        # bit for bit: compare the patterns
        assert torch.equal(scale.view(torch.int32), ws.contiguous().view(torch.int32)), (case, rank)
    else:
        assert torch.equal(scale, ws), (case, rank)
    return got.numel()


def layout(shape, dtype, mesh, ranks, placements):
    return reshard.Layout(shape, dtype, mesh, ranks, placements)


def fixed_cases(world):
    """Blocks that straddle uneven source shards, partial last blocks, zero blocks, every
    scheme, both fp8 formats, f32/bf16/f16 sources."""
    cases = []
    every = list(range(world))
    for i, (scheme, shape, src_pl, dst_pl, dst_mesh) in enumerate(
        [
            # 3 uneven row shards of 37 rows cut the 8-row blocks; columns split on blocks
            ("block:8x16", (37, 64), ["S(0)"], ["S(1)"], (2,)),
            ("block:8x16:ue8m0", (37, 64), ["S(0)"], ["S(1)"], (2,)),
            ("block:128x128", (256, 384), ["S(1)"], ["S(0)"], (2,)),
            ("mx:32", (13, 96), ["S(1)"], ["S(1)"], (3,)),
            ("channel", (21, 40), ["S(1)"], ["S(1)"], (2,)),
            ("channel", (21, 40), ["S(0)"], ["S(0)"], (3,)),
            ("tensor", (19, 10), ["S(0)"], ["S(1)"], (2,)),
            ("block:4x4", (3, 12, 8), ["S(1)"], ["S(0)"], (3,)),
        ]
    ):
        n = 1
        for m in dst_mesh:
            n *= m
        src = layout(shape, "f32", (3,), range(3), src_pl)
        for j, (src_dtype, fp8) in enumerate([("f32", "fp8e4m3"), ("bf16", "fp8e5m2"), ("f16", "fp8e4m3")]):
            src = layout(shape, src_dtype, (3,), [0, 1, 2], src_pl)
            first = (i + j) % (world - n + 1)
            dst = layout(shape, fp8, dst_mesh, every[first : first + n], dst_pl)
            cases.append((shape, src_dtype, fp8, scheme, src, dst, 100 * i + j))
    return cases


def use_native(rank, native):
    """The Rust kernels (True), torch operations (False, the path of tensors on a GPU), or
    ("mixed") the one on even ranks and the other on odd ranks: the same bytes on the wire."""
    rt._NATIVE = native if native != "mixed" else rank % 2 == 0


def fixed(rank, world, native=True, checksum=False):
    use_native(rank, native)
    compared = 0
    for case in fixed_cases(world):
        compared += check_case(rank, case, lambda s: s.clone(), checksum=checksum)
    assert compared > 0
    rt._NATIVE = True


def test_every_scheme_bit_for_bit():
    run_ranks(fixed, 4)


def test_every_scheme_bit_for_bit_with_torch_ops():
    run_ranks(fixed, 4, False)


def test_rust_kernels_and_torch_ops_agree_on_the_wire():
    run_ranks(fixed, 4, "mixed", True)


def corrupted(rank, world):
    """Under ``checksum=True``, a byte changed on the way is refused, naming what it hit:
    the fp8 values of a transfer or the scales a message carries (its receiver raises before
    it unpacks anything), or a partial amax (every rank raises before any value moves)."""
    use_native(rank, "mixed")
    shape = (16, 32)
    full = varied(shape, torch.bfloat16, 21)
    # rows 0..6, 6..12, 12..16: both row blocks of 8 straddle two source shards
    src = layout(shape, "bf16", (3,), [0, 1, 2], ["S(0)"])
    dst = layout(shape, "fp8e4m3", (1,), [3], ["R"])
    s = rt.local_tensor(src, rank, full)
    s = None if s is None else s.clone()
    d = torch.zeros(shape, dtype=torch.float8_e4m3fn) if rank == 3 else None
    scale = rt.scale_tensor(dst, rank, "block:8x16")
    q, want_scale = reference(full, "block:8x16", "fp8e4m3")

    def go():
        rt.reshard_(s, d, src, dst, quant="block:8x16", scale=scale, checksum=True)

    seal = tq._seal

    def flip(which):
        """Rank 0's message to rank 3 holds its transfer's values, then its scales; a
        partial amax message ends at its sum (one span from 0)."""

        def corrupt(buffer, at, spans):
            seal(buffer, at, spans)
            amax = spans == [(0, at)]
            if which == "amax" and amax and not flipped:
                buffer[1] ^= 0x40
                flipped.append(1)
            elif which in ("values", "scales") and not amax:
                buffer[spans[0 if which == "values" else 1][0] + 1] ^= 0x40

        flipped = []
        return corrupt

    go()
    if rank == 3:
        assert torch.equal(d.view(torch.uint8), q) and torch.equal(scale, want_scale)
    for which, sender, message in [
        ("values", 0, "the transfer from rank 0 to rank 3 at offset [0, 0] extent 6x32"),
        ("scales", 0, "the scales from rank 0 to rank 3 of blocks at offset [0, 0] extent 1x2"),
    ]:
        if rank == sender:
            tq._seal = flip(which)
        if rank == 3:
            d.zero_()
            scale.zero_()
            with pytest.raises(reshard.ReshardError) as e:
                go()
            want = f"rank 3: checksum mismatch in {message}: sent with crc32c 0x"
            assert str(e.value).startswith(want), str(e.value)
            assert not d.view(torch.uint8).any() and not scale.any(), "something was unpacked"
        else:
            go()
        tq._seal = seal
    # rank 1's partial amax of the first row of blocks, to rank 0, changed: nobody moves
    if rank == 1:
        tq._seal = flip("amax")
    message = (
        "checksum mismatch in the partial amax from rank 1 to rank 0 of blocks at offset [0, 0] extent 1x2"
    )
    with pytest.raises(reshard.ReshardError) as e:
        go()
    tq._seal = seal
    want = message if rank == 0 else f"nothing was moved: rank 0: {message}"
    assert str(e.value).startswith(want), str(e.value)
    if rank == 3:
        assert not d.view(torch.uint8).any()
    # the group still works afterwards
    go()
    if rank == 3:
        assert torch.equal(d.view(torch.uint8), q) and torch.equal(scale, want_scale)
    rt._NATIVE = True


def test_checksums_name_a_changed_transfer_scale_or_amax():
    run_ranks(corrupted, 4)


def random_cases(seed, count, world):
    rng = random.Random(seed)
    out = []
    for k in range(count):
        scheme = rng.choice(["block:2x4", "block:4x2:ue8m0", "block:3x5", "mx:32", "channel", "tensor"])
        ndim = rng.choice([2, 2, 3])
        dst_mesh = rng.choice([(1,), (2,), (2, 2), (4,)])
        k_dst = 1
        for m in dst_mesh:
            k_dst *= m
        # dims whose destination chunks land on block boundaries: multiples of block * 4
        shape = [rng.randint(1, 3) for _ in range(ndim - 2)]
        base = block_shape(scheme, shape + [1, 1])
        if scheme == "mx:32":
            shape += [4 * rng.randint(1, 3), 32 * 4 * rng.randint(1, 2) // rng.choice([1, 2, 4])]
        elif scheme in ("channel", "tensor"):
            shape += [rng.randint(1, 17), rng.randint(1, 19)]
        else:
            r, c = base[-2], base[-1]
            shape += [r * 4 * rng.randint(1, 3), c * 4 * rng.randint(1, 2)]
        dst_pl = []
        for _ in dst_mesh:
            choice = rng.choice(["R", "S(0)", f"S({ndim - 2})", f"S({ndim - 1})"])
            dst_pl.append(choice)
        if scheme == "tensor" or (scheme == "channel"):
            pass  # any split: per-channel and per-tensor scales are replicated where cut
        src_mesh = rng.choice([(1,), (2,), (3,), (2, 2), (4,)])
        src_pl = [rng.choice(["R", "S(0)", f"S({ndim - 1})", f"S({ndim - 2})"]) for _ in src_mesh]
        n_src = 1
        for m in src_mesh:
            n_src *= m
        src_ranks = rng.sample(range(world), n_src)
        dst_ranks = rng.sample(range(world), k_dst)
        src_dtype = rng.choice(list(SRC))
        fp8 = rng.choice(list(FP8))
        try:
            src = layout(shape, src_dtype, src_mesh, src_ranks, src_pl)
            dst = layout(shape, fp8, dst_mesh, dst_ranks, dst_pl)
            reshard._core.QuantPacking(src, dst, 0, scheme)
        except reshard.ReshardError:
            continue  # a destination that cuts a block: the error test covers it
        out.append((tuple(shape), src_dtype, fp8, scheme, src, dst, 1000 + k))
    return out


def randomized(rank, world, native=True):
    use_native(rank, native)
    compared = 0
    cases = random_cases(7, 60, world)
    assert len(cases) >= 20
    for case in cases:
        # transposed-then-back sources are not contiguous: packed from a contiguous copy
        compared += check_case(rank, case, lambda s: s.t().contiguous().t() if s.dim() == 2 else s.clone())
    assert compared > 0
    rt._NATIVE = True


def test_random_layouts_bit_for_bit():
    run_ranks(randomized, 4)


def test_random_layouts_bit_for_bit_with_torch_ops():
    run_ranks(randomized, 4, False)


def e8m0_scales(rank, world, native=True):
    use_native(rank, native)
    src = layout((16, 64), "bf16", (2,), [0, 1], ["S(1)"])
    dst = layout((16, 64), "fp8e4m3", (2,), [1, 0], ["S(0)"])
    case = ((16, 64), "bf16", "fp8e4m3", "block:8x32:ue8m0", src, dst, 5)
    assert check_case(rank, case, lambda s: s.clone(), scale_dtype="e8m0") > 0
    assert reshard.quant_scale_dtype("block:8x32:ue8m0", "e8m0") == "e8m0"
    assert reshard.quant_scale_dtype("mx:32") == "e8m0"
    assert reshard.quant_scale_dtype("channel") == "f32"


@pytest.mark.parametrize("native", [True, False])
def test_ue8m0_scales_as_biased_exponents(native):
    run_ranks(e8m0_scales, 2, native)


def errors(rank, world, native=True):
    use_native(rank, native)
    src = layout((16, 16), "bf16", (2,), [0, 1], ["S(0)"])
    dst = layout((16, 16), "fp8e4m3", (2,), [0, 1], ["S(1)"])
    s = torch.ones(8, 16, dtype=torch.bfloat16)
    d = torch.zeros(16, 8, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(2, 1)

    def raises(match, **kw):
        with pytest.raises(reshard.ReshardError, match=match):
            rt.reshard_(kw.pop("s", s), kw.pop("d", d), kw.pop("src", src), kw.pop("dst", dst), **kw)

    raises("quant: block:8 is invalid: block size `8` is not RxC", quant="block:8", scale=scale)
    bf16 = layout((16, 16), "bf16", (2,), [0, 1], ["S(1)"])
    raises(
        "quant channel: the destination dtype is bf16",
        quant="channel",
        dst=bf16,
        d=d.to(torch.bfloat16),
        scale=scale,
    )
    cut = layout((16, 16), "fp8e4m3", (2,), [0, 1], ["S(1)"])
    raises(
        "dst: a shard boundary at 8 along dim 1 cuts a quantization block of 16x16",
        quant="block:16x16",
        dst=cut,
        scale=torch.zeros(1, 1),
    )
    raises(
        "scale: rank .* holds a scale shard of shape \\(2, 1\\)", quant="block:8x8", scale=torch.zeros(2, 2)
    )
    raises(
        "scale_dtype e8m0: quant block:8x8 has scales that are not powers of two",
        quant="block:8x8",
        scale=scale,
        scale_dtype="e8m0",
    )
    raises("scale is on meta but src_local on cpu", quant="block:8x8", scale=torch.zeros(2, 1, device="meta"))
    with pytest.raises(reshard.ReshardError, match="scale, scale_dtype: given only with quant"):
        rt.reshard_(s, torch.zeros(16, 8, dtype=torch.bfloat16), src, bf16, scale=scale)
    # a NaN on rank 1 fails every rank, naming the block, before any value moves
    bad = s.clone()
    if rank == 1:
        bad[3, 5] = float("nan")
    d.fill_(1.0)
    raises(
        r"(rank 1: )?src_local: block \[1, 0\] holds a non-finite value \(NaN\) at element \[11, 5\]",
        quant="block:8x8",
        s=bad,
        scale=torch.zeros(2, 1),
    )
    assert torch.all(d.view(torch.uint8) == torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8))
    # the group still works afterwards
    rt.reshard_(s, d, src, dst, quant="block:8x8", scale=scale)
    assert torch.all(d.to(torch.float32) == 448.0)
    assert torch.all(scale == 1.0 / 448.0)
    dist.barrier()


@pytest.mark.parametrize("native", [True, False])
def test_errors_name_the_field(native):
    run_ranks(errors, 2, native)


def test_scale_shape():
    dst = reshard.Layout((300, 256), "fp8e4m3", 2, [4, 5], [reshard.Shard(1)])
    assert reshard.quant_scale_shape(dst, 4, "block:128x128") == [3, 1]
    assert reshard.quant_scale_shape(dst, 0, "block:128x128") is None
    assert reshard.quant_scale_shape(dst, 5, "channel") == [300, 1]
    assert reshard.quant_scale_shape(dst, 5, "tensor") == [1, 1]
    assert reshard.quant_scale_shape(dst, 5, "mx:32") == [300, 4]
    with pytest.raises(reshard.ReshardError, match="quant"):
        reshard.quant_scale_shape(dst, 5, "block:0x2")
    assert rt.scale_tensor(dst, 5, "mx:32").dtype == torch.uint8
    assert rt.scale_tensor(dst, 5, "channel", device="meta").device.type == "meta"


def mixed_many(rank, world):
    """reshard_many_ with an fp8 destination quantized and a plain tensor beside it."""
    shape = (24, 32)
    full_w = varied(shape, torch.bfloat16, 11)
    full_n = varied((32,), torch.bfloat16, 12)
    w_src = layout(shape, "bf16", (3,), [0, 1, 2], ["S(0)"])
    w_dst = layout(shape, "fp8e4m3", (2,), [2, 3], ["S(1)"])
    n_src = layout((32,), "bf16", (2,), [0, 1], ["S(0)"])
    n_dst = layout((32,), "bf16", (2,), [2, 3], ["R"])

    def shard(lay, full, dtype=None):
        region = lay.local_region(rank)
        if region is None:
            return None
        if dtype is not None:
            return torch.zeros(region[1], dtype=dtype)
        return rt.local_tensor(lay, rank, full).clone()

    w = shard(w_dst, None, torch.float8_e4m3fn)
    n = shard(n_dst, None, torch.bfloat16)
    scale = rt.scale_tensor(w_dst, rank, "block:8x16")
    grouped = dict(quant=rt.Quant("block:8x16", scales={"w": scale}))
    flat = dict(quant="block:8x16", scales={"w": scale})  # the earlier spelling, folded in
    # a second call reuses what the first agreed on: the two spellings are one job
    for options in (grouped, flat, grouped):
        if rank in (2, 3):
            w.view(torch.uint8).zero_()
            n.zero_()
            scale.zero_()
        rt.reshard_many_(
            {
                "w": (shard(w_src, full_w), w, w_src, w_dst),
                "n": (shard(n_src, full_n), n, n_src, n_dst),
            },
            **options,
        )
        if rank in (2, 3):
            q, s = reference(full_w, "block:8x16", "fp8e4m3")
            offset, extent = w_dst.local_region(rank)
            assert torch.equal(w.view(torch.uint8), q[:, offset[1] : offset[1] + extent[1]])
            assert torch.equal(scale, s[:, offset[1] // 16 : (offset[1] + extent[1]) // 16])
            assert torch.equal(n, full_n)
    with pytest.raises(reshard.ReshardError, match="w: dst_layout: dtype fp8e4m3 needs quant"):
        rt.reshard_many_({"w": (shard(w_src, full_w), w, w_src, w_dst)})


def test_reshard_many_quantizes_fp8_destinations():
    run_ranks(mixed_many, 4)


TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def moe_refit(rank, world, config, native=True):
    use_native(rank, native)
    refit = reshard.Refit(config, train="tp=2", infer="tp=2", infer_quant="fp8-block:16x16")
    assert refit.quant == "block:16x16"
    base = refit.infer_base
    src, dst, want = {}, {}, {}
    fused = refit.fused(rank)
    scale_fused = refit.scale_fused(rank)
    members = {m for ms in fused.values() for m, *_ in ms}
    in_scale_buffers = {m for ms in scale_fused.values() for m, *_ in ms}
    for k, name in enumerate(refit.names):
        s_layout, d_layout = refit.layouts(name)
        full = varied(tuple(s_layout.shape), rt.torch_dtype(s_layout), 300 + k)
        if rank in s_layout.ranks:
            src[name] = rt.local_tensor(s_layout, rank, full).clone()
        if rank not in d_layout.ranks:
            continue
        if name in refit.scales:
            scale_name, scale_shape = refit.scales[name]
            q, s = reference(full, refit.quant, d_layout.dtype)
            offset, extent = d_layout.local_region(rank)
            blocks = blocks_touching(offset, extent, block_shape(refit.quant, list(d_layout.shape)))
            want[name] = (q[tuple(slice(o, o + e) for o, e in zip(offset, extent))], s[blocks])
            if name not in in_scale_buffers:
                dst[scale_name] = torch.zeros(tuple(reshard.quant_scale_shape(d_layout, rank, refit.quant)))
        else:
            want[name] = (rt.local_tensor(d_layout, rank, full), None)
        if name not in members:
            dst[name] = torch.zeros(d_layout.local_shape(rank), dtype=rt.torch_dtype(d_layout))
    for buffers, ms_of in ((fused, lambda n: refit.layouts(n)[1].local_shape(rank)), (scale_fused, None)):
        for buffer, ms in buffers.items():
            first = refit.layouts(ms[0][0])[1]
            dim = ms[0][1]
            if ms_of is not None:
                shape = list(first.local_shape(rank))
                dtype = rt.torch_dtype(first)
            else:
                shape = list(reshard.quant_scale_shape(first, rank, refit.quant))
                dtype = torch.float32
            shape[dim] = sum(e for *_, e in ms)
            dst[buffer] = torch.zeros(shape, dtype=dtype)
    if rank >= base:
        assert any(b.endswith("w13_weight_scale_inv") for b in scale_fused), scale_fused
        assert any(n.endswith("w2_weight_scale_inv") for n in dst), sorted(dst)

    # checksummed on the torch-operations path
    rt.reshard_many_(refit, src=src, dst=dst, checksum=not native)

    def got(name):
        for buffer, ms in fused.items():
            for m, dim, off, ext in ms:
                if m == name:
                    return dst[buffer].narrow(dim, off, ext)
        return dst[name]

    def got_scale(name):
        for buffer, ms in scale_fused.items():
            for m, dim, off, ext in ms:
                if m == name:
                    return dst[buffer].narrow(dim, off, ext)
        return dst[refit.scales[name][0]]

    for name, (values, scales) in want.items():
        g = got(name)
        if scales is None:
            assert torch.equal(g, values), name
        else:
            assert torch.equal(g.view(torch.uint8), values), name
            assert torch.equal(got_scale(name), scales), name
    if rank >= base:
        assert len(want) == len(refit.names)


@pytest.mark.parametrize("native", [True, False])
def test_moe_refit_into_fp8_with_scales(tmp_path, native):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MOE))
    run_ranks(moe_refit, 4, str(config), native)


def test_torch_ops_powers_and_logarithms_are_exact():
    """The device path's 2^e and log2 (from bit patterns) over every f32 power of two,
    subnormals included, and the values just above them."""
    import reshard.quant.ops as ops

    e = torch.arange(-149, 128)
    x = ops._pow2(e)
    assert torch.equal(x.to(torch.float64), torch.ldexp(torch.ones(len(e), dtype=torch.float64), e))
    floor, exact = ops._log2_parts(x)
    assert torch.equal(floor.to(torch.int64), e) and bool(exact.all())
    inner = x[1:-1]
    above = (inner.view(torch.int32) + 1).view(torch.float32)
    floor, exact = ops._log2_parts(above)
    assert torch.equal(floor.to(torch.int64), e[1:-1]) and not bool(exact.any())


def test_torch_ops_scales_at_the_extremes():
    """Block scales of the device path against the reference for amax 0, the smallest
    subnormal, the clamp at 1e-4, FMAX and just above, and the largest f32."""
    import reshard.quant.ops as ops

    tiny = torch.tensor(2.0**-149)
    values = [0.0, float(tiny), 1e-4, 0.99e-4, 1.5, 448.0, 449.0, 57344.0, 3.0e38, -2.5e-30, 2.0**-126]
    x32 = torch.zeros(len(values), 32)
    x32[:, 0] = torch.tensor(values)
    x32[:, 1] = torch.tensor(values) / 3
    # f64 sources round to f32 first, then multiply (values between two f32)
    x64 = x32.to(torch.float64) * (1 + 2.0**-30)
    for fp8, (x, dtype) in zip(list(FP8) * 2, [(x32, "f32"), (x32, "f32"), (x64, "f64"), (x64, "f64")]):
        for scheme in ["block:1x32", "block:1x32:ue8m0", "mx:32", "channel"]:
            src = layout(tuple(x.shape), dtype, (1,), [0], ["R"])
            dst = layout(tuple(x.shape), fp8, (1,), [0], ["R"])
            for scale_dtype in [None, "e8m0"] if scheme.endswith("ue8m0") else [None]:
                packing = reshard._core.QuantPacking(src, dst, 0, scheme, scale_dtype)
                source = ops.Source(packing, ([0, 0], list(x.shape)), x)
                source.merge([])
                q, want = reference(x, scheme, fp8, scale_dtype)
                got = source.stored
                if got.dtype == torch.float32:
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scheme, fp8)
                else:
                    assert torch.equal(got, want), (scheme, fp8, scale_dtype)
                got = source.quantized([0, 0], list(x.shape))
                assert torch.equal(got.view(torch.uint8), q), (scheme, fp8)
