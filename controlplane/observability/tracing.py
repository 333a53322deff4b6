"""OpenTelemetry for epd, on the SDK's own path: its ``TracerProvider``, ``BatchSpanProcessor``, OTLP
exporter and samplers, configured by the standard ``OTEL_*`` variables; W3C trace context carried in
gRPC metadata.

Exporter (``exporter_from_env``):
  OTEL_SDK_DISABLED=true                       none
  OTEL_TRACES_EXPORTER=none                    none
  OTEL_TRACES_EXPORTER=console                 spans printed to stdout (ConsoleSpanExporter)
  OTEL_TRACES_EXPORTER=otlp, or unset with
  OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT set     OTLP over gRPC (the exporter reads the endpoint, headers,
                                               TLS and timeout variables itself)
  anything else unset                          none: spans are not recorded, but a trace context that
                                               arrives (a client's ``traceparent``) is still passed on

Sampler (when spans are exported):
  OTEL_TRACES_SAMPLER unset                    ``parentbased_traceidratio`` at ``DEFAULT_SAMPLER_RATIO``:
                                               a request that arrives with a ``traceparent`` follows its
                                               sampled flag; one without is traced with that probability
  OTEL_TRACES_SAMPLER set                      the SDK reads it and OTEL_TRACES_SAMPLER_ARG itself
                                               (e.g. ``always_on`` exports every span)
A sampled-out request still carries its trace context to the workers (their spans are not recorded
either: they follow the parent). The sampler is fixed when the process's provider is made (the first
``setup_tracing`` or ``add_span_processor``). The batch processor reads ``OTEL_BSP_*``.

``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the process; ``OTEL_PROPAGATORS`` picks the
propagators that read a client's headers (default W3C tracecontext + baggage). Internal gRPC hops always
carry W3C trace context (``workers.tracing.W3C``).

A request's spans are started with an explicit parent (``start_span(..., parent=...)``) and never made
"current" across a ``yield``: the control plane's request generators step on different threads, and the
only way a span's context reaches a worker is the ``traceparent`` in the call's gRPC metadata
(``grpc_metadata``); workers continue it in ``workers.tracing.TracingInterceptor``.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio, Sampler
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from controlplane.observability.metrics import OBSERVABILITY
from workers.tracing import W3C

log = logging.getLogger(__name__)

TRACER_NAME = "epd.controlplane"
DEFAULT_SAMPLER = "parentbased_traceidratio"
DEFAULT_SAMPLER_RATIO = 0.1  # of the requests that arrive without a trace context
_EXPORTERS = ("otlp", "console", "none")
# the values of OTEL_TRACES_SAMPLER the SDK builds in (the spec's others need a plugin epd does not ship)
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
_lock = threading.Lock()
_provider: TracerProvider | None = None
_exporting: list[SpanProcessor] = []  # what setup_tracing added (stop_exporting shuts them down)


class TracingConfigError(ValueError):
    """OTEL_* variables that cannot be honoured; the message names the variable."""


def exporter_from_env(env: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The span exporter the ``OTEL_*`` variables ask for, or None (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not names:
        names = ["otlp"] if endpoint else ["none"]
    bad = [n for n in names if n not in _EXPORTERS]
    if bad:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: unsupported "
                                 f"exporter {bad[0]!r}; epd supports {', '.join(_EXPORTERS)}")
    if len(names) > 1:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: epd sends spans "
                                 "to one exporter; name one of otlp, console, none")
    name = names[0]
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol.strip().lower() != "grpc":
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: epd ships the OTLP gRPC exporter "
                                 "only; use grpc (port 4317 on a collector)")
    for var in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        check_headers(var, env.get(var, ""))
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_* itself


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def check_headers(var: str, value: str) -> None:
    """TracingConfigError unless ``value`` is comma-separated ``name=value`` pairs, as the OTLP exporter reads
    them. The SDK would log a malformed entry whole, and these often carry credentials (an Authorization
    header): the refusal names the entry by position only."""
    entries = [e for e in value.split(",") if e.strip()]
    for i, entry in enumerate(entries, 1):
        name, eq, _ = entry.partition("=")
        if not eq or not _HEADER_NAME.fullmatch(name.strip()):
            raise TracingConfigError(f"{var}: entry {i} of {len(entries)} is not name=value (an HTTP header name, "
                                     f"'=', then the value, URL-encoded); its text is not shown, as it may hold a "
                                     f"credential")


def sampler_from_env(env: Mapping[str, str] | None = None) -> Sampler | None:
    """epd's default sampler when ``OTEL_TRACES_SAMPLER`` is unset; None when it is set (the SDK's
    ``TracerProvider`` then reads it and ``OTEL_TRACES_SAMPLER_ARG`` itself). Raises
    ``TracingConfigError`` for values the SDK would ignore with a warning."""
    env = os.environ if env is None else env
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not name:
        if arg:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is set but OTEL_TRACES_SAMPLER is not, and the "
                                     "argument applies only with it: set OTEL_TRACES_SAMPLER=parentbased_traceidratio "
                                     f"too (epd's default sampler, at {DEFAULT_SAMPLER_RATIO})")
        return ParentBasedTraceIdRatio(DEFAULT_SAMPLER_RATIO)
    if name not in _SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={env.get('OTEL_TRACES_SAMPLER')!r}: unsupported sampler; "
                                 f"epd supports {', '.join(_SAMPLERS)}")
    if name.endswith("traceidratio") and arg:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: {name} takes a probability from 0 to 1")
    return None


def provider(service_name: str, sampler: Sampler | None = None) -> TracerProvider:
    """This process's SDK tracer provider, installed as the global one on first use (with ``sampler``;
    None: the SDK's, from ``OTEL_TRACES_SAMPLER``, default ``parentbased_always_on``); an SDK provider
    someone installed first is shared instead."""
    global _provider
    with _lock:
        if _provider is None:
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):  # someone installed an SDK provider first: share it
                _provider = current
            else:
                attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name}
                _provider = TracerProvider(sampler=sampler, resource=Resource.create(attrs))
                trace.set_tracer_provider(_provider)
                atexit.register(_provider.shutdown)
        return _provider


def setup_tracing(service_name: str, exporter: SpanExporter | None = None,
                  env: Mapping[str, str] | None = None) -> bool:
    """Export this process's spans to ``exporter``, or to the one the OTEL_* variables name, sampled as
    they say (see the module docstring). Returns whether spans are now exported; False leaves the no-op
    provider (context still propagates). Raises ``TracingConfigError`` naming a bad variable."""
    sampler = sampler_from_env(env)
    exporter = exporter if exporter is not None else exporter_from_env(env)
    if exporter is None:
        return False
    processor = BatchSpanProcessor(exporter)
    provider(service_name, sampler).add_span_processor(processor)
    with _lock:
        _exporting.append(processor)
    return True


def stop_exporting(timeout_ms: int = 5000) -> None:
    """Flush and shut down the exporters ``setup_tracing`` added. For a deployment closing in a process
    that lives on (tests, the benchmarks): a later deployment adds its own exporter, and without this
    the old one would keep sending every span, twice, to an endpoint that may be gone."""
    with _lock:
        processors = list(_exporting)
        _exporting.clear()
    for processor in processors:
        processor.force_flush(timeout_ms)
        processor.shutdown()


def add_span_processor(processor: SpanProcessor, service_name: str = "epd") -> None:
    """Send every span this process records through ``processor`` too (tests add an in-memory one)."""
    provider(service_name).add_span_processor(processor)


def force_flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# ---------------------------------------------------------------- spans with explicit parents
_tracer: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    """The control plane's tracer (cached: ``get_tracer`` builds a new one per call). A proxy until a
    provider is installed, then bound to it."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


