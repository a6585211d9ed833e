"""The README's RL loop for 3 steps: FSDP2 trainer, vLLM-layout engine, a refit after every
step, the engine's logits bitwise equal to the trainer's with an f32 engine, its weights
bitwise the trainer's in bf16 with a bf16 one (the loop stops otherwise); and with --delta,
the refits after the first sending fewer bytes than dense."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

LOOP = Path(__file__).resolve().parents[1] / "examples" / "rl_loop.py"


def test_rl_loop_three_steps():
    # 4 prompts of 4 tokens: rewards that differ, so that every step changes the weights (with
    # fewer, the rewards can tie and the update vanish, leaving nothing for the refit to move)
    args = [sys.executable, str(LOOP), "--steps", "3", "--engine-dtype", "f32", "--lr", "1e-3"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if " step " in line]
    # a line per step and model: 3 steps and the last refit, for Qwen3 and Qwen3-MoE
    assert len(lines) == 8, done.stdout
    assert all(line.endswith("logits bitwise equal") for line in lines), lines
    assert sum(line.startswith("qwen3_moe") for line in lines) == 4


def test_rl_loop_delta_sends_less_after_the_first_refit():
    # the defaults: f32 masters, Adam at 1e-6, a bf16 engine: few bf16 weights change a step
    args = [sys.executable, str(LOOP), "--steps", "3", "--model", "qwen3", "--delta"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if " step " in line]
    assert len(lines) == 4, done.stdout
    assert all(line.endswith("weights bitwise equal (bf16)") for line in lines), lines
    assert "(first refit)" in lines[0], lines[0]
    # every later refit is a delta of a changed model: fewer bytes sent than the dense refit's
    for line in lines[1:]:
        found = re.search(r"delta: sent ([\d.]+) of ([\d.]+) kB \([\d.]+%\), ([\d.]+)% changed", line)
        assert found, line
        assert 0 < float(found[1]) < float(found[2]) / 4, line
        assert 0 < float(found[3]) < 25, line
        assert re.search(r"changed +[\d.]+%", line), line
