"""``LeanSpan`` against the SDK's own span: the same operations give the same exported span, and the
SDK's rules (sampling, limits, status, ended spans, exceptions) hold."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from controlplane.observability.lean_spans import LeanSpan, LeanTracerProvider

pytestmark = [pytest.mark.unit]

RESOURCE = Resource.create({"service.name": "lean-test"})
REMOTE = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                     trace_flags=TraceFlags(TraceFlags.SAMPLED))


def _pair(**kwargs) -> list[tuple[object, InMemorySpanExporter]]:
    out = []
    for cls in (TracerProvider, LeanTracerProvider):
        exporter = InMemorySpanExporter()
        provider = cls(resource=RESOURCE, shutdown_on_exit=False, **kwargs)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        out.append((provider.get_tracer("epd.test", "1.0"), exporter))
    return out


def _script(tracer) -> None:
    """One request's worth of span operations, the way the control plane and workers use them."""
    root = tracer.start_span("POST /v1/completions", context=trace.set_span_in_context(NonRecordingSpan(REMOTE)),
                             kind=SpanKind.SERVER, attributes={"http.method": "POST", "n": 3, "ok": True, "x": 0.5,
                                                               "tags": ["a", "b"]})
    ctx = trace.set_span_in_context(root)
    child = tracer.start_span("prefill", context=ctx, kind=SpanKind.CLIENT,
                              links=[Link(REMOTE, {"why": "retry"})], start_time=1_000, attributes={"epd.stage": "p"})
    child.add_event("sent", {"bytes": 10}, timestamp=1_500)
    child.set_status(Status(StatusCode.ERROR, "worker gone"))
    child.end(end_time=2_000)
    with tracer.start_as_current_span("queue", context=ctx) as queued:
        queued.set_attribute("epd.pool", "decode")
    root.set_attribute("http.response.status_code", 200)
    root.update_name("POST /v1/completions (renamed)")
    root.end()


def _comparable(span: ReadableSpan, ids: dict[int, int]) -> tuple:
    def sid(span_id: int) -> int:
        return ids.setdefault(span_id, len(ids))

    return (span.name, span.kind, sid(span.context.span_id), span.context.trace_id, span.context.trace_flags,
            sid(span.parent.span_id) if span.parent else None, span.parent.is_remote if span.parent else None,
            dict(span.attributes or {}), span.status.status_code, span.status.description,
            [(e.name, dict(e.attributes or {}), e.timestamp) for e in span.events],
            [(ln.context, dict(ln.attributes or {})) for ln in span.links],
            span.dropped_attributes, span.dropped_events, span.dropped_links,
            span.resource.attributes, span.instrumentation_scope,
            span.start_time if span.start_time == 1_000 else "now", span.end_time if span.end_time == 2_000 else "now")


def test_a_lean_span_exports_what_the_sdk_span_exports():
    (sdk, sdk_out), (lean, lean_out) = _pair()
    _script(sdk)
    _script(lean)
    sdk_spans, lean_spans = sdk_out.get_finished_spans(), lean_out.get_finished_spans()
    assert all(isinstance(s, LeanSpan) for s in lean_spans) and not any(isinstance(s, LeanSpan) for s in sdk_spans)
    assert [_comparable(s, {}) for s in lean_spans] == [_comparable(s, {}) for s in sdk_spans]
    # and the OTLP encoding has the same shape (ids and clock times aside)
    a, b = encode_spans(sdk_spans), encode_spans(lean_spans)
    for req in (a, b):
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    s.ClearField("span_id")
                    s.ClearField("parent_span_id")
                    if s.start_time_unix_nano != 1_000:
                        s.ClearField("start_time_unix_nano")
                        s.ClearField("end_time_unix_nano")
    assert a == b


def test_parent_links_and_trace_ids_hold_across_lean_spans():
    (_, _), (lean, out) = _pair()
    _script(lean)
    by_name = {s.name: s for s in out.get_finished_spans()}
    root = by_name["POST /v1/completions (renamed)"]
    assert root.parent == REMOTE and root.context.trace_id == REMOTE.trace_id
    for name in ("prefill", "queue"):
        assert by_name[name].parent.span_id == root.context.span_id and not by_name[name].parent.is_remote


def test_a_sampled_out_span_is_not_recorded_and_its_children_follow():
    (_, _), (lean, out) = _pair(sampler=ParentBased(ALWAYS_OFF))
    root = lean.start_span("root")
    assert isinstance(root, NonRecordingSpan) and not root.is_recording()
    assert root.get_span_context().is_valid and not root.get_span_context().trace_flags.sampled
    child = lean.start_span("child", context=trace.set_span_in_context(root))
    assert not child.is_recording()
    sampled = lean.start_span("under a sampled remote parent",
                              context=trace.set_span_in_context(NonRecordingSpan(REMOTE)))
    assert sampled.is_recording()  # ParentBased follows the caller's decision
    child.end(), root.end(), sampled.end()
    assert [s.name for s in out.get_finished_spans()] == ["under a sampled remote parent"]


