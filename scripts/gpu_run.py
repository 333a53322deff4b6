"""Helper of scripts/gpu_check.sh: run one step with the system python, never pip.

Modules the GPU machine lacks come from ``$GPU_CHECK_EXTRA`` (``.gpu-deps/pyXY``, made by ``make
gpu-deps`` where a registry is reachable), appended to ``sys.path`` after the system's packages so
those always win.

``$GPU_CHECK_WIRE`` (``.gpu-deps/pyXY-wire``), when set, goes *first*: the protobuf and grpcio the generated
wire code was made with, for a machine whose own are older (gpu_check.sh sets it for the KV steps only).

  python scripts/gpu_run.py env              the environment in a few lines; rc 2 when it cannot run (without
                                             CUDA too, unless GPU_CHECK_DRY_RUN=1)
  python scripts/gpu_run.py bench ARGS...    ``epd bench ARGS`` without an installed ``epd``; a usage error
                                             is one line and rc 2, as ``epd`` gives it
  python scripts/gpu_run.py -c CODE          ``python -c CODE``
  python scripts/gpu_run.py MODULE ARGS...   ``python -m MODULE ARGS``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys

NEEDED = ("torch", "triton", "transformers", "pytest", "pytest_timeout", "safetensors", "tokenizers", "jinja2",
          "xxhash", "PIL", "yaml", "pydantic", "pydantic_settings", "numpy")


def env() -> int:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gpu-check: python {sys.version.split()[0]} lacks {', '.join(missing)}: run `make gpu-deps` where a "
              f"package registry is reachable (GPU_DEPS_EXTRA=pillow for PIL) and bring .gpu-deps/ here",
              file=sys.stderr)
        return 2
    import torch
    import transformers
    import triton
    if not torch.cuda.is_available():
        if os.environ.get("GPU_CHECK_DRY_RUN") == "1":  # the script's flow on CPU: CUDA tests skip, benches refuse
            print(f"gpu-check: dry run without CUDA (python {sys.version.split()[0]}, torch {torch.__version__})")
            return 0
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device here", file=sys.stderr)
        return 2
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"triton {triton.__version__}, transformers {transformers.__version__}")
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        print(f"cuda:{i} {torch.cuda.get_device_name(i)}: {total / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    return 0


def bench(argv: list[str]) -> int:
    from bench.cli import add_bench_parser
    from controlplane.cli_args import UsageError

    parser = argparse.ArgumentParser(prog="epd")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"epd bench: {e}", file=sys.stderr)
        return 2


def main() -> int:
    extra = os.environ.get("GPU_CHECK_EXTRA")
    if extra and os.path.isdir(extra):
        sys.path.append(extra)
    wire = os.environ.get("GPU_CHECK_WIRE")
    if wire and os.path.isdir(wire):
        sys.path.insert(0, wire)
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "env":
        return env()
    if what == "bench":
        return bench(rest)
    if what == "-c":
        sys.argv = ["-c", *rest[1:]]
        exec(compile(rest[0], "<gpu_run -c>", "exec"), {"__name__": "__main__"})
        return 0
    sys.argv = [what, *rest]
    runpy.run_module(what, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
