#!/usr/bin/env bash
# `make gpu-check`: the GPU engine's and the GPU KV path's checks on a CUDA machine, offline, within a time
# budget (GPU_CHECK_BUDGET seconds, default 560: inside a 600-second device command).
#   env        the environment, one line each (rc 2 and one line saying what is missing when it cannot run)
#   wire       the generated protobuf/gRPC code imports (the KV steps need it; see docs/gpu.md)
#   model      the 1b preset (random weights, TinyLlama-1.1B's shape) written here, unless GPU_CHECK_MODEL_DIR
#              names a folder that holds one; made on the CPU in the background while the next three run, all
#              four at once (none of those tests sizes its KV pool from free memory)
#   kernels    the Triton kernel tests, compiled for this GPU; kv-unit: the codec, re-quantise and checksum
#              kernels and device placement
#   kv-cuda    the cuda-marked KV tests (DisaggPair on cuda for every codec and transport, CUDA IPC, an IPC
#              handle mapped by a second process, the sink's re-quantising kernel, the torch quantised write
#              and codecs giving the CPU's bits on CUDA)
#   cuda       tests/cuda on the preset: HF parity with graphs on, batching invariance, eager past the largest
#              bucket, pool sizing
#   bench      `epd bench engine --device cuda`: decode batch 1 and 128 (and sampled at 128), prefill 2,048,
#              roofline, KV pool, peak memory, graph capture time
#   bench-kv   `epd bench kv --device cuda`
# GPU_CHECK_STEPS (a comma list of the step names above; default all) runs only those, for a second, shorter
# call after a first one named what failed; the preset is written only when cuda or bench is asked for.
# Every step has a hard time limit (the smaller of its own and what is left of the budget; pytest also
# stops any one test after --timeout seconds), a step that fails does not stop the next, and the end prints
# a summary: each step's status and time, every failed test, and the benchmarks' figures.
# The system python runs it (GPU_CHECK_PYTHON, default python3), never .venv and never pip. Everything
# printed is kept in .gpu-check/report.txt, the summary in .gpu-check/summary.txt; when $OUT names a folder
# (the device tool's), those and the benchmarks' JSON are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_CHECK_PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-$PWD/.gpu-check}  # what it writes (a test points it elsewhere)
LOGS=$DIR/logs
mkdir -p "$LOGS"
rm -f "$LOGS"/* "$DIR"/bench.json "$DIR"/bench-kv.json "$DIR"/summary.txt
exec > >(tee "$DIR/report.txt") 2>&1
BUDGET=${GPU_CHECK_BUDGET:-560}
START=$SECONDS
VER=$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
export GPU_CHECK_EXTRA="$PWD/.gpu-deps/py$VER"
WIRE_DIR="$PWD/.gpu-deps/py$VER-wire"
export PYTHONPATH="$PWD:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export COLUMNS=250  # pytest's FAILED lines keep their message (cut to the terminal's width, 80 when piped)
# Nothing can be fetched here: Hugging Face libraries must not try (and wait on) the network, nor reach for
# kernels from the Hub (transformers' USE_HUB_KERNELS, on by default in recent versions).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=0
PYTEST=(pytest -q -p no:cacheprovider -W default -ra)

STEPS=",${GPU_CHECK_STEPS:-kernels,kv-unit,kv-cuda,cuda,bench,bench-kv},"
for s in ${STEPS//,/ }; do
  case $s in kernels|kv-unit|kv-cuda|cuda|bench|bench-kv) ;;
    *) echo "gpu-check: GPU_CHECK_STEPS names '$s', which is not a step (kernels, kv-unit, kv-cuda, cuda, bench," \
         "bench-kv)"; exit 2 ;;
  esac
done
wanted() { [[ $STEPS == *",$1,"* ]]; }
NAMES=() STATUS=() TIMES=()
note() { NAMES+=("$1"); STATUS+=("$2"); TIMES+=("$3"); }
left() { echo $((BUDGET - (SECONDS - START))); }

# step NAME CAP CMD...: run CMD under `timeout` (CAP seconds, or what is left of the budget less 20 s for the
# summary), its output shown and kept in $LOGS/NAME.log; records ok / rc N / timeout / skipped.
step() {
  local name=$1 cap=$2; shift 2
  wanted "$name" || return 0
  local t; t=$(left); t=$((t - 20 < cap ? t - 20 : cap))
  echo "== $name ($((SECONDS - START)) s so far, limit ${t} s)"
  if [ "$t" -lt 10 ]; then
    echo "gpu-check: $name skipped, the time budget ($BUDGET s) is spent"
    note "$name" skipped 0
    return 1
  fi
  local t0=$SECONDS rc
  timeout -k 10 "$t" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) note "$name" ok $((SECONDS - t0)) ;;
    124|137) note "$name" "timeout after ${t}s" $((SECONDS - t0)) ;;
    *) note "$name" "rc $rc" $((SECONDS - t0)) ;;
  esac
  return "$rc"
}
# start NAME CAP CMD...: `step` in the background, its output only in $LOGS/NAME.log; finish waits for every
# started step, then shows and records each. For test steps that can share the GPU (none sizes its KV pool
# from free memory), so they overlap each other and the preset's writing.
BG=() BG_PIDS=()
start() {
  local name=$1 cap=$2; shift 2
  wanted "$name" || return 0
  local t; t=$(left); t=$((t - 20 < cap ? t - 20 : cap))
  if [ "$t" -lt 10 ]; then
    echo "gpu-check: $name skipped, the time budget ($BUDGET s) is spent"
    note "$name" skipped 0
    return 1
  fi
  echo "== $name: started in the background ($((SECONDS - START)) s so far, limit ${t} s)"
  ( t0=$SECONDS; timeout -k 10 "$t" "$@" </dev/null >"$LOGS/$name.log" 2>&1
    echo "$? $((SECONDS - t0)) $t" >"$LOGS/$name.rc" ) &
  BG+=("$name") BG_PIDS+=($!)
}
finish() {
  local name rc secs t
  [ ${#BG_PIDS[@]} -gt 0 ] && wait "${BG_PIDS[@]}"
  for name in "${BG[@]}"; do
    read -r rc secs t <"$LOGS/$name.rc" || { rc=1 secs=0 t=0; }
    echo "== $name (rc $rc in $secs s)"
    cat "$LOGS/$name.log"
    case $rc in
      0) note "$name" ok "$secs" ;;
      124|137) note "$name" "timeout after ${t}s" "$secs" ;;
      *) note "$name" "rc $rc" "$secs" ;;
    esac
  done
  BG=() BG_PIDS=()
}
RUN=("$PY" scripts/gpu_run.py)  # an array, not a function: `timeout` runs programs
# The test files of a list that exist (pytest refuses a whole run over one missing path).
existing() { local f; for f in "$@"; do [ -e "$f" ] && echo "$f"; done; }

summary() {
  {
    echo
    echo "== summary: $((SECONDS - START)) s of a $BUDGET s budget"
    cat "$LOGS/env.txt"
    local i
    for i in "${!NAMES[@]}"; do
      local tail=""
      [ -f "$LOGS/${NAMES[$i]}.log" ] && tail=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s' \
        "$LOGS/${NAMES[$i]}.log" | tail -1 | tr -d '=' | sed 's/^ *//')
      printf '%-10s %-18s %5ss  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${TIMES[$i]}" "$tail"
    done
    local failed
    failed=$(grep -hE '^(FAILED|ERROR) |^gpu-check: |CUDA graph capture failed' "$LOGS"/*.log 2>/dev/null | \
      cut -c1-300 | head -60)
    if [ -n "$failed" ]; then echo "-- failures"; echo "$failed"; fi
    for i in "${!NAMES[@]}"; do  # a step that failed without a test failure: its last lines
      if [[ ${STATUS[$i]} != ok* ]] && [ -f "$LOGS/${NAMES[$i]}.log" ] && \
          ! grep -qE '^(FAILED|ERROR) ' "$LOGS/${NAMES[$i]}.log"; then
        echo "-- ${NAMES[$i]} (${STATUS[$i]}), its last lines:"
        grep -v '^\s*$' "$LOGS/${NAMES[$i]}.log" | tail -4 | cut -c1-300
      fi
    done
    if [ -f "$LOGS/bench.log" ]; then
      echo "-- bench engine"
      grep -E '^(model |device copy|figure|decode |sampled |prefill |KV pool|FAILED)' "$LOGS/bench.log"
    fi
    if [ -f "$LOGS/bench-kv.log" ]; then
      echo "-- bench kv"
      sed -n '/^figure/,$p' "$LOGS/bench-kv.log" | grep -E '^(figure|FAILED )|[0-9]x$' | head -40  # no tracebacks
      grep -E '^device copy' "$LOGS/bench-kv.log"
    fi
  } | tee "$DIR/summary.txt"
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$DIR"/report.txt "$DIR"/summary.txt "$OUT"/ 2>/dev/null
    cp "$DIR"/bench.json "$DIR"/bench-kv.json "$OUT"/ 2>/dev/null
  fi
}
# before the summary's trap: without CUDA (or a module), one line and rc 2
timeout -k 10 120 $PY scripts/gpu_run.py env 2>&1 | tee "$LOGS/env.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
trap summary EXIT
command -v nvidia-smi >/dev/null && timeout 10 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
  --format=csv,noheader | tee -a "$LOGS/env.txt"

# The wire's generated code (ignored by git: carry proto/epd to the device, see docs/gpu.md). Generated here
# only when missing and grpc_tools is installed. If the system's protobuf/grpcio are older than the code needs,
# .gpu-deps/pyXY-wire (make gpu-deps) supplies theirs, put first on the path of the KV steps only.
if ! ls proto/epd/kvtransfer/v1/kvtransfer_pb2.py >/dev/null 2>&1 && $PY -c 'import grpc_tools' 2>/dev/null; then
  $PY -m grpc_tools.protoc -I proto --python_out=proto --grpc_python_out=proto --pyi_out=proto \
    $(find proto -name '*.proto') && touch proto/epd/.generated
fi
WIRE_IMPORT='import os, google.protobuf as p, grpc, epd.kvtransfer.v1.kvtransfer_pb2_grpc, epd.worker.v1.worker_pb2_grpc
print("wire: protobuf", p.__version__, "grpcio", grpc.__version__, "from", os.path.dirname(os.path.dirname(p.__file__)))'
WIRE=()
if ! ls proto/epd/kvtransfer/v1/kvtransfer_pb2.py >/dev/null 2>&1; then
  echo "gpu-check: proto/epd/*_pb2*.py are missing (generated, not committed): carry proto/epd; the KV steps are skipped"
  note wire missing 0
  WIRE=(false)
elif timeout -k 10 60 $PY -c "$WIRE_IMPORT" 2>"$LOGS/wire.err"; then
  note wire ok 0
elif [ -d "$WIRE_DIR" ] && GPU_CHECK_WIRE=$WIRE_DIR timeout -k 10 60 $PY scripts/gpu_run.py -c "$WIRE_IMPORT"; then
  echo "gpu-check: the system's protobuf/grpcio cannot import the generated code ($(tail -1 "$LOGS/wire.err")); the KV" \
    "steps use those in $WIRE_DIR"
  note wire "ok (.gpu-deps)" 0
  WIRE=(env "GPU_CHECK_WIRE=$WIRE_DIR")
else
  cat "$LOGS/wire.err"
  echo "gpu-check: the generated wire code does not import here (above; make gpu-deps brings py$VER-wire): the KV" \
    "steps are skipped"
  note wire "no import" 0
  WIRE=(false)
fi

MODEL=${GPU_CHECK_MODEL_DIR:-$DIR/preset-1b}
MODEL_PID=""
if ! wanted cuda && ! wanted bench; then
  :  # neither step that uses the preset was asked for
elif [ ! -f "$MODEL/config.json" ]; then
  echo "== model: writing the 1b preset into $MODEL in the background"
  t=$(($(left) - 20 < 180 ? $(left) - 20 : 180))
  model_t0=$SECONDS
  ( timeout -k 10 "$t" $PY scripts/gpu_run.py controlplane.cli model init --preset 1b --force "$MODEL" \
      >"$LOGS/model.log" 2>&1; echo $? >"$LOGS/model.rc" ) &
  MODEL_PID=$!
else
  echo "== model: $MODEL"
fi

mapfile -t FILES < <(existing tests/unit/test_triton_attention.py tests/unit/test_triton_small_ops.py \
  tests/unit/test_triton_engine.py)
start kernels 150 "${RUN[@]}" "${PYTEST[@]}" --timeout=60 "${FILES[@]}"
if [ "${WIRE[0]:-}" != false ]; then
  mapfile -t FILES < <(existing tests/unit/test_triton_codecs.py tests/unit/test_kv_devices.py \
    tests/unit/test_triton_requant.py tests/unit/test_triton_checksum.py)
  start kv-unit 120 "${WIRE[@]}" "${RUN[@]}" "${PYTEST[@]}" --timeout=60 "${FILES[@]}"
  mapfile -t FILES < <(existing tests/integration/test_kv_gpu_pair.py tests/integration/test_kv_cuda_ipc.py \
    tests/integration/test_kv_requant.py tests/cuda/test_cuda_ipc_handles.py tests/unit/test_kv_cache.py \
    tests/unit/test_codecs.py)
  start kv-cuda 150 "${WIRE[@]}" "${RUN[@]}" "${PYTEST[@]}" --timeout=90 -m cuda "${FILES[@]}"
fi
finish

if [ -n "$MODEL_PID" ]; then
  wait "$MODEL_PID"
  rc=$(cat "$LOGS/model.rc" 2>/dev/null || echo 1)
  echo "== model written in $((SECONDS - model_t0)) s (rc $rc)"
  cat "$LOGS/model.log"
  case $rc in 0) note model ok $((SECONDS - model_t0)) ;; 124|137) note model timeout 0 ;; *) note model "rc $rc" 0 ;; esac
fi
if [ -f "$MODEL/config.json" ]; then
  export GPU_CHECK_MODEL_DIR=$MODEL
else
  if wanted cuda || wanted bench; then
    echo "gpu-check: no 1b preset; tests/cuda use the tiny preset and the engine benchmark is skipped"
  fi
  unset GPU_CHECK_MODEL_DIR
fi

# the wire's fallback where the KV steps use it (a test here may import the wire), none where it is missing
CUDA_WIRE=()
[ "${WIRE[0]:-}" = env ] && CUDA_WIRE=("${WIRE[@]}")
step cuda 150 "${CUDA_WIRE[@]}" "${RUN[@]}" "${PYTEST[@]}" --timeout=120 tests/cuda \
  --ignore=tests/cuda/test_cuda_ipc_handles.py
if [ -n "${GPU_CHECK_MODEL_DIR:-}" ]; then
  step bench 110 "${RUN[@]}" bench engine --device cuda --dtype bfloat16 --model "$MODEL" --batches 1,128 \
    --prefill-lengths 2048 --decode-tokens 64 --repeats 3 --json "$DIR/bench.json"
fi
if [ "${WIRE[0]:-}" != false ]; then
  step bench-kv 100 "${WIRE[@]}" "${RUN[@]}" bench kv --device cuda --repeats 2 --json "$DIR/bench-kv.json"
fi

for s in "${STATUS[@]}"; do
  [[ $s == ok* ]] || exit 1
done
exit 0
