"""One pool replica as a Ray actor: a worker's gRPC service plus its lease in the registry.

The manager wraps ``WorkerActor`` with ``ray.remote`` and sets its resources per pool. Only plain data
crosses Ray: the constructor takes strings and ints, every method returns str/int/float/bool values.
Tokens, KV and embeddings travel over the worker's gRPC service, never through Ray.

Lifecycle of one replica (``ReplicaState``):
  1. STARTING  ``__init__``: settings re-validated from JSON, model loaded, codecs resolved, gRPC server
               started, lease registered, heartbeats on. Any failure raises, so the actor dies and the
               manager reports the exception text.
  2. SERVING   routed to; ``info``, ``status``, ``pid`` answer; ``watch`` blocks until the replica stops
               (the manager's liveness signal: it returns, or fails if the process died).
  3. DRAINING  ``drain(timeout_s)``: the service refuses new work and the registry marks it draining (so
               routing skips it); waits until no request runs or waits and no reservation is held.
  4. STOPPED   ``stop()``: heartbeats off, deregistered, gRPC server stopped after a grace period for
               RPCs still finishing. Idempotent. The manager then kills the actor process.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:  # annotations only: the actor imports the control plane lazily, in its process
    from controlplane.settings import PoolName

log = logging.getLogger(__name__)

STATUS_POLL_S = 0.05
STOP_GRACE_S = 5.0
# A draining worker stays up at least this long, refusing new work: routing reads the registry every 0.2 s
# (longer on a loaded host), so a request routed on an older snapshot is refused and sent elsewhere, where a
# worker already stopped would fail it as lost (a migration, or a 503 with none left).
ROUTING_CATCH_UP_S = 2.0
# ``watch`` calls run in a concurrency group of their own (the manager creates the actor with it), so those
# left running by managers that died (each returns within its timeout) never hold the threads that ``status``,
# ``drain`` and ``stop`` need: a control plane restarted several times in a row can still probe its replicas.
WATCH_GROUP = "watch"
WATCH_CONCURRENCY = 16


class ReplicaState(enum.StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class WorkerActor:
    """Runs in its own Ray worker process. Methods may be called from several threads at once."""

    def __init__(self, pool: PoolName, model_dir: str, settings_json: str, token: str, redis_url: str,
                 redis_prefix: str, index: int, host: str = "127.0.0.1", launch: str = "", wire: str = "") -> None:
        """``model_dir`` "" serves ``settings.model`` or the demo model; ``host`` "" binds this node's IP.
        ``launch``: the manager's digest of what it started this replica with (``launch.launch_key``; ``info``
        reports it). ``wire``: the manager's wire protocol digest; a replica whose own code speaks another
        refuses to start (WireMismatch) before it loads a model or registers ("": no check)."""
        from pathlib import Path

        from controlplane.log_lines import log_to_stderr
        from controlplane.pools import replica
        from controlplane.pools.affinity import core_for, pin_process
        from controlplane.settings import Settings
        from controlplane.state import WorkerRegistry, connect

        log_to_stderr(f"{pool} {index}")
        if wire:
            replica.check_wire(replica.wire_digest(), wire, f"this {pool} replica")

        self.state = ReplicaState.STARTING
        self.index = index
        self.launch = launch
        self.starting_at = time.time()  # wall clock: when this replica began loading, and when it served
        settings = Settings.model_validate_json(settings_json)  # no env or file sources: exactly the driver's
        security = replica.security_for(settings, token)
        folder = Path(model_dir) if model_dir else replica.model_dir(settings)
        if not host:  # on a cluster: this node's address, as the other nodes reach it
            import ray
            host = ray.util.get_node_ip_address()
        core = core_for(settings.pool(pool).cpu_affinity, index)
        if core is not None:
            pin_process(core)  # before the model loads, so torch's threads start on the core
        device = replica.reserved_device(settings.pool(pool))  # sees the node's GPUs: runs on its reserved one
        if device is not None:
            log.info("%s replica %d: engine on %s (the GPU Ray reserved, of all the node's)", pool, index, device)
        self._conn = connect(redis_url, redis_prefix)
        try:
            self.worker = replica.build_worker(pool, settings, folder, security, host, device)
        except BaseException:
            self._conn.close()
            raise
        try:
            registry = WorkerRegistry(self._conn, ttl=settings.redis.heartbeat_ttl_s)
            self.lease = replica.Lease(registry, self.worker)
            self.lease.start()
        except BaseException:
            self.worker.stop()
            self._conn.close()
            raise
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        from controlplane.heap import freeze_startup_heap
        freeze_startup_heap(f"{pool} replica {index}")  # the model and imports: out of the GC's way
        from workers.quiet_trim import QuietTrim
        quiet_s = settings.pool(pool).trim_memory_quiet_s
        self._trim = QuietTrim(quiet_s).start() if quiet_s is not None else None  # a burst's peak given back
        self.state = ReplicaState.SERVING
        self.serving_at = time.time()
        log.info("%s replica %d serving at %s", pool, index, self.worker.address)

    # ------------------------------------------------------------------ plain-data answers
    def info(self) -> dict:
        """``wire``: the wire protocol this replica's own code speaks (``replica.wire_digest``)."""
        from controlplane.pools.replica import wire_digest

        return {"worker_id": self.worker.identity.worker_id, "pool": self.worker.pool,
                "address": self.worker.address, "index": self.index, "starting_at": self.starting_at,
                "serving_at": self.serving_at, "launch": self.launch, "wire": wire_digest()}

    def pid(self) -> int:
        return os.getpid()

    def status(self) -> dict:
        from controlplane.pools.replica import worker_status

        s = worker_status(self.worker)
        return {"worker_id": s.worker_id, "pool": s.pool, "address": s.address, "state": self.state.value,
                "draining": s.draining, "running": s.running, "waiting": s.waiting,
                "kv_blocks_total": s.kv_blocks_total, "kv_blocks_free": s.kv_blocks_free,
                "reservations": s.reservations, "model_fingerprint": s.model_fingerprint,
                "heartbeat_running": self.lease.running, "heartbeat_ok": self.lease.healthy}

    @ray.method(concurrency_group=WATCH_GROUP)
    def watch(self, timeout_s: float | None = None) -> str:
        """Block until the replica stops, or ``timeout_s`` passed; returns its state then ("stopped" once it
        stopped). A manager that dies leaves its call running: the timeout frees that thread."""
        self._stopped.wait(timeout_s)
        return self.state.value

    # ------------------------------------------------------------------ drain and stop
    def drain(self, timeout_s: float) -> bool:
        """Take no new work, then wait (at most ``timeout_s`` seconds) for in-flight requests and
        reservations to finish, and at least ``ROUTING_CATCH_UP_S``. Returns whether the worker is idle."""
        from epd.worker.v1 import worker_pb2 as wpb

        with self._lock:
            if self.state == ReplicaState.STOPPED:
                return True
            self.state = ReplicaState.DRAINING
        from controlplane.state import StateError

        self.worker.service.Drain(wpb.DrainRequest(), None)  # type: ignore[attr-defined]  # each concrete service has Drain
        try:
            self.lease.set_draining()
        except StateError as exc:  # the service already refuses new work; routing learns at the next beat
            log.warning("could not mark %s draining in Redis: %s", self.worker.identity.worker_id, exc)
        began = time.monotonic()
        deadline = began + timeout_s
        while True:
            s = self.status()
            if s["running"] == 0 and s["waiting"] == 0 and s["reservations"] == 0 and (
                    time.monotonic() >= min(began + ROUTING_CATCH_UP_S, deadline)):
                return True
            if time.monotonic() >= deadline:
                log.warning("%s did not drain in %.1f s: %s", s["worker_id"], timeout_s, s)
                return False
            time.sleep(STATUS_POLL_S)

    def stop(self) -> None:
        """Heartbeats off and deregistered (routing forgets it), then the gRPC server. Idempotent."""
        with self._lock:
            if self.state == ReplicaState.STOPPED:
                return
            self.state = ReplicaState.STOPPED
        try:
            self.lease.stop()  # out of routing first: a trim in progress must not hold that up
            if self._trim is not None:
                self._trim.stop()
            self.worker.stop(STOP_GRACE_S)
            self._conn.close()
        finally:
            self._stopped.set()
