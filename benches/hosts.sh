#!/usr/bin/env bash
# Emulated hosts (BENCHMARKS.md, "Across emulated hosts"): 2 hosts x 4 ranks, 2 Gbit/s links,
# `reshard bench` over auto (shared memory inside a host, tcp across), then in the same
# topology one rank to one rank over reshard's tcp, and a plain socket stream (Python) from
# host 0 to host 1. Needs root and iproute2.
#   bash benches/hosts.sh            (RATE=2gbit ITERS=5 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
R=target/release/reshard
RATE=${RATE:-2gbit}
ITERS=${ITERS:-5}
shape=(--shape 8192,8192 --dtype bf16)

echo "== bench, 2 hosts x 4 ranks, $RATE links, auto"
"$R" launch --hosts 2 --nproc 8 --link "$RATE" -- bench "${shape[@]}" \
  --src "mesh=4 place=S(0)" --dst "mesh=4 ranks=4..8 place=S(1)" --transport auto \
  --iters "$ITERS" --warmup 1

echo "== one rank to one rank across the link, reshard over tcp (the whole tensor)"
"$R" launch --hosts 2 --nproc 2 --link "$RATE" -- run "${shape[@]}" \
  --src "mesh=1 place=R" --dst "mesh=1 ranks=1 place=R" --transport tcp

echo "== a plain socket stream across the link (128 MiB in 4 MiB writes)"
# a slow job holds the namespaces while the stream runs in them; killed after
mark="hosts-bench-$$"
RESHARD_BENCH_MARK=$mark "$R" launch --hosts 2 --nproc 2 --link "$RATE" -- bench \
  --shape 64,64 --src "mesh=1 place=R" --dst "mesh=1 ranks=1 place=R" --iters 1000000 \
  >/dev/null 2>&1 &
job=$!
trap 'kill -9 $job 2>/dev/null || true' EXIT
sleep 2
pids=$(grep -l "RESHARD_BENCH_MARK=$mark" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true)
h0=""; h1=""
for p in $pids; do
  case "$(tr '\0' ' ' </proc/$p/cmdline)" in
    *" bench "*) ;;
    *) continue ;;
  esac
  case "$(tr '\0' '\n' </proc/$p/environ | grep '^RESHARD_HOST=' || true)" in
    RESHARD_HOST=host0) h0=$p ;;
    RESHARD_HOST=host1) h1=$p ;;
  esac
done
nsenter --net=/proc/$h1/ns/net python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.87.0.2", 29999)); s.listen(1); c, _ = s.accept()
buf = bytearray(4 << 20); n = 0
while n < (128 << 20):
    got = c.recv_into(buf); n += got
    if not got: break
c.sendall(b"k")
' &
recv=$!
sleep 0.5
nsenter --net=/proc/$h0/ns/net python3 -c '
import socket, time
buf = bytes(4 << 20)
s = socket.create_connection(("10.87.0.2", 29999))
t = time.perf_counter()
for _ in range(32): s.sendall(buf)
s.recv(1)
dt = time.perf_counter() - t
print(f"raw socket: 128 MiB in {dt*1e3:.1f} ms, {(128 << 20) / dt / 1e9:.3f} GB/s")
'
wait $recv
