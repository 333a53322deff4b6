"""Deferred worker server spans: what the request path leaves becomes, when built, the span the SDK
path makes (ids, parent, kind, attributes, status), the sampler still decides, anything unusual takes
the SDK path, and nothing waits past a flush."""

from __future__ import annotations

import secrets
import time

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode, TraceFlags

from controlplane.observability.deferred_spans import DeferredSpans, FlushDeferred
from controlplane.observability.lean_spans import LeanTracerProvider
from controlplane.observability.otlp_encode import encode_request

pytestmark = [pytest.mark.unit]

ATTRS = {"rpc.system": "grpc", "rpc.method": "Prefill", "epd.pool": "prefill"}


def _rig(**provider_kwargs) -> tuple[LeanTracerProvider, DeferredSpans, InMemorySpanExporter]:
    provider = LeanTracerProvider(resource=Resource.create({"service.name": "deferred-test"}), shutdown_on_exit=False,
                                  **provider_kwargs)
    deferred = DeferredSpans(provider.get_tracer("epd.workers"), interval_s=60)  # built only when flushed
    provider.add_span_processor(FlushDeferred(deferred))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, deferred, exporter


def _carrier(sampled: bool = True) -> tuple[dict[str, str], int, int]:
    trace_id, parent = secrets.randbits(128) | 1, secrets.randbits(64) | 1
    return {"traceparent": f"00-{trace_id:032x}-{parent:016x}-{'01' if sampled else '00'}"}, trace_id, parent


def test_a_deferred_span_is_built_as_the_call_left_it_with_its_children_parented_on_it() -> None:
    provider, deferred, exporter = _rig()
    carrier, trace_id, parent = _carrier()
    span = deferred.begin(carrier, "PrefillWorker/Prefill", SpanKind.SERVER, ATTRS)
    assert span is not None
    token = otel_context.attach(span.context)
    try:
        trace.get_current_span().set_attribute("epd.images", 2)  # what a handler writes on its server span
        child = provider.get_tracer("epd.workers").start_span("kv-transfer")  # under the current span
        child.end()
    finally:
        otel_context.detach(token)
    deferred.finish(span, ("no reservation for request 'x'", 5), {"epd.messages": 3})
    assert [s.name for s in exporter.get_finished_spans()] == ["kv-transfer"]  # the server span waits
    provider.force_flush()
    kv, server = exporter.get_finished_spans()
    assert server.name == "PrefillWorker/Prefill" and server.kind == SpanKind.SERVER
    assert server.context.trace_id == trace_id and server.context.trace_flags.sampled
    assert server.parent.span_id == parent and server.parent.is_remote
    assert kv.parent.span_id == server.context.span_id and kv.context.trace_id == trace_id
    assert dict(server.attributes) == {**ATTRS, "epd.images": 2, "epd.messages": 3, "rpc.grpc.status_code": 5}
    assert server.status.status_code == StatusCode.ERROR and server.status.description == "no reservation for request 'x'"
    assert 0 < server.start_time <= server.end_time <= time.time_ns()
    # it encodes as any span does
    assert encode_request([server]) == encode_spans([server]).SerializeToString()


@pytest.mark.parametrize(("sampler", "caller_sampled"), [
    (None, False),  # the default parent-based sampler: an unsampled caller, no span
    (ALWAYS_OFF, True),  # any other sampler is asked, whatever the caller says
    (ParentBased(ALWAYS_OFF, remote_parent_sampled=ALWAYS_OFF), True),
    (TraceIdRatioBased(0.0), True),
])
def test_a_span_the_sampler_drops_is_not_built_and_its_children_carry_the_flag(sampler, caller_sampled: bool
                                                                              ) -> None:  # type: ignore[no-untyped-def]
    provider, deferred, exporter = _rig(**({"sampler": sampler} if sampler is not None else {}))
    carrier, _, _ = _carrier(sampled=caller_sampled)
    span = deferred.begin(carrier, "PrefillWorker/Prefill", SpanKind.SERVER, ATTRS)
    assert span is not None and not span.record and not span.span_context.trace_flags.sampled
    assert not trace.get_current_span(span.context).get_span_context().trace_flags.sampled
    deferred.finish(span)
    provider.force_flush()
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize("carrier", [
    {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "vendor=1"},  # tracestate: SDK parses it
    {"traceparent": "00-" + "A" * 32 + "-" + "b" * 16 + "-01"},  # not lowercase
    {"traceparent": "01-" + "a" * 32 + "-" + "b" * 16 + "-01"},  # another version
    {"traceparent": "00-" + "0" * 32 + "-" + "b" * 16 + "-01"},  # all-zero trace id
    {"traceparent": "00-" + "a" * 32 + "-" + "0" * 16 + "-01"},  # all-zero parent id
    {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01-extra"},
    {"traceparent": "00-" + "+" + "a" * 31 + "-" + "b" * 16 + "-01"},  # int() would take it
    {},
])
def test_anything_but_a_plain_version_00_traceparent_takes_the_sdk_path(carrier: dict[str, str]) -> None:
    _, deferred, _ = _rig()
    assert deferred.begin(carrier, "X/Y", SpanKind.SERVER, ATTRS) is None


def test_pending_spans_are_bounded_and_built_by_the_thread() -> None:
    provider, deferred, exporter = _rig()
    deferred.max_pending, deferred.batch = 3, 2
    with deferred._build_lock:  # the builder is held up: pending spans pile up to the bound
        for _ in range(5):
            carrier, _, _ = _carrier()
            span = deferred.begin(carrier, "X/Y", SpanKind.SERVER, ATTRS)
            deferred.finish(span)  # type: ignore[arg-type]
        assert deferred.dropped == 2 and exporter.get_finished_spans() == ()
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < deferred.batch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(exporter.get_finished_spans()) >= deferred.batch  # a full batch woke the builder, no flush
    provider.shutdown()  # builds what is still pending (less than a batch waits for the interval)
    assert len(exporter.get_finished_spans()) == 3
    carrier, _, _ = _carrier()
    assert deferred.begin(carrier, "X/Y", SpanKind.SERVER, ATTRS) is None  # stopped: the SDK path


def test_spans_reach_the_processors_in_order_once() -> None:
    provider, deferred, exporter = _rig()
    names = [f"call-{i}" for i in range(20)]
    for name in names:
        carrier, _, _ = _carrier()
        deferred.finish(deferred.begin(carrier, name, SpanKind.SERVER, ATTRS))  # type: ignore[arg-type]
    provider.force_flush()
    provider.force_flush()
    got: list[ReadableSpan] = list(exporter.get_finished_spans())
    assert [s.name for s in got] == names
    assert all(s.context.trace_flags == TraceFlags(TraceFlags.SAMPLED) for s in got)
