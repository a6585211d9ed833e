"""Shared helpers: random layouts, and running a function on several gloo processes."""

import os
import random
import shutil
import socket
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, timeout=None):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **options)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world, *args, timeout=None):
    """Runs ``fn(rank, world, *args)`` in ``world`` processes joined by a gloo process group
    on loopback; a failure in any process fails the test with its traceback. ``timeout`` (in
    seconds) bounds every collective of the group: a rank left waiting for a peer that gave
    up then fails instead of hanging the test until gloo's default of 30 minutes."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), fn, args, timeout), nprocs=world, join=True)


def random_mesh(rng: random.Random, max_ranks: int = 8):
    """A mesh shape of 1 to 3 axes with at most ``max_ranks`` positions."""
    while True:
        dims = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        size = 1
        for d in dims:
            size *= d
        if size <= max_ranks:
            return dims


def random_placements(rng: random.Random, mesh_ndim: int, ndim: int, negative: bool = True):
    """Placements as strings: shards of any dim (repeats make nested sharding), replicas."""
    out = []
    for _ in range(mesh_ndim):
        if ndim == 0 or rng.random() < 0.3:
            out.append("R")
        else:
            d = rng.randrange(ndim)
            if negative and rng.random() < 0.2:
                d -= ndim
            out.append(f"S({d})")
    return out


def random_shape(rng: random.Random, max_ndim: int = 3, max_dim: int = 13):
    """Shapes with uneven, tiny and empty dims."""
    return [rng.choice([0, 1, 2, 3, rng.randint(1, max_dim)]) for _ in range(rng.randint(1, max_ndim))]


def cli_binary():
    """The command-line tool built by ``cargo build``/``cargo test``, to compare messages."""
    if os.environ.get("RESHARD_BIN"):
        return os.environ["RESHARD_BIN"]
    root = Path(__file__).resolve().parents[2]
    for profile in ("debug", "release"):
        path = root / "target" / profile / "reshard"
        if path.exists():
            return str(path)
    return shutil.which("reshard")


@pytest.fixture
def reshard_cli():
    path = cli_binary()
    if path is None:
        pytest.skip("the reshard binary is not built (cargo build) and RESHARD_BIN is unset")
    return path
