"""One delta codec: the torch path (run here on CPU tensors, as it runs on a GPU) and the
core's kernels (reshard._core.delta_encode / delta_apply / delta_written) write the same bytes
for the same regions, and each applies the other's messages to the exact new values; random
regions (N-D, strided and transposed views), element sizes 1, 2, 4 and 8, and densities of
change from nothing to everything."""

import random

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
from reshard import _core  # noqa: E402
from reshard.delta import codec  # noqa: E402

# elements of 1, 2, 4 and 8 bytes
DTYPES = [torch.uint8, torch.bool, torch.bfloat16, torch.int16, torch.float32, torch.int32, torch.float64]
DTYPES += [torch.int64]
# nothing, a few elements, about 1%, about half, everything
DENSITIES = [0.0, "few", 0.01, 0.5, 1.0]


def random_values(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def changed_values(old, density, gen):
    """``old`` with a share ``density`` of its elements changed in their bits ("few": three)."""
    new = old.clone()
    n = old.numel()
    if density == "few":
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[torch.randperm(n, generator=gen)[:3]] = True
    else:
        chosen = torch.rand(n, generator=gen) < density
        if density == 1.0:
            chosen[:] = True
    flat = new.view(-1)
    if old.dtype == torch.bool:
        flat[chosen] = ~flat[chosen]
    else:
        codec.bits(flat)[chosen] += 1
    return new, int(chosen.sum())


def random_view(rng, gen, numel, dtype):
    """A region of about ``numel`` elements as a view of a larger tensor: a box of it (a slice),
    a box with steps, or a transposed box, of 1 to 4 dims. Returns (holder, view function)."""
    ndim = rng.randint(1, 4)
    shape = [1] * ndim
    left = numel
    for d in range(ndim):
        shape[d] = max(1, round(left ** (1 / (ndim - d)) * rng.uniform(0.5, 1.5)))
        left = max(1, left // shape[d])
    margin = [rng.randint(0, 3) for _ in range(ndim)]
    kind = rng.choice(["box", "box", "steps", "transposed", "contiguous"])
    step = [rng.choice([1, 2]) if kind == "steps" else 1 for _ in range(ndim)]
    outer = [s * st + m for s, st, m in zip(shape, step, margin)]
    if kind == "contiguous":
        outer = list(shape)
    holder = random_values(outer, dtype, gen)
    offset = [rng.randint(0, o - s * st) for o, s, st in zip(outer, shape, step)]

    def view(t):
        v = t[tuple(slice(o, o + s * st, st) for o, s, st in zip(offset, shape, step))]
        if kind == "transposed" and ndim > 1:
            v = v.transpose(0, ndim - 1)
        return v

    return holder, view


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(codec.bits(codec.flat(a)), codec.bits(codec.flat(b)))


def case(seed):
    """A message's worth of regions: each a source view holding the new values, its base (a
    contiguous stream, or a view of the caller's previous tensor) and a destination view
    holding the base inside a larger tensor."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    regions = []
    for _ in range(rng.randint(1, 4)):
        dtype = rng.choice(DTYPES)
        numel = rng.choice([1, 7, 100, 4095, 4096, 4097, rng.randint(1, 30000)])
        holder, view = random_view(rng, gen, numel, dtype)
        old = view(holder).clone(memory_format=torch.contiguous_format)
        new_values, changed = changed_values(old, rng.choice(DENSITIES), gen)
        view(holder).copy_(new_values)
        previous = None
        if rng.random() < 0.5:  # the caller's previous tensor, the base a view of it
            previous = random_values(holder.shape, dtype, gen)
            view(previous).copy_(old)
        dst, dst_view = destination(rng, gen, old)
        regions.append(
            dict(holder=holder, src=view(holder), old=old, new=new_values, changed=changed, view=view)
            | dict(previous=previous, dst=dst, dst_view=dst_view)
        )
    return regions


def destination(rng, gen, old):
    """A tensor holding the region's base somewhere in it, another layout than the source's:
    a slice of a larger tensor, a tensor of its own, or one stored column-major."""
    shape = list(old.shape)
    kind = rng.choice(["slice", "own", "column-major"])
    if kind == "slice":
        holder = random_values([s + 2 for s in shape], old.dtype, gen)

        def view(t):
            return t[tuple(slice(1, 1 + s) for s in shape)]

    elif kind == "own":
        holder = random_values(shape, old.dtype, gen)

        def view(t):
            return t

    else:
        holder = random_values(shape[::-1], old.dtype, gen)

        def view(t):
            return t.permute(*reversed(range(len(shape))))

    view(holder).copy_(old)
    return holder, view


def outgoing(regions, keep):
    """The regions to encode, with copies of their bases (each path updates its own), and
    with ``keep`` a stream per region that takes the new values (the base itself where the
    base is one)."""
    out = []
    for r in regions:
        if r["previous"] is None:
            base = r["old"].reshape(-1).clone()
            k = base if keep else None
        else:
            base = r["view"](r["previous"].clone())
            k = torch.empty(r["new"].numel(), dtype=r["new"].dtype) if keep else None
        out.append(codec.Outgoing(r["src"], base, k))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_both_paths_write_the_same_message_and_apply_each_others(seed):
    regions = case(seed)
    checksum = seed % 3 == 0
    keep = seed % 2 == 0
    sent = {}
    for torch_ops in (False, True):
        out = outgoing(regions, keep)
        [(message, summary)] = codec.encode_messages([out], checksum, torch_ops=torch_ops)
        sent[torch_ops] = (message, summary)
        for r, o, e in zip(regions, out, summary):
            # the bases the caller keeps took the new values; a base of its own did not
            if o.keep is not None:
                assert bits_equal(o.keep.view(r["new"].shape), r["new"])
            else:
                assert bits_equal(o.base.reshape(r["old"].shape), r["old"])
            assert e.changed == r["changed"]
            assert sum(e.blocks) == (r["new"].numel() + 4095) // 4096
    (rust, rust_summary), (ops, ops_summary) = sent[False], sent[True]
    assert rust_summary == ops_summary
    assert torch.equal(rust, ops), (rust.numel(), ops.numel())
    unchanged = all(r["changed"] == 0 for r in regions)
    assert codec.says_nothing(rust_summary, checksum) == (unchanged and not checksum)
    sizes = [r["new"].numel() * r["new"].element_size() for r in regions]
    assert codec.message_length(rust) == rust.numel() <= codec.largest(sizes, checksum)
    # a message lands in a buffer of the largest size it can have, or alone; one that says
    # nothing need not be sent at all
    roomy = torch.full((codec.largest(sizes, checksum) + 24,), 7, dtype=torch.uint8)
    roomy[: rust.numel()] = rust
    arrivals = [rust, ops, roomy] + ([None] if codec.says_nothing(rust_summary, checksum) else [])
    for message in arrivals:
        for torch_ops in (False, True):
            dsts = [r["dst"].clone() for r in regions]
            views = [(r["dst_view"](d), f"region {i}") for i, (r, d) in enumerate(zip(regions, dsts))]
            [applied] = codec.apply_messages([(message, "test", views)], checksum, torch_ops=torch_ops)
            for r, d, a in zip(regions, dsts, applied):
                want = r["dst"].clone()
                r["dst_view"](want).copy_(r["new"])
                assert bits_equal(d, want)  # the region's new values, nothing else touched
                if checksum:
                    assert a.crc == a.sent_crc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", DENSITIES)
def test_one_region_at_every_density(dtype, density):
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    for numel in [1, 4096, 3 * 4096 + 17, 50000]:
        holder, view = random_view(rng, gen, numel, dtype)
        old = view(holder).clone(memory_format=torch.contiguous_format)
        new, changed = changed_values(old, density, gen)
        view(holder).copy_(new)
        a = codec.encode(view(holder), old.reshape(-1), torch_ops=False)
        b = codec.encode(view(holder), old.reshape(-1), torch_ops=True)
        assert (a.mode, a.blocks, a.changed, a.nbytes) == (b.mode, b.blocks, b.changed, b.nbytes)
        assert a.changed == changed
        assert all(torch.equal(x, y) for x, y in zip(a.sections, b.sections))
        if changed == 0:
            assert a.mode == codec.REGION_UNCHANGED and a.nbytes == 0
        elif a.mode == codec.REGION_BLOCKS:
            # the core's encoding, smaller than the values: its header says so
            length = int(a.sections[0][:8].view(torch.int64)[0])
            assert length < old.numel() * old.element_size()
            assert a.sections[0][8:10].tolist() == [1, old.element_size()]
        for torch_ops in (False, True):
            out = old.clone()
            buffer = a.sections[0] if a.sections else torch.empty(0, dtype=torch.uint8)
            codec.decode(codec.Reader(buffer, "test"), a.mode, out, "test", torch_ops=torch_ops)
            assert bits_equal(out, new)


def test_blocks_take_the_cores_encoding_by_its_rule():
    # 4096 bf16 elements: offsets cost 4 bytes a change, a bitmask 512 bytes + 2 a change
    base = torch.zeros(4096 * 6, dtype=torch.bfloat16)
    new = base.clone()
    gen = torch.Generator().manual_seed(3)
    for block, changed in enumerate([0, 1, 255, 257, 3800, 3900]):
        picked = torch.randperm(4096, generator=gen)[:changed] + 4096 * block
        codec.bits(new)[picked] += 1
    for torch_ops in (False, True):
        encoded = codec.encode(new, base, torch_ops=torch_ops)
        # unchanged, offsets, offsets, bitmask, bitmask, dense
        assert encoded.blocks == [1, 2, 2, 1], encoded.blocks
        body = encoded.sections[0][8 + codec.HEADER_BYTES :]
        assert body[0] == codec.UNCHANGED and body[1] == codec.OFFSETS
        # offsets: u16 count 1, the offset, the value
        assert body[2:4].tolist() == [1, 0]


def test_the_kernels_refuse_what_they_cannot_do_and_write_nothing():
    base = torch.arange(10000, dtype=torch.float32)
    new = base.clone()
    new[::97] += 1
    out = torch.zeros(100000, dtype=torch.uint8)
    nbytes, blocks, changed = _core.delta_encode(new, base.clone(), out)
    assert changed == len(range(0, 10000, 97)) and sum(blocks) == 3
    dst = base.clone()
    # cut, flipped, another element size: refused, the destination as it was
    with pytest.raises(reshard.ReshardError, match="delta: truncated"):
        _core.delta_apply(out, dst, 0, nbytes - 1)
    with pytest.raises(reshard.ReshardError, match="has bytes after the last block"):
        _core.delta_apply(out, dst, 0, nbytes + 1)
    with pytest.raises(reshard.ReshardError, match="elements are of 4 bytes, the region's of 8"):
        _core.delta_apply(out, dst.double(), 0, nbytes)
    bad = out.clone()
    bad[codec.HEADER_BYTES] = 9  # the first block's tag
    with pytest.raises(reshard.ReshardError, match="unknown tag 9"):
        _core.delta_apply(bad, dst, 0, nbytes)
    assert torch.equal(dst, base)
    _core.delta_apply(out, dst, 0, nbytes)
    assert torch.equal(dst, new)
    # too little room for the largest encoding, a tensor on another device, shared memory
    kept = base.clone()
    with pytest.raises(reshard.ReshardError, match="out: bytes 0..40021 lie outside its 40000 bytes"):
        _core.delta_encode(new, kept, torch.empty(40000, dtype=torch.uint8))
    assert torch.equal(kept, base)
    with pytest.raises(reshard.ReshardError, match="the tensor is on meta"):
        _core.delta_encode(new.to("meta"), kept, out)
    with pytest.raises(reshard.ReshardError, match="shares memory"):
        _core.delta_encode(new, new[:], out)
    with pytest.raises(reshard.ReshardError, match="expected 10000 elements of 4 bytes"):
        _core.delta_encode(new, kept[1:], out)
    with pytest.raises(reshard.ReshardError, match="contiguous 1-D torch.uint8"):
        _core.delta_encode(new, kept, out.view(torch.int32))
    with pytest.raises(reshard.ReshardError, match="dim 0 has stride 0"):
        _core.delta_apply(out, torch.zeros(1).expand(10000), 0, nbytes)


def test_what_an_encoding_writes_lands_through_any_strides():
    gen = torch.Generator().manual_seed(9)
    holder = torch.randn(40, 300, generator=gen)
    view = holder[3:37, 10:290].t()  # transposed: offsets through its strides
    old = view.clone(memory_format=torch.contiguous_format)
    new, _ = changed_values(old, 0.02, gen)
    out = torch.empty(200000, dtype=torch.uint8)
    nbytes, _, changed = _core.delta_encode(new, old.reshape(-1).clone(), out)
    shape, strides = list(view.shape), list(view.stride())
    offsets, values, (_, _, written) = _core.delta_written(out, shape, strides, 4, 0, nbytes)
    assert written == changed
    index = torch.frombuffer(offsets, dtype=torch.int64)
    storage = view.as_strided((int(index.max()) + 1,), (1,))
    storage[index] = torch.frombuffer(values, dtype=torch.float32)
    assert bits_equal(view, new)


def test_a_message_cut_short_is_refused_by_both_paths():
    base = torch.zeros(10000, dtype=torch.float32)
    new = base.clone()
    codec.bits(new)[::7] += 1
    out = [codec.Outgoing(new, base.clone())]
    [(message, _)] = codec.encode_messages([out], False)
    # the message says it is longer than what arrived, or its region's encoding runs past
    # the length it says
    short = message.clone()
    short[:8].view(torch.int64)[0] = message.numel() - 100
    for torch_ops in (False, True):
        dst = base.clone()
        with pytest.raises(reshard.ReshardError, match=f"says it has {message.numel()} bytes, but"):
            codec.apply_messages([(message[:-100], "cut", [(dst, "r")])], False, torch_ops=torch_ops)
        with pytest.raises(reshard.ReshardError, match="the message ends at byte"):
            codec.apply_messages([(short, "cut", [(dst, "r")])], False, torch_ops=torch_ops)
        assert torch.equal(dst, base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gpu_writes_the_cores_bytes():
    for seed in range(12):
        regions = case(seed)
        checksum = seed % 2 == 0
        cpu = outgoing(regions, keep=True)
        [(rust, rust_summary)] = codec.encode_messages([cpu], checksum)
        gpu = []
        for r in regions:
            if r["previous"] is None:
                base = r["old"].reshape(-1).cuda()
                keep = base
            else:
                base = r["view"](r["previous"].cuda())
                keep = torch.empty(r["new"].numel(), dtype=r["new"].dtype, device="cuda")
            gpu.append(codec.Outgoing(r["view"](r["holder"].cuda()), base, keep))
        [(ops, ops_summary)] = codec.encode_messages([gpu], checksum)
        assert ops_summary == rust_summary
        assert torch.equal(rust, ops.cpu())
        for r, o in zip(regions, gpu):
            assert bits_equal(o.keep.cpu().view(r["new"].shape), r["new"])
        dsts = [r["dst"].cuda() for r in regions]
        views = [(r["dst_view"](d), f"region {i}") for i, (r, d) in enumerate(zip(regions, dsts))]
        [applied] = codec.apply_messages([(rust.cuda(), "test", views)], checksum)
        for r, d, a in zip(regions, dsts, applied):
            want = r["dst"].clone()
            r["dst_view"](want).copy_(r["new"])
            assert bits_equal(d.cpu(), want)
            assert a.crc == a.sent_crc or not checksum
