#!/usr/bin/env bash
# The testbed cost model against measurement (BENCHMARKS.md, "The cost model against
# measurement"): calibrate one core's shared-memory and TCP rates with two ranks on this
# machine, write the testbed files (2 hosts x 4 ranks, 4 hosts x 2 ranks), then run `bench`
# on emulated hosts with --simulate, relay on and off, and print predicted against measured.
# Needs root and iproute2.
#   bash benches/costmodel.sh        (RATE=2gbit ITERS=3 OUT=target/costmodel by default)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
R=target/release/reshard
RATE=${RATE:-2gbit}
ITERS=${ITERS:-3}
OUT=${OUT:-target/costmodel}
mkdir -p "$OUT"
gbit=${RATE%gbit}
shape=(--shape 8192,8192 --dtype bf16)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# calibration: one rank's whole tensor to another rank of this machine, per transport
rate() {
  "$R" launch --nproc 2 -- bench "${shape[@]}" --src "mesh=1 place=R" \
    --dst "mesh=1 ranks=1 place=R" --transport "$1" --iters "$ITERS" --warmup 1 --json \
    | python3 -c 'import json,sys; j=json.load(sys.stdin); print(round(j["dst_bytes"]/j["reshard"]["median_s"]/1e9, 3))'
}
mem=$(rate shm)
tcp=$(rate tcp)
cores=$(nproc)
echo "calibration: memory_gb_s=$mem tcp_gb_s=$tcp cores=$cores"
for map in 2x4 4x2; do
  cat >"$OUT/testbed-$map.json" <<JSON
{"kind": "hosts", "name": "testbed-$map", "hosts": ${map%x*}, "ranks_per_host": ${map#*x},
 "link_gbit": $gbit, "link_latency_us": 0, "memory_gb_s": $mem, "tcp_gb_s": $tcp,
 "cores": $cores, "shared_cpu": true}
JSON
done

run() { # map relay name args...
  local map=$1 relay=$2 name=$3; shift 3
  "$R" launch --hosts "${map%x*}" --nproc 8 --link "$RATE" -- bench "$@" --transport auto \
    --hosts "$map" --relay "$relay" --simulate "$OUT/testbed-$map.json" \
    --iters "$ITERS" --warmup 1 --json >"$OUT/$name-$map-relay-$relay.json"
}
for map in 2x4 4x2; do
  for relay in on off; do
    echo "== $map relay $relay"
    run "$map" "$relay" tp4-s1 "${shape[@]}" --src "mesh=4 place=S(0)" \
      --dst "mesh=4 ranks=4..8 place=S(1)"
    run "$map" "$relay" dp2xtp2 "${shape[@]}" --src "mesh=4 place=S(0)" \
      --dst "mesh=2x2 ranks=4..8 place=R,S(1)"
    run "$map" "$relay" suite --suite refit
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(f"{out}/*-relay-*.json")):
    base = os.path.basename(path)[:-5]
    kind, rest = base.split("-", 1) if base.startswith(("tp4-s1", "dp2xtp2", "suite")) else (base, "")
    j = json.load(open(path))
    relay = base.rsplit("-", 1)[1]
    hosts = base.split("-relay-")[0].rsplit("-", 1)[1]
    cases = j["cases"] if "cases" in j else [dict(j, name=base.split("-" + hosts)[0])]
    for c in cases:
        rows.setdefault((hosts, c["name"]), {})[relay] = c
err = lambda p, m: f"{(p / m - 1) * 100:+.0f}%"
print("| hosts | case | link ratio | reshard relay on: measured / predicted / error | relay off | gather+broadcast (relay-on run) | g+b (relay-off run) |")
print("|---|---|---|---|---|---|---|")
for (hosts, name), by in sorted(rows.items()):
    cell = lambda m: f"{m['median_s']*1e3:.0f} / {m['predicted_s']*1e3:.0f} ms / {err(m['predicted_s'], m['median_s'])}"
    on, off = by.get("on"), by.get("off")
    print(f"| {hosts} | {name} | {on.get('link_ratio', 0):.2f} | {cell(on['reshard'])} | {cell(off['reshard'])} | {cell(on['gather_broadcast'])} | {cell(off['gather_broadcast'])} |")
PY
