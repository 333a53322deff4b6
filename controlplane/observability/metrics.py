"""Every Prometheus metric epd exports, defined here and nowhere else, under the ``epd:`` prefix.

Names and meanings follow vLLM's (``vllm:time_to_first_token_seconds`` is ``epd:time_to_first_token_seconds``,
``vllm:kv_cache_usage_perc`` is ``epd:kv_cache_usage_perc``): seconds and bytes in the name, ``_total`` on
counters (prometheus_client adds it), one label per dimension, and every ``epd:`` series carries
``model_name`` (the served model's id, as in /v1/models; ``bind_model`` sets it). All of them live in the
control-plane process and are served by its ``/metrics``:

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
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# the pool gauges live in cluster_gauges.py; their types are re-exported here for callers and tests
from controlplane.observability.cluster_gauges import CLUSTER_CACHE_S as CLUSTER_CACHE_S
from controlplane.observability.cluster_gauges import CLUSTER_WAIT_S as CLUSTER_WAIT_S
from controlplane.observability.cluster_gauges import ClusterCollector, ClusterSource
from controlplane.observability.cluster_gauges import ClusterSnapshot as ClusterSnapshot
from controlplane.observability.cluster_gauges import DecodeKV as DecodeKV
from controlplane.observability.cluster_gauges import PoolSnapshot as PoolSnapshot
from controlplane.observability.cluster_gauges import PoolsSource as PoolsSource
from controlplane.observability.cluster_gauges import snapshot_from_pools as snapshot_from_pools
from controlplane.observability.labels import MODEL, MODEL_LABEL, PREFIX
from controlplane.observability.timeline import Timeline

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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

# up to the longest a request may take (scheduler.request_timeout_s, 600 s by default), so p99 does not
# clamp at the top bucket in exactly the incidents it is read in
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 120.0, 300.0, 600.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
              0.5, 0.75, 1.0, 2.5)
_E2E = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 600.0, 900.0)

# ---------------------------------------------------------------- histograms
_M = [MODEL_LABEL]
TTFT = Histogram(f"{PREFIX}time_to_first_token_seconds", "Request arrival to its first token, seconds.", _M,
                 buckets=_LATENCY, registry=REGISTRY)
TPOT = Histogram(f"{PREFIX}time_per_output_token_seconds",
                 "Per request: (last token - first token) / (output tokens - 1), seconds.", _M,
                 buckets=_PER_TOKEN, registry=REGISTRY)
ITL = Histogram(f"{PREFIX}inter_token_latency_seconds", "Between consecutive output tokens of a request, seconds.",
                _M, buckets=_PER_TOKEN, registry=REGISTRY)
E2E = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request arrival to its last token, seconds.", _M,
                buckets=_E2E, registry=REGISTRY)
STAGE = Histogram(f"{PREFIX}request_stage_seconds",
                  "Time a request spent in one stage (queue, reserve, encode, prefill, kv_transfer, decode, "
                  "stream), seconds.", [*_M, "stage"], buckets=_LATENCY, registry=REGISTRY)
KV_SECONDS = Histogram(f"{PREFIX}kv_transfer_seconds", "One request's KV push prefill -> decode, seconds.",
                       [*_M, "codec"], buckets=_LATENCY, registry=REGISTRY)

# ---------------------------------------------------------------- counters
REQUESTS = Counter(f"{PREFIX}requests", "HTTP requests answered, by route and status code.",
                   [*_M, "route", "status"], registry=REGISTRY)
CUT_SHORT = Counter(f"{PREFIX}requests_cut_short", "Requests that ended after their first token without their last: "
                    "a worker failed (the status that failure maps to) or the client left (499). A streamed "
                    "answer's status line, counted as 200 in epd:requests, was sent by then.",
                    [*_M, "route", "status"], registry=REGISTRY)
MIGRATIONS = Counter(f"{PREFIX}request_migrations", "Moves of an admitted request off a worker that died or hung, "
                     "by the stage that lost it (encode, prefill, decode, colocated); past the migration limit "
                     "the request ends with a retriable 503 instead.", [*_M, "stage"], registry=REGISTRY)
PROMPT_TOKENS = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", _M, registry=REGISTRY)
GENERATION_TOKENS = Counter(f"{PREFIX}generation_tokens", "Output tokens of finished requests.", _M,
                            registry=REGISTRY)
KV_LOGICAL_BYTES = Counter(f"{PREFIX}kv_transfer_logical_bytes",
                           "KV moved prefill -> decode, counted as the same blocks in bf16, bytes.", [*_M, "codec"],
                           registry=REGISTRY)
KV_WIRE_BYTES = Counter(f"{PREFIX}kv_transfer_wire_bytes", "KV moved prefill -> decode as sent (payload + scales), "
                        "bytes.", [*_M, "codec"], registry=REGISTRY)
KV_TRANSFERS = Counter(f"{PREFIX}kv_transfers", "KV pushes prefill -> decode that finished, by the transport the "
                       "prefill worker used (auto picks cuda_ipc, shm or grpc per push, and falls back; tcp when "
                       "configured; unknown from a worker that did not say).",
                       [*_M, "transport"], registry=REGISTRY)
KV_FAILURES = Counter(f"{PREFIX}kv_transfer_failures", "Requests whose KV transfer failed, by gRPC status.",
                      [*_M, "code"], registry=REGISTRY)
ADMISSION_REJECTIONS = Counter(f"{PREFIX}admission_rejections", "Requests refused with 429, by reason.",
                               [*_M, "reason"], registry=REGISTRY)
ENCODER_IMAGES = Counter(f"{PREFIX}encoder_images", "Images sent to the encode pool.", _M, registry=REGISTRY)
ENCODER_CACHE_HITS = Counter(f"{PREFIX}encoder_cache_hits", "Images the encode pool served from its cache.", _M,
                             registry=REGISTRY)

# ---------------------------------------------------------------- gauges kept here
QUEUE_DEPTH = Gauge(f"{PREFIX}queue_depth", "Requests handed to a pool's stage and not back yet (waiting or "
                    "running in its workers), as this control plane counts them.", [*_M, "pool"], registry=REGISTRY)


def bind_model(name: str) -> None:
    """Label every epd: series recorded from now on with ``model_name=name``. The series with no other
    label start at zero now (as vLLM's do), so a dashboard shows 0 rather than nothing before traffic."""
    MODEL.value = name
    for family in (TTFT, TPOT, ITL, E2E, PROMPT_TOKENS, GENERATION_TOKENS, ENCODER_IMAGES, ENCODER_CACHE_HITS):
        family.labels(name)


CLUSTER = ClusterCollector()
REGISTRY.register(CLUSTER)


def bind_cluster(source: ClusterSource | None, waiting: Callable[[], int] | None = None,
                 held_for: Callable[[], float] | None = None) -> None:
    """Serve pool gauges from ``source`` (None: none), the scheduler's queue gauges from ``waiting`` (None: 0)
    and its first-come-first-served hold from ``held_for`` (None: 0). One control plane per process binds one."""
    CLUSTER.source = source
    CLUSTER.waiting = waiting or (lambda: 0)
    CLUSTER.held_for = held_for or (lambda: 0.0)
    CLUSTER._cached = (0.0, None)


def queue_depth(pool: str, delta: int) -> None:
    """``delta`` requests handed to (+1) or back from (-1) ``pool``'s stage (counted even with metrics off,
    so a switch in between never leaves the gauge off by one)."""
    QUEUE_DEPTH.labels(MODEL.value, pool).inc(delta)


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
            in_flight = len(self._open)
        TIMELINE.depth(CLUSTER.waiting(), in_flight)
        return rec

    def get(self, request_id: str) -> RequestRecord | None:
        with self._lock:
            return self._open.get(request_id)

    def close(self, request_id: str) -> None:
        with self._lock:
            rec = self._open.pop(request_id, None)
            if rec is not None:
                self.finished.append(rec)
            in_flight = len(self._open)
        TIMELINE.depth(CLUSTER.waiting(), in_flight)
        if rec is not None and rec.e2e_s is not None:  # answered whole: its latencies join the history
            latencies = [(m, v) for m, v in (("ttft", rec.ttft_s), ("tpot", rec.tpot_s), ("e2e", rec.e2e_s))
                         if v is not None]
            latencies += [(f"stage:{k}", v) for k, v in rec.stages.items()]
            TIMELINE.finished(latencies, rec.kv_logical_bytes, rec.kv_wire_bytes)

    def recent(self, since: float = 0.0) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.finished if r.started_at >= since]


