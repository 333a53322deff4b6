"""The routable workers per pool as this scheduler sees them: a snapshot of the Redis registry plus
what this scheduler has sent each worker since.

A pool's snapshot is reread every ``refresh_s`` seconds, by one thread at a time (decoding a large
pool's rows takes a while under the GIL); requests arriving meanwhile route on the snapshot it is
replacing, so a snapshot served is at most ``refresh_s`` plus one reread old. Who rereads:
  - started (``start()``, as ``epd serve`` does): a background thread keeps every pool asked for so far
    fresh, and routing only reads the snapshot in memory. The request path reads Redis only for a pool
    it asks for the first time, and after ``invalidate`` (a request waiting for decode room asks for
    fresh load reports). ``close()`` stops the thread.
  - not started (direct use, tests with an injected clock): the request that finds the snapshot stale
    rereads it in line.
When a reread fails (Redis stalled, restarting or away) routing keeps the last good snapshot and the view
is *degraded* until a reread succeeds; while degraded it rereads at most every ``degraded_retry_s``
seconds, so a stalled Redis costs at most one bounded wait (the connection's command budget) per retry
interval, in the background when started. Only a pool never read yet fails with ``StateError``.

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

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.scheduler.policies import Candidate
from controlplane.state.errors import StateError
from controlplane.state.registry import WorkerRegistry

log = logging.getLogger(__name__)
INVALIDATED = float("-inf")  # a snapshot's read time after ``invalidate``: due at once

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
        self._draining: dict[str, int] = {}  # pool -> live workers its last read found draining
        self._first_failure: dict[str, tuple[float, StateError]] = {}  # pool -> when its first read last failed
        self.refresh_s = refresh_s
        self.degraded_retry_s = degraded_retry_s
        self.clock = clock
        self._cache: dict[str, tuple[float, list[Candidate]]] = {}
        self._refreshing: set[str] = set()  # pools whose snapshot a thread is rereading now
        self._inflight: dict[str, list[int]] = {}  # worker id -> [tokens, requests, blocks] (sums of charges)
        self._degraded: Degraded | None = None
        self._last_try: dict[str, float] = {}  # pool -> when a reread last began
        self._pools: dict[str, None] = {}  # every pool asked for, in order: what the background thread rereads
        self._refresher: tuple[threading.Thread, threading.Event] | None = None  # the background thread, its stop
        self._lock = threading.Lock()
        self._read_done = threading.Condition(self._lock)  # notified when a reread ends (snapshotless threads wait)

    @property
    def degraded(self) -> Degraded | None:
        return self._degraded

    def start(self) -> WorkerView:
        """Keep every pool asked for so far (and from now on) fresh from a background thread. Idempotent."""
        with self._lock:
            if self._refresher is None:
                stop = threading.Event()
                thread = threading.Thread(target=self._refresh_loop, args=(stop,), name="worker-view", daemon=True)
                self._refresher = (thread, stop)
                thread.start()
        return self

    def close(self) -> None:
        """Stop the background thread (one reread in flight finishes first, within the connection's command
        budget); rereads are back on the request path. Idempotent."""
        with self._lock:
            refresher, self._refresher = self._refresher, None
        if refresher is not None:
            thread, stop = refresher
            stop.set()
            thread.join()

    def candidates(self, pool: str) -> list[Candidate]:
        now = self.clock()
        with self._lock:
            cached = self._cache.get(pool)
            if cached is None:
                self._pools.setdefault(pool, None)
                stale = True
            elif cached[0] == INVALIDATED:  # a request waiting for room asked for fresh load reports: one
                stale = self._due(pool, cached[0], now)  # thread rereads now (while degraded, at the retry pace)
            elif self._refresher is not None:
                stale = False  # the background thread keeps it fresh
            else:
                stale = self._due(pool, cached[0], now)
            # one thread rereads a stale snapshot; the others route on it meanwhile (it is at most one
            # reread old), instead of every request thread decoding the whole pool from Redis at once
            reread = stale and pool not in self._refreshing
            if reread:
                self._refreshing.add(pool)
            while cached is None and not reread:  # the pool's first read is in flight: wait for it
                self._read_done.wait(timeout=1.0)  # a reread ends within its command budget; this only re-checks
                cached = self._cache.get(pool)
                if cached is None and pool not in self._refreshing:  # that read failed
                    now = self.clock()
                    failed = self._first_failure.get(pool)
                    if failed is not None and now - failed[0] < self.degraded_retry_s:
                        raise failed[1]  # as it did for the thread that read: the waiters fail together
                    reread = True  # an older failure: try again here
                    self._refreshing.add(pool)
        if reread:
            cached = self._reread(pool, cached, now)
        assert cached is not None
        inflight, make = self._inflight, Candidate._make
        with self._lock:  # the snapshot's rows (in flight 0) with this scheduler's own in-flight work on each worker
            return [c if (held := inflight.get(c[0])) is None else make((*c[:6], *held, 0)) for c in cached[1]]

    def _due(self, pool: str, read_at: float, now: float) -> bool:
        """Whether a snapshot read at ``read_at`` is to be reread at ``now``. Under the lock."""
        if self._degraded is not None:
            return now - max(read_at, self._last_try.get(pool, read_at)) > self.degraded_retry_s
        return now - read_at > self.refresh_s

    def _reread(self, pool: str, cached: tuple[float, list[Candidate]] | None,
                now: float) -> tuple[float, list[Candidate]] | None:
        """Read ``pool`` (begun at ``now``; the caller marked it refreshing) and store the snapshot; on a
        failed read keep ``cached`` and degrade, raising only when there is no snapshot to keep."""
        try:
            listed, fresh = self._read(pool)
        except StateError as exc:
            with self._lock:
                self._last_try[pool] = now
                if self._degraded is None:
                    self._degraded = Degraded(now, str(exc))
                if cached is None:
                    self._first_failure[pool] = (self.clock(), exc)
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
                self._draining[pool] = listed - len(fresh) if listed else 0
                self._degraded = None
        finally:
            with self._lock:
                self._refreshing.discard(pool)
                self._read_done.notify_all()
        return cached

    def _refresh_loop(self, stop: threading.Event) -> None:
        """The background thread: reread each pool when it is due, sleeping until the next one is."""
        failing = False  # a reread failed since the last success: logged once, not at every retry
        while not stop.is_set():
            now = self.clock()
            with self._lock:
                due = [p for p in self._pools if p not in self._refreshing
                       and ((c := self._cache.get(p)) is None or self._due(p, c[0], now))]
                self._refreshing.update(due)
            for pool in due:
                try:
                    self._reread(pool, self._cache.get(pool), now)
                except Exception as exc:  # no snapshot yet, or not a StateError: the request path tries itself
                    with self._lock:
                        self._last_try[pool] = now
                        if self._degraded is None and not isinstance(exc, StateError):
                            self._degraded = Degraded(now, f"{type(exc).__name__}: {exc}")
                degraded = self._degraded
                if degraded is not None and not failing:
                    log.warning("worker view: a reread of the %s pool failed; routing on the last good snapshot "
                                "(%s)", pool, degraded.reason)
                elif degraded is None and failing:
                    log.info("worker view: Redis answers again; snapshots are fresh")
                failing = degraded is not None
            stop.wait(self._next_wait())

    def _next_wait(self) -> float:
        """Seconds until the next pool is due (at least a millisecond, at most ``refresh_s``)."""
        now = self.clock()
        with self._lock:
            period = self.degraded_retry_s if self._degraded is not None else self.refresh_s
            ats = [max(c[0], self._last_try.get(p, c[0])) if self._degraded is not None else c[0]
                   for p in self._pools if (c := self._cache.get(p)) is not None]
        wait = min((at + period - now for at in ats), default=period)
        return min(max(wait, 0.001), period)

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

    def draining(self, pool: str) -> int:
        """Live workers of ``pool`` that its last read found draining (registered, never routed to)."""
        with self._lock:
            return self._draining.get(pool, 0)

    def invalidate(self) -> None:
        """Reread every pool on next use, by one thread while the others route on the snapshot it replaces
        (while degraded, rereads keep their own slower pace). Every request waiting for decode room calls
        this after each backoff: dropping the snapshots instead sent hundreds of threads to Redis at once."""
        with self._lock:
            if self._degraded is None:
                self._cache = {pool: (INVALIDATED, rows) for pool, (_, rows) in self._cache.items()}


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
