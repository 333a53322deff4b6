"""Every Prometheus metric epd exports, defined here and nowhere else, under the ``epd:`` prefix.

Names follow vLLM (``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``) and
Dynamo: seconds and bytes in the name, ``_total`` on counters (prometheus_client adds it), one label
per dimension. All of them live in the control-plane process and are served by its ``/metrics``:

  recorded as requests flow   the ingress (TTFT, TPOT, ITL, E2E, requests by route and status),
                              the scheduler (queue time, admission rejections) and the dispatcher
                              (stage times, KV transfer stats that the Prefill reply carries, encoder
                              cache hits, in-flight requests per pool);
  read at scrape time         pool gauges (replicas desired / ready, KV blocks per decode worker,
                              load), from a ``ClusterSource`` over the Redis registry the workers
                              heartbeat into, cached for ``CLUSTER_CACHE_S``.

``OBSERVABILITY.metrics = False`` makes every recording helper return at once (the switch
``epd bench controlplane --observability-cost`` flips to price them).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controlplane.admin import PoolView

PREFIX = "epd:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLUSTER_CACHE_S = 1.0
# A scrape waits at most this long for the pool gauges (they read Redis); a stalled Redis (its client
# retries for ~8 s a command) leaves them out of that scrape instead of holding the scrape past
# Prometheus's timeout. The read goes on in the background and serves the next scrape.
CLUSTER_WAIT_S = 1.0
RECENT_REQUESTS = 1000  # kept for the dashboard's charts and timelines


@dataclass
class Switches:
    """Process-wide on/off for recording metrics and making spans (settings.observability sets them)."""

    metrics: bool = True
    tracing: bool = True


OBSERVABILITY = Switches()

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
              0.5, 0.75, 1.0, 2.5)
_E2E = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0)

# ---------------------------------------------------------------- histograms
TTFT = Histogram(f"{PREFIX}time_to_first_token_seconds", "Request arrival to its first token, seconds.",
                 buckets=_LATENCY, registry=REGISTRY)
TPOT = Histogram(f"{PREFIX}time_per_output_token_seconds",
                 "Per request: (last token - first token) / (output tokens - 1), seconds.",
                 buckets=_PER_TOKEN, registry=REGISTRY)
ITL = Histogram(f"{PREFIX}inter_token_latency_seconds", "Between consecutive output tokens of a request, seconds.",
                buckets=_PER_TOKEN, registry=REGISTRY)
E2E = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request arrival to its last token, seconds.",
                buckets=_E2E, registry=REGISTRY)
STAGE = Histogram(f"{PREFIX}request_stage_seconds",
                  "Time a request spent in one stage (queue, reserve, encode, prefill, kv_transfer, decode, "
                  "stream), seconds.", ["stage"], buckets=_LATENCY, registry=REGISTRY)
KV_SECONDS = Histogram(f"{PREFIX}kv_transfer_seconds", "One request's KV push prefill -> decode, seconds.",
                       ["codec"], buckets=_LATENCY, registry=REGISTRY)

# ---------------------------------------------------------------- counters
REQUESTS = Counter(f"{PREFIX}requests", "HTTP requests answered, by route and status code.", ["route", "status"],
                   registry=REGISTRY)
CUT_SHORT = Counter(f"{PREFIX}requests_cut_short", "Requests that ended after their first token without their last: "
                    "a worker failed (the status that failure maps to) or the client left (499). A streamed "
                    "answer's status line, counted as 200 in epd:requests, was sent by then.",
                    ["route", "status"], registry=REGISTRY)
PROMPT_TOKENS = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", registry=REGISTRY)
GENERATION_TOKENS = Counter(f"{PREFIX}generation_tokens", "Output tokens of finished requests.", registry=REGISTRY)
KV_LOGICAL_BYTES = Counter(f"{PREFIX}kv_transfer_logical_bytes",
                           "KV moved prefill -> decode, counted as the same blocks in bf16, bytes.", ["codec"],
                           registry=REGISTRY)
KV_WIRE_BYTES = Counter(f"{PREFIX}kv_transfer_wire_bytes", "KV moved prefill -> decode as sent (payload + scales), "
                        "bytes.", ["codec"], registry=REGISTRY)
KV_FAILURES = Counter(f"{PREFIX}kv_transfer_failures", "Requests whose KV transfer failed, by gRPC status.",
                      ["code"], registry=REGISTRY)
ADMISSION_REJECTIONS = Counter(f"{PREFIX}admission_rejections", "Requests refused with 429, by reason.",
                               ["reason"], registry=REGISTRY)
ENCODER_IMAGES = Counter(f"{PREFIX}encoder_images", "Images sent to the encode pool.", registry=REGISTRY)
ENCODER_CACHE_HITS = Counter(f"{PREFIX}encoder_cache_hits", "Images the encode pool served from its cache.",
                             registry=REGISTRY)

# ---------------------------------------------------------------- gauges kept here
QUEUE_DEPTH = Gauge(f"{PREFIX}queue_depth", "Requests handed to a pool's stage and not back yet (waiting or "
                    "running in its workers), as this control plane counts them.", ["pool"], registry=REGISTRY)
SCHEDULER_QUEUE = Gauge(f"{PREFIX}scheduler_queue_depth", "Admitted requests waiting for decode room.",
                        registry=REGISTRY)


# ---------------------------------------------------------------- gauges read at scrape time
@dataclass(frozen=True)
class PoolSnapshot:
    pool: str
    desired: int | None  # None: no target set
    ready: int
    running: int  # requests, summed over the pool's live workers
    queued_tokens: int


@dataclass(frozen=True)
class DecodeKV:
    worker_id: str
    used_blocks: int
    free_blocks: int


@dataclass(frozen=True)
class ClusterSnapshot:
    pools: tuple[PoolSnapshot, ...]
    decode_kv: tuple[DecodeKV, ...]


class ClusterSource(Protocol):
    def snapshot(self) -> ClusterSnapshot: ...


class _ClusterCollector(Collector):
    """Pool gauges from the bound source; a failing or slow source yields no pool gauges, never a failed
    or stalled scrape."""

    def __init__(self) -> None:
        self.source: ClusterSource | None = None
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
        snap = self.current()
        if snap is None:
            return
        desired = GaugeMetricFamily(f"{PREFIX}replicas_desired", "Target replicas of the pool.", labels=["pool"])
        ready = GaugeMetricFamily(f"{PREFIX}replicas_ready", "Live, non-draining replicas of the pool.",
                                  labels=["pool"])
        running = GaugeMetricFamily(f"{PREFIX}pool_running_requests", "Requests running in the pool's engines "
                                    "(worker heartbeats).", labels=["pool"])
        queued = GaugeMetricFamily(f"{PREFIX}pool_queued_tokens", "Prompt tokens waiting in the pool's engines "
                                   "(worker heartbeats).", labels=["pool"])
        for p in snap.pools:
            if p.desired is not None:
                desired.add_metric([p.pool], p.desired)
            ready.add_metric([p.pool], p.ready)
            running.add_metric([p.pool], p.running)
            queued.add_metric([p.pool], p.queued_tokens)
        used = GaugeMetricFamily(f"{PREFIX}kv_blocks_used", "KV blocks in use on a decode worker.",
                                 labels=["worker_id"])
        free = GaugeMetricFamily(f"{PREFIX}kv_blocks_free", "KV blocks free on a decode worker.", labels=["worker_id"])
        for kv in snap.decode_kv:
            used.add_metric([kv.worker_id], kv.used_blocks)
            free.add_metric([kv.worker_id], kv.free_blocks)
        yield from (desired, ready, running, queued, used, free)


CLUSTER = _ClusterCollector()
REGISTRY.register(CLUSTER)


def bind_cluster(source: ClusterSource | None) -> None:
    """Serve pool gauges from ``source`` (None: none). One control plane per process binds one."""
    CLUSTER.source = source
    CLUSTER._cached = (0.0, None)


def exposition() -> bytes:
    """The /metrics body, Prometheus text format."""
    return generate_latest(REGISTRY)


# ---------------------------------------------------------------- per-request records (dashboard)
@dataclass
class RequestRecord:
    """One request as the dashboard shows it. Times in seconds; ``started_at`` since the epoch."""

    request_id: str
    route: str
    started_at: float
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    kv_wire_bytes: int = 0
    kv_logical_bytes: int = 0
    stages: dict[str, float] = field(default_factory=dict)  # stage name -> seconds


class RequestLog:
    """Records of requests in flight (by id) and the last ``RECENT_REQUESTS`` finished ones."""

    def __init__(self, keep: int = RECENT_REQUESTS, max_open: int = 10_000) -> None:
        self.finished: deque[RequestRecord] = deque(maxlen=keep)
        self._open: OrderedDict[str, RequestRecord] = OrderedDict()
        self._max_open = max_open
        self._lock = threading.Lock()

    def open(self, request_id: str, route: str) -> RequestRecord:
        rec = RequestRecord(request_id, route, time.time())
        with self._lock:
            self._open[request_id] = rec
            while len(self._open) > self._max_open:  # a caller that never closes cannot grow this
                self._open.popitem(last=False)
        return rec

    def get(self, request_id: str) -> RequestRecord | None:
        with self._lock:
            return self._open.get(request_id)

    def close(self, request_id: str) -> None:
        with self._lock:
            rec = self._open.pop(request_id, None)
            if rec is not None:
                self.finished.append(rec)

    def recent(self, since: float = 0.0) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.finished if r.started_at >= since]


REQUEST_LOG = RequestLog()


# ---------------------------------------------------------------- recording helpers (cheap when off)
def stage(request_id: str, name: str, seconds: float) -> None:
    """A request spent ``seconds`` in stage ``name``: queue, reserve, encode, prefill, kv_transfer,
    decode, stream (complete in colocated mode)."""
    if not OBSERVABILITY.metrics:
        return
    STAGE.labels(name).observe(seconds)
    rec = REQUEST_LOG.get(request_id)
    if rec is not None:
        rec.stages[name] = rec.stages.get(name, 0.0) + seconds


def kv_transfer(request_id: str, seconds: float, per_codec: Iterable[tuple[str, int, int]]) -> None:
    """A KV push finished: ``per_codec`` holds (codec, wire bytes, logical bytes)."""
    if not OBSERVABILITY.metrics:
        return
    per_codec = list(per_codec)
    label = "+".join(sorted(c for c, _, _ in per_codec)) or "none"
    KV_SECONDS.labels(label).observe(seconds)
    wire = logical = 0
    for codec, w, lg in per_codec:
        KV_WIRE_BYTES.labels(codec).inc(w)
        KV_LOGICAL_BYTES.labels(codec).inc(lg)
        wire += w
        logical += lg
    rec = REQUEST_LOG.get(request_id)
    if rec is not None:
        rec.stages["kv_transfer"] = seconds
        rec.kv_wire_bytes += wire
        rec.kv_logical_bytes += logical
    STAGE.labels("kv_transfer").observe(seconds)


def kv_failure(code: str) -> None:
    if OBSERVABILITY.metrics:
        KV_FAILURES.labels(code).inc()


def encoder(images: int, hits: int) -> None:
    if OBSERVABILITY.metrics:
        ENCODER_IMAGES.inc(images)
        ENCODER_CACHE_HITS.inc(hits)


def rejected(reason: str) -> None:
    if OBSERVABILITY.metrics:
        ADMISSION_REJECTIONS.labels(reason).inc()


def snapshot_from_pools(views: Iterable["PoolView"]) -> ClusterSnapshot:
    """A ClusterSnapshot from ``controlplane.admin.pools_status`` views."""
    pools, kv = [], []
    for v in views:
        workers = list(v.workers)
        pools.append(PoolSnapshot(v.pool, v.target, v.ready, sum(w.running for w in workers),
                                  sum(w.queued_tokens for w in workers)))
        if v.pool == "decode":
            kv.extend(DecodeKV(w.worker_id, w.total_kv_blocks - w.free_kv_blocks, w.free_kv_blocks) for w in workers)
    return ClusterSnapshot(tuple(pools), tuple(kv))


class PoolsSource:
    """A ClusterSource over any callable that returns pool views (``admin.pools_status`` bound to Redis)."""

    def __init__(self, views: Callable[[], Iterable["PoolView"]]) -> None:
        self.views = views

    def snapshot(self) -> ClusterSnapshot:
        return snapshot_from_pools(self.views())