def test_limits_cut_and_count_what_they_drop():
    limits = SpanLimits(max_span_attributes=2, max_span_attribute_length=4, max_events=1, max_links=1)
    for tracer, out in _pair(span_limits=limits):
        span = tracer.start_span("s", attributes={"a": "abcdefgh", "b": 1}, links=[Link(REMOTE), Link(REMOTE)])
        span.set_attribute("c", 2)  # over the count: the oldest ("a") goes
        span.set_attribute("a", "xyzxyzxyz")  # and again ("b")
        span.add_event("e1")
        span.add_event("e2")
        span.end()
        (got,) = out.get_finished_spans()
        assert list(got.attributes.items()) == [("c", 2), ("a", "xyzx")]
        assert (got.dropped_attributes, got.dropped_events, got.dropped_links) == (2, 1, 1)
        assert [e.name for e in got.events] == ["e2"]  # the newest kept


def test_bad_attribute_values_are_dropped_not_raised():
    (_, _), (lean, out) = _pair()
    span = lean.start_span("s")
    span.set_attribute("obj", object())
    span.set_attribute("mixed", [1, "a"])
    span.set_attribute("", 1)
    span.set_attribute("fine", (1, 2))
    span.end()
    assert dict(out.get_finished_spans()[0].attributes) == {"fine": (1, 2)}


def test_status_rules_and_an_ended_span_take_no_writes():
    (_, _), (lean, out) = _pair()
    span = lean.start_span("s")
    span.set_status(StatusCode.UNSET)
    assert span.status.status_code is StatusCode.UNSET
    span.set_status(StatusCode.OK)
    span.set_status(StatusCode.ERROR, "too late")  # OK is final
    span.end()
    span.set_attribute("after", 1)
    span.add_event("after")
    span.update_name("after")
    span.end()  # a second end is ignored: exported once
    (got,) = out.get_finished_spans()
    assert got.name == "s" and got.status.status_code is StatusCode.OK and not got.attributes and not got.events
    assert not span.is_recording()


def test_an_exception_in_a_span_context_is_recorded_and_marks_the_span_failed():
    (_, _), (lean, out) = _pair()
    with pytest.raises(ValueError):
        with lean.start_as_current_span("s"):
            raise ValueError("bad prompt")
    (got,) = out.get_finished_spans()
    assert got.status.status_code is StatusCode.ERROR and "ValueError: bad prompt" in got.status.description
    (event,) = got.events
    assert event.name == "exception" and event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "bad prompt"
    assert "Traceback" in event.attributes["exception.stacktrace"]


def test_a_disabled_sdk_hands_out_no_op_tracers(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = LeanTracerProvider(shutdown_on_exit=False)
    assert not provider.get_tracer("x").start_span("s").is_recording()


def test_one_tracer_per_scope():
    provider = LeanTracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    assert provider.get_tracer("a") is provider.get_tracer("a")
    assert provider.get_tracer("a") is not provider.get_tracer("b")


def test_a_span_ended_from_many_threads_at_once_is_exported_once():
    import threading

    (_, _), (lean, out) = _pair()
    for _ in range(50):
        span = lean.start_span("raced")
        gate = threading.Barrier(8)

        def end(span=span, gate=gate) -> None:
            gate.wait()
            span.end()

        threads = [threading.Thread(target=end) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(out.get_finished_spans()) == 50


def test_event_and_link_attributes_are_limited_as_the_sdk_limits_them():
    limits = SpanLimits(max_event_attributes=1, max_link_attributes=1, max_attribute_length=3)
    got = []
    for tracer, out in _pair(span_limits=limits):
        span = tracer.start_span("s", links=[Link(REMOTE, {"a": "abcdef", "b": 2})])
        span.add_event("e", {"x": 1, "y": "long value"})
        span.end()
        (s,) = out.get_finished_spans()
        got.append(([(dict(e.attributes), e.dropped_attributes) for e in s.events],
                    [(dict(ln.attributes), ln.dropped_attributes) for ln in s.links]))
    assert got[0] == got[1] == ([({"y": "lon"}, 1)], [({"b": 2}, 1)])


def test_an_sdk_without_what_lean_spans_read_gets_its_own_tracer(monkeypatch, caplog):
    """A later opentelemetry-sdk may drop a private attribute lean spans read: then the SDK's own tracer
    is handed out (slower, never broken), with one warning naming what is missing."""
    from opentelemetry.sdk.trace import Tracer

    monkeypatch.delattr(Tracer, "_is_enabled")
    exporter = InMemorySpanExporter()
    provider = LeanTracerProvider(resource=RESOURCE, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("epd.test")
    assert isinstance(tracer, Tracer)
    provider.get_tracer("epd.other")
    assert [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()] == [
        "this opentelemetry-sdk lacks _is_enabled: using its own (slower) spans instead of lean ones"]
