"""A prefill worker whose /dev/shm is too small for a shared-memory segment (Docker's and Kubernetes' default
is 64 MiB) does not crash: ``auto`` sends the push over gRPC instead, and an explicit ``shm`` fails the push
with a message that names /dev/shm. Each case runs shm_full_process.py in a private mount namespace whose
/dev/shm is a 32 KiB tmpfs; where this machine cannot make one (no unshare, or no right to mount), it skips."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("shm_full_process.py")
SMALL_SHM = "mount -t tmpfs -o size=32k tmpfs /dev/shm && exec \"$0\" \"$@\""


def _small_shm_possible() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", SMALL_SHM, "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_small_shm = pytest.mark.skipif(not _small_shm_possible(),
                                     reason="cannot mount a tmpfs in a private mount namespace here")


def _run(transport: str) -> dict:
    proc = subprocess.run(["unshare", "-m", "sh", "-c", SMALL_SHM, sys.executable, str(SCRIPT), transport],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode} (135 or -7: SIGBUS)\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_small_shm
def test_auto_sends_over_grpc_when_dev_shm_has_no_room() -> None:
    out = _run("auto")
    assert out["transport"] == "grpc"
    assert out["tokens"] == out["expected"]
    assert out["blocks_back"]


@needs_small_shm
def test_shm_fails_the_push_with_a_message_naming_dev_shm() -> None:
    out = _run("shm")
    assert "tokens" not in out
    assert out["error"].startswith("cannot use shared memory: /dev/shm has no room for a 16 MiB segment (32 KiB free")
    assert "larger /dev/shm" in out["error"]
    assert out["blocks_back"]
