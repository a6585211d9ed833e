"""A refit through ``reshard.sglang_loader.load``, SGLang's custom weight loader, into SGLang's own
model classes (built on the CPU over gloo, two tensor-parallel ranks) equals SGLang's own loader
run on the full checkpoint, byte for byte, padding rows included, in the same storage. The
loader is called by SGLang's own weight-update code (scheduler and model runner), inside its
``begin_weight_update`` / ``end_weight_update`` bracket (see ``sglang_worker.py``).

Runs in a virtual environment with SGLang from PyPI (``.ci/run`` makes it); skipped without."""

import pytest

pytest.importorskip("sglang.srt.models.qwen3")

from launch import run  # noqa: E402
from oracle import QWEN3, QWEN3_MOE, case  # noqa: E402

WORLD = 2

DENSE = [
    case("qwen3 from fsdp, configured", QWEN3, "fsdp=2"),
    case("qwen3 from tp, configured from the environment", QWEN3, "tp=2", from_env=True),
]
MOE = [
    case("qwen3-moe from fsdp, configured", QWEN3_MOE, "fsdp=2"),
    case("qwen3-moe from tp, configured from the environment", QWEN3_MOE, "tp=2", from_env=True),
]


def _check(out: str, cases) -> None:
    assert out.count("refused outside begin/end") == WORLD, out
    assert out.count(" exact through SGLang's custom weight loader ") == WORLD * len(cases), out


def test_dense(tmp_path):
    _check(run(WORLD, DENSE, tmp_path, script="sglang_worker.py"), DENSE)


def test_moe(tmp_path):
    _check(run(WORLD, MOE, tmp_path, script="sglang_worker.py"), MOE)
