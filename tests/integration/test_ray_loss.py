"""A control plane whose Ray cluster goes away (the head killed, as a restarted KubeRay head pod): its Ray probe
says so within its limit, it starts no local Ray of its own meanwhile (Ray's auto-connect would), and it stops
at once. Real parts: a Ray head started with `ray start` in its own process group, a pool manager with one
replica joined through the Ray client in its own process, a real redis-server."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from controlplane.settings import MiB, Settings
from controlplane.state import LocalRedis

from http_helpers import free_loopback_port
from redis_fixture import redis_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("ray_loss_process.py")
ROOT = Path(__file__).resolve().parents[2]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _line(proc: subprocess.Popen[str], within_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    assert ready, f"no line from the manager within {within_s} s"
    line = proc.stdout.readline()
    assert line, f"the manager exited ({proc.wait(30)})"
    return line.strip()


def test_a_lost_head_is_reported_within_the_limit_and_no_local_ray_takes_its_place(
        redis_server: LocalRedis) -> None:  # noqa: F811
    tmp = Path(tempfile.mkdtemp(prefix="epd-rl-"))  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_ENABLE_AUTO"))}
    env.update(HOME=str(tmp), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=str(ROOT))
    port, client = free_loopback_port(), free_loopback_port()
    with open(tmp / "head.log", "w") as log:  # the child keeps its own copy of the file
        head = subprocess.Popen(
            [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
             "--node-ip-address=127.0.0.1", f"--temp-dir={tmp / 'ray'}", "--num-cpus=2", "--include-dashboard=false",
             "--disable-usage-stats", f"--ray-client-server-port={client}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    manager = None
    try:
        deadline = time.monotonic() + 60
        while not _listening(client):
            assert head.poll() is None, "ray start failed:\n" + (tmp / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray client port did not listen within 60 s"
            time.sleep(0.2)
        settings = Settings(mode="colocated", transfer={"codec_policy": "fp32"},
                            decode={"replicas": 1, "num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * MiB}})
        address = f"ray://127.0.0.1:{client}"
        with open(tmp / "manager.log", "w") as log:
            manager = subprocess.Popen(
                [sys.executable, str(SCRIPT), address, redis_server.url, f"loss-{uuid.uuid4().hex[:8]}",
                 "loss-test-token-0123456789", settings.model_dump_json()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert _line(manager, 180) == "started None"  # joined, one replica up, and Ray answers its probe

        os.killpg(head.pid, signal.SIGKILL)  # the head, its GCS, raylet and the replica's process
        head.wait(30)
        assert manager.stdin is not None
        manager.stdin.write("go\n")
        manager.stdin.flush()
        lost = _line(manager, 60)
        assert lost.startswith("lost after "), lost
        assert float(lost.split()[2]) < 15  # the probe's limit is 5 s, checked every 0.5 s
        assert f"the Ray cluster at {address} has not answered for " in lost
        assert "until the control plane restarts and joins it again" in lost
        # 40 s after the loss (past the Ray client's 30 s of reconnecting, the reconcile loop calling Ray all
        # along): with Ray's auto-connect a local raylet and GCS ran here in the real cluster's place
        assert json.loads(_line(manager, 90)) == []
        stopped = _line(manager, 60)
        assert stopped.startswith("stopped in ") and float(stopped.split()[2]) < 10, stopped
        assert manager.wait(30) == 0, (tmp / "manager.log").read_text()[-3000:]
    finally:
        if manager is not None:
            if manager.poll() is None:
                manager.kill()
                manager.wait(30)
            for pipe in (manager.stdin, manager.stdout):
                if pipe is not None:
                    pipe.close()
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
