"""``tracing``: the cost of a request's spans, ours against the OpenTelemetry SDK's, in the same repeat.

``tracing.span``: the spans the control plane makes for a one-token request (the HTTP server span with
its attributes, a ``queue`` span with explicit times, a ``prefill`` client span, each ended), through
``LeanTracerProvider``; the reference is the same calls through the SDK's ``TracerProvider``. Both
providers have the same resource and one span processor that drops what it gets, so the figure is the
span's own cost: start, attributes, end, the processor call. Microseconds per span.

``tracing.encode``: ``encode_request`` (our OTLP encoder) over a batch of 512 of those spans; the
reference is the exporter package's ``encode_spans`` and its serialisation, the bytes it would send.
Microseconds per span. Both produce the same bytes (``tests/unit/test_otlp_encode.py``).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from bench.micro.results import Result
from bench.micro.timing import Plan, paired, per_call_us
from controlplane.observability.lean_spans import LeanTracerProvider
from controlplane.observability.otlp_encode import encode_request

SPANS_PER_REQUEST = 3
BATCH = 512
RESOURCE = Resource.create({"service.name": "epd-controlplane"})


class _Drop(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        pass


def _request(tracer: Any) -> None:
    """A one-token request's control-plane spans, as ``controlplane.observability`` makes them."""
    root = tracer.start_span("POST /v1/completions", kind=SpanKind.SERVER,
                             attributes={"http.request.method": "POST", "http.route": "/v1/completions",
                                         "url.path": "/v1/completions"})
    ctx = trace.set_span_in_context(root)
    queued = tracer.start_span("queue", context=ctx, attributes={"epd.request_id": "cmpl-0123456789abcdef",
                                                                 "epd.stage": "queue"}, start_time=1_000)
    queued.end(end_time=2_000)
    prefill = tracer.start_span("prefill", context=ctx, kind=SpanKind.CLIENT,
                                attributes={"epd.request_id": "cmpl-0123456789abcdef", "epd.stage": "prefill",
                                            "epd.prompt_tokens": 8})
    prefill.end()
    root.set_attribute("http.response.status_code", 200)
    root.end()


def _tracer(cls: type[TracerProvider], processor: SpanProcessor) -> Any:
    provider = cls(resource=RESOURCE, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider.get_tracer("epd.controlplane")


def run(plan: Plan) -> list[Result]:
    calls = 200 if plan.quick else 1000
    lean, sdk = _tracer(LeanTracerProvider, _Drop()), _tracer(TracerProvider, _Drop())
    figs, refs = paired(per_call_us(lambda: _request(lean), calls, plan.timer),
                        per_call_us(lambda: _request(sdk), calls, plan.timer), plan)
    out = [Result("tracing.span", "tracing", "us/span", "lower",
                  "the OpenTelemetry SDK's span, the same calls",
                  tuple(f / SPANS_PER_REQUEST for f in figs), tuple(r / SPANS_PER_REQUEST for r in refs),
                  note=f"start, attributes and end of a one-token request's {SPANS_PER_REQUEST} control-plane "
                       f"spans; {plan.clock} clock")]
    kept = InMemorySpanExporter()
    recorder = _tracer(LeanTracerProvider, SimpleSpanProcessor(kept))
    for _ in range(BATCH // SPANS_PER_REQUEST + 1):
        _request(recorder)
    batch = kept.get_finished_spans()[:BATCH]
    figs, refs = paired(per_call_us(lambda: encode_request(batch), 1, plan.timer),
                        per_call_us(lambda: encode_spans(batch).SerializeToString(), 1, plan.timer), plan)
    out.append(Result("tracing.encode", "tracing", "us/span", "lower",
                      "the OTLP exporter package's encode_spans + serialisation, the same batch",
                      tuple(f / len(batch) for f in figs), tuple(r / len(batch) for r in refs),
                      note=f"a batch of {len(batch)} spans to OTLP request bytes; {plan.clock} clock"))
    return out
