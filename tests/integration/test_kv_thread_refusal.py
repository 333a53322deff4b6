"""A KV push whose sender cannot start a thread (a pids limit, no address space) fails at once with
UNAVAILABLE (so the request may move), gives back every block it held on both engines and the bulk TCP
connection it had opened (closed, not left bound to a push that never runs), and the next push,
once threads can start, lands whole. Each case runs in a fresh process (thread_refusal_process.py): the
sender's reused-thread pools are process-wide, so only there is the push sure to need a new thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("thread_refusal_process.py")


@pytest.mark.parametrize("prefix", ["kv-bulk-result", "kv-bulk-write"], ids=["result-reader", "writer"])
def test_a_push_without_its_thread_fails_cleanly_and_the_next_one_lands(prefix: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), prefix], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["error"] == "cannot start a thread for the push: can't start new thread", out
    assert out["code"] == "UNAVAILABLE" and out["blocks_back"] is True and out["failed_after_s"] < 5, out
    # what stays open: the gRPC channel the bulk connection's ticket was asked on (both its ends, in this one
    # process); the bulk connection itself (two more) is closed
    assert out["sockets_left"] <= 2, out
    assert out["tokens_after"] == out["expected"], out
