#!/bin/bash
# The served prefix-cache figure (docs/performance.md, "Prefix cache, served"): epd serve with the prefix
# cache on, then off, each load-tested by epd bench serve on the prefix dataset. Usage:
#   scripts/prefix_cache_ab.sh [PORT]        (default 8411; run from the repository root, after make setup)
set -euo pipefail
port=${1:-8411}
for cache in true false; do
  echo "== prefix cache $cache"
  log=$(mktemp)
  EPD_PREFILL__ENGINE__PREFIX_CACHING=$cache EPD_DECODE__ENGINE__PREFIX_CACHING=$cache \
    .venv/bin/epd serve --port "$port" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 180); do grep -q "Uvicorn running" "$log" && break; sleep 1; done
  .venv/bin/epd bench serve --url "http://127.0.0.1:$port" --dataset prefix --num-prefixes 2 --prefix-len 1024 \
    --input-len 64 --output-len 16 --num-prompts 40 --concurrency 2 --warmup 2 --seed 7 --ignore-eos \
    --disable-tqdm | sed -n '/^load/,$p'
  kill -INT "$pid"; wait "$pid" || true
  rm -f "$log"
done
