"""Staged refit from Python (reshard.torch.DeltaSession.prepare / commit / abort), over four
gloo processes on loopback: the live shards stay bit for bit what they were until commit,
the staging holds what a plain refit produces, and a rank that fails to prepare leaves every
rank on the old version."""

import json

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402
from test_delta import DST, SRC, TINY, bits_equal, nudged, shard  # noqa: E402


def same(a, b):
    return (a is None and b is None) or bits_equal(a, b)


def clone(t):
    return None if t is None else t.clone()


def step(full, gen, density=0.01):
    """The next version: a share of the elements moved by one bf16 ulp."""
    return nudged(full.to(torch.bfloat16), density, gen).to(torch.float32)


def live_shard(rank):
    shape = DST.local_shape(rank)
    return None if shape is None else torch.zeros(shape, dtype=torch.bfloat16)


def stage_commit_abort(rank, world):
    gen = torch.Generator().manual_seed(23)
    full = (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)
    out = live_shard(rank)
    # the reference: a plain refit of every version into tensors of its own
    ref, ref_out = rt.DeltaSession(), live_shard(rank)

    def pairs(target):
        return {"w": (shard(SRC, rank, full), target, SRC, DST)}

    def staged():
        return session.staging.get("w")

    session = rt.DeltaSession(checksum=True)
    assert session.serving is None and session.staged is None
    nbytes = session.staging_bytes(pairs(out))
    assert nbytes == (0 if out is None else out.numel() * 2)

    # version 1, dense: the staging holds it, the live shards are untouched
    before = clone(out)
    report = session.prepare(pairs(out), 1)
    ref.refit(pairs(ref_out), 1)
    assert isinstance(report, rt.StageReport) and isinstance(report.refit, rt.DeltaReport)
    assert report.version == 1 and report.onto is None and report.allocated
    assert report.staging_bytes == nbytes and report.refit.version == 1
    assert session.staged == 1 and session.serving is None and session.held is None
    assert same(out, before)
    assert same(staged(), ref_out)

    # refusals: the wrong version, a second prepare; neither drops what is staged
    wrong = "commit: version 2 was asked for, but version 1 is staged"
    with pytest.raises(reshard.ReshardError, match=wrong):
        session.commit(2)
    with pytest.raises(reshard.ReshardError, match="version 1 is staged: commit or abort it first"):
        session.prepare(pairs(out), 2)
    assert session.staged == 1 and same(out, before)

    done = session.commit(1)
    assert isinstance(done, rt.CommitReport)
    assert done.version == 1 and done.previous is None and done.bytes_copied == nbytes
    assert same(out, ref_out)
    assert session.serving == session.held == 1 and session.staged is None and not session.staging
    with pytest.raises(reshard.ReshardError, match="commit: nothing is staged: prepare a version first"):
        session.commit()
    with pytest.raises(reshard.ReshardError, match=r"nothing is staged \(version 2 was asked for\)"):
        session.commit(2)

    # version 2 by delta: fewer bytes than dense, exact
    full = step(full, gen)
    before = clone(out)
    report = session.prepare(pairs(out))
    ref.refit(pairs(ref_out), 2)
    assert report.version == 2 and report.onto == 1 and not report.refit.fenced
    assert same(out, before) and same(staged(), ref_out)
    if rank in (0, 1):
        assert report.refit.regions_dense == 0
        assert report.refit.bytes_sent < report.refit.bytes_dense // 4, report.refit
    session.commit()
    assert same(out, ref_out) and session.serving == 2

    # version 3 aborted: the live shards keep serving 2, though the senders' bases moved on
    full = step(full, gen)
    before = clone(out)
    session.prepare(pairs(out))
    ref.refit(pairs(ref_out), 3)
    with pytest.raises(reshard.ReshardError, match="abort: version 4 was asked for, but version 3"):
        session.abort(4)
    assert session.abort(3) == 3 and session.abort() is None
    assert session.staged is None and session.serving == 2 and session.held == 2
    assert same(out, before)

    # so the next refit sends every destination dense, and is exact
    full = step(full, gen)
    report = session.refit(pairs(out))
    ref.refit(pairs(ref_out), 4)
    fenced = "holds version 2, but the base is version 3"
    assert report.version == 4 and report.fenced == {1: fenced, 2: fenced, 3: fenced}, report.fenced
    assert same(out, ref_out) and session.serving == 4
    full = step(full, gen)
    report = session.refit(pairs(out))  # and the one after is a delta again
    ref.refit(pairs(ref_out), 5)
    assert not report.fenced and same(out, ref_out)

    # the caller's staging: filled from the live shards, the refit lands in it
    full = step(full, gen)
    mine = None if out is None else torch.full_like(out, 7.0)
    pointer = None if mine is None else mine.data_ptr()
    before = clone(out)
    report = session.prepare(pairs(out), staging={} if out is None else {"w": mine})
    ref.refit(pairs(ref_out), 6)
    assert not report.allocated and not report.refit.fenced
    assert staged() is mine and (mine is None or mine.data_ptr() == pointer)
    assert same(mine, ref_out) and same(out, before)
    session.commit(6)
    assert same(out, ref_out) and (mine is None or mine.data_ptr() == pointer)

    # a plain refit between prepare and commit: the staging is stale, commit refuses
    full = step(full, gen)
    session.prepare(pairs(out))
    ref.refit(pairs(ref_out), 7)
    full = step(full, gen)
    session.refit(pairs(out), 8)
    ref.refit(pairs(ref_out), 8)
    # every rank votes against it, so the job aborts it everywhere and drops the staging
    stale = "version 7 was staged onto shards serving version 6, but they now serve version 8"
    with pytest.raises(reshard.AbortedError, match=stale):
        session.commit()
    assert session.staged is None and session.abort() is None
    assert session.serving == 8 and same(out, ref_out)

    # so does a restore
    session.prepare(pairs(out), 9)
    session.restore(8)
    with pytest.raises(reshard.AbortedError, match="but they now serve version 8 .a refit or restore"):
        session.commit(9)
    assert session.abort() is None


