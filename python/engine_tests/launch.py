"""Starts the ranks of ``worker.py`` on loopback and reports the first that failed."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
NOISE = (
    "warn",
    "flashinfer",
    "triton",
    "vllm._c",
    "enforce eager",
    "model runner",
    "ssm cache",
    "attempted to load",
    "inductor",
    "opaque",
    "deprecated",
    "writing model shards",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, cases: list, tmp: Path, script: str = "worker.py", timeout: int = 600) -> str:
    """Runs ``cases`` on ``world`` ranks; returns their output, raises with it on a failure."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            VLLM_TARGET_DEVICE="cpu",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), str(spec), str(tmp)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs, failed = [], []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failed.append(rank)
        if p.returncode != 0:
            failed.append(rank)
        lines = [line for line in out.splitlines() if not any(n in line.lower() for n in NOISE)]
        outs.append(f"--- rank {rank} (exit {p.returncode})\n" + "\n".join(lines[-60:]))
    text = "\n".join(outs)
    if failed:
        raise AssertionError(f"ranks {sorted(set(failed))} failed:\n{text}")
    return text
