"""The README's RL loop for 3 steps: FSDP2 trainer, vLLM-layout engine, a refit after every
step, the engine's logits bitwise equal to the trainer's (the loop stops otherwise)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

LOOP = Path(__file__).resolve().parents[1] / "examples" / "rl_loop.py"


def test_rl_loop_three_steps():
    args = [sys.executable, str(LOOP), "--steps", "3", "--tokens", "2", "--batch", "2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if " step " in line]
    # a line per step and model: 3 steps and the last refit, for Qwen3 and Qwen3-MoE
    assert len(lines) == 8, done.stdout
    assert all(line.endswith("logits bitwise equal") for line in lines), lines
    assert sum(line.startswith("qwen3_moe") for line in lines) == 4
