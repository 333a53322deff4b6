#!/usr/bin/env bash
# `make gpu-deps`: where a package registry is reachable, put into .gpu-deps/pyXY the modules
# scripts/gpu_check.sh needs beside torch, triton and transformers, for each Python version in
# GPU_DEPS_PYTHONS (default "3.11 3.12"); bring the folder to the GPU machine, which has no registry.
# gpu_run.py appends it after the system's packages, so the system's own copies always win.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PKGS="pytest pluggy iniconfig packaging pytest-timeout xxhash pillow pyyaml jinja2 markupsafe pydantic pydantic-core
pydantic-settings annotated-types typing-inspection typing-extensions python-dotenv"
for v in ${GPU_DEPS_PYTHONS:-3.11 3.12}; do
  dir=.gpu-deps/py${v/./}
  rm -rf "$dir"
  $PIP install --quiet --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --target "$dir" $PKGS
  echo "wrote $dir ($(du -sh "$dir" | cut -f1))"
done
