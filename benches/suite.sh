#!/usr/bin/env bash
# The reshard-vs-gather+broadcast tables of BENCHMARKS.md, in one run: `reshard bench --suite
# refit` on every transport (8 processes, or 8 threads for local; under mpirun both `mpi` and
# `auto`, which puts the ranks of one host in shared memory), and MPI's own collectives
# (MPI_Allgatherv + MPI_Bcast) on the suite's layouts that shard dim 0 on the source, next to
# the same layouts' gather+broadcast baseline over the mpi transport.
# Needs OpenMPI (libopenmpi-dev openmpi-bin libclang-dev).
#   bash benches/suite.sh            (SUITE_BYTES=128MiB ITERS=5 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release --features mpi --bins --examples --quiet
MPIRUN=(mpirun -n 8 --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
R=target/release/reshard
BYTES=${SUITE_BYTES:-128MiB}
ITERS=${ITERS:-5}
common=(bench --suite refit --suite-bytes "$BYTES" --iters "$ITERS" --warmup 1)

echo "== local (threads)"
"$R" "${common[@]}" --transport local
for t in tcp shm; do
  echo "== $t (8 processes)"
  "$R" launch --nproc 8 -- "${common[@]}" --transport "$t"
done
echo "== mpi (8 processes)"
"${MPIRUN[@]}" "$R" "${common[@]}" --transport mpi
echo "== auto under mpirun (8 processes: shared memory on this host, notices over MPI)"
"${MPIRUN[@]}" "$R" "${common[@]}" --transport auto

echo "== the baseline against MPI's own collectives, same data (8192x8192 bf16)"
median() { python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['gather_broadcast']['median_s']*1e3,1) if 'gather_broadcast' in d else round(d['median_s']*1e3,1))"; }
for case in "mesh=4 place=S(0)|mesh=4 place=S(1)" "mesh=4 place=S(0)|mesh=2 place=S(1)" \
            "mesh=2x2 place=R,S(0)|mesh=4 place=S(1)" "mesh=2 place=S(0)|mesh=4 place=S(1)" \
            "mesh=2 place=R|mesh=4 place=R"; do
  IFS='|' read -r src dst <<< "$case"
  one=(bench --shape 8192,8192 --dtype bf16 --src "$src" --dst "$dst" --iters "$ITERS" --warmup 1 --json)
  mpi_ms=$("${MPIRUN[@]}" target/release/examples/mpi_gather_bcast 8192,8192 bf16 "$src" "$dst" "$ITERS" | median)
  ours_mpi=$("${MPIRUN[@]}" "$R" "${one[@]}" --transport mpi | median)
  ours_shm=$("$R" launch --nproc 8 -- "${one[@]}" --transport shm | median)
  printf '%-24s -> %-20s MPI_Allgatherv+MPI_Bcast %8s ms | baseline over mpi %8s ms | over shm %8s ms\n' \
    "$src" "$dst" "$mpi_ms" "$ours_mpi" "$ours_shm"
done
