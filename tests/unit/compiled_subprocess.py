"""Run a Triton compile probe in a fresh Python and read the JSON it prints last.

The compile tests run their probes out of process: importing triton here, before ``tests.unit.triton_env``
sets ``TRITON_INTERPRET``, would make the interpreter tests collected later compile their kernels. This
module imports neither triton nor torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_json(argv: list[str], timeout: float, *, interpret: bool = False, path: tuple[Path, ...] = ()) -> Any:
    """``python argv...`` from the repository root, with it, its generated wire code and ``path`` importable
    and ``TRITON_INTERPRET`` set only when ``interpret``; asserts it succeeded and returns its last line as
    JSON."""
    (out,) = run_json_together([argv], timeout, interpret=interpret, path=path)
    return out


def run_json_together(argvs: list[list[str]], timeout: float, *, interpret: bool = False,
                      path: tuple[Path, ...] = ()) -> list[Any]:
    """``run_json`` for each of ``argvs``, all at once (one process each), in their order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(ROOT), str(ROOT / "proto"), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    procs = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for argv in argvs]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs
