"""The ingress side: a root span and request counters per HTTP request, and the token-timing
metrics of each answer.

  ObservabilityMiddleware  pure ASGI, outermost. For every /v1/* request: ``epd:requests_total``
                           by route and status once the response is sent (streams included); for
                           the two generation routes also the root span, continuing a client's
                           ``traceparent``, current for the request's task (so the scheduler and
                           dispatcher parent their spans on it), ended after the last byte.
  watch(chunks, ...)       wraps the backend's chunks: TTFT at the first token, inter-token latency
                           per later token, TPOT and E2E at the last, the "stream" stage and span,
                           and the request's record for the dashboard.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.backend import BackendError, Chunk, Overloaded
from controlplane.observability import metrics
from controlplane.observability.metrics import OBSERVABILITY, REQUEST_LOG
from controlplane.observability.tracing import context_from_headers, current_parent, end_span, start_span, tracer

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
KNOWN_ROUTES = GENERATION_ROUTES + ("/v1/models", "/tokenize", "/detokenize")
T0_KEY = "epd_t0"  # request.state key: perf_counter() at arrival
_TRACE_HEADERS = (b"traceparent", b"tracestate", b"baggage")  # what the W3C propagators read


def route_label(path: str) -> str | None:
    """The ``route`` label for a path: a known /v1 route, "/v1/other", or None (not counted)."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    if path == "/v1" or path.startswith("/v1/"):
        return "/v1/other"
    return None


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_label(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None or not (OBSERVABILITY.metrics or OBSERVABILITY.tracing):
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[T0_KEY] = time.perf_counter()
        status = [500]  # if the app raises before answering, CatchAll (inside) answers 500
        span = token = None
        if OBSERVABILITY.tracing and route in GENERATION_ROUTES:
            raw = scope.get("headers") or ()
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k in _TRACE_HEADERS}
            span = tracer().start_span(f"{scope.get('method', 'POST')} {route}", context=context_from_headers(carrier),
                                       kind=SpanKind.SERVER,
                                       attributes={"http.request.method": scope.get("method", ""), "http.route": route,
                                                   "url.path": scope.get("path", "")})
            token = otel_context.attach(trace.set_span_in_context(span))

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            if OBSERVABILITY.metrics:
                metrics.REQUESTS.labels(metrics.MODEL.value, route, str(status[0])).inc()
                if route in GENERATION_ROUTES:  # the dashboard's request and error rates: completions only
                    metrics.TIMELINE.answered(status[0])
            if span is not None:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {status[0]}"))
                span.end()
            if token is not None:
                otel_context.detach(token)


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, Overloaded):
        return 429
    if isinstance(exc, BackendError):
        return exc.status
    return 500


async def watch(chunks: AsyncGenerator[Chunk, None], request_id: str, route: str,
                t0: float | None = None, *, streamed: bool = False,
                status_of: Callable[[Exception], int] | None = None) -> AsyncGenerator[Chunk, None]:
    """``chunks`` unchanged, timed. ``t0``: perf_counter() at the request's arrival. Closing this
    closes ``chunks`` at once (so a client that leaves aborts the request on the workers). ``streamed``:
    the answer's status line (200) went out with its first token, so one cut short is an error the
    dashboard would not see otherwise. ``status_of``: the HTTP status an exception maps to (the API's)."""
    timed = _timed(chunks, request_id, route, t0, streamed, status_of or _status_of)
    async with aclosing(chunks), aclosing(timed):  # leaving closes timed (its records), then chunks
        async for chunk in timed:
            yield chunk


async def _timed(chunks: AsyncGenerator[Chunk, None], request_id: str, route: str, t0: float | None,
                 streamed: bool, status_of: Callable[[Exception], int]) -> AsyncGenerator[Chunk, None]:
    on = OBSERVABILITY.metrics
    model = metrics.MODEL.value
    if not (on or OBSERVABILITY.tracing):
        async for chunk in chunks:
            yield chunk
        return
    t0 = time.perf_counter() if t0 is None else t0
    record = REQUEST_LOG.open(request_id, route) if on else None
    parent = current_parent()
    stream_span = None
    first_at = last_at = None
    status = 200
    completed = yielded = False
    try:
        async for chunk in chunks:
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                if first_at is None:
                    first_at = now
                    if not chunk.finished:  # an answer that arrives whole (one token) has no stream stage
                        stream_span = start_span("stream", parent, attributes={"epd.request_id": request_id,
                                                                              "epd.stage": "stream"})
                    if on:
                        metrics.TTFT.labels(model).observe(now - t0)
                        for _ in range(n - 1):  # tokens that came with the first: no wait of their own
                            metrics.ITL.labels(model).observe(0.0)
                elif on and last_at is not None:  # set with the first token
                    gap = (now - last_at) / n
                    itl = metrics.ITL.labels(model)
                    for _ in range(n):
                        itl.observe(gap)
                last_at = now
            if chunk.finished:
                completed = True
                _finished(chunk, t0, now, first_at, record, on)
            yielded = True
            yield chunk
    except BaseException as exc:
        if on and isinstance(exc, Overloaded) and not (streamed and yielded):  # answered 429, not cut short
            metrics.rejected(exc.reason)
        if not completed:  # else the last token went out before the client left: answered, not cut short
            status = status_of(exc) if isinstance(exc, Exception) else 499
            if on and first_at is not None:
                metrics.CUT_SHORT.labels(model, route, str(status)).inc()
                if streamed:  # answered 200 as far as the middleware knows: the dashboard's error rate counts it
                    metrics.TIMELINE.cut_short(status)
            if streamed and status >= 500 and parent is not None:  # the root span's status line said 200
                root = trace.get_current_span(parent)
                if root.is_recording():
                    root.set_status(Status(StatusCode.ERROR, f"HTTP {status} after the stream began: {exc}"))
        end_span(stream_span, exc)
        stream_span = None
        raise
    finally:
        end = time.perf_counter()
        if first_at is not None and on and completed:  # as every other stage: answered requests only
            metrics.stage(request_id, "stream", end - first_at)
        end_span(stream_span, end_time=None)
        if record is not None:
            record.status = status
            REQUEST_LOG.close(request_id)


def _finished(last: Chunk, t0: float, now: float, first_at: float | None, record: metrics.RequestRecord | None,
              on: bool) -> None:
    if not on:
        return
    e2e = now - t0
    model = metrics.MODEL.value
    metrics.E2E.labels(model).observe(e2e)
    metrics.PROMPT_TOKENS.labels(model).inc(last.prompt_tokens)
    metrics.GENERATION_TOKENS.labels(model).inc(last.completion_tokens)
    tpot = None
    if first_at is not None and last.completion_tokens > 1:
        tpot = (now - first_at) / (last.completion_tokens - 1)
        metrics.TPOT.labels(model).observe(tpot)
    if record is not None:
        record.e2e_s = e2e
        record.ttft_s = None if first_at is None else first_at - t0
        record.tpot_s = tpot
        record.prompt_tokens = last.prompt_tokens
        record.completion_tokens = last.completion_tokens


def fastapi_kwargs() -> dict[str, Any]:
    """FastAPI(**fastapi_kwargs()): turn off FastAPI's own OpenTelemetry (newer FastAPI makes HTTP and
    per-operation spans whenever a tracer provider is installed), so a request has one server span,
    ours, and the switches here decide what is recorded."""
    import inspect

    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
