"""A rolling commit's groups (`--rolling`): each group whole inference replicas, or refused
naming the replica a count would cut, for one tensor's destination layout and for a whole
model's inference parallelism."""

import random

import pytest

import reshard
from reshard import Layout, Refit


def dst(spec: str) -> Layout:
    return Layout.from_spec(spec, (16, 16), "bf16", 2)


def test_a_layouts_replicas_differ_along_replicated_axes_only():
    assert dst("mesh=2x2 place=R,S(1)").replicas == [[2, 3], [4, 5]]
    assert dst("mesh=2x2 place=S(0),R").replicas == [[2, 4], [3, 5]]
    assert dst("mesh=4 place=S(1)").replicas == [[2, 3, 4, 5]]
    assert dst("mesh=4 place=R").replicas == [[2], [3], [4], [5]]


def test_groups_of_whole_replicas():
    assert dst("mesh=2x2 place=R,S(1)").rolling_groups(2) == [[2, 3], [4, 5]]
    assert dst("mesh=2x2 place=R,S(1)").rolling_groups(1) == [[2, 3, 4, 5]]
    # replicas of ranks that are not contiguous: a group each still
    assert dst("mesh=2x2 place=S(0),R").rolling_groups(2) == [[2, 4], [3, 5]]


def test_a_count_that_cuts_a_replica_is_refused_naming_it():
    with pytest.raises(reshard.ReshardError) as e:
        dst("mesh=2x2 place=R,S(1)").rolling_groups(4)
    message = str(e.value)
    # bad input, like any invalid argument
    assert isinstance(e.value, reshard.ArgumentError), type(e.value)
    assert message.startswith("rolling: 4 is invalid"), message
    assert "cuts the inference replica of ranks 2,3 across commit groups 0 and 1" in message
    with pytest.raises(reshard.ReshardError, match="ranks 2,3,4,5 across commit groups 0 and 1"):
        dst("mesh=4 place=S(1)").rolling_groups(2)
    for count in (0, 3):
        with pytest.raises(reshard.ReshardError, match=f"rolling: {count} is invalid: must divide the 4"):
            dst("mesh=2x2 place=R,S(1)").rolling_groups(count)


def test_random_layouts_accept_whole_replicas_and_name_a_cut_one():
    rng = random.Random(7)
    for _ in range(200):
        axes = rng.randint(1, 3)
        mesh = [rng.randint(1, 3) for _ in range(axes)]
        place = ",".join(rng.choice(["R", "S(0)", "S(1)"]) for _ in range(axes))
        size = 1
        for m in mesh:
            size *= m
        ranks = rng.sample(range(40), size)
        layout = Layout.from_spec(
            f"mesh={'x'.join(map(str, mesh))} ranks={','.join(map(str, ranks))} place={place}",
            (5, 7),
            "f32",
        )
        replicas = [set(r) for r in layout.replicas]
        assert sorted(r for rep in replicas for r in rep) == sorted(ranks)
        count = rng.randint(1, 8)
        try:
            groups = layout.rolling_groups(count)
        except reshard.ReshardError as e:
            message = str(e)
            assert len(replicas) % count != 0, message
            if "cuts the inference replica of ranks " in message:
                named = message.split("ranks ", 1)[1].split(" ", 1)[0]
                assert set(map(int, named.split(","))) in replicas, message
            else:
                assert size % count != 0, message
            continue
        assert len(replicas) % count == 0
        assert len(groups) == count
        assert sorted(r for g in groups for r in g) == sorted(ranks)
        for g in groups:
            assert len(g) == size // count
            for rep in replicas:
                assert rep <= set(g) or not rep & set(g), (g, rep)


def test_a_refits_replicas_are_its_engines():
    refit = Refit("qwen3-0.6b", "tp=2", "tp=2,pp=2,dp=2")
    assert refit.replicas == [[2, 3, 4, 5], [6, 7, 8, 9]]
    assert refit.rolling_groups(2) == refit.replicas
    assert refit.rolling_groups(1) == [list(range(2, 10))]
    with pytest.raises(reshard.ReshardError) as e:
        refit.rolling_groups(4)
    assert "cuts the inference replica of ranks 2,3,4,5 across commit groups 0 and 1" in str(e.value)


def test_experts_over_the_engines_make_one_replica():
    refit = Refit("qwen3-30b-a3b", "tp=2,ep=2", "tp=2,dp=2,ep")
    assert refit.replicas == [[2, 3, 4, 5]]
    with pytest.raises(reshard.ReshardError, match="ranks 2,3,4,5 across commit groups 0 and 1"):
        refit.rolling_groups(2)
