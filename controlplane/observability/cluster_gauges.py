"""Pool gauges read at scrape time: replicas desired / ready / pending, load, KV use, and vLLM's
``num_requests_running`` / ``num_requests_waiting`` / ``kv_cache_usage_perc``, from a ``ClusterSource`` over the
Redis registry the workers heartbeat into (``PoolsSource`` over ``admin.pools_status``), cached for
``CLUSTER_CACHE_S``. ``metrics.py`` registers the collector and binds its source."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.observability.labels import MODEL, MODEL_LABEL, PREFIX

if TYPE_CHECKING:
    from controlplane.admin import PoolView

CLUSTER_CACHE_S = 1.0
# A scrape waits at most this long for the pool gauges (they read Redis); a stalled Redis (its client
# retries for ~8 s a command) leaves them out of that scrape instead of holding the scrape past
# Prometheus's timeout. The read goes on in the background and serves the next scrape.
CLUSTER_WAIT_S = 1.0


@dataclass(frozen=True)
class PoolSnapshot:
    pool: str
    desired: int | None  # None: no target set
    ready: int
    running: int  # requests, summed over the pool's live workers
    queued_tokens: int
    kv_used_blocks: int = 0  # summed over the pool's live workers
    kv_total_blocks: int = 0
    pending: int = 0  # replicas asked for and not placed yet (waiting for resources)


@dataclass(frozen=True)
class DecodeKV:
    worker_id: str
    used_blocks: int
    free_blocks: int


@dataclass(frozen=True)
class WorkerCounters:
    """A prefill or decode worker's engine counters, each since the worker started."""

    pool: str
    worker_id: str
    preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in its prefix cache
    prefix_cache_hits: int = 0  # of which their KV was cached


@dataclass(frozen=True)
class ClusterSnapshot:
    pools: tuple[PoolSnapshot, ...]
    decode_kv: tuple[DecodeKV, ...]
    counters: tuple[WorkerCounters, ...] = ()  # prefill and decode workers


class ClusterSource(Protocol):
    def snapshot(self) -> ClusterSnapshot: ...


