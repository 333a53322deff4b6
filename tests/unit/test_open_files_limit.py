"""`epd serve` raises its soft limit on open files as far as its hard limit allows (each client connection holds
one), and leaves a limit it cannot raise alone. Each case runs in a child process started with its own limits."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_PROBE = ("import logging, resource, sys; logging.basicConfig(level=logging.INFO); "
          "from controlplane.serve import raise_open_files_limit as r; "
          "got = r(int(sys.argv[1])); print(got, resource.getrlimit(resource.RLIMIT_NOFILE)[0])")


def _child(soft: int, hard: int, wanted: int) -> tuple[list[int], str]:
    done = subprocess.run([sys.executable, "-c", _PROBE, str(wanted)], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert done.returncode == 0, done.stderr
    return [int(x) for x in done.stdout.split()], done.stderr


def test_the_soft_limit_rises_to_what_is_wanted_or_to_the_hard_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard limit on open files is {hard}")
    (said, now), log = _child(256, 2048, 1500)
    assert said == now == 1500 and "raised from 256 to 1500" in log
    (said, now), _ = _child(256, 2048, 100_000)  # no further than the hard limit
    assert said == now == 2048


def test_a_limit_already_high_enough_is_left_alone() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"this machine's hard limit on open files is {hard}")
    (said, now), log = _child(1024, 1024, 512)
    assert said == now == 1024 and "raised" not in log
