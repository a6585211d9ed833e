#!/usr/bin/env bash
# Everything BENCHMARKS.md compares between processes, in one run, on the same data (6
# processes, an 8192x8192 bf16 tensor, 4 x S(0) -> 2 x S(1) and 2 x S(0) -> 4 x S(1)):
#   reshard over tcp, shm and mpi; a raw loopback socket stream; memcpy; OpenMPI's
#   MPI_Alltoallw with subarray datatypes; PyTorch's batch_isend_irecv over gloo.
# Needs OpenMPI (libopenmpi-dev openmpi-bin libclang-dev) and, for gloo, torch from PyPI.
#   bash benches/compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release --features mpi --examples --quiet
# OpenMPI busy-polls; with 6 ranks on 2 cores it must yield, or it measures its own spinning.
MPIRUN=(mpirun -n 6 --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
R=target/release/reshard
ITERS=${ITERS:-10}
gbps() { python3 -c "import json,sys; d=json.load(sys.stdin); print(round(134217728/d['seconds']/1e9,2))"; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['gbps'])"; }

echo "== raw transports, and reshard over tcp and shm"
cargo bench --quiet --features mpi --bench transports

for case in "mesh=4 place=S(0)|mesh=2 place=S(1)|0|1|4|2" "mesh=2 place=S(0)|mesh=4 place=S(1)|0|1|2|4"; do
  IFS='|' read -r src dst sdim ddim nsrc ndst <<< "$case"
  echo "== $src -> $dst"
  common=(run --shape 8192,8192 --dtype bf16 --src "$src" --dst "$dst" --verify --json --iters "$ITERS" --warmup 2)
  printf 'reshard tcp                     %s GB/s\n' "$("$R" launch --nproc 6 -- "${common[@]}" --transport tcp | gbps)"
  printf 'reshard shm                     %s GB/s\n' "$("$R" launch --nproc 6 -- "${common[@]}" --transport shm | gbps)"
  printf 'reshard mpi                     %s GB/s\n' "$("${MPIRUN[@]}" "$R" "${common[@]}" --transport mpi | gbps)"
  printf 'MPI_Alltoallw (subarray types)  %s GB/s\n' \
    "$("${MPIRUN[@]}" target/release/examples/mpi_alltoallw 8192,8192 bf16 "$src" "$dst" "$ITERS" | field)"
  if python3 -c "import torch" 2>/dev/null; then
    printf 'torch gloo batch_isend_irecv    %s GB/s\n' \
      "$(python3 benches/gloo_reshard.py --src "$nsrc" --src-dim "$sdim" --dst "$ndst" --dst-dim "$ddim" --iters "$ITERS" 2>/dev/null | field)"
  fi
done
