#!/usr/bin/env bash
# Reshard (mpi, shm, tcp transports) against OpenMPI's MPI_Alltoallw with subarray datatypes,
# on the same data, 6 processes, 8192x8192 bf16. Results in BENCHMARKS.md.
#   cargo build --release --features mpi --examples && bash benches/mpi_compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# OpenMPI busy-polls; with 6 ranks on 2 cores it must yield, or it measures its own spinning.
MPIRUN=(mpirun -n 6 --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
R=target/release/reshard
ITERS=${ITERS:-10}
gbps() { python3 -c "import json,sys; d=json.load(sys.stdin); print(round(134217728/d['seconds']/1e9,2))"; }
for case in "mesh=4 place=S(0)|mesh=2 place=S(1)" "mesh=2 place=S(0)|mesh=4 place=S(1)"; do
  IFS='|' read -r src dst <<< "$case"
  echo "== $src -> $dst"
  printf 'MPI_Alltoallw (subarray types)  %s GB/s\n' \
    "$("${MPIRUN[@]}" target/release/examples/mpi_alltoallw 8192,8192 bf16 "$src" "$dst" "$ITERS" | python3 -c "import json,sys; print(json.load(sys.stdin)['gbps'])")"
  common=(run --shape 8192,8192 --dtype bf16 --src "$src" --dst "$dst" --verify --json --iters "$ITERS" --warmup 2)
  printf 'reshard mpi                     %s GB/s\n' "$("${MPIRUN[@]}" "$R" "${common[@]}" --transport mpi | gbps)"
  printf 'reshard shm                     %s GB/s\n' "$("$R" launch --nproc 6 -- "${common[@]}" --transport shm | gbps)"
  printf 'reshard tcp                     %s GB/s\n' "$("$R" launch --nproc 6 -- "${common[@]}" --transport tcp | gbps)"
done
