#!/usr/bin/env bash
# The GPU smoke test of the Python path, for a machine with at least two CUDA devices: builds
# the extension (`maturin develop`, nothing else) and runs python/tests/test_gpu.py alone,
# verbosely (extra arguments go to pytest). It installs nothing: torch with CUDA and NCCL,
# pytest and maturin must be in the Python environment already (the active one, else
# target/pyvenv). Where torch sees fewer than two CUDA devices, every test is skipped and
# the summary says why.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
if [[ -z "${VIRTUAL_ENV:-}" && -f target/pyvenv/bin/activate ]]; then
    # shellcheck disable=SC1091
    source target/pyvenv/bin/activate
fi
for tool in python maturin; do
    command -v "$tool" >/dev/null || { echo "gpu_check: $tool is not on PATH (this script installs nothing)" >&2; exit 2; }
done
python -c 'import pytest, torch' || { echo "gpu_check: pytest and torch must be installed (this script installs nothing)" >&2; exit 2; }
python -c 'import torch, torch.distributed as dist
nccl = "yes" if dist.is_nccl_available() else "no"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} CUDA device(s), NCCL {nccl}")'
if command -v nvidia-smi >/dev/null; then nvidia-smi -L || true; fi
(cd python && maturin develop -q)
exec python -m pytest -v -rs python/tests/test_gpu.py "$@"
