"""``encode_request`` against the exporter package's ``encode_spans``: the same bytes for the same spans
(SDK spans and lean spans, every attribute type, events, links, statuses, remote parents, limits)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags,
                                 TraceState)

from controlplane.observability.lean_spans import LeanTracerProvider
from controlplane.observability.otlp_encode import FastOTLPSpanExporter, encode_request

pytestmark = [pytest.mark.unit]

REMOTE = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                     trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("vendor", "a1")]))


def _same(spans) -> None:
    want = encode_spans(spans)
    got = encode_request(spans)
    assert ExportTraceServiceRequest.FromString(got) == want
    assert got == want.SerializeToString()


def _record(provider_cls, script, **kwargs):
    exporter = InMemorySpanExporter()
    provider = provider_cls(resource=Resource.create({"service.name": "enc", "n": 3}, schema_url="https://x/1"),
                            shutdown_on_exit=False, **kwargs)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    script(provider)
    return exporter.get_finished_spans()


def _request_like(provider) -> None:
    tracer = provider.get_tracer("epd.controlplane", "0.1", "https://schema/1")
    other = provider.get_tracer("epd.workers")
    root = tracer.start_span("POST /v1/completions", context=trace.set_span_in_context(NonRecordingSpan(REMOTE)),
                             kind=SpanKind.SERVER, attributes={"http.method": "POST", "n": -7, "ok": False, "r": 0.0,
                                                               "big": 2**62, "tags": ["a", "é"], "nums": [1, 2],
                                                               "empty": ""})
    ctx = trace.set_span_in_context(root)
    for kind in (SpanKind.CLIENT, SpanKind.INTERNAL, SpanKind.PRODUCER, SpanKind.CONSUMER):
        child = other.start_span(f"child-{kind.name}", context=ctx, kind=kind, links=[Link(REMOTE, {"why": "retry"})])
        child.add_event("sent", {"bytes": 10, "flag": True}, timestamp=1_500)
        child.add_event("", None, timestamp=1_600)
        child.set_status(Status(StatusCode.ERROR, "worker gone") if kind is SpanKind.CLIENT else StatusCode.OK)
        child.end(end_time=2_000_000_000_000_000_000)
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        root.record_exception(exc)
    root.end()


@pytest.mark.parametrize("provider_cls", [TracerProvider, LeanTracerProvider])
def test_the_same_bytes_as_the_exporter_package_for_a_request_s_spans(provider_cls):
    spans = _record(provider_cls, _request_like)
    assert len(spans) == 5
    _same(spans)
    _same(spans[:1])
    _same([])


def test_dropped_counts_and_cut_values_encode_the_same():
    def script(provider):
        span = provider.get_tracer("t").start_span("s", attributes={f"k{i}": i for i in range(5)},
                                                  links=[Link(REMOTE)] * 3)
        for i in range(4):
            span.add_event(f"e{i}")
        span.end()

    for cls in (TracerProvider, LeanTracerProvider):
        spans = _record(cls, script, span_limits=SpanLimits(max_span_attributes=2, max_events=2, max_links=1))
        assert spans[0].dropped_attributes == 3 and spans[0].dropped_events == 2 and spans[0].dropped_links == 2
        _same(spans)


_scalars = st.one_of(st.text(max_size=40), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                     st.floats(allow_nan=False), st.binary(max_size=20))
_values = st.one_of(_scalars, st.lists(st.text(max_size=8), max_size=4), st.lists(st.integers(-5, 2**40), max_size=4),
                    st.lists(st.floats(allow_nan=False), max_size=3), st.lists(st.booleans(), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attrs=st.dictionaries(st.text(min_size=1, max_size=12), _values, max_size=8),
       name=st.text(max_size=30), start=st.integers(0, 2**63), remote_parent=st.booleans())
def test_random_attributes_names_and_times_encode_the_same(attrs, name, start, remote_parent):
    def script(provider):
        parent = trace.set_span_in_context(NonRecordingSpan(REMOTE)) if remote_parent else None
        span = provider.get_tracer("t").start_span(name, context=parent, attributes=attrs, start_time=start)
        span.add_event("ev", attrs)
        span.end(end_time=start + 1)

    for cls in (TracerProvider, LeanTracerProvider):
        _same(_record(cls, script))


def test_a_value_the_wire_cannot_carry_is_skipped_like_the_package_does():
    from opentelemetry.sdk.trace import ReadableSpan

    span = ReadableSpan("s", context=REMOTE, attributes={"ok": 1, "huge": 2**64, "after": "x"},
                        resource=Resource.create({"service.name": "enc"}))
    got = ExportTraceServiceRequest.FromString(encode_request([span]))
    keys = [kv.key for kv in got.resource_spans[0].scope_spans[0].spans[0].attributes]
    assert keys == ["ok", "after"]


def test_the_fast_exporter_is_the_package_s_exporter_with_this_encoding():
    spans = _record(LeanTracerProvider, _request_like)
    exporter = FastOTLPSpanExporter(endpoint="http://127.0.0.1:1", insecure=True)
    try:
        assert exporter._translate_data(spans) == encode_spans(spans)
    finally:
        exporter.shutdown()


def test_spans_group_by_equal_resources_and_scopes_as_the_package_does():
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    r1, r1_again, r2 = (Resource.create({"service.name": n}) for n in ("a", "a", "b"))
    s1, s1_again, s2 = InstrumentationScope("x", "1"), InstrumentationScope("x", "1"), InstrumentationScope("y")
    assert r1 is not r1_again and r1 == r1_again
    spans = [ReadableSpan(f"s{i}", context=REMOTE, resource=r, instrumentation_scope=s)
             for i, (r, s) in enumerate([(r1, s1), (r2, s1), (r1_again, s1_again), (r1, s2), (r2, None), (r1, None)])]
    got = ExportTraceServiceRequest.FromString(encode_request(spans))
    assert [[[sp.name for sp in ss.spans] for ss in rs.scope_spans] for rs in got.resource_spans] == \
        [[["s0", "s2"], ["s3"], ["s5"]], [["s1"], ["s4"]]]
    _same(spans)


def test_a_string_that_is_not_valid_unicode_is_skipped_like_the_package_does():
    from opentelemetry.sdk.trace import ReadableSpan

    span = ReadableSpan("s", context=REMOTE, attributes={"ok": 1, "bad": "x\ud800y", "bad\ud800key": 2, "after": "x"},
                        resource=Resource.create({"service.name": "enc"}))
    _same([span])
    got = ExportTraceServiceRequest.FromString(encode_request([span]))
    assert [kv.key for kv in got.resource_spans[0].scope_spans[0].spans[0].attributes] == ["ok", "after"]
