#!/usr/bin/env bash
# `make gpu-deps`: where a package registry is reachable, put into .gpu-deps/ what scripts/gpu_check.sh needs
# beside torch, triton and transformers, for each Python version in GPU_DEPS_PYTHONS (default "3.11 3.12"); bring
# the folder to the GPU machine, which has no registry (docs/gpu.md: the device tool's `carry`).
#   pyXY       pure dependencies (pytest, pydantic, ...); gpu_run.py appends it after the system's packages, so
#              the system's own copies always win. Pillow is left out (about 22 MB, and the H200 image has it):
#              GPU_DEPS_EXTRA="pillow" adds it, or any other package.
#   pyXY-wire  protobuf and grpcio at the versions this checkout's generated wire code (proto/epd) was made
#              with; gpu_check.sh puts it first for the KV steps, and only when the system's cannot import
#              that code (older than it).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PY=$(dirname "$PIP")/python
PKGS="pytest pluggy iniconfig packaging pytest-timeout xxhash pyyaml jinja2 markupsafe pydantic pydantic-core
pydantic-settings annotated-types typing-inspection typing-extensions python-dotenv ${GPU_DEPS_EXTRA:-}"
WIRE="protobuf==$($PY -c 'import google.protobuf as p; print(p.__version__)') grpcio==$($PY -c 'import grpc; print(grpc.__version__)')"
get() {
  $PIP install --quiet --no-deps --no-compile --only-binary=:all: --python-version "$1" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --target "$2" $3
}
for v in ${GPU_DEPS_PYTHONS:-3.11 3.12}; do
  dir=.gpu-deps/py${v/./}
  rm -rf "$dir" "$dir-wire"
  get "$v" "$dir" "$PKGS"
  get "$v" "$dir-wire" "$WIRE"
  rm -rf "$dir/bin" "$dir-wire/bin"
  echo "wrote $dir ($(du -sh "$dir" | cut -f1)) and $dir-wire ($WIRE; $(du -sh "$dir-wire" | cut -f1))"
done
