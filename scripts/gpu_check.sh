#!/usr/bin/env bash
# `make gpu-check`: the GPU engine's checks on a CUDA machine, offline, in under 5 minutes.
#   1. the environment, one line each (rc 2 and one line saying what is missing when it cannot run);
#   2. the 1b preset (random weights, TinyLlama-1.1B's shape) written here, unless GPU_CHECK_MODEL_DIR
#      names a folder that holds one already;
#   3. the CUDA tests (tests/cuda: HF parity with graphs on, batching invariance, eager past the largest
#      bucket, pool sizing) and the Triton kernel tests compiled for the GPU, on that preset;
#   4. `epd bench engine --device cuda` on it: decode batch 1 and 128, prefill 2,048, the roofline, KV
#      pool, peak memory, graph capture time.
# The system python runs it (GPU_CHECK_PYTHON, default python3), never .venv and never pip. Everything
# printed is also kept in .gpu-check/report.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_CHECK_PYTHON:-python3}
OUT=.gpu-check
mkdir -p "$OUT"
exec > >(tee "$OUT/report.txt") 2>&1
VER=$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
export GPU_CHECK_EXTRA="$PWD/.gpu-deps/py$VER"
export PYTHONPATH="$PWD:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
run() { $PY scripts/gpu_run.py "$@"; }
start=$SECONDS

echo "== environment"
run env || exit 2
# The wire's generated code is not needed by these checks; generate it only when missing and possible.
if [ ! -f proto/epd/.generated ] && $PY -c 'import grpc_tools' 2>/dev/null; then
  $PY -m grpc_tools.protoc -I proto --python_out=proto --grpc_python_out=proto --pyi_out=proto \
    $(find proto -name '*.proto') && touch proto/epd/.generated
fi

MODEL=${GPU_CHECK_MODEL_DIR:-$PWD/$OUT/preset-1b}
echo "== model: $MODEL"
if [ ! -f "$MODEL/config.json" ]; then
  run controlplane.cli model init --preset 1b --force "$MODEL" || exit 1
fi
export GPU_CHECK_MODEL_DIR=$MODEL

echo "== CUDA tests ($((SECONDS - start)) s so far)"
# -W default: the GPU image's own torch/transformers may warn where this repository's pins do not; the
# suite's warnings-as-errors is for the pinned environment, these checks are about the GPU.
run pytest -q -p no:cacheprovider -W default tests/cuda tests/unit/test_triton_attention.py \
  tests/unit/test_triton_small_ops.py tests/unit/test_triton_engine.py
tests_rc=$?

echo "== benchmark ($((SECONDS - start)) s so far)"
run bench engine --device cuda --dtype bfloat16 --model "$MODEL" --batches 1,128 --prefill-lengths 2048 \
  --decode-tokens 64 --repeats 3 --json "$OUT/bench.json"
bench_rc=$?

# KV on the GPU (issue 20): the cuda-marked KV tests, the codec kernels and device placement on cuda, and
# `epd bench kv --device cuda`. They need grpcio and protobuf (the KV transfer's wire).
echo "== KV on the GPU ($((SECONDS - start)) s so far)"
if $PY -c 'import grpc, google.protobuf' 2>/dev/null; then
  run pytest -q -p no:cacheprovider -m cuda tests/integration/test_kv_gpu_pair.py tests/integration/test_kv_cuda_ipc.py \
    tests/integration/test_kv_requant.py
  kv_rc=$?
  run pytest -q -p no:cacheprovider tests/unit/test_triton_codecs.py tests/unit/test_kv_devices.py || kv_rc=1
  run bench kv --device cuda --repeats 2 --json "$OUT/bench-kv.json" || kv_rc=1
else
  echo "gpu-check: grpcio/protobuf missing here, the KV checks cannot run (make gpu-deps)"
  kv_rc=2
fi

echo "== done in $((SECONDS - start)) s: tests rc=$tests_rc, benchmark rc=$bench_rc, KV rc=$kv_rc (report: $OUT/report.txt)"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$kv_rc" -eq 0 ]
