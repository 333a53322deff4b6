"""Worker server spans recorded on the request path as a few values, and made into spans later, in
batches, on a thread of their own.

Why: a prefill worker's one server span per traced call cost 0.18-0.35 ms of CPU per one-token call
with OTLP export here, where ``bench micro --only tracing`` prices a span at ~6 µs. Timed inside the
worker, reading the ``traceparent`` took 19-25 µs, starting the span 20-31 µs and ending it 7-11 µs:
run between engine steps, the interpreter finds none of that code in cache, and the process's other
threads wait longer for the GIL meanwhile (docs/observability.md#cost). Recorded here, a traced call
costs a regular-expression match, two ids and the context its handler runs in; building 512 spans in a
row costs ~9 µs each, warm. On one worker (one-token Prefill calls from 8 client threads, bf16, OTLP
export; four runs of 8 interleaved pairs each way): a traced call's extra CPU was +0.10, +0.03, +0.11
and +0.05 ms through the SDK path, +0.02 to +0.03 ms deferred. In the whole stack's on/off figure
(``bench controlplane --observability-cost 16``) the difference is within the noise: 0.876 and 0.911
before, 0.887 and 0.920 after, interleaved.

What is kept exact: the span's ids (chosen on the request path, so the handler's child spans, such as
prefill's ``kv-transfer``, name it as their parent), its times, kind, attributes, status and the
gRPC status code; the sampler's decision (made on the request path: the default ``parentbased_*``
samplers follow the caller's sampled flag without a call, any other sampler is asked); the processors
each span reaches (through ``on_start`` and ``on_end``, when it is built); attributes the handler sets
on its current span (``set_attribute``; the only writes handlers make). What changes: a span reaches
the processors up to ``interval_s`` after it ends (``force_flush`` and shutdown build what is pending
first), and ``on_start`` sees it then too. A ``traceparent`` that is not plain W3C version 00, or one
with a ``tracestate``, takes the SDK's own path (``begin`` returns None), as does every call in a
process whose provider hands out the SDK's tracer.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from dataclasses import dataclass
from time import time_ns
from typing import Any, Mapping

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, sampling
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from controlplane.observability.lean_spans import LeanSpan, LeanTracer

log = logging.getLogger(__name__)

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(slots=True)
class Deferred:
    """One call's span as the request path leaves it."""

    name: str
    kind: SpanKind
    attributes: dict[str, Any]
    span_context: SpanContext
    parent: SpanContext
    context: Context  # what the handler runs in: this span's context as the current span
    record: bool
    start_ns: int
    end_ns: int = 0
    extra: Mapping[str, Any] | None = None
    failure: tuple[str, int | None] | None = None  # (status description, gRPC status code)


class _Current(NonRecordingSpan):
    """The deferred span as its handler sees it (``trace.get_current_span()``): its context, for child
    spans; and the attributes the handler sets, kept for the build."""

    def __init__(self, deferred: Deferred) -> None:
        super().__init__(deferred.span_context)
        self._deferred = deferred

    def set_attribute(self, key: str, value: Any) -> None:
        if self._deferred.record and not self._deferred.end_ns:
            self._deferred.attributes[key] = value  # checked against the span rules when it is built

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)


def _follows_parent(sampler: sampling.Sampler) -> bool:
    """The default ``parentbased_*`` shape: a remote parent's sampled flag decides, nothing else."""
    return (isinstance(sampler, sampling.ParentBased)
            and getattr(sampler, "_remote_parent_sampled", None) is sampling.ALWAYS_ON
            and getattr(sampler, "_remote_parent_not_sampled", None) is sampling.ALWAYS_OFF)


