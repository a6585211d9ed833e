"""kill -9 of one rank during a staged refit from Python (prepare, the decision, the commit):
every surviving destination rank serves the old version or the new one, whole, checked on its
bytes, and every survivor's call ends within a bounded time with an error of reshard's kinds
(or a commit), never a hang or a raw backend error.

Four processes on loopback gloo: sources 0 and 1, destinations 1, 2 and 3 (rank 1 is both). The
victim kills itself with SIGKILL at the point the trial names; the others write what their
live shards hold and what their calls said to a file each."""

import datetime
import json
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from conftest import free_port  # noqa: E402

TIMEOUT = 4.0  # RESHARD_TIMEOUT of the trials, in seconds
WORLD = 4


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _versions():
    """Versions 1 and 2 of the global tensor, alike on every rank."""
    from test_stage import step

    gen = torch.Generator().manual_seed(61)
    v1 = (torch.randn(48, 4100, generator=gen) * 8).to(torch.bfloat16).to(torch.float32)
    v2 = step(v1, gen, density=0.3)
    return v1, v2


def _trial(rank, port, victim, point, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RESHARD_TIMEOUT=str(TIMEOUT))
    import torch.distributed as dist

    import reshard
    import reshard.torch as rt
    from reshard.delta import stage as staged
    from reshard.transfer import control
    from test_delta import DST, SRC, bits_equal, shard
    from test_stage import live_shard

    torch.set_num_threads(1)
    # the backend's own timeout is a backstop far beyond reshard's
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    v1, v2 = _versions()
    out = live_shard(rank)
    session = rt.DeltaSession()
    session.prepare({"w": (shard(SRC, rank, v1), out, SRC, DST)}, 1)
    session.commit()

    me = rank == victim
    if me and point == "prepare":
        _die()
    if me and point in ("before-vote", "after-vote"):
        decide = control.decide

        calls = []

        def dying(group, why_not):
            calls.append(why_not)
            if len(calls) == 2 and point == "before-vote":  # the commit's vote, not prepare's
                _die()
            result = decide(group, why_not)
            if len(calls) == 2:  # the commit's decision came, and is not applied here
                _die()
            return result

        control.decide = dying
    if me and point == "mid-commit":
        apply = staged._apply

        def half(session_, stage):
            if not stage.live:  # rank 0 holds no destination shard: it dies at once
                _die()
            name = next(iter(stage.live))
            live = stage.live[name]
            live.view(-1)[: live.numel() // 2].copy_(stage.shadows[name].view(-1)[: live.numel() // 2])
            _die()
            return apply(session_, stage)

        staged._apply = half

    start = time.monotonic()
    said = "committed"
    try:
        session.prepare({"w": (shard(SRC, rank, v2), out, SRC, DST)}, 2)
        session.commit()
    except reshard.ReshardError as e:
        said = f"{type(e).__name__}: {e}"
    except Exception as e:  # a raw backend error: the trial fails on it
        said = f"RAW {type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if out is None:
        holds = None
    else:
        want1 = rt.local_tensor(DST, rank, v1.to(torch.bfloat16))
        want2 = rt.local_tensor(DST, rank, v2.to(torch.bfloat16))
        holds = 1 if bits_equal(out, want1) else 2 if bits_equal(out, want2) else "mix"
    record = dict(rank=rank, said=said, holds=holds, serving=session.serving, seconds=seconds)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    os._exit(0)  # the group is broken: no teardown that could wait on the dead rank


def _run(target, args_by_rank):
    """Runs ``target(*args)`` in a process per rank and waits for all of them, within a bound
    (rank 0's patience is two timeouts, a member's four, plus the start of torch); a rank still
    waiting then fails the test. Returns the processes, ended."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_by_rank]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60 + 6 * TIMEOUT
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still waited after the deadline"
    return procs


TRIALS = [
    (1, "prepare"),
    (0, "prepare"),
    (2, "before-vote"),
    (0, "before-vote"),
    (3, "after-vote"),
    (0, "after-vote"),
    (2, "mid-commit"),
    (0, "mid-commit"),
]


@pytest.mark.parametrize("victim,point", TRIALS)
def test_kill_9_leaves_every_survivor_on_one_whole_version(tmp_path, victim, point):
    port = free_port()
    procs = _run(_trial, [(r, port, victim, point, str(tmp_path)) for r in range(WORLD)])
    assert procs[victim].exitcode == -signal.SIGKILL
    records = {}
    for r in range(WORLD):
        if r == victim:
            continue
        assert procs[r].exitcode == 0, (r, procs[r].exitcode)
        with open(tmp_path / f"rank{r}.json") as f:
            records[r] = json.load(f)
    for rec in records.values():
        assert not rec["said"].startswith("RAW"), rec
        assert rec["seconds"] < 6 * TIMEOUT + 5, rec
        if rec["holds"] is None:
            continue  # rank 0 holds no destination shard
        assert rec["holds"] in (1, 2), rec  # a whole version, never a mix
        if rec["said"] == "committed":
            assert rec["holds"] == 2 and rec["serving"] == 2, rec
        else:
            assert rec["holds"] == 1 and rec["serving"] == 1, rec
    if point in ("prepare", "before-vote"):
        # nobody can have decided to commit without the victim's vote
        assert all(rec["holds"] in (None, 1) for rec in records.values()), records


def _recovering(rank, port, port2, out_dir):
    """Rank 2 dies after the first version; ranks 0 and 1 see PeerLostError naming it, destroy
    the broken group, form a new job of two and refit it exactly."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RESHARD_TIMEOUT=str(TIMEOUT))
    import torch.distributed as dist

    import reshard
    import reshard.torch as rt

    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=120))
    src = reshard.Layout((6, 8), "f32", mesh=2, ranks=[0, 1], placements=["S(0)"])
    dst = reshard.Layout((6, 8), "f32", mesh=2, ranks=[1, 2], placements=["S(1)"])
    full = torch.arange(48, dtype=torch.float32).view(6, 8)
    s = None if rank == 2 else rt.local_tensor(src, rank, full).clone()
    d = None if rank == 0 else torch.zeros(dst.local_shape(rank))
    session = rt.DeltaSession()
    session.prepare({"w": (s, d, src, dst)}, 1)
    session.commit()
    if rank == 2:
        _die()
    record = {}
    try:
        session.prepare({"w": (s, d, src, dst)}, 2)
        record["said"] = "prepared"
    except reshard.ReshardError as e:
        record["said"] = f"{type(e).__name__}: {e}"
    # the job on the old group is over: a call on it raises at once, naming the failure
    try:
        session.refit({"w": (s, d, src, dst)}, 3)
        record["again"] = "refit"
    except reshard.ReshardError as e:
        record["again"] = type(e).__name__
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port2)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    whole = reshard.Layout((6, 8), "f32", mesh=1, ranks=[0], placements=["R"])
    there = reshard.Layout((6, 8), "f32", mesh=1, ranks=[1], placements=["R"])
    out = torch.zeros(6, 8) if rank == 1 else None
    fresh = rt.DeltaSession()
    fresh.prepare({"w": (full if rank == 0 else None, out, whole, there)}, 1)
    fresh.commit()
    record["exact"] = out is None or bool(torch.equal(out, full))
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def test_survivors_name_the_lost_rank_then_form_a_new_job(tmp_path):
    ports = free_port(), free_port()
    procs = _run(_recovering, [(r, *ports, str(tmp_path)) for r in range(3)])
    for r in (0, 1):
        assert procs[r].exitcode == 0, (r, procs[r].exitcode)
        with open(tmp_path / f"rank{r}.json") as f:
            record = json.load(f)
        assert record["said"].startswith("PeerLostError") and "rank 2" in record["said"], record
        assert record["again"] == "PeerLostError", record
        assert record["exact"], record
