"""The faults: one replica killed (SIGKILL), one stopped (SIGSTOP, then SIGCONT), Redis killed (the
deployment's watchdog restarts it). Each waits until the deployment is whole again and says how long
that took."""

from __future__ import annotations

import enum
import os
import signal
import time
from dataclasses import dataclass

from bench.chaos.deployment import Deployment
from bench.chaos.procs import listening_pid, private_redis


class FaultKind(enum.Enum):
    KILL = "kill -9"
    STOP = "SIGSTOP"
    REDIS = "restart Redis"


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    pool: str | None = None  # the pool of the replica hit (None for Redis)

    def describe(self) -> str:
        return self.kind.value if self.pool is None else f"{self.kind.value} {self.pool}"


PLAN = (FaultSpec(FaultKind.REDIS), FaultSpec(FaultKind.KILL, "decode"), FaultSpec(FaultKind.KILL, "prefill"),
        FaultSpec(FaultKind.KILL, "encode"), FaultSpec(FaultKind.STOP, "decode"))


@dataclass(frozen=True)
class FaultResult:
    spec: FaultSpec
    target: str  # the worker id, or the redis-server's pid
    at: float  # time.monotonic() of the fault
    recovered_at: float  # whole again: the pool back at its target, or Redis answering and /ready clean
    replaced: bool  # a new replica took the hit one's place (False: it resumed, or Redis)

    @property
    def recovery_s(self) -> float:
        return self.recovered_at - self.at


class FaultError(RuntimeError):
    """A fault could not be applied, or the deployment did not recover within the bound."""


def inject(dep: Deployment, spec: FaultSpec, stop_s: float = 10.0, recover_s: float = 180.0) -> FaultResult:
    if spec.kind is FaultKind.REDIS:
        return _restart_redis(dep, recover_s)
    assert spec.pool is not None
    workers = dep.workers(spec.pool)
    if not workers:
        raise FaultError(f"no {spec.pool} worker to hit")
    victim = max(workers, key=lambda w: (w.total_kv_blocks - w.free_kv_blocks, w.running))  # the busiest: worst case
    pid = listening_pid(victim.port)
    if pid is None:
        raise FaultError(f"cannot find the process of {spec.pool} worker {victim.worker_id} ({victim.address})")
    target = dep.pools()[spec.pool]["target"]
    at = time.monotonic()
    if spec.kind is FaultKind.KILL:
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop_s)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # the pool manager found it hung and replaced it meanwhile
            pass
    deadline = at + recover_s
    while time.monotonic() < deadline:
        ids = {w.worker_id for w in dep.workers(spec.pool)}
        gone = victim.worker_id not in ids
        if len(ids) >= target and (gone or spec.kind is FaultKind.STOP):
            return FaultResult(spec, victim.worker_id, at, time.monotonic(), gone)
        time.sleep(0.25)
    raise FaultError(f"{spec.pool} pool not back to {target} replicas {recover_s:.0f} s after {spec.describe()}")


def _restart_redis(dep: Deployment, recover_s: float) -> FaultResult:
    assert dep.proc is not None
    found = private_redis(dep.proc.pid)
    if found is None:
        raise FaultError("no private redis-server under epd serve (is redis.url set?)")
    pid, _ = found
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = at + recover_s
    while time.monotonic() < deadline:
        now = private_redis(dep.proc.pid)
        body = dep.ready_body()
        clean = body.get("status") == "ready" and "Redis" not in body.get("degraded", "")
        if now is not None and now[0] != pid and clean:
            return FaultResult(FaultSpec(FaultKind.REDIS), f"redis-server {pid}", at, time.monotonic(), False)
        time.sleep(0.25)
    raise FaultError(f"Redis not back {recover_s:.0f} s after it was killed")
