#!/bin/bash
# The routing verdict (docs/performance.md, "Cache-aware routing, served"): epd serve with two replicas of the
# pool that computes prompts, under each routing policy, load-tested by epd bench serve on
#   - the prefix dataset: 8 shared 1,024-token prefixes (512 KV blocks) with 64-token suffixes, against
#     replicas whose KV pools hold 384 blocks each: all the prefixes fit in the two pools together, not in one;
#   - the random dataset (no shared prefix), to show what the policy costs where there is nothing to reuse.
# Usage (from the repository root, after make setup):
#   scripts/routing_ab.sh [disaggregated|colocated] [PORT] [POLICY...]
#     disaggregated (default): 2 prefill replicas + 1 decode; colocated: 2 decode replicas computing whole requests
#     POLICY: the policies to compare (default: least_loaded prefix_affinity)
set -euo pipefail
mode=${1:-disaggregated}
port=${2:-8412}
shift $(($# < 2 ? $# : 2))
policies=("$@")
[ $# -gt 0 ] || policies=(least_loaded prefix_affinity)
pool=prefill
[ "$mode" = colocated ] && pool=decode
pool_env=$(echo "$pool" | tr a-z A-Z)
# "HITS QUERIES": the prefix-cache counters of $pool's workers (prompt tokens), summed from /metrics
counters() {
  sleep 3  # a heartbeat's worth (scheduler.heartbeat_ttl_s / 3): the counters ride on heartbeats
  curl -s "http://127.0.0.1:$port/metrics" | awk -v pool="pool=\"$pool\"" '
    index($0, pool) && /^epd:prefix_cache_hits_total/ {h += $NF}
    index($0, pool) && /^epd:prefix_cache_queries_total/ {q += $NF}
    END {printf "%d %d\n", h, q}'
}
for policy in "${policies[@]}"; do
  echo "== $mode, routing_policy $policy"
  log=$(mktemp)
  env EPD_SCHEDULER__ROUTING_POLICY="$policy" "EPD_${pool_env}__REPLICAS=2" \
    "EPD_${pool_env}__ENGINE__KV_CACHE_BYTES=$((48 * 1024 * 1024))" \
    .venv/bin/epd serve --mode "$mode" --port "$port" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do grep -q "Uvicorn running" "$log" && break; sleep 1; done
  grep -q "Uvicorn running" "$log" || { cat "$log"; kill -INT "$pid"; exit 1; }
  for dataset in prefix random; do
    echo "-- $dataset"
    read -r h0 q0 < <(counters)
    .venv/bin/epd bench serve --url "http://127.0.0.1:$port" --dataset "$dataset" --num-prefixes 8 \
      --prefix-len 1024 --input-len "$([ "$dataset" = prefix ] && echo 64 || echo 1088)" --output-len 8 \
      --num-prompts "${NUM_PROMPTS:-96}" --concurrency 4 --warmup 2 --seed 7 --ignore-eos --disable-tqdm \
      | sed -n '/^load/,$p'
    read -r h1 q1 < <(counters)
    awk -v h=$((h1 - h0)) -v q=$((q1 - q0)) -v pool="$pool" \
      'BEGIN {printf "  prefix cache  %s pool: %d of %d prompt tokens looked up were cached (%.0f%%)\n", pool, h, q, q ? 100 * h / q : 0}'
  done
  kill -INT "$pid"; wait "$pid" || true
  rm -f "$log"
done
