"""Delta refit from Python (reshard.torch.DeltaSession): the block codec in torch ops, and
refits over several gloo processes on loopback, every version compared element by element
(bit for bit) with the full tensor it was cut from."""

import json
import random

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import random_mesh, random_placements, run_ranks  # noqa: E402
from reshard.delta import codec  # noqa: E402

DENSITIES = [0.0, 1e-4, 0.01, 0.5, 1.0]


def nudged(full, density, gen):
    """``full`` with a share ``density`` of its elements moved by one unit in the last place
    (of their own dtype, which is the wire dtype): a change no tolerance would see."""
    out = full.clone()
    chosen = torch.rand(full.shape, generator=gen) < density
    if density >= 1.0:
        chosen[...] = True
    ints = codec.bits(out.view(-1))
    ints[chosen.view(-1)] += 1
    return out


def bits_equal(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(codec.bits(a.reshape(-1)), codec.bits(b.reshape(-1)))


def pack(encoded):
    buffer = torch.zeros(encoded.nbytes, dtype=torch.uint8)
    at = 0
    for s in encoded.sections:
        buffer[at : at + s.numel()] = s
        at += codec.aligned(s.numel())
    return buffer


def roundtrip(new, base):
    encoded = codec.encode(new, base)
    buffer = pack(encoded)
    out = base.clone() if base is not None else torch.zeros_like(new)
    codec.decode(codec.Reader(buffer, "test"), encoded.mode, out, "test")
    return encoded, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.bool])
