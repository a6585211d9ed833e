"""Sessions, versions and the staged commit as one job decides them, over four gloo processes:
two models under the same names stay exact, a staging that aliases a live tensor is refused,
a commit that one rank cannot make is aborted on every rank before any rank writes, versions
only increase, and ranks that choose differently between commit and abort all keep the old
version. Every case ends exact or refused on every rank."""

import pytest

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import run_ranks  # noqa: E402
from test_delta import DST, SRC, expect, shard  # noqa: E402
from test_stage import clone, live_shard, same, step  # noqa: E402


def weights(seed):
    """A generator and the first version of a 48x4100 tensor, bf16 values held in f32."""
    gen = torch.Generator().manual_seed(seed)
    return gen, (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)


def policy_and_reference(rank, world, explicit):
    gen = torch.Generator().manual_seed(41)
    policy = (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)
    reference = (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)
    out_policy, out_reference = live_shard(rank), live_shard(rank)
    for version in range(1, 5):
        policy = step(policy, gen)  # the policy trains; the reference stays frozen
        for name, full, out in (("policy", policy, out_policy), ("reference", reference, out_reference)):
            pairs = {"w": (shard(SRC, rank, full), out, SRC, DST)}
            delta = rt.Delta(model=name) if explicit else True
            report = rt.reshard_many_(pairs, delta=delta, checksum=True)
            expect(full, rank, out)
            if explicit and version > 1 and rank in (1, 2, 3):
                # each model keeps its own bases: the frozen reference sends nothing new
                assert not report.fenced, report.fenced
            if not explicit and version > 1 and rank in (1, 2, 3):
                # one session for both: each rank's tensors changed, so it got them dense
                assert rank in report.fenced, report.fenced


@pytest.mark.parametrize("explicit", [True, False])
def test_a_policy_and_a_frozen_reference_stay_exact(explicit):
    run_ranks(policy_and_reference, 4, explicit, timeout=60)


LABELS = [
    ("another live tensor", "shares memory with the live tensor 'b'"),
    ("one tensor for two names", "shares memory with the staging of"),
    ("a view of the live tensor", "is the live tensor itself"),
]


def aliasing_staging(rank, world):
    gen, full = weights(43)
    a, b = live_shard(rank), live_shard(rank)
    session = rt.DeltaSession()

    def pairs():
        return {
            "a": (shard(SRC, rank, full), a, SRC, DST),
            "b": (shard(SRC, rank, full * 2), b, SRC, DST),
        }

    session.prepare(pairs(), 1)
    session.commit()
    full = step(full, gen)
    before_a, before_b = clone(a), clone(b)

    def cases():
        if a is None:  # rank 0 holds no destination shard: nothing of its own to stage
            return [(label, None, message) for label, message in LABELS]
        shared = torch.empty_like(a)
        return [
            (LABELS[0][0], {"a": b, "b": torch.empty_like(b)}, LABELS[0][1]),
            (LABELS[1][0], {"a": shared, "b": shared}, LABELS[1][1]),
            (LABELS[2][0], {"a": a[:, :], "b": torch.empty_like(b)}, LABELS[2][1]),
        ]

    for label, bad, message in cases():
        mine = bad if rank == 2 else None
        with pytest.raises(reshard.ReshardError) as raised:
            session.prepare(pairs(), 2, staging=mine)
        if rank == 2:
            assert isinstance(raised.value, reshard.ArgumentError), (label, raised.value)
            assert message in str(raised.value), (label, str(raised.value))
        else:
            assert "rank 2" in str(raised.value), (label, str(raised.value))
        assert session.staged is None and session.serving == 1
        assert same(a, before_a) and same(b, before_b), label
    # then the version goes through, with the session's own staging
    session.prepare(pairs(), 3)
    session.commit(3)
    expect(full, rank, a)
    expect(full * 2, rank, b)


def test_a_staging_that_aliases_a_live_tensor_is_refused_everywhere():
    run_ranks(aliasing_staging, 4, timeout=60)


def resized_before_commit(rank, world):
    gen, full = weights(47)
    a, b = live_shard(rank), live_shard(rank)
    session = rt.DeltaSession()

    def pairs():
        return {
            "a": (shard(SRC, rank, full), a, SRC, DST),
            "b": (shard(SRC, rank, full + 1), b, SRC, DST),
        }

    session.prepare(pairs(), 1)
    session.commit()
    full = step(full, gen)
    session.prepare(pairs(), 2)
    before_a, before_b = clone(a), clone(b)
    if rank == 3:
        b.resize_(0)  # the engine swapped its buffer: this rank cannot commit
    with pytest.raises(reshard.AbortedError) as raised:
        session.commit(2)
    assert "rank 3" in str(raised.value) and "b: the live tensor changed since prepare" in str(raised.value)
    # no rank wrote a byte, and every rank still serves version 1
    assert same(a, before_a) and session.serving == 1 and session.staged is None
    if rank != 3:
        assert same(b, before_b)


def test_a_commit_one_rank_cannot_make_is_aborted_before_any_rank_writes():
    run_ranks(resized_before_commit, 4, timeout=60)


def versions_only_increase(rank, world):
    gen, full = weights(53)
    out = live_shard(rank)
    session = rt.DeltaSession()

    def pairs():
        return {"w": (shard(SRC, rank, full), out, SRC, DST)}

    session.refit(pairs(), 20)
    full = step(full, gen)
    session.refit(pairs(), 21)
    snapshot = clone(out)
    for reused in (20, 21, 3):
        before = clone(out)
        full2 = step(full, gen, density=0.5)
        with pytest.raises(reshard.VersionError, match=f"version: {reused} is not above version 21"):
            session.refit({"w": (shard(SRC, rank, full2), out, SRC, DST)}, reused)
        assert same(out, before)
        with pytest.raises(reshard.VersionError):
            session.prepare({"w": (shard(SRC, rank, full2), out, SRC, DST)}, reused)
        assert same(out, before) and session.staged is None
    # a rank restored to its snapshot of 21 is exact after the next refit
    if out is not None:
        out.copy_(snapshot)
    session.restore(21)
    full = step(full, gen)
    session.refit(pairs(), 22)
    expect(full, rank, out)


def test_versions_only_increase_on_every_rank():
    run_ranks(versions_only_increase, 4, timeout=60)


def one_decision(rank, world):
    gen, full = weights(59)
    out = live_shard(rank)
    session = rt.DeltaSession()

    def pairs():
        return {"w": (shard(SRC, rank, full), out, SRC, DST)}

    session.prepare(pairs(), 1)
    session.commit()
    served = clone(out)
    # the README's pattern, where ranks judge differently: rank 2's engine is busy
    for version, aborting in ((2, {2}), (3, {0}), (4, {0, 1, 2, 3})):
        full = step(full, gen)
        session.prepare(pairs(), version)
        if rank in aborting:
            assert session.abort() == version
        else:
            with pytest.raises(reshard.AbortedError, match=f"rank {min(aborting)}: abort"):
                session.commit()
        assert same(out, served) and session.serving == 1 and session.staged is None
    # every rank commits: the next version lands everywhere, exact
    full = step(full, gen)
    session.prepare(pairs(), 5)
    report = session.commit()
    assert report.version == 5 and session.serving == 5
    expect(full, rank, out)


def test_ranks_that_decide_differently_all_keep_the_old_version():
    run_ranks(one_decision, 4, timeout=60)