TIMELINE = Timeline()  # the dashboard's six hours of history
REQUEST_LOG = RequestLog()


# ---------------------------------------------------------------- recording helpers (cheap when off)
def stage(request_id: str, name: str, seconds: float) -> None:
    """A request spent ``seconds`` in stage ``name``: queue, reserve, encode, prefill, kv_transfer,
    decode, stream (complete in colocated mode)."""
    if not OBSERVABILITY.metrics:
        return
    STAGE.labels(MODEL.value, name).observe(seconds)
    rec = REQUEST_LOG.get(request_id)
    if rec is not None:
        rec.stages[name] = rec.stages.get(name, 0.0) + seconds


def kv_transfer(request_id: str, seconds: float, per_codec: Iterable[tuple[str, int, int]],
                transport: str = "") -> None:
    """A KV push finished over ``transport``: ``per_codec`` holds (codec, wire bytes, logical bytes)."""
    if not OBSERVABILITY.metrics:
        return
    per_codec = list(per_codec)
    label = "+".join(sorted(c for c, _, _ in per_codec)) or "none"
    model = MODEL.value
    KV_SECONDS.labels(model, label).observe(seconds)
    KV_TRANSFERS.labels(model, transport or "unknown").inc()
    wire = logical = 0
    for codec, w, lg in per_codec:
        KV_WIRE_BYTES.labels(model, codec).inc(w)
        KV_LOGICAL_BYTES.labels(model, codec).inc(lg)
        wire += w
        logical += lg
    rec = REQUEST_LOG.get(request_id)
    if rec is not None:
        rec.stages["kv_transfer"] = seconds
        rec.kv_wire_bytes += wire
        rec.kv_logical_bytes += logical
    STAGE.labels(model, "kv_transfer").observe(seconds)


def kv_failure(code: str) -> None:
    if OBSERVABILITY.metrics:
        KV_FAILURES.labels(MODEL.value, code).inc()


def encoder(images: int, hits: int) -> None:
    if OBSERVABILITY.metrics:
        ENCODER_IMAGES.labels(MODEL.value).inc(images)
        ENCODER_CACHE_HITS.labels(MODEL.value).inc(hits)


def migrated(stage: str) -> None:
    if OBSERVABILITY.metrics:
        MIGRATIONS.labels(MODEL.value, stage).inc()


def rejected(reason: str) -> None:
    if OBSERVABILITY.metrics:
        ADMISSION_REJECTIONS.labels(MODEL.value, reason).inc()
