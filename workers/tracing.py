"""Worker-side tracing, all of it: a server span per traced RPC, parented on the ``traceparent`` the
caller put in the gRPC metadata (W3C trace context), and the child spans a handler makes under it.

Only calls that carry a ``traceparent`` get a span, so heartbeats, status probes and untraced callers
cost one metadata scan. A unary handler runs with its span current (so the service can add children,
e.g. prefill's ``kv-transfer``); a response-streaming handler's span is ended when its stream ends,
without being made current across yields. Spans come from the process's global tracer provider, the
OpenTelemetry SDK's: its sampler decides (the default ones follow the caller's sampled flag), its
processors export. Installing that provider and its exporter is the process's business (a pool replica
does it from the standard ``OTEL_*`` variables); without one, spans are no-ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

TRACER_NAME = "epd.workers"
TRACEPARENT = "traceparent"
# Internal hops carry W3C trace context only (traceparent, tracestate), whatever OTEL_PROPAGATORS says
# for clients: the control plane injects with the same propagator, and a worker has no use for baggage.
W3C = TraceContextTextMapPropagator()


_tracer: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    """The workers' tracer (cached: ``get_tracer`` builds a new one per call)."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


def _failure(context: grpc.ServicerContext, exc: BaseException | None) -> tuple[str, int | None] | None:
    """(status description, gRPC status code) of a call that failed; None for one that did not."""
    code = context.code() if hasattr(context, "code") else None
    if exc is None and code == grpc.StatusCode.CANCELLED:  # the caller went away (see _streaming)
        return None
    if exc is not None or (code is not None and code != grpc.StatusCode.OK):
        details = context.details() if hasattr(context, "details") else None
        return str(details or exc or code), (code.value[0] if code is not None else None)
    return None


class TracingInterceptor(grpc.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers of calls that carry a trace context."""

    def __init__(self, pool: str, worker_id: Callable[[], str] | str = "") -> None:
        self.pool = pool
        self._worker_id = worker_id
        self._named: dict[tuple[str, str], tuple[str, dict]] = {}  # (method, worker id) -> span name, attributes

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        metadata = details.invocation_metadata or ()
        if handler is None or not any(k == TRACEPARENT for k, _ in metadata):
            return handler
        if handler.request_streaming:
            return handler  # KV and embedding pushes are traced by their callers' spans
        carrier = {k: v for k, v in metadata if isinstance(v, str)}
        name, attrs = self._name_of(details.method)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, carrier, name, attrs),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, carrier, name, attrs),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def _name_of(self, full_method: str) -> tuple[str, dict]:
        """The span name and attributes of calls to ``full_method`` (the same for every call; cached)."""
        worker_id = self._worker_id() if callable(self._worker_id) else self._worker_id
        named = self._named.get((full_method, worker_id))
        if named is None:
            service, _, method = full_method.lstrip("/").rpartition("/")
            attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "epd.pool": self.pool,
                     "epd.worker_id": worker_id}
            named = (f"{service.rpartition('.')[2]}/{method}", attrs)
            if len(self._named) < 256:  # a service has a handful of methods; a worker one id at a time
                self._named[(full_method, worker_id)] = named
        return named

    @staticmethod
    def _unary(behavior: Callable, carrier: dict[str, str], name: str, attrs: dict) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            current, end = _begin(carrier, name, attrs)
            # current for the handler (its child spans), by hand: start_as_current_span's context-manager
            # layers cost more than the span itself on a one-token request
            token = otel_context.attach(current)
            error: BaseException | None = None
            try:
                return behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                otel_context.detach(token)
                end(_failure(context, error), None)
        return run

    @staticmethod
    def _streaming(behavior: Callable, carrier: dict[str, str], name: str, attrs: dict) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            _, end = _begin(carrier, name, attrs)  # never made current across yields
            error: BaseException | None = None
            extra: dict[str, Any] = {"epd.messages": 0}
            try:
                for item in behavior(request, context):
                    extra["epd.messages"] += 1
                    yield item
            except GeneratorExit:
                # the caller stopped reading (it had what it needed, or left): not the server's failure,
                # as OpenTelemetry's RPC conventions leave a server span's status unset for CANCELLED
                extra["epd.cancelled"] = True
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                end(_failure(context, error), extra)
        return run


_Ending = Callable[[tuple[str, int | None] | None, Mapping[str, Any] | None], None]


def _begin(carrier: dict[str, str], name: str, attrs: dict) -> tuple[otel_context.Context, _Ending]:
    """A traced call's server span, started: the context its handler runs in, and how to end it (with
    the call's failure and extra attributes). Parented from the metadata alone, never this thread's
    context."""
    parent = W3C.extract(carrier)
    span = tracer().start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs)

    def end(failure: tuple[str, int | None] | None, extra: Mapping[str, Any] | None) -> None:
        if span.is_recording():  # a sampled-out call's span takes nothing
            if extra:
                span.set_attributes(extra)
            if failure is not None:
                span.set_status(Status(StatusCode.ERROR, failure[0]))
                if failure[1] is not None:
                    span.set_attribute("rpc.grpc.status_code", failure[1])
        span.end()
    return trace.set_span_in_context(span, parent), end


def current_span() -> trace.Span:
    """The RPC's server span inside a traced unary handler (a no-op span otherwise)."""
    return trace.get_current_span()


def child_span(name: str, attributes: dict | None = None) -> trace.Span | None:
    """A span under the current RPC's server span, or None when the call is not traced (so an
    untraced call never starts a stray root span)."""
    parent = trace.get_current_span()
    if not parent.get_span_context().is_valid:
        return None
    return tracer().start_span(name, attributes=attributes)


def end_child(span: trace.Span | None, error: str | None = None,
              attributes: Mapping[str, AttributeValue] | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


FAILURE_KEY = "epd-failure"  # trailing metadata naming what failed, e.g. "kv-transfer"
KV_TRANSFER_FAILURE = "kv-transfer"
DRAINING_REFUSAL = "draining"  # the worker is alive and refused new work (epd drain)
EXCEEDS_CONTEXT = "exceeds-context"  # the request does not fit this worker's context or KV pool


def mark_failure(context: grpc.ServicerContext, what: str) -> None:
    """Tell the caller (in trailing metadata) what this call failed on: the worker itself answered, so a
    transport-level status it ends with (UNAVAILABLE) does not mean the worker broke."""
    try:
        context.set_trailing_metadata(((FAILURE_KEY, what),))
    except Exception:  # an in-process call without a real context
        pass


def mark_kv_failure(context: grpc.ServicerContext) -> None:
    """Tell the caller (in trailing metadata) that this call failed in the KV transfer."""
    mark_failure(context, KV_TRANSFER_FAILURE)