def test_codec_applies_exactly_at_every_density(dtype):
    gen = torch.Generator().manual_seed(7)
    for n in [1, 100, 4095, 4096, 4097, 3 * 4096 + 5, 40000]:
        base = (torch.randn(n, generator=gen) * 100).to(dtype)
        for density in DENSITIES + [0.07, 0.95]:
            chosen = torch.rand(n, generator=gen) < density
            new = base.clone()
            if dtype == torch.bool:
                new[chosen] = ~new[chosen]
            else:
                codec.bits(new)[chosen] += 1
            encoded, out = roundtrip(new, base)
            assert bits_equal(out, new), (n, density)
            assert encoded.changed == int(chosen.sum())
            assert sum(encoded.blocks) == (n + 4095) // 4096
            if density == 0.0:
                assert encoded.mode == codec.REGION_UNCHANGED and encoded.nbytes == 0
            assert encoded.nbytes <= n * new.element_size() + 8 * 5 + 3 * ((n + 4095) // 4096)


def test_codec_chooses_blocks_by_the_cores_rule():
    # 4096 bf16 elements: offsets cost 4 bytes a change, a bitmask 512 bytes + 2 a change
    base = torch.zeros(4096, dtype=torch.bfloat16)
    cases = [(0, "unchanged"), (1, "offsets"), (255, "offsets"), (257, "bitmask")]
    cases += [(3800, "bitmask"), (3900, "dense")]
    for changed, want in cases:
        new = base.clone()
        codec.bits(new)[torch.randperm(4096, generator=torch.Generator().manual_seed(changed))[:changed]] += 1
        encoded, out = roundtrip(new, base)
        assert encoded.blocks[codec.ENCODINGS.index(want)] == 1, (changed, encoded.blocks)
        assert bits_equal(out, new)


def test_codec_refuses_a_truncated_message():
    base = torch.zeros(10000, dtype=torch.float32)
    new = base.clone()
    codec.bits(new)[::7] += 1
    encoded = codec.encode(new, base)
    assert encoded.mode == codec.REGION_BLOCKS
    buffer = pack(encoded)[:-100]
    with pytest.raises(reshard.ReshardError, match="the message ends at byte"):
        codec.decode(codec.Reader(buffer, "test"), encoded.mode, base.clone(), "test")


def random_layout(rng, world, shape, dtype):
    mesh = random_mesh(rng, max_ranks=world)
    size = 1
    for d in mesh:
        size *= d
    ranks = rng.sample(range(world), size)
    return reshard.Layout(shape, dtype, mesh, ranks, random_placements(rng, len(mesh), len(shape)))


def empty(layout, rank):
    shape = layout.local_shape(rank)
    return None if shape is None else torch.zeros(shape, dtype=rt.torch_dtype(layout))


def shard(layout, rank, full):
    view = rt.local_tensor(layout, rank, full)
    return None if view is None else view.clone()


def random_refits(rank, world, cases):
    rng = random.Random(4321)  # every rank draws the same cases
    gen = torch.Generator().manual_seed(99)  # and the same values
    for case in range(cases):
        shapes = [[rng.choice([1, 3, rng.randint(1, 9)]), rng.randint(200, 3000)] for _ in range(2)]
        if rng.random() < 0.4:
            shapes[1] = [rng.randint(2, 6), rng.randint(2, 7), rng.randint(50, 700)]
        dtypes = [rng.choice(["f32", "bf16"]), rng.choice(["f64", "i32", "bf16"])]
        layouts = {}
        fulls = {}
        for k, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            src = random_layout(rng, world, shape, dtype)
            dst = random_layout(rng, world, shape, dtype)
            layouts[f"t{k}"] = (src, dst)
            fulls[f"t{k}"] = (torch.randn(shape, generator=gen) * 50).to(rt.torch_dtype(src))
        outs = {n: empty(d, rank) for n, (_, d) in layouts.items()}
        # every other case with a bucket per tensor
        session = rt.DeltaSession(checksum=case % 2 == 1, bucket_bytes=1 if case % 4 >= 2 else 1 << 30)
        densities = DENSITIES[:]
        rng.shuffle(densities)
        for version, density in enumerate([None] + densities, start=1):
            if density is not None:
                fulls = {n: nudged(f, density, gen) for n, f in fulls.items()}
            pairs = {n: (shard(s, rank, fulls[n]), outs[n], s, d) for n, (s, d) in layouts.items()}
            report = session.refit(pairs)
            assert report.version == version
            for n, (s, d) in layouts.items():
                want = rt.local_tensor(d, rank, fulls[n])
                assert (want is None) == (outs[n] is None)
                assert want is None or bits_equal(outs[n], want), (case, version, n, density, s, d)
            if version == 1:
                assert report.base is None and report.regions_delta == 0
            else:
                assert report.base == version - 1 and not report.fenced and not report.unbased
                assert report.regions_dense == 0
            if density == 0.0:
                assert report.changed == 0
                assert report.blocks["offsets"] == report.blocks["bitmask"] == report.blocks["dense"] == 0
                if not session.checksum:
                    assert report.bytes_sent == 0 and report.bytes_received == 0
            if density == 1e-4 and report.bytes_dense > 100_000:
                assert report.bytes_sent < report.bytes_dense // 10, report
            if density == 1.0:
                assert report.blocks["dense"] == sum(report.blocks.values())
            assert report.base_bytes == report.bytes_dense  # one copy of what it sends


def test_delta_refits_are_exact_on_random_layouts():
    run_ranks(random_refits, 5, 24, timeout=120)


# Two training ranks (0, 1) hold rows, three inference ranks (1, 2, 3) columns: rank 1 is on
# both sides.
SRC = reshard.Layout((48, 4100), "f32", mesh=2, ranks=[0, 1], placements=["S(0)"])
DST = reshard.Layout((48, 4100), "bf16", mesh=3, ranks=[1, 2, 3], placements=["S(1)"])


def expect(full, rank, out):
    want = rt.local_tensor(DST, rank, full.to(torch.bfloat16))
    assert (want is None) == (out is None)
    assert want is None or bits_equal(out, want)


def cast_and_fencing(rank, world):
    gen = torch.Generator().manual_seed(5)
    # f32 values that bf16 holds exactly: one f32 ulp more vanishes in the cast
    full = (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)
    out = None if DST.local_region(rank) is None else torch.zeros(DST.local_shape(rank), dtype=torch.bfloat16)
    session = rt.DeltaSession()

    def refit(version=None):
        report = session.refit({"w": (shard(SRC, rank, full), out, SRC, DST)}, version)
        expect(full, rank, out)
        return report

    first = refit()
    assert first.version == 1 and set(first.fenced) == {1, 2, 3}
    assert all(why.startswith("first refit") for why in first.fenced.values())
    full = nudged(full, 0.3, gen)  # every change vanishes in bf16
    report = refit()
    assert report.changed == 0 and report.bytes_sent == 0 and report.bytes_received == 0
    assert not report.fenced and report.base_bytes == report.bytes_dense
    if rank in (0, 1):
        assert report.blocks["unchanged"] > 0 and report.regions_delta > 0
    full = nudged(full.to(torch.bfloat16), 0.01, gen).to(torch.float32)  # one bf16 ulp
    snapshot = None if out is None else out.clone()  # rank 2 keeps version 3
    report = refit()
    assert report.version == 3 and report.changed > 0 if rank in (0, 1) else True
    assert report.bytes_sent < report.bytes_dense // 4 or rank not in (0, 1)

    # rank 2 goes back to its snapshot of version 3 while the others refit version 4
    full = nudged(full.to(torch.bfloat16), 0.01, gen).to(torch.float32)
    refit()
    if rank == 2:
        out.copy_(snapshot)
        session.restore(3)
    full = nudged(full.to(torch.bfloat16), 0.01, gen).to(torch.float32)
    report = refit()
    assert report.fenced == {2: "holds version 3, but the base is version 4"}, report.fenced

    # rank 3 is a new replica: no version, an empty shard
    if rank == 3:
        session.forget()
        out.zero_()
    full = nudged(full.to(torch.bfloat16), 0.01, gen).to(torch.float32)
    report = refit()
    assert report.fenced == {3: "holds no version (a new or restarted rank)"}, report.fenced
    assert not report.unbased

    # training rank 0 restarts: it has no base, so it sends dense; the others still delta
    if rank == 0:
        session.forget()
    full = nudged(full.to(torch.bfloat16), 0.01, gen).to(torch.float32)
    report = refit()
    assert report.unbased == {0: "keeps no base"} and not report.fenced  # 0 receives nothing
    if rank == 0:
        assert report.regions_delta == 0 and report.regions_dense > 0
    if rank == 1:
        assert report.regions_delta > 0 and report.regions_dense == 0

    # versions are the caller's to give, and every rank gives the same
    full = nudged(full.to(torch.bfloat16), 0.01, gen).to(torch.float32)
    report = refit(version=100)
    assert report.version == 100 and report.base == 7 and not report.unbased
    with pytest.raises(reshard.ReshardError, match="version: rank"):
        refit(version=200 + (rank == 2))
    refusal = "version: -1 is invalid" if rank == 1 else "rank 1 refused"
    with pytest.raises(reshard.ReshardError, match=refusal):
        refit(version=-1 if rank == 1 else 300)


def test_casts_fencing_and_versions():
    run_ranks(cast_and_fencing, 4, timeout=60)


def checksums_and_anchors(rank, world):
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(48, 4100, generator=gen)
    out = None if DST.local_region(rank) is None else torch.zeros(DST.local_shape(rank), dtype=torch.bfloat16)

    def run(session, version=None):
        # parameters, as a trainer and an engine hold them: written in place all the same
        mine = shard(SRC, rank, full)
        mine = None if mine is None else torch.nn.Parameter(mine)
        engine = None if out is None else torch.nn.Parameter(out)
        return session.refit({"w": (mine, engine, SRC, DST)}, version)

    # without checksums, a shard changed behind the session's back stays wrong: nothing sees it
    plain = rt.DeltaSession()
    run(plain)
    if rank == 2:
        out[0, 0] += 1
    full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
    full[0, :] = full.to(torch.bfloat16).to(torch.float32)[0, :]  # row 0 keeps its value
    run(plain)
    if rank == 2:
        want = rt.local_tensor(DST, rank, full.to(torch.bfloat16))
        assert not bits_equal(out, want)

    # with them, the rank whose shard is not the base raises, and the next refit heals it
    checked = rt.DeltaSession(checksum=True)
    report = run(checked)
    expect(full, rank, out)
    wire = reshard.Layout((48, 4100), "bf16", mesh=2, ranks=[0, 1], placements=["S(0)"])
    assert report.checked == len(reshard.rank_plan(wire, DST, rank).recvs)
    if rank == 2:
        out[0, 0] += 1
    full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
    if rank == 2:
        with pytest.raises(reshard.ReshardError, match="checksum mismatch after applying"):
            run(checked)
        assert checked.held is None
    else:
        report = run(checked)
        expect(full, rank, out)
    report = run(checked)
    assert report.fenced == {2: "holds no version (a new or restarted rank)"}
    expect(full, rank, out)

    # a bucket per tensor: the rank whose first tensor fails its checksum still takes part in
    # the second bucket and applies it, then raises
    other = None if out is None else torch.zeros_like(out)
    buckets = rt.DeltaSession(checksum=True, bucket_bytes=1)

    def both():
        mine = shard(SRC, rank, full)
        return buckets.refit({"a": (mine, out, SRC, DST), "b": (mine, other, SRC, DST)})

    both()
    if rank == 2:
        out[0, 0] += 1
    full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
    if rank == 2:
        with pytest.raises(reshard.ReshardError, match="a: region at offset .* checksum mismatch"):
            both()
    else:
        both()
    if other is not None:
        assert bits_equal(other, rt.local_tensor(DST, rank, full.to(torch.bfloat16)))
    both()
    expect(full, rank, out)

    # anchor=3: versions 3 and 6 go dense to every destination
    anchored = rt.DeltaSession(anchor=3)
    for version in range(1, 8):
        full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
        report = run(anchored)
        expect(full, rank, out)
        if version in (3, 6):
            assert set(report.fenced) == {1, 2, 3}
            why = f"anchor: version {version} is a multiple of anchor=3"
            assert all(reason == why for reason in report.fenced.values())
            assert report.regions_delta == 0
        elif version > 1:
            assert not report.fenced and report.regions_dense == 0
    with pytest.raises(reshard.ReshardError, match="anchor: 0 is invalid"):
        rt.DeltaSession(anchor=0)


def test_checksums_catch_a_wrong_base_and_anchors_send_dense():
    run_ranks(checksums_and_anchors, 4, timeout=60)


def previous_and_options(rank, world):
    gen = torch.Generator().manual_seed(13)
    full = torch.randn(48, 4100, generator=gen)
    out = None if DST.local_region(rank) is None else torch.zeros(DST.local_shape(rank), dtype=torch.bfloat16)

    # keep_base=False keeps nothing: with previous= the caller's last tensors are the base
    session = rt.DeltaSession(keep_base=False)
    report = session.refit({"w": (shard(SRC, rank, full), out, SRC, DST)})
    assert report.base_bytes == 0
    for _ in range(2):
        old, full = full, nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
        previous = {"w": shard(SRC, rank, old)} if rank in (0, 1) else {}
        report = session.refit({"w": (shard(SRC, rank, full), out, SRC, DST)}, previous=previous)
        expect(full, rank, out)
        assert report.base_bytes == 0 and not report.unbased and not report.fenced
        if rank in (0, 1):
            assert report.regions_dense == 0 and report.bytes_sent < report.bytes_dense // 4
    full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
    report = session.refit({"w": (shard(SRC, rank, full), out, SRC, DST)})  # no previous: dense
    expect(full, rank, out)
    assert report.unbased == {0: "keeps no base", 1: "keeps no base"} or report.base is None
    assert report.regions_delta == 0

    # reshard_many_(delta=True): the module's session of the group
    for version in range(1, 4):
        full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
        report = rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}, delta=True)
        expect(full, rank, out)
        assert report.version == version and (version == 1) == bool(report.fenced)
    mine = rt.DeltaSession(checksum=True)
    report = rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}, delta=rt.Delta(mine, version=7))
    assert report.version == 7 and mine.last == 7
    # delta=session is Delta(session=session); the flat session= and version= fold in alike
    full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
    report = rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}, delta=mine)
    expect(full, rank, out)
    assert report.version == 8 and mine.last == 8 and not report.fenced
    full = nudged(full.to(torch.bfloat16), 0.001, gen).to(torch.float32)
    report = rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}, session=mine, version=10)
    expect(full, rank, out)
    assert report.version == 10 and mine.last == 10 and not report.fenced
    assert rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}) is None

    # what a delta refit does not do raises on every rank, before anything moves
    fp8 = reshard.Layout((48, 4100), "fp8e4m3", mesh=3, ranks=[1, 2, 3], placements=["S(1)"])
    # fp8 already quantized on both sides moves as its bytes, by delta too
    fp8_src = reshard.Layout((48, 4100), "fp8e4m3", mesh=2, ranks=[0, 1], placements=["S(0)"])
    fp8_out = None if out is None else torch.zeros(out.shape, dtype=torch.float8_e4m3fn)
    values = (torch.randn(48, 4100, generator=gen) * 8).to(torch.float8_e4m3fn)
    fp8_session = rt.DeltaSession()
    for _ in range(3):
        values = nudged(values, 0.01, gen)
        fp8_session.refit({"q": (shard(fp8_src, rank, values), fp8_out, fp8_src, fp8)})
        want = rt.local_tensor(fp8, rank, values)
        assert want is None or bits_equal(fp8_out, want)
    with pytest.raises(reshard.ReshardError, match="quant: a delta refit does not quantize"):
        rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}, delta=True, quant=rt.Quant("tensor"))
    refused = "delta: w: dst_layout is fp8e4m3, and a delta refit does not quantize"
    with pytest.raises(reshard.ReshardError, match=refused):
        rt.reshard_many_({"w": (shard(SRC, rank, full), fp8_out, SRC, fp8)}, delta=True)
    with pytest.raises(reshard.ReshardError, match="version, previous, model: given only with delta"):
        rt.reshard_many_({"w": (shard(SRC, rank, full), out, SRC, DST)}, version=3)
    wrong = None if out is None else torch.zeros(out.shape, dtype=torch.float32)
    with pytest.raises(reshard.ReshardError, match="dst_local" if rank in (1, 2, 3) else "refused"):
        mine.refit({"w": (shard(SRC, rank, full), wrong, SRC, DST)})
    # the ranks disagree on the job: every rank names the difference
    replicated = reshard.Layout((48, 4100), "bf16", mesh=3, ranks=[1, 2, 3], placements=["R"])
    other = DST if rank != 3 else replicated
    bad = None if out is None else torch.zeros(other.local_shape(rank), dtype=torch.bfloat16)
    with pytest.raises(reshard.ReshardError, match="disagree"):
        mine.refit({"w": (shard(SRC, rank, full), bad, SRC, other)})


