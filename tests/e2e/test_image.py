"""The Dockerfile's image, built here with podman (scripts/build_image_local.sh: a locally made Debian base, as
no registry is reachable) and run: `epd serve` inside a container answers a completion, and Ctrl-C stops it.

Opt-in (`make test-image`, which sets EPD_TEST_IMAGE=1): it needs root, podman and debootstrap (Debian's
packages) and builds for minutes (the base, then pip installs into the image; later builds reuse podman's
layer cache), so `make test` leaves it out on every machine alike. Marked `slow`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from serve_process import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/epd:test"


@pytest.fixture(scope="module")
def image() -> str:
    if os.environ.get("EPD_TEST_IMAGE") != "1":
        pytest.skip("opt-in: make test-image (EPD_TEST_IMAGE=1)")
    if shutil.which("podman") is None or shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip("needs root, podman and debootstrap (apt-get install podman debootstrap)")
    out = subprocess.run([str(ROOT / "scripts" / "build_image_local.sh"), TAG], capture_output=True, text=True,
                         timeout=3000)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return TAG


def test_the_image_serves_a_completion_and_stops_on_ctrl_c(image: str):
    port, name = free_port(), f"epd-test-{uuid.uuid4().hex[:8]}"
    # host networking, loopback only: the API on 127.0.0.1 (the image defaults to 0.0.0.0 for published ports)
    # podman's default ulimits (nofile, nproc) exceed the hard limits of a sandboxed host, where the runtime
    # then fails to set them: ask for less; runc where installed (crun refuses this host's hybrid cgroups)
    runtime = ["--runtime", "runc"] if shutil.which("runc") else []
    run = ["podman", "run", *runtime, "--rm", "--name", name, "--network", "host",
           "--ulimit", "nofile=8192:8192", "--ulimit", "nproc=8192:8192", "--shm-size", "512m",
           "-e", "EPD_API__HOST=127.0.0.1", "-e", f"EPD_API__PORT={port}",
           "-e", "EPD_MODE=colocated", "-e", "EPD_DECODE__NUM_CPUS=0.25",
           "-e", "EPD_DECODE__ENGINE__KV_CACHE_BYTES=33554432", image]
    proc = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the container's epd serve did not become ready"
            time.sleep(1)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        answer = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text
        whoami = subprocess.run(["podman", "exec", name, "id", "-u"], capture_output=True, text=True, timeout=30)
        assert whoami.stdout.strip() == "1000"  # not root inside
    finally:
        subprocess.run(["podman", "kill", "--signal", "INT", name], capture_output=True, timeout=30)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            subprocess.run(["podman", "kill", name], capture_output=True, timeout=30)
            out, _ = proc.communicate(timeout=30)
    assert "epd: serving" in out and "epd: stopped in" in out, out[-3000:]
