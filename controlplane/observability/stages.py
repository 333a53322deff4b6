"""One request's stages as the dispatcher drives them: a client span per worker call (its context
injected into the call's gRPC metadata), the stage's time, and the pool's in-flight count.

    obs = RequestObserver(request_id)          # parent: the caller's trace context (the HTTP span)
    st = obs.begin("prefill", pool="prefill")  # span + timer + queue_depth{pool="prefill"} += 1
    stub.Prefill(req, metadata=st.metadata(md))
    st.end(error=None, reply=reply)            # once; records the stage, KV stats from the reply, ...

Everything is a no-op when both switches are off (``OBSERVABILITY``), so the dispatcher calls these
unconditionally.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from controlplane.observability import metrics
from controlplane.observability.metrics import OBSERVABILITY
from controlplane.observability.tracing import current_parent, end_span, grpc_metadata, start_span
from epd.worker.v1 import worker_pb2 as wpb
from workers.tracing import FAILURE_KEY, KV_TRANSFER_FAILURE  # what a worker sets in trailing metadata


class RequestObserver:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.parent = current_parent()
        self.kv_failed = False

    def begin(self, stage: str, pool: str | None = None, *, traced: bool = True, **attributes: Any) -> Stage:
        """``traced=False``: time and count the stage, but make no span (and pass no trace context)."""
        return Stage(self, stage, pool, attributes, traced)

    def failure(self, exc: BaseException) -> None:
        """Count a KV-transfer failure once per request, when a worker said that is what failed."""
        if self.kv_failed or not isinstance(exc, grpc.RpcError):
            return
        try:
            trailing = exc.trailing_metadata() or ()
        except Exception:  # not a call error (e.g. a local failure)
            return
        # grpc's metadata items are (key, value) named tuples
        if any(m.key == FAILURE_KEY and m.value == KV_TRANSFER_FAILURE for m in trailing):
            self.kv_failed = True
            code = exc.code() if hasattr(exc, "code") else None
            metrics.kv_failure(code.name if code is not None else "UNKNOWN")


class Stage:
    __slots__ = ("obs", "name", "pool", "span", "t0", "ended", "counted", "images")

    def __init__(self, obs: RequestObserver, name: str, pool: str | None, attributes: dict[str, Any],
                 traced: bool = True) -> None:
        self.obs, self.name, self.pool, self.ended = obs, name, pool, False
        self.images = int(attributes.get("images", 0))
        self.t0 = time.perf_counter()
        self.span = None if obs.parent is None or not traced else start_span(
            name, obs.parent, SpanKind.CLIENT,
            {"epd.request_id": obs.request_id, "epd.stage": name, **{f"epd.{k}": v for k, v in attributes.items()}})
        self.counted = False
        if pool is not None and OBSERVABILITY.metrics:
            self.counted = True
            metrics.queue_depth(pool, 1)

    def metadata(self, base: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        return grpc_metadata(base, self.span)

    def end(self, error: BaseException | str | None = None, reply: Any = None) -> None:
        if self.ended:
            return
        self.ended = True
        seconds = time.perf_counter() - self.t0
        if self.counted and self.pool is not None:
            metrics.queue_depth(self.pool, -1)  # even if metrics were switched off since
        if error is None:
            metrics.stage(self.obs.request_id, self.name, seconds)
            if reply is not None:
                self._reply(reply)
        elif isinstance(error, BaseException):
            self.obs.failure(error)
        end_span(self.span, error)

    def end_future(self, fut: Future) -> None:
        """``add_done_callback`` form: ends with the call's error or its reply."""
        exc = fut.exception() if not fut.cancelled() else None
        self.end(error=exc if exc is not None else ("cancelled" if fut.cancelled() else None),
                 reply=None if exc is not None or fut.cancelled() else fut.result())

    def _reply(self, reply: Any) -> None:
        if isinstance(reply, wpb.PrefillReply) and reply.kv_codecs:
            stats = [(c.codec, c.wire_bytes, c.logical_bytes) for c in reply.kv_codecs]
            metrics.kv_transfer(self.obs.request_id, reply.kv_seconds, stats, reply.transport)
            if self.span is not None:
                self.span.set_attribute("epd.kv.wire_bytes", reply.kv_bytes)
                self.span.set_attribute("epd.kv.logical_bytes", reply.kv_logical_bytes)
                self.span.set_attribute("epd.kv.seconds", reply.kv_seconds)
                self.span.set_attribute("epd.kv.codec", "+".join(c for c, _, _ in stats))
                self.span.set_attribute("epd.kv.transport", reply.transport)
        elif isinstance(reply, wpb.EncodeReply):
            metrics.encoder(self.images, reply.cache_hits)
            if self.span is not None:
                self.span.set_attribute("epd.encoder.cache_hits", reply.cache_hits)


def queued(request_id: str, parent: Any, start_ns: int, end_ns: int, error: str | None = None) -> None:
    """The request waited in the scheduler from ``start_ns`` to ``end_ns`` (``time.time_ns()``)."""
    if error is None:
        metrics.stage(request_id, "queue", (end_ns - start_ns) / 1e9)
    span = start_span("queue", parent, SpanKind.INTERNAL, {"epd.request_id": request_id, "epd.stage": "queue"},
                      start_time=start_ns)
    end_span(span, error, end_time=end_ns)