def current_parent() -> Context | None:
    """The caller's trace context to parent a request's spans on; None when tracing is off or no
    request span is current (a caller outside the ingress, e.g. a test, gets no stray root spans)."""
    if not OBSERVABILITY.tracing:
        return None
    ctx = otel_context.get_current()
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def start_span(name: str, parent: Context | None, kind: SpanKind = SpanKind.INTERNAL,
               attributes: Attributes = None, start_time: int | None = None) -> Span | None:
    """A started span under ``parent`` (not made current), or None when tracing is off (parent None)."""
    if parent is None:
        return None
    return tracer().start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_time)


def end_span(span: Span | None, error: BaseException | str | None = None, end_time: int | None = None) -> None:
    if span is None:
        return
    if error is not None and span.is_recording():
        span.set_status(Status(StatusCode.ERROR, str(error)))
        if isinstance(error, BaseException):
            span.record_exception(error)
    span.end(end_time=end_time)


# ---------------------------------------------------------------- W3C propagation
def grpc_metadata(base: tuple[tuple[str, str], ...], span: Span | None) -> tuple[tuple[str, str], ...]:
    """``base`` plus ``traceparent`` (and ``tracestate``) naming ``span`` as the caller's span: W3C trace
    context only, whatever OTEL_PROPAGATORS says for clients (``workers.tracing.W3C`` reads it)."""
    if span is None:
        return base
    carrier: dict[str, str] = {}
    W3C.inject(carrier, context=trace.set_span_in_context(span))
    return base + tuple(carrier.items())


def context_from_headers(headers: Mapping[str, str]) -> Context:
    """The trace context a client sent (``traceparent``/``tracestate``); an empty context if none."""
    return propagate.extract(headers)