def test_previous_tensors_module_sessions_and_refusals():
    run_ranks(previous_and_options, 4, timeout=60)


TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def refit_versions(rank, world, path, lean):
    refit = reshard.Refit(path, train="tp=2", infer="tp=2", train_dtype="f32")
    gen = torch.Generator().manual_seed(17)
    fulls = {}
    for name in refit.names:
        s_layout, _ = refit.layouts(name)
        fulls[name] = (torch.randn(s_layout.shape, generator=gen) * 4).to(torch.bfloat16).to(torch.float32)
    fused = refit.fused(rank)
    members = {m for ms in fused.values() for m, *_ in ms}
    dst = {}
    for name in refit.rank_names(rank):
        d_layout = refit.layouts(name)[1]
        if rank in d_layout.ranks and name not in members:
            dst[name] = torch.zeros(d_layout.local_shape(rank), dtype=torch.bfloat16)
    for buffer, ms in fused.items():
        shape = list(refit.layouts(ms[0][0])[1].local_shape(rank))
        shape[ms[0][1]] = sum(extent for *_, extent in ms)
        dst[buffer] = torch.zeros(shape, dtype=torch.bfloat16)
    # lean: no bases kept, the trainer's tensors of the last version passed instead
    session = rt.DeltaSession(checksum=True, keep_base=not lean)
    src = None
    for version, density in enumerate([None, 0.0, 0.01, 1.0], start=1):
        previous = src if lean else None
        if density is not None:
            wire = {n: nudged(f.to(torch.bfloat16), density, gen) for n, f in fulls.items()}
            fulls = {n: f.to(torch.float32) for n, f in wire.items()}
        src = {}
        for name in refit.rank_names(rank):
            s_layout = refit.layouts(name)[0]
            if rank in s_layout.ranks:
                src[name] = shard(s_layout, rank, fulls[name])
        report = session.refit(refit, src=src, dst=dst, previous=previous)
        assert report.version == version
        assert (report.base_bytes == 0) == (lean or rank >= 2)
        for name in refit.names:
            d_layout = refit.layouts(name)[1]
            want = rt.local_tensor(d_layout, rank, fulls[name].to(torch.bfloat16))
            if want is None:
                continue
            got = dst.get(name)
            for buffer, ms in fused.items():
                for member, dim, offset, extent in ms:
                    if member == name:
                        got = dst[buffer].narrow(dim, offset, extent)
            assert bits_equal(got, want), (version, name)
        if density == 0.0:
            assert report.changed == 0 and report.blocks["unchanged"] == sum(report.blocks.values())
        if density == 0.01 and rank in (0, 1):
            assert report.regions_dense == 0 and report.bytes_sent < report.bytes_dense // 2


@pytest.mark.parametrize("lean", [False, True], ids=["kept-bases", "previous-tensors"])
def test_refit_of_a_model_over_versions(tmp_path, lean):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    run_ranks(refit_versions, 4, str(path), lean, timeout=60)
