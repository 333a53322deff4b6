"""A pool manager that dies without stopping (SIGKILL, as an OOM kill) leaves its replicas serving on a Ray
cluster joined at an address, and the next manager of the deployment adopts them instead of loading the model
again; a replica started with other settings is stopped and replaced. Real parts: a Ray head started with
`ray start` in its own process group, managers in their own processes, a real redis-server."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.settings import MiB, Settings
from controlplane.state import LocalRedis, connect

from ray_head import ray_head as start_ray_head
from redis_fixture import process_gone, redis_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "adoption-test-token-0123456789"
SCRIPT = Path(__file__).with_name("manager_process.py")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray cluster that outlives the managers, as a KubeRay head does (tests/ray_head.py)."""
    with start_ray_head("epd-rh-") as head:
        try:
            yield head.gcs, head.env
        finally:
            for manager in Manager.started:
                manager.kill()


def _settings(kv_bytes: int = 32 * MiB, replicas: int = 1) -> str:
    return Settings(mode="colocated", transfer={"codec_policy": "fp32"},
                    decode={"replicas": replicas, "num_cpus": 0.25, "engine": {"kv_cache_bytes": kv_bytes}}
                    ).model_dump_json()


def _gone(pid: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class Manager:
    started: list[Manager] = []  # every one this module ran, killed at the end if a test left it running

    def __init__(self, head: tuple[str, dict[str, str]], redis_url: str, prefix: str, settings_json: str,
                 start_timeout_s: float | None = None, wire: str | None = None) -> None:
        """``wire``: the wire protocol digest this manager takes for its own (its replicas keep theirs)."""
        address, env = head
        if wire is not None:
            env = {**env, "MANAGER_PROCESS_WIRE_DIGEST": wire}
        timeout = [] if start_timeout_s is None else [str(start_timeout_s)]
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), address, redis_url, prefix, TOKEN, settings_json,
                                      *timeout],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        Manager.started.append(self)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        assert ready, "the manager did not start within 180 s"
        line = self.proc.stdout.readline()
        assert line, f"the manager exited {self.proc.wait(30)} before it started"
        self.held: dict[str, list[list]] = json.loads(line)  # or {"failed": why}, after which it exits

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._close()

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "stopped"
        assert self.proc.wait(30) == 0
        self._close()

    def _close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def test_a_killed_managers_replicas_are_adopted_and_other_settings_replaced(
        ray_head, redis_server: LocalRedis, default_ckpt: Path) -> None:  # noqa: F811
    prefix = f"adopt-{uuid.uuid4().hex[:8]}"
    first = Manager(ray_head, redis_server.url, prefix, _settings())
    [[worker_id, pid]] = first.held["decode"]
    first.kill()  # no stop(): the replica is not told
    time.sleep(1)
    assert not process_gone(pid), "the replica died with its manager"

    # a count changed meanwhile (helm upgrade): the running replica is adopted, one more is started
    second = Manager(ray_head, redis_server.url, prefix, _settings(replicas=2))
    assert second.held["decode"][0] == [worker_id, pid] and len(second.held["decode"]) == 2
    [_, [added_id, added_pid]] = second.held["decode"]
    second.kill()
    third = Manager(ray_head, redis_server.url, prefix, _settings(replicas=2))  # adopted a second time
    assert third.held["decode"] == [[worker_id, pid], [added_id, added_pid]]
    third.kill()

    # a start that fails (one more replica, not up in time) stops what it started, not what it adopted
    failing = Manager(ray_head, redis_server.url, prefix, _settings(replicas=3), start_timeout_s=0.5)
    assert "did not start within" in failing.held["failed"], failing.held
    assert failing.proc.wait(60) == 0
    failing.kill()
    assert not process_gone(pid) and not process_gone(added_pid), "a failed start took down adopted replicas"
    fourth = Manager(ray_head, redis_server.url, prefix, _settings(replicas=2))  # so they are adopted again
    assert fourth.held["decode"] == [[worker_id, pid], [added_id, added_pid]]
    fourth.kill()

    # another deployment with the same prefix (its own Redis database) leaves these alone
    foreign = Manager(ray_head, f"{redis_server.url}/1", prefix, _settings())
    [[foreign_id, foreign_pid]] = foreign.held["decode"]
    assert foreign_id not in (worker_id, added_id)
    foreign.stop()
    assert _gone(foreign_pid) and not process_gone(pid) and not process_gone(added_pid)

    # a control plane on another image than the Ray nodes: it adopts none of them (their code speaks another
    # wire protocol), stops them, and refuses the replicas it starts there, naming why
    skewed = Manager(ray_head, redis_server.url, prefix, _settings(replicas=2), wire="0123456789ab")
    assert "speaks another wire protocol" in skewed.held["failed"], skewed.held
    assert skewed.proc.wait(60) == 0
    skewed.kill()
    assert _gone(pid) and _gone(added_pid), "a control plane adopted replicas that speak another wire protocol"

    other = Manager(ray_head, redis_server.url, prefix, _settings(kv_bytes=16 * MiB))  # a settings change
    [[new_id, new_pid]] = other.held["decode"]
    assert new_id not in (worker_id, added_id) and new_pid not in (pid, added_pid)
    assert _gone(pid) and _gone(added_pid), "the replicas with the old settings still run"
    other.stop()  # a clean stop stops what it holds: nothing is left for a later manager
    assert _gone(new_pid), f"a stopped manager's replica still runs (pid {new_pid})"
    for url in (redis_server.url, f"{redis_server.url}/1"):
        conn = connect(url, prefix)
        try:
            assert conn.redis.keys(f"{prefix}:worker:*") == []  # every lease deregistered
            for key in conn.redis.scan_iter(match=conn.keys.pattern):
                conn.redis.delete(key)
        finally:
            conn.close()
