"""The routable workers per pool as this scheduler sees them: a snapshot of the Redis registry plus
what this scheduler has sent each worker since.

The snapshot is reread at most every ``refresh_s`` seconds, by one thread at a time (``redis.list`` of
64 workers is ~2.5 ms of decoding under the GIL); requests arriving meanwhile route on the snapshot it
is replacing. When a reread fails (Redis stalled, restarting or away) routing keeps the last good
snapshot and the view is *degraded* until a reread succeeds; while degraded it rereads at most every
``degraded_retry_s`` seconds, so a stalled Redis costs one request a bounded wait (the connection's
command budget), not every request. Only a pool never read yet fails with ``StateError``.

A Redis that restarted answers with an empty registry until each worker's next heartbeat registers it
again. So a pool that was not empty and reads as empty keeps its last rows for up to ``empty_grace_s``
seconds (one lease); a worker among them that is really gone fails fast when called.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.scheduler.policies import Candidate
from controlplane.state.errors import StateError
from controlplane.state.registry import WorkerRegistry


@dataclass(frozen=True)
class Degraded:
    """Routing runs on a stale snapshot because Redis did not answer; ``since`` is on the view's clock."""

    since: float
    reason: str


class WorkerView:
    def __init__(self, registry: WorkerRegistry, refresh_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, degraded_retry_s: float = 1.0,
                 empty_grace_s: float = 5.0) -> None:
        """``empty_grace_s``: one worker lease (``redis.heartbeat_ttl_s``), seconds."""
        self.registry = registry
        self.empty_grace_s = empty_grace_s
        self._empty_since: dict[str, float] = {}  # pools that read as empty after having rows
        self.refresh_s = refresh_s
        self.degraded_retry_s = degraded_retry_s
        self.clock = clock
        self._cache: dict[str, tuple[float, list[Candidate]]] = {}
        self._refreshing: set[str] = set()  # pools whose snapshot a thread is rereading now
        self._inflight: dict[str, list[int]] = {}  # worker id -> [tokens, requests]
        self._degraded: Degraded | None = None
        self._last_try: dict[str, float] = {}  # pool -> when a reread last began
        self._lock = threading.Lock()

    @property
    def degraded(self) -> Degraded | None:
        return self._degraded

    def candidates(self, pool: str) -> list[Candidate]:
        now = self.clock()
        with self._lock:
            cached = self._cache.get(pool)
            if cached is None:
                stale = True
            elif self._degraded is not None:
                stale = now - max(cached[0], self._last_try.get(pool, cached[0])) > self.degraded_retry_s
            else:
                stale = now - cached[0] > self.refresh_s
            # one thread rereads a stale snapshot; the others route on it meanwhile (it is at most one
            # reread old), instead of every request thread decoding the whole pool from Redis at once
            reread = stale and (cached is None or pool not in self._refreshing)
            if reread:
                self._refreshing.add(pool)
        if reread:
            try:
                listed, fresh = self._read(pool)
            except StateError as exc:
                with self._lock:
                    self._last_try[pool] = now
                    if self._degraded is None:
                        self._degraded = Degraded(now, str(exc))
                if cached is None:
                    raise
            else:
                with self._lock:
                    if not listed and cached is not None and cached[1]:
                        since = self._empty_since.setdefault(pool, now)
                        if now - since < self.empty_grace_s:  # emptied at once: Redis restarted, most likely
                            fresh = cached[1]
                    else:
                        self._empty_since.pop(pool, None)
                    self._cache[pool] = cached = (now, fresh)
                    self._degraded = None
            finally:
                with self._lock:
                    self._refreshing.discard(pool)
        assert cached is not None
        inflight, none = self._inflight, (0, 0)
        with self._lock:  # the snapshot's rows with this scheduler's own in-flight work on each worker
            return [Candidate(*c[:6], *inflight.get(c[0], none)) for c in cached[1]]

    def _read(self, pool: str) -> tuple[int, list[Candidate]]:
        """(workers listed, draining ones included; the routable ones)."""
        listed = self.registry.live_workers(pool)
        records = [r for r in listed if not r.info.draining]
        return len(listed), [Candidate(r.info.worker_id, r.info.address, r.info.load.queued_tokens,
                                       r.info.load.free_kv_blocks, r.info.load.total_kv_blocks, r.info.load.running)
                             for r in records]

    def begin(self, worker_id: str, tokens: int) -> None:
        with self._lock:
            entry = self._inflight.setdefault(worker_id, [0, 0])
            entry[0] += tokens
            entry[1] += 1

    def end(self, worker_id: str, tokens: int) -> None:
        with self._lock:
            entry = self._inflight.get(worker_id)
            if entry is not None:
                entry[0] -= tokens
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._inflight[worker_id]

    def invalidate(self) -> None:
        """Reread every pool on next use (while degraded, rereads keep their own slower pace)."""
        with self._lock:
            if self._degraded is None:
                self._cache.clear()
