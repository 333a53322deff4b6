"""A prefill worker whose /dev/shm is too small for a shared-memory segment (Docker's and Kubernetes' default
is 64 MiB) does not crash: ``auto`` sends the push over gRPC instead, and an explicit ``shm`` fails the push
with a message that names /dev/shm, and a small /dev/shm is not kept full by idle segments. Each case runs a
child in a private mount namespace whose /dev/shm is a small tmpfs; where this machine cannot make one (no
unshare, or no right to mount), it skips."""

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
DOCKER_SHM = "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" \"$@\""  # Docker's default size


def _small_shm_possible() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", SMALL_SHM, "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_small_shm = pytest.mark.skipif(not _small_shm_possible(),
                                     reason="cannot mount a tmpfs in a private mount namespace here")


def _run(transport: str, mount: str = SMALL_SHM, *args: str) -> dict:
    proc = subprocess.run(["unshare", "-m", "sh", "-c", mount, sys.executable, str(SCRIPT), transport, *args],
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
def test_a_dev_shm_full_only_for_now_costs_that_push_shared_memory_not_the_next() -> None:
    """64 MiB /dev/shm, filled by something else: that push goes over gRPC; once the space is back, the next
    one uses shared memory again (a /dev/shm that can never hold a segment is skipped for a minute instead)."""
    out = _run("auto", DOCKER_SHM, "--fill")
    assert (out["transport"], out["transport_after"]) == ("grpc", "shm")
    assert out["tokens"] == out["tokens_after"] == out["expected"]
    assert out["blocks_back"]


@needs_small_shm
def test_shm_fails_the_push_with_a_message_naming_dev_shm() -> None:
    out = _run("shm")
    assert "tokens" not in out
    assert out["error"].startswith("cannot use shared memory: /dev/shm has no room for a 16 MiB segment (32 KiB free")
    assert "larger /dev/shm" in out["error"]
    assert out["blocks_back"]


@needs_small_shm
def test_a_small_dev_shm_is_not_kept_full_by_idle_segments() -> None:
    """Three pushes at once on a 64 MiB /dev/shm take three 16 MiB segments; once they are done, the pool
    keeps a quarter of /dev/shm idle (one segment), not all three (48 of 64 MiB, for as long as it lives)."""
    code = ("from kvtransfer.shm import SegmentPool, SHM_DIR; pool = SegmentPool(); segs = [pool.take(1) for _ in "
            "range(3)]; [pool.give(s) for s in segs]; print(pool.max_bytes >> 20, pool.idle, "
            "len(list(SHM_DIR.glob('epd-kv-*')))); pool.close(); "
            # a push past the quarter (a 20 MiB class) still keeps its segment when it would be the only one idle
            "big = SegmentPool(); seg = big.take(17 << 20); big.give(seg); print(seg.size >> 20, big.idle); "
            "big.close()")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", DOCKER_SHM, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["16", "1", "1", "20", "1"]
