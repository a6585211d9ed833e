#!/usr/bin/env bash
# The moonshot, modeled (BENCHMARKS.md, "Relay per NVLink domain, modeled"): DeepSeek-V3 and
# Kimi-K2 refits priced on the h100 and gb200 presets, planned on the NVLink domains as hosts
# with relay on and off, beside the domain bound and gather+broadcast.
#   bash benches/moonshot.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
R=target/release/reshard
echo "| model | --train -> --infer | cluster | ranks | relay on | relay off | any plan (domain bound) | gather+broadcast | planning, relay on |"
echo "|---|---|---|---|---|---|---|---|---|"
while read -r model train infer cluster colocated; do
  extra=()
  [ "$colocated" = yes ] && extra=(--colocated)
  row=()
  for relay in on off; do
    start=$(date +%s.%N)
    out=$("$R" refit --model "$model" --train "$train" --infer "$infer" "${extra[@]}" \
      --simulate "$cluster" --relay "$relay")
    took=$(echo "$(date +%s.%N) - $start" | bc)
    row+=("$(echo "$out" | sed -n 's/^  reshard *\([0-9.]* m\?s\).*/\1/p')")
    [ "$relay" = on ] && on_took=$took
    bound=$(echo "$out" | sed -n 's/^  any plan *at least \([0-9.]* m\?s\).*/\1/p')
    gb=$(echo "$out" | sed -n 's/^  gather+broadcast *\([0-9.]* m\?s\).*/\1/p')
  done
  ranks=$([ "$colocated" = yes ] && echo colocated || echo apart)
  printf '| %s | `%s` -> `%s` | %s | %s | %s | %s | %s | %s | %.1f s |\n' \
    "$model" "$train" "$infer" "$cluster" "$ranks" "${row[0]}" "${row[1]}" "$bound" "$gb" "$on_took"
done <<'CASES'
deepseek-v3 ep=16,pp=16,dp=16 tp=32,dp=8 h100 yes
deepseek-v3 ep=16,pp=16,dp=16 tp=32,dp=8 h100 no
deepseek-v3 ep=16,pp=16,dp=16 tp=32,dp=8 gb200 no
deepseek-v3 ep=16,dp=32,pp=4 tp=8,dp=16 gb200 no
deepseek-v3 ep=16,dp=32,pp=4 tp=8,dp=16 h100 no
kimi-k2 ep=16,pp=16,dp=16 tp=32,dp=8 h100 yes
kimi-k2 ep=16,pp=16,dp=16 tp=32,dp=8 h100 no
kimi-k2 ep=16,pp=16,dp=16 tp=32,dp=8 gb200 no
kimi-k2 ep=16,dp=32,pp=4 tp=8,dp=16 gb200 no
CASES
