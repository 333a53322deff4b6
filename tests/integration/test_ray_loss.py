"""A control plane whose Ray cluster goes away (the head killed, as a restarted KubeRay head pod): its Ray probe
says so within its limit, it starts no local Ray of its own meanwhile (Ray's auto-connect would), and it stops
at once. Real parts: a Ray head started with `ray start` in its own process group, a pool manager with one
replica joined through the Ray client in its own process, a real redis-server."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controlplane.settings import MiB, Settings
from controlplane.state import LocalRedis

from ray_head import RayHead
from ray_head import ray_head as start_ray_head
from redis_fixture import redis_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("ray_loss_process.py")


def _line(proc: subprocess.Popen[str], within_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    assert ready, f"no line from the manager within {within_s} s"
    line = proc.stdout.readline()
    assert line, f"the manager exited ({proc.wait(30)})"
    return line.strip()


def test_a_lost_head_is_reported_within_the_limit_and_no_local_ray_takes_its_place(
        redis_server: LocalRedis) -> None:  # noqa: F811
    with start_ray_head("epd-rl-") as head:
        _lose_the_head(head, redis_server.url)


def _lose_the_head(head: RayHead, redis_url: str) -> None:
    manager = None
    try:
        settings = Settings(mode="colocated", transfer={"codec_policy": "fp32"},
                            decode={"replicas": 1, "num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * MiB}})
        address = head.client
        with open(head.folder / "manager.log", "w") as log:
            manager = subprocess.Popen(
                [sys.executable, str(SCRIPT), address, redis_url, f"loss-{uuid.uuid4().hex[:8]}",
                 "loss-test-token-0123456789", settings.model_dump_json()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**head.env, "RAY_CLIENT_RECONNECT_GRACE_PERIOD": "5"})  # Ray's 30 s, shortened
        assert _line(manager, 180) == "started None"  # joined, one replica up, and Ray answers its probe

        head.kill()  # its GCS, raylet and the replica's process
        assert manager.stdin is not None
        manager.stdin.write("go\n")
        manager.stdin.flush()
        lost = _line(manager, 60)
        assert lost.startswith("lost after "), lost
        assert 3.5 <= float(lost.split()[2]) < 15  # the probe's limit is 5 s from its last answer (0.5 s apart)
        assert f"the Ray cluster at {address} has not answered for " in lost
        assert "until the control plane restarts and joins it again" in lost
        # 10 s after the Ray client gave up reconnecting, the reconcile loop calling Ray all along: with Ray's
        # auto-connect a local raylet and GCS ran here in the real cluster's place
        assert json.loads(_line(manager, 90)) == []
        stopped = _line(manager, 60)
        assert stopped.startswith("stopped in ") and float(stopped.split()[2]) < 10, stopped
        assert manager.wait(30) == 0, (head.folder / "manager.log").read_text()[-3000:]
    finally:
        if manager is not None:
            if manager.poll() is None:
                manager.kill()
                manager.wait(30)
            for pipe in (manager.stdin, manager.stdout):
                if pipe is not None:
                    pipe.close()
