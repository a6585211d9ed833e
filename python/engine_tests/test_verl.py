"""reshard as verl's checkpoint engine ("reshard", from verl's own registry): verl's FSDP2
shard export on 2 trainer ranks, moved into 2 rollout ranks (replicated, or split over tp=2),
equals the trainer's full tensors (gathered by torch, DTensor.full_tensor()) byte for byte; a
shard that is no DTensor split is refused on every rank, naming it; an export that raises is
heard by every rank. CPU and gloo, each side in a world of its own, as verl runs them
(verl_worker.py); the test plays verl's CheckpointEngineManager between them. Below, the
layouts every rank derives from ShardSpecs (HSDP, FSDP2 x TP, explicit places), in-process.

Runs in a virtual environment with verl from PyPI (``.ci/run`` makes it); skipped without."""

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

HERE = Path(__file__).parent
ROUNDS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def put(path: Path, obj) -> None:
    part = path.with_suffix(".part")
    part.write_bytes(pickle.dumps(obj))
    os.replace(part, path)


def same_bytes(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def play_manager(tmp: Path, procs, timeout: float = 240) -> None:
    """verl's CheckpointEngineManager.build_process_group, once per round: every worker's
    prepare() metadata (actors first) into build_topology, its answer to each worker."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("reshard.verl_backend")
    engine_cls = CheckpointEngineRegistry.get("reshard")
    workers = ["trainer0", "trainer1", "rollout0", "rollout1"]
    end = time.time() + timeout
    for rnd in range(ROUNDS):
        paths = [tmp / f"meta-{rnd}-{w}.pkl" for w in workers]
        while not all(p.exists() for p in paths):
            if time.time() > end or any(p.poll() not in (None, 0) for p in procs):
                return  # the workers' output says why
            time.sleep(0.05)
        metadata = [pickle.loads(p.read_bytes()) for p in paths]
        actor_kwargs, rollout_kwargs = engine_cls.build_topology(2, 2, metadata)
        for i, w in enumerate(workers[:2]):
            put(tmp / f"kw-{rnd}-{w}.pkl", {k: v[i] for k, v in actor_kwargs.items()})
        for i, w in enumerate(workers[2:]):
            put(tmp / f"kw-{rnd}-{w}.pkl", {k: v[i] for k, v in rollout_kwargs.items()})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl")
    ports = {"trainer": free_port(), "rollout": free_port()}
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs, names = [], []
    for role in ("trainer", "rollout"):
        for i in range(2):
            cmd = [sys.executable, str(HERE / "verl_worker.py"), role, str(i), str(tmp), str(ports[role])]
            with open(tmp / f"{role}{i}.log", "w") as log:  # a file: a pipe could fill and stall it
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            names.append(f"{role}{i}")
    try:
        play_manager(tmp, procs)
        end = time.time() + 240
        while time.time() < end and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # the others may still fail on their own, then they are stopped
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [(p.wait(), (tmp / f"{n}.log").read_text())[1] for n, p in zip(names, procs)]
    failed = [n for n, p in zip(names, procs) if p.returncode != 0]
    if failed:
        text = "\n".join(
            f"--- {n} (exit {p.returncode})\n" + "\n".join(o.splitlines()[-40:])
            for n, p, o in zip(names, procs, outs)
        )
        raise AssertionError(f"workers {failed} failed:\n{text}")
    return tmp


def test_fsdp2_shards_into_replicated_rollout(run):
    oracle = torch.load(run / "oracle.pt")
    assert len(oracle) == 25 and oracle["model.embed_tokens.weight"].shape == (1001, 64)
    for i in range(2):
        got = torch.load(run / f"recv-0-rollout{i}.pt")
        assert list(got) == list(oracle)  # verl's order, every tensor once
        for name, full in oracle.items():
            assert full.dtype == torch.bfloat16
            assert same_bytes(got[name], full), name
    metrics = pickle.loads((run / "metrics-trainer0.pkl").read_bytes())
    assert metrics["checkpoint_engine/reshard_tensors"] == 25


def test_refused_on_every_rank_naming_the_parameter(run):
    for w in ("trainer0", "trainer1", "rollout0", "rollout1"):
        said = pickle.loads((run / f"refusal-{w}.pkl").read_bytes())
        assert said.startswith("reshard.ArgumentError: bad.weight: ShardSpec.place"), (w, said)
        assert "no DTensor split" in said, said


def test_a_failing_export_is_heard_by_every_rank(run):
    said = {
        w: pickle.loads((run / f"failure-{w}.pkl").read_bytes())
        for w in ("trainer0", "trainer1", "rollout0", "rollout1")
    }
    assert said.pop("trainer1") == "builtins.RuntimeError: the export failed here"
    for w, text in said.items():
        assert text == (
            "reshard.AgreementError: nothing was moved: trainer rank 1's export raised "
            "RuntimeError: the export failed here"
        ), (w, text)


def test_full_pairs_after_a_refusal_on_the_same_group(run):
    oracle = torch.load(run / "oracle.pt")
    for i in range(2):
        got = torch.load(run / f"recv-3-rollout{i}.pt")
        assert list(got) == list(oracle)
        for name, full in oracle.items():
            assert same_bytes(got[name], full), name


def test_fsdp2_shards_into_tp2_rollout(run):
    oracle = torch.load(run / "oracle.pt")
    dims = {
        "q_proj": 0,
        "k_proj": 0,
        "v_proj": 0,
        "gate_proj": 0,
        "up_proj": 0,
        "o_proj": 1,
        "down_proj": 1,
        "embed_tokens": 0,
        "lm_head": 0,
    }
    for i in range(2):
        got = torch.load(run / f"recv-4-rollout{i}.pt")
        assert list(got) == list(oracle)
        for name, full in oracle.items():
            dim = next((d for key, d in dims.items() if key in name), None)
            want = full if dim is None else torch.chunk(full, 2, dim)[i].contiguous()
            assert same_bytes(got[name], want), name
    # the odd vocabulary: 501 rows on one rollout rank, 500 on the other
    assert torch.load(run / "recv-4-rollout1.pt")["lm_head.weight"].shape == (500, 64)


# ---- the layouts every rank derives from the trainer ranks' ShardSpecs (no processes) ----


def derive(specs, shape, tp=1, rules=()):
    """``specs[r]`` is trainer rank r's (local shard, ShardSpec); two rollout ranks follow."""
    from reshard import _verl_specs, verl_backend

    actors = len(specs)
    heard = [
        dict(world_rank=r, rollout_tp=tp, rollout_shard_dims=list(rules), rollout_dtype=None)
        for r in range(actors + 2)
    ]
    job = verl_backend._Job(heard, actors, actors, torch.device("cpu"))
    said = []
    for local, spec in specs:
        name, desc, _ = _verl_specs.describe(("w", local, spec))
        said.append(dict(names=[name], descs=[desc], last=True, failed=None))
    (entry,), last = job.agree(said + [None, None])
    return entry


def regions(layout, ranks):
    return [layout.local_region(r) for r in ranks]


def fake_mesh(shape):
    from types import SimpleNamespace

    return SimpleNamespace(mesh=torch.arange(4).reshape(shape), ndim=len(shape))


def test_hsdp_and_fsdp_tp_specs_become_their_boxes():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from verl.workers.engine.spec import ShardSpec

    hsdp = ShardSpec(full_shape=(6, 4), mesh=fake_mesh((2, 2)), placements=(Replicate(), Shard(0)))
    _, src, dst, _ = derive([(torch.zeros(12), hsdp)] * 4, (6, 4))
    assert regions(src, range(4)) == [((0, 0), (3, 4)), ((3, 0), (3, 4))] * 2
    assert regions(dst, (4, 5)) == [((0, 0), (6, 4))] * 2
    # FSDP2 over TP: torch shards over tp first, then dp within each tp shard
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    fsdp_tp = ShardSpec(full_shape=(8, 4), mesh=fake_mesh((2, 2)), placements=strided)
    _, src, _, _ = derive([(torch.zeros(8), fsdp_tp)] * 4, (8, 4))
    assert [r[0][0] for r in regions(src, range(4))] == [0, 4, 2, 6]


def test_explicit_places_that_are_a_dtensor_split_and_identity_slots():
    from verl.workers.engine.spec import BlockPlacement, ShardSpec

    from reshard import ArgumentError

    flat = [
        (torch.zeros(9), ShardSpec(full_shape=(5, 3), place=0)),
        (torch.zeros(6), ShardSpec(full_shape=(5, 3), place=9)),
    ]
    _, src, _, _ = derive(flat, (5, 3))
    assert regions(src, (0, 1)) == [((0, 0), (3, 3)), ((3, 0), (2, 3))]
    slots = [("e0", (3,)), ("e1", (3,)), ("e2", (3,)), ("e3", (3,)), ("e4", (3,))]
    blocks = [
        (
            torch.zeros(3),
            ShardSpec(full_shape=(5, 3), place=BlockPlacement((1, 3), (0, 0), (5, 3)), hf_slots=slots),
        ),
        (
            torch.zeros(12),
            ShardSpec(full_shape=(5, 3), place=BlockPlacement((4, 3), (1, 0), (5, 3)), hf_slots=slots),
        ),
    ]
    with pytest.raises(ArgumentError, match=r"^w: ShardSpec.place: .* no DTensor split"):
        derive(blocks, (5, 3))  # 1 + 4 rows is no torch.chunk split of 5 (3 + 2)
    blocks[0] = (
        torch.zeros(9),
        ShardSpec(full_shape=(5, 3), place=BlockPlacement((3, 3), (0, 0), (5, 3)), hf_slots=slots),
    )
    blocks[1] = (
        torch.zeros(6),
        ShardSpec(full_shape=(5, 3), place=BlockPlacement((2, 3), (3, 0), (5, 3)), hf_slots=slots),
    )
    _, src, _, got = derive(blocks, (5, 3))
    assert regions(src, (0, 1)) == [((0, 0), (3, 3)), ((3, 0), (2, 3))] and got == tuple(slots)


def test_refusals_name_the_parameter():
    from torch.distributed.tensor import Partial, Shard
    from verl.workers.engine.spec import ShardSpec

    from reshard import ArgumentError

    partial = ShardSpec(full_shape=(4,), mesh=fake_mesh((4,)), placements=(Partial(),))
    with pytest.raises(ArgumentError, match=r"^w: ShardSpec.placements: .*Partial"):
        derive([(torch.zeros(4), partial)] * 4, (4,))
    converter = ShardSpec(
        full_shape=(4, 2), mesh=fake_mesh((4,)), placements=(Shard(0),), to_hf_chunk=lambda start, seg: []
    )
    with pytest.raises(ArgumentError, match=r"^w: ShardSpec.to_hf_chunk"):
        derive([(torch.zeros(2), converter)] * 4, (4, 2))
    plain = ShardSpec(full_shape=(4, 2), mesh=fake_mesh((4,)), placements=(Shard(0),))
    with pytest.raises(ArgumentError, match=r"^w: rollout_shard_dims: dim 2"):
        derive([(torch.zeros(2), plain)] * 4, (4, 2), tp=2, rules=[("w", 2)])
