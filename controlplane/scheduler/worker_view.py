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

What this scheduler has on each worker is counted live, per attempt, by a ``Charge`` (``begin``): on a
decode worker the tokens its KV cache holds for the attempt (prompt, then each generated token as it
streams) and the blocks they fill; on a prefill or encode worker the prompt tokens still to compute
(until the attempt's first token, when ``release`` gives them back); one request each. Every charge is
given back exactly once, whatever ends the attempt.
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
                 empty_grace_s: float = 5.0, block_size: int = 16) -> None:
        """``empty_grace_s``: one worker lease (``redis.heartbeat_ttl_s``), seconds. ``block_size``: the decode
        pool's KV block size, tokens (what a decode charge's blocks are counted in)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.registry = registry
        self.block_size = block_size
        self.empty_grace_s = empty_grace_s
        self._empty_since: dict[str, float] = {}  # pools that read as empty after having rows
        self.refresh_s = refresh_s
        self.degraded_retry_s = degraded_retry_s
        self.clock = clock
        self._cache: dict[str, tuple[float, list[Candidate]]] = {}
        self._refreshing: set[str] = set()  # pools whose snapshot a thread is rereading now
        self._inflight: dict[str, list[int]] = {}  # worker id -> [tokens, requests, blocks] (sums of charges)
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
        inflight, make = self._inflight, Candidate._make
        with self._lock:  # the snapshot's rows (in flight 0) with this scheduler's own in-flight work on each worker
            return [c if (held := inflight.get(c[0])) is None else make((*c[:6], *held)) for c in cached[1]]

    def _read(self, pool: str) -> tuple[int, list[Candidate]]:
        """(workers listed, draining ones included; the routable ones)."""
        listed = self.registry.live_workers(pool)
        records = [r for r in listed if not r.info.draining]
        return len(listed), [Candidate(r.info.worker_id, r.info.address, r.info.load.queued_tokens,
                                       r.info.load.free_kv_blocks, r.info.load.total_kv_blocks, r.info.load.running)
                             for r in records]

    def begin(self, worker_id: str, tokens: int, *, kv: bool = False) -> Charge:
        """Count one request of ``tokens`` on ``worker_id`` until the returned charge is released. ``kv``: the
        worker keeps the tokens in its KV cache (a decode or colocated worker), so they are counted in blocks
        too and ``Charge.grow`` adds the generated ones."""
        charge = Charge(self, worker_id, tokens, -(-tokens // self.block_size) if kv else 0, kv)
        self._add(worker_id, tokens, 1, charge.blocks)
        return charge

    def _add(self, worker_id: str, tokens: int, requests: int, blocks: int) -> None:
        with self._lock:
            entry = self._inflight.setdefault(worker_id, [0, 0, 0])
            entry[0] += tokens
            entry[1] += requests
            entry[2] += blocks
            if entry[1] <= 0:
                del self._inflight[worker_id]

    def invalidate(self) -> None:
        """Reread every pool on next use (while degraded, rereads keep their own slower pace)."""
        with self._lock:
            if self._degraded is None:
                self._cache.clear()


class Charge:
    """One attempt's load on one worker in its ``WorkerView``: ``tokens``, the ``blocks`` they fill (KV
    workers only) and one request. ``release`` gives it all back once; later calls, and ``grow`` after
    it, do nothing."""

    __slots__ = ("view", "worker_id", "tokens", "blocks", "kv", "_live", "_lock")

    def __init__(self, view: WorkerView, worker_id: str, tokens: int, blocks: int, kv: bool) -> None:
        self.view, self.worker_id, self.tokens, self.blocks, self.kv = view, worker_id, tokens, blocks, kv
        self._live = True
        self._lock = threading.Lock()

    def grow(self, tokens: int) -> None:
        """``tokens`` more held by the worker (generated ones, for a KV worker; else ignored)."""
        if not self.kv or tokens <= 0:
            return
        with self._lock:
            if not self._live:
                return
            blocks = -(-(self.tokens + tokens) // self.view.block_size) - self.blocks
            self.tokens += tokens
            self.blocks += blocks
            self.view._add(self.worker_id, tokens, 0, blocks)

    def release(self) -> None:
        with self._lock:
            if not self._live:
                return
            self._live = False
            self.view._add(self.worker_id, -self.tokens, -1, -self.blocks)