class ClusterCollector(Collector):
    """Pool gauges from the bound source; a failing or slow source yields no pool gauges, never a failed
    or stalled scrape."""

    def __init__(self) -> None:
        self.source: ClusterSource | None = None
        self.waiting: Callable[[], int] = lambda: 0  # the scheduler's queue (no Redis involved)
        self.held_for: Callable[[], float] = lambda: 0.0  # its room queue's first request's wait
        self._cached: tuple[float, ClusterSnapshot | None] = (0.0, None)
        self._lock = threading.Lock()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-gauges")
        self._reading: Future | None = None

    def describe(self) -> Iterable[Metric]:
        return []

    def _read(self, src: ClusterSource) -> ClusterSnapshot | None:
        try:
            snap: ClusterSnapshot | None = src.snapshot()
        except Exception:  # Redis away: the rest of /metrics still answers
            snap = None
        with self._lock:
            if self.source is src:
                self._cached = (time.monotonic(), snap)
        return snap

    def current(self, wait_s: float | None = None) -> ClusterSnapshot | None:
        src = self.source
        if src is None:
            return None
        with self._lock:
            at, snap = self._cached
            if snap is not None and time.monotonic() - at <= CLUSTER_CACHE_S:
                return snap
            if self._reading is None or self._reading.done():  # one read at a time, however many scrapes
                self._reading = self._reader.submit(self._read, src)
            reading = self._reading
        try:
            return reading.result(timeout=CLUSTER_WAIT_S if wait_s is None else wait_s)
        except FutureTimeout:
            return None

    def collect(self) -> Iterator[Metric]:
        waiting = self.waiting()
        yield _gauge("scheduler_queue_depth", "Admitted requests waiting for decode room.", [], [([], waiting)])
        # vLLM's vllm:num_requests_waiting: requests accepted and not yet running (here: the scheduler's queue)
        yield _gauge("num_requests_waiting", "Requests admitted and waiting to be scheduled onto the pools.",
                     [], [([], waiting)])
        yield _gauge("scheduler_fcfs_hold_seconds", "How long the request that goes first (it waited "
                     "scheduler.fcfs_after_s for decode room) has waited; 0 when none does. While above 0, later "
                     "requests leave the replicas that refused it alone; near queue_timeout_s, it and the requests "
                     "held behind it get 429.", [], [([], self.held_for())])
        snap = self.current()
        if snap is None:
            return
        per_pool = ("pool",)
        yield _gauge("replicas_desired", "Target replicas of the pool.", per_pool,
                     [([p.pool], p.desired) for p in snap.pools if p.desired is not None])
        yield _gauge("replicas_ready", "Live, non-draining replicas of the pool.", per_pool,
                     [([p.pool], p.ready) for p in snap.pools])
        yield _gauge("replicas_pending", "Replicas the pool manager asked Ray for that are not placed yet "
                     "(waiting for the resources they need; epd status says which).", per_pool,
                     [([p.pool], p.pending) for p in snap.pools])
        yield _gauge("pool_running_requests", "Requests running in the pool's engines (worker heartbeats).", per_pool,
                     [([p.pool], p.running) for p in snap.pools])
        yield _gauge("pool_queued_tokens", "Prompt tokens waiting in the pool's engines (worker heartbeats).",
                     per_pool, [([p.pool], p.queued_tokens) for p in snap.pools])
        # vLLM's vllm:num_requests_running: requests in the engines' batches (prefill and decode engines)
        yield _gauge("num_requests_running", "Requests running in the prefill and decode engines (worker "
                     "heartbeats).", [], [([], sum(p.running for p in snap.pools if p.pool != "encode"))])
        # vLLM's vllm:kv_cache_usage_perc: a fraction, 1 = every KV block in use
        yield _gauge("kv_cache_usage_perc", "KV-cache usage of the pool's workers, as a fraction (1 = 100%).",
                     per_pool, [([p.pool], p.kv_used_blocks / p.kv_total_blocks)
                                for p in snap.pools if p.kv_total_blocks > 0])
        yield _gauge("kv_blocks_used", "KV blocks in use on a decode worker.", ("worker_id",),
                     [([kv.worker_id], kv.used_blocks) for kv in snap.decode_kv])
        yield _gauge("kv_blocks_free", "KV blocks free on a decode worker.", ("worker_id",),
                     [([kv.worker_id], kv.free_blocks) for kv in snap.decode_kv])
        # vLLM's vllm:num_preemptions_total, per worker: each engine counts from its start (a replaced worker's
        # series ends and a new one begins at 0, which rate() and increase() take as they take any new series)
        preempted = CounterMetricFamily(f"{PREFIX}num_preemptions", "Sequences a worker's engine preempted since "
                                        "it started: its KV pool had no block for a running sequence's next "
                                        "token or prompt chunk, so it waits and recomputes (worker heartbeats).",
                                        labels=[MODEL_LABEL, "pool", "worker_id"])
        # vLLM's vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total (tokens), counted the same way
        per_worker = [MODEL_LABEL, "pool", "worker_id"]
        queries = CounterMetricFamily(f"{PREFIX}prefix_cache_queries", "Prompt tokens a worker's engine looked up "
                                      "in its prefix cache since it started (each admission, a preempted "
                                      "sequence's again; worker heartbeats).", labels=per_worker)
        hits = CounterMetricFamily(f"{PREFIX}prefix_cache_hits", "Of the prompt tokens a worker's engine looked "
                                   "up in its prefix cache, those whose KV was cached and not computed again "
                                   "(worker heartbeats).", labels=per_worker)
        for c in snap.counters:
            labels = [MODEL.value, c.pool, c.worker_id]
            preempted.add_metric(labels, c.preemptions)
            queries.add_metric(labels, c.prefix_cache_queries)
            hits.add_metric(labels, c.prefix_cache_hits)
        yield preempted
        yield queries
        yield hits


def _gauge(name: str, doc: str, labels: Iterable[str], values: Iterable[tuple[list[str], float]]) -> Metric:
    family = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=[MODEL_LABEL, *labels])
    model = MODEL.value
    for label_values, value in values:
        family.add_metric([model, *label_values], value)
    return family


def snapshot_from_pools(views: Iterable[PoolView]) -> ClusterSnapshot:
    """A ClusterSnapshot from ``controlplane.admin.pools_status`` views."""
    pools: list[PoolSnapshot] = []
    kv: list[DecodeKV] = []
    counters: list[WorkerCounters] = []
    for v in views:
        workers = list(v.workers)
        pools.append(PoolSnapshot(v.pool, v.target, v.ready, sum(w.running for w in workers),
                                  sum(w.queued_tokens for w in workers),
                                  sum(w.total_kv_blocks - w.free_kv_blocks for w in workers),
                                  sum(w.total_kv_blocks for w in workers), len(v.pending)))
        if v.pool == "decode":
            kv.extend(DecodeKV(w.worker_id, w.total_kv_blocks - w.free_kv_blocks, w.free_kv_blocks) for w in workers)
        if v.pool != "encode":
            counters.extend(WorkerCounters(v.pool, w.worker_id, w.preemptions, w.prefix_cache_queries,
                                           w.prefix_cache_hits) for w in workers)
    return ClusterSnapshot(tuple(pools), tuple(kv), tuple(counters))


class PoolsSource:
    """A ClusterSource over any callable that returns pool views (``admin.pools_status`` bound to Redis)."""

    def __init__(self, views: Callable[[], Iterable[PoolView]]) -> None:
        self.views = views

    def snapshot(self) -> ClusterSnapshot:
        return snapshot_from_pools(self.views())
