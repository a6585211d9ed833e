"""Plans: the same content as ``reshard plan --json``, the command line's error messages (naming
arguments where it names flags), and per-rank parts that add up to the whole."""

import itertools
import json
import random
import subprocess

import pytest

import reshard
from conftest import random_mesh, random_placements, random_shape


def cli(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def test_seed_example():
    src = reshard.Layout((8, 8), "bf16", 2, None, ["S(0)"])
    dst = reshard.Layout((8, 8), "bf16", 4, range(2, 6), ["S(1)"])
    plan = reshard.plan(src, dst)
    assert len(plan) == 8 and plan.src == src and plan.dst == dst
    assert all(t.extent == (4, 2) and t.bytes == 16 and not t.is_local for t in plan.transfers)
    assert plan.totals == {
        "bytes_remote": 128,
        "bytes_local": 0,
        "messages": 8,
        "max_rank_send_bytes": 64,
        "max_rank_recv_bytes": 32,
        "gather_broadcast_bytes": 640,
    }
    rp = plan.for_rank(3)
    assert rp.sends == [] and rp.locals == [] and rp.peers == [0, 1]
    assert sorted((t.src, t.offset) for t in rp.recvs) == [(0, (0, 2)), (1, (4, 2))]


def test_totals_past_64_bits_are_none_and_named():
    # a 2^62-byte tensor to four replicas: 2^64 bytes, one more than 64 bits hold
    src = reshard.Layout((1 << 62,), "u8", 1, None, ["R"])
    dst = reshard.Layout((1 << 62,), "u8", 4, range(1, 5), ["R"])
    totals = reshard.plan(src, dst).totals
    assert totals["bytes_remote"] is None and totals["gather_broadcast_bytes"] is None
    assert totals["max_rank_recv_bytes"] == 1 << 62 and totals["messages"] == 4
    assert totals["overflow"] == ["bytes_remote", "max_rank_send_bytes", "gather_broadcast_bytes"]


def test_json_equals_the_command_line(reshard_cli):
    rng = random.Random(7)
    for _ in range(12):
        shape = random_shape(rng)
        smesh, dmesh = random_mesh(rng), random_mesh(rng)
        sp = random_placements(rng, len(smesh), len(shape))
        dp = random_placements(rng, len(dmesh), len(shape))
        src = reshard.Layout(shape, "f16", smesh, None, sp)
        first = rng.randint(0, len(src.ranks))  # overlapping, adjacent or disjoint
        dst = reshard.Layout.from_spec(
            f"mesh={'x'.join(map(str, dmesh))} place={','.join(dp)}", shape, "f16", first_rank=first
        )
        out = cli(
            reshard_cli,
            "plan",
            "--json",
            "--shape",
            ",".join(map(str, shape)) or "[]",
            "--dtype",
            "f16",
            "--src",
            src.spec,
            "--dst",
            dst.spec,
        )
        assert out.returncode == 0, out.stderr
        plan = reshard.plan(src, dst)
        assert plan.to_json().strip() == out.stdout.strip()
        want = json.loads(out.stdout)
        assert [t.to_dict() for t in plan.transfers] == want["transfers"]
        assert plan.totals == want["totals"]


@pytest.mark.parametrize(
    "src, dst, shape",
    [
        ("mesh=2 place=S(2)", "mesh=2 place=R", "8,8"),
        ("mesh=2x2 place=S(0)", "mesh=2 place=R", "8,8"),
        ("mesh=2 ranks=0,0 place=S(0)", "mesh=2 place=R", "8,8"),
        ("mesh=2 ranks=0..3 place=S(0)", "mesh=2 place=R", "8,8"),
        ("mesh=2 place=S(0)", "mesh=2 place=Q", "8,8"),
    ],
)
def test_errors_equal_the_command_line(reshard_cli, src, dst, shape):
    out = cli(reshard_cli, "plan", "--shape", shape, "--src", src, "--dst", dst)
    assert out.returncode == 2
    cli_message = out.stderr.strip().removeprefix("error: ")
    dims = [int(n) for n in shape.split(",")]
    with pytest.raises(reshard.ReshardError) as e:
        a = reshard.Layout.from_spec(src, dims, "bf16")
        reshard.Layout.from_spec(dst, dims, "bf16", first_rank=max(a.ranks) + 1)
    side = "--src" if "Q" not in dst else "--dst"
    assert cli_message == f"{side}: {e.value}"


def test_dtype_error_equals_the_command_line(reshard_cli):
    out = cli(
        reshard_cli,
        "plan",
        "--shape",
        "8",
        "--dtype",
        "c64",
        "--src",
        "mesh=2 place=S(0)",
        "--dst",
        "mesh=2 place=R",
    )
    with pytest.raises(reshard.ReshardError) as e:
        reshard.Layout((8,), "c64", 2, None, ["S(0)"])
    # the same message, naming the input by its argument where the command line names its flag
    assert str(e.value).startswith("dtype: unknown dtype `c64`")
    assert out.stderr.strip() == f"error: --{e.value}"


def test_sides_must_agree():
    a = reshard.Layout((8, 8), "bf16", 2, None, ["S(0)"])
    with pytest.raises(
        reshard.ReshardError, match=r"shape: the sides disagree: src has shape 8x8, dst has shape 8x4"
    ):
        reshard.plan(a, reshard.Layout((8, 4), "bf16", 2, None, ["S(0)"]))
    # float dtypes convert in flight; other pairs are refused
    reshard.rank_plan(a, reshard.Layout((8, 8), "f32", 2, None, ["S(0)"]), 0)
    with pytest.raises(reshard.ReshardError, match=r"dst_dtype: cannot convert bf16 to i32"):
        reshard.rank_plan(a, reshard.Layout((8, 8), "i32", 2, None, ["S(0)"]), 0)


def volume(extent):
    n = 1
    for e in extent:
        n *= e
    return n


def test_rank_parts_add_up():
    """Every rank's part equals the whole plan's share, rank_plan equals for_rank, and every
    destination shard is tiled exactly once by what it receives and copies."""
    rng = random.Random(8)
    for _ in range(60):
        shape = random_shape(rng, max_dim=9)
        smesh, dmesh = random_mesh(rng), random_mesh(rng)
        src = reshard.Layout(shape, "i32", smesh, None, random_placements(rng, len(smesh), len(shape)))
        n = volume(dmesh)
        ranks = rng.sample(range(n + len(src.ranks)), n)
        dst = reshard.Layout(shape, "i32", dmesh, ranks, random_placements(rng, len(dmesh), len(shape)))
        split = rng.choice([0, 16, 65536])
        plan = reshard.plan(src, dst, min_split_bytes=split)
        seen = set()
        for r in plan.ranks:
            part = plan.for_rank(r)
            cheap = reshard.rank_plan(src, dst, r, min_split_bytes=split)
            assert (part.sends, part.recvs, sorted(part.locals)) == (
                cheap.sends,
                cheap.recvs,
                sorted(cheap.locals),
            )
            seen.update(part.sends + part.recvs + part.locals)
            region = dst.local_region(r)
            if region is None:
                assert part.recvs == [] and part.locals == []
                continue
            cells = set()
            for t in part.recvs + part.locals:
                assert t.dst == r
                box = [range(o, o + e) for o, e in zip(t.offset, t.extent)]
                for cell in itertools.product(*box):
                    assert cell not in cells
                    cells.add(cell)
            offset, extent = region
            assert len(cells) == volume(extent)
            assert all(o <= c < o + e for cell in cells for c, o, e in zip(cell, offset, extent))
        assert seen == set(plan.transfers)