def test_prepare_commit_abort_and_the_next_refit():
    run_ranks(stage_commit_abort, 4, timeout=60)


def failed_prepares(rank, world):
    gen = torch.Generator().manual_seed(29)
    full = (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)
    out = live_shard(rank)

    def pairs():
        return {"w": (shard(SRC, rank, full), out, SRC, DST)}

    session = rt.DeltaSession(checksum=True)
    session.prepare(pairs())
    session.commit()
    committed = clone(out)

    # rank 2 gives a staging tensor of the wrong shape, rank 3 one of the wrong dtype
    full = step(full, gen)
    staging = None
    if rank == 2:
        staging = {"w": torch.zeros(out.shape[0], out.shape[1] + 1, dtype=torch.bfloat16)}
    if rank == 3:
        staging = {"w": torch.zeros(out.shape, dtype=torch.float32)}
    if rank == 2:
        mine = r"staging: w: shape is \(48, 1368\), but the destination's is \(48, 1367\)"
    elif rank == 3:
        mine = "staging: w: dtype is torch.float32, but the destination's is torch.bfloat16"
    else:
        mine = "nothing was moved: rank 2 refused its arguments"
    with pytest.raises(reshard.ReshardError, match=mine) as raised:
        session.prepare(pairs(), staging=staging)
    assert "version 2 was staged on no rank: rank(s) [0, 1, 2, 3] were not prepared" in str(raised.value)
    assert session.staged is None and session.serving == 1 and session.held == 1
    assert same(out, committed)

    # rank 2's live shard changed behind the session's back: its checksum fails in the
    # staging, and no rank stages the version
    if rank == 2:
        out[0, 0] += 1
    behind = clone(out)
    full = step(full, gen)
    mine = "checksum mismatch after applying" if rank == 2 else "prepare: version 2 was staged on no rank"
    with pytest.raises(reshard.ReshardError, match=mine) as raised:
        session.prepare(pairs())
    assert "rank(s) [2] were not prepared" in str(raised.value)
    assert "the live shards still serve version 1" in str(raised.value)
    assert session.staged is None and session.serving == 1 and not session.staging
    assert same(out, behind)
    assert session.held == (None if rank == 2 else 1)  # rank 2's shard is not what it was

    # the next prepare sends every destination dense, and heals rank 2
    full = step(full, gen)
    report = session.prepare(pairs())
    fenced = "holds version 1, but the base is version 2"
    assert report.version == 3
    assert report.refit.fenced == {1: fenced, 2: "holds no version (a new or restarted rank)", 3: fenced}
    session.commit(3)
    want = rt.local_tensor(DST, rank, full.to(torch.bfloat16))
    assert same(out, want) and session.serving == session.held == 3


def test_a_rank_that_fails_to_prepare_leaves_every_rank_on_the_old_version():
    run_ranks(failed_prepares, 4, timeout=60)


def staged_model(rank, world, path):
    refit = reshard.Refit(path, train="tp=2", infer="tp=2", train_dtype="f32")
    gen = torch.Generator().manual_seed(31)
    fulls = {}
    for name in refit.names:
        s_layout, _ = refit.layouts(name)
        fulls[name] = (torch.randn(s_layout.shape, generator=gen) * 4).to(torch.bfloat16).to(torch.float32)
    # the engine's tensors: its fused buffers (qkv_proj, gate_up_proj) and the others
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
    session = rt.DeltaSession(checksum=True)
    for version, density in enumerate([None, 0.01], start=1):
        if density is not None:
            fulls = {n: step(f, gen, density) for n, f in fulls.items()}
        src = {}
        for name in refit.rank_names(rank):
            s_layout = refit.layouts(name)[0]
            if rank in s_layout.ranks:
                src[name] = shard(s_layout, rank, fulls[name])
        before = {n: t.clone() for n, t in dst.items()}
        nbytes = session.staging_bytes(refit, dst=dst)
        assert nbytes == sum(t.numel() * t.element_size() for t in dst.values())
        report = session.prepare(refit, src=src, dst=dst)
        assert report.version == version and report.staging_bytes == nbytes
        assert set(session.staging) == set(dst)  # a staging per buffer, fused ones as such
        assert all(bits_equal(dst[n], before[n]) for n in dst)
        if density is not None and rank in (0, 1):
            assert report.refit.regions_dense == 0 and report.refit.bytes_sent < report.refit.bytes_dense // 2
        session.commit(version)
        for name in refit.names:
            want = rt.local_tensor(refit.layouts(name)[1], rank, fulls[name].to(torch.bfloat16))
            if want is None:
                continue
            got = dst.get(name)
            for buffer, ms in fused.items():
                for member, dim, offset, extent in ms:
                    if member == name:
                        got = dst[buffer].narrow(dim, offset, extent)
            assert bits_equal(got, want), (version, name)


def test_staged_refit_of_a_model_with_fused_buffers(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    run_ranks(staged_model, 4, str(path), timeout=60)