class DeferredSpans:
    def __init__(self, tracer: LeanTracer, interval_s: float = 1.0, batch: int = 512,
                 max_pending: int = 8192) -> None:
        self._sdk = tracer._sdk
        self.interval_s = interval_s
        self.batch = batch
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: deque[Deferred] = deque()
        self._build_lock = threading.Lock()  # one builder at a time: spans reach the processors once, in order
        self._start_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None  # started by the first span to finish

    # ------------------------------------------------------------------ the request path
    def begin(self, carrier: Mapping[str, str], name: str, kind: SpanKind,
              attributes: Mapping[str, Any]) -> Deferred | None:
        """The call's span, begun; None when it must take the SDK's path (see the module docstring)."""
        header = carrier.get("traceparent")
        if header is None or "tracestate" in carrier or self._stopped:
            return None
        match = _TRACEPARENT.fullmatch(header)
        if match is None:
            return None
        trace_id, parent_id, flags = int(match[1], 16), int(match[2], 16), int(match[3], 16)
        if not trace_id or not parent_id:
            return None
        sdk = self._sdk
        if not sdk._is_enabled():
            return None
        parent = SpanContext(trace_id, parent_id, is_remote=True, trace_flags=TraceFlags(flags))
        attrs = dict(attributes)
        trace_state = None
        if _follows_parent(sdk.sampler):
            sampled = record = bool(flags & TraceFlags.SAMPLED)
        else:
            result = sdk.sampler.should_sample(trace_api.set_span_in_context(NonRecordingSpan(parent)), trace_id,
                                               name, kind, attributes, ())
            sampled, record = result.decision.is_sampled(), result.decision.is_recording()
            trace_state = result.trace_state
            attrs = {**result.attributes, **attrs}
        out = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
        if parent.trace_flags.random_trace_id:
            out |= TraceFlags.RANDOM_TRACE_ID
        span_context = SpanContext(trace_id, sdk.id_generator.generate_span_id(), is_remote=False,
                                   trace_flags=TraceFlags(out), trace_state=trace_state)
        deferred = Deferred(name, kind, attrs, span_context, parent, Context(), record, time_ns())
        deferred.context = trace_api.set_span_in_context(_Current(deferred))
        return deferred

    def finish(self, span: Deferred, failure: tuple[str, int | None] | None = None,
               extra: Mapping[str, Any] | None = None) -> None:
        """The call ended (``failure``: its status description and gRPC code)."""
        if not span.record:
            return
        span.end_ns, span.failure, span.extra = time_ns(), failure, extra
        if len(self._pending) >= self.max_pending:  # the builder is far behind: drop, as a full batch queue does
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.warning("deferred spans: %d dropped (more than %d waiting to be built)", self.dropped,
                            self.max_pending)
            return
        self._pending.append(span)
        if self._thread is None:
            self._start()
        if len(self._pending) >= self.batch:
            self._wake.set()

    # ------------------------------------------------------------------ building
    def flush(self) -> None:
        """Build every pending span now and hand it to the processors."""
        with self._build_lock:
            while self._pending:
                try:
                    self._build(self._pending.popleft())
                except Exception:  # one bad span must not stop the others (or the thread)
                    log.exception("deferred spans: building a span failed")

    def _build(self, d: Deferred) -> None:
        span = LeanSpan(d.name, d.span_context, d.parent, self._sdk, d.kind, d.attributes, (), True, True)
        span.start(d.start_ns, None)
        if d.extra:
            span.set_attributes(d.extra)
        if d.failure is not None:
            description, code = d.failure
            span.set_status(Status(StatusCode.ERROR, description))
            if code is not None:
                span.set_attribute("rpc.grpc.status_code", code)
        span.end(d.end_ns)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="epd-deferred-spans", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.flush()

    def stop(self) -> None:
        """Build what is pending and stop the thread; later calls take the SDK's path."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()


class FlushDeferred(SpanProcessor):
    """Added to the provider before any other processor, so that its ``force_flush`` and ``shutdown``
    build the pending spans before the exporters flush."""

    def __init__(self, deferred: DeferredSpans) -> None:
        self.deferred = deferred

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.deferred.flush()
        return True

    def shutdown(self) -> None:
        self.deferred.stop()
