"""``tracing``: what a request's spans cost on the OpenTelemetry SDK's path, in the same repeat.

``tracing.span``: the spans the control plane makes for a one-token request that arrives without a
trace context (the HTTP server span with its attributes, a ``queue`` span with explicit times, a
``prefill`` client span, each ended), through the SDK's ``TracerProvider`` with epd's default sampler
(``controlplane.observability.tracing.sampler_from_env``: parent-based, a ratio of new traces); the
reference is the same calls with every span recorded (``ALWAYS_ON``). Both providers have the same
resource and one span processor that drops what it gets, so the figure is the span's own cost: the
sampler, start, attributes, end, the processor call. Microseconds per span.

``tracing.encode``: the OTLP exporter package's ``encode_spans`` and serialisation of a batch of 512 of
those spans, recorded: the bytes it would send. The reference is recording the same number of spans
(``ALWAYS_ON``, as above), so the ratio says what export adds to each recorded span. Microseconds per span.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler
from opentelemetry.trace import SpanKind

from bench.micro.results import Result
from bench.micro.timing import Plan, paired, per_call_us
from controlplane.observability.tracing import DEFAULT_SAMPLER, DEFAULT_SAMPLER_RATIO, sampler_from_env

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


def _tracer(sampler: Sampler, processor: SpanProcessor) -> Any:
    provider = TracerProvider(sampler=sampler, resource=RESOURCE, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider.get_tracer("epd.controlplane")


def run(plan: Plan) -> list[Result]:
    calls = 200 if plan.quick else 1000
    default = sampler_from_env({})  # what an exporting process uses when OTEL_TRACES_SAMPLER is unset
    assert default is not None
    sampled, every = _tracer(default, _Drop()), _tracer(ALWAYS_ON, _Drop())
    figs, refs = paired(per_call_us(lambda: _request(sampled), calls, plan.timer),
                        per_call_us(lambda: _request(every), calls, plan.timer), plan)
    out = [Result("tracing.span", "tracing", "us/span", "lower",
                  "the same calls with every span recorded (the SDK's ALWAYS_ON sampler)",
                  tuple(f / SPANS_PER_REQUEST for f in figs), tuple(r / SPANS_PER_REQUEST for r in refs),
                  note=f"a one-token request's {SPANS_PER_REQUEST} control-plane spans under epd's default "
                       f"sampler ({DEFAULT_SAMPLER} {DEFAULT_SAMPLER_RATIO}); {plan.clock} clock")]
    kept = InMemorySpanExporter()
    recorder = _tracer(ALWAYS_ON, SimpleSpanProcessor(kept))
    for _ in range(BATCH // SPANS_PER_REQUEST + 1):
        _request(recorder)
    batch = kept.get_finished_spans()[:BATCH]
    requests = len(batch) // SPANS_PER_REQUEST

    def record() -> None:
        for _ in range(requests):
            _request(every)

    figs, refs = paired(per_call_us(lambda: encode_spans(batch).SerializeToString(), 1, plan.timer),
                        per_call_us(record, 1, plan.timer), plan)
    out.append(Result("tracing.encode", "tracing", "us/span", "lower",
                      "recording the same number of spans (ALWAYS_ON, a processor that drops them)",
                      tuple(f / len(batch) for f in figs), tuple(r / (requests * SPANS_PER_REQUEST) for r in refs),
                      note=f"a batch of {len(batch)} spans to OTLP request bytes by the exporter package; "
                           f"{plan.clock} clock"))
    return out
