"""A cheaper recording span for the OpenTelemetry SDK's pipeline.

The SDK's ``Span`` costs ~20 µs of CPU to start in isolation and 60 µs inside the control plane's
request threads (a lock, a ``BoundedAttributes`` with its own lock, two ``BoundedList``s, a validation
pass over every attribute, the SDK's self-metrics hook, and a ``ReadableSpan`` copy at the end). A
one-token request makes four spans, so on 2 cores that alone was ~10% of the stack's requests/s with
every span exported (``epd bench controlplane --observability-cost``).

``LeanTracerProvider`` is the SDK's ``TracerProvider`` (sampler, resource, id generator, span
processors, exporters, flush and shutdown all unchanged) whose tracers make ``LeanSpan``s: a
``ReadableSpan`` that is also an API ``Span``, holding its attributes in a plain dict and handed to the
processors as itself when it ends (it takes no writes after that, so no copy is needed). What it keeps
from the SDK's span: the sampler's decision and attributes, the span limits (attribute count, value
length, events, links, with the dropped counts exported), attribute validation (values of the wrong type
are dropped with a warning, as the SDK does), ``record_exception``, status rules (OK sticks, UNSET is
ignored) and the context-manager behaviour. What it drops: the SDK's own span metrics
(``otel.sdk.span.*``, off unless OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED) and the per-span lock (an
attribute write is one dict store under the GIL; a write after ``end`` is ignored with a warning; ending
and evicting at a full limit take one module-wide lock, so a span is exported once).
"""

from __future__ import annotations

import logging
import threading
import traceback
from time import time_ns
from types import TracebackType
from typing import Any, Iterator, Mapping, Sequence

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, Tracer, TracerProvider
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util._decorator import _agnosticcontextmanager

log = logging.getLogger(__name__)

_PRIMITIVES = (str, bool, int, float)
# One lock for every span's rare paths (ending; evicting at a full limit) instead of one per span: a span
# is written by the thread that owns its call, but two threads ending one span must not both export it.
_RARE = threading.Lock()


def _clean(key: object, value: Any, max_len: int | None) -> Any:
    """The value as the OTel attribute rules allow it (primitives, or a homogeneous sequence of one
    primitive type, as a tuple), strings cut to ``max_len``; None when it is not allowed."""
    if not isinstance(key, str) or not key:
        log.warning("span attribute key %r is not a non-empty string; dropped", key)
        return None
    if type(value) in _PRIMITIVES:
        return value[:max_len] if max_len is not None and type(value) is str else value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        if isinstance(value, _PRIMITIVES):  # a subclass (an IntEnum, a str subclass)
            return value
        log.warning("span attribute %r: type %s is not allowed; dropped", key, type(value).__name__)
        return None
    kinds = {type(v) for v in value if v is not None}
    if len(kinds) > 1 or not kinds <= set(_PRIMITIVES):
        log.warning("span attribute %r: a sequence must hold one primitive type; dropped", key)
        return None
    if max_len is not None and kinds == {str}:
        return tuple(v[:max_len] if v is not None else None for v in value)
    return tuple(value)


def _push(items: list, item: Any, limit: int | None) -> int:
    """Append ``item``; at ``limit`` the oldest goes first, as in the SDK's BoundedList. Returns how
    many were dropped (0 or 1)."""
    if limit is None or len(items) < limit:
        items.append(item)
        return 0
    if limit > 0:
        del items[0]
        items.append(item)
    return 1


def _linkable(context: SpanContext | None, attributes: Mapping[str, Any] | None) -> bool:
    """The SDK's rule: a link needs a valid context, or attributes or trace state to say something."""
    return bool(context and (context.is_valid or attributes or context.trace_state))


class LeanSpan(trace_api.Span, ReadableSpan):
    """A recording span; see the module docstring for what it keeps and drops."""

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, tracer: Tracer,
                 kind: SpanKind, attributes: Mapping[str, Any] | None, links: Sequence[Link],
                 record_exception: bool, set_status_on_exception: bool) -> None:
        # ReadableSpan's fields, set directly (its __init__ would build an empty Resource)
        self._name = name
        self._context = context
        self._kind = kind
        self._parent = parent
        self._resource = tracer.resource
        self._instrumentation_scope = tracer._instrumentation_scope
        self._instrumentation_info = tracer.instrumentation_info
        self._status = Status(StatusCode.UNSET)
        self._start_time: int | None = None
        self._end_time: int | None = None
        self._limits: SpanLimits = tracer._span_limits
        self._processor = tracer.span_processor
        self._record_exception = record_exception
        self._set_status_on_exception = set_status_on_exception
        self._attributes: dict[str, Any] = {}
        self._events: list[Event] = []
        self._links: list[Link] = []
        self._dropped_attributes = self._dropped_events = self._dropped_links = 0
        if attributes:
            self.set_attributes(attributes)
        for link in links:
            if link is not None:
                self.add_link(link.context, link.attributes)

    # ---------------------------------------------------------------- ReadableSpan
    @property
    def dropped_attributes(self) -> int:
        return self._dropped_attributes

    @property
    def dropped_events(self) -> int:
        return self._dropped_events

    @property
    def dropped_links(self) -> int:
        return self._dropped_links

    def __repr__(self) -> str:
        return f'{type(self).__name__}(name="{self._name}", context={self._context})'

    # ---------------------------------------------------------------- the API Span
    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def _ended(self, what: str) -> bool:
        if self._end_time is not None:
            log.warning("%s on an ended span (%s); ignored", what, self._name)
            return True
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        if self._ended("set_attribute"):
            return
        value = _clean(key, value, self._limits.max_span_attribute_length)
        if value is None:
            return
        attrs = self._attributes
        limit = self._limits.max_span_attributes
        if key in attrs:  # as the SDK: a key set again moves to the end
            del attrs[key]
        elif limit is not None and len(attrs) >= limit:  # full: the oldest goes, as in the SDK
            with _RARE:
                self._dropped_attributes += 1
                if limit == 0:
                    return
                if len(attrs) >= limit:
                    del attrs[next(iter(attrs))]
        attrs[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def _rare_attributes(self, attributes: Mapping[str, Any] | None, limit: int | None) -> BoundedAttributes:
        """An event's or a link's attributes, as the SDK keeps them (events and links are rare: an
        exception, a retry; the SDK's own container is cheap enough there)."""
        return BoundedAttributes(limit, attributes, immutable=True, max_value_len=self._limits.max_attribute_length)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self._ended("add_event"):
            return
        event = Event(name, self._rare_attributes(attributes, self._limits.max_event_attributes), timestamp)
        self._dropped_events += _push(self._events, event, self._limits.max_events)

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._ended("add_link") or not _linkable(context, attributes):
            return
        link = Link(context, self._rare_attributes(attributes, self._limits.max_link_attributes))
        self._dropped_links += _push(self._links, link, self._limits.max_links)

    def update_name(self, name: str) -> None:
        if not self._ended("update_name"):
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._ended("set_status"):
            return
        if self._status.status_code is StatusCode.OK:  # OK is final
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is StatusCode.UNSET:
            return
        self._status = status

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        attrs: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def start(self, start_time: int | None, parent_context: Context | None) -> None:
        self._start_time = start_time if start_time is not None else time_ns()
        self._processor.on_start(self, parent_context=parent_context)  # type: ignore[arg-type]

    def end(self, end_time: int | None = None) -> None:
        with _RARE:
            ended = self._end_time is not None
            if not ended:
                self._end_time = end_time if end_time is not None else time_ns()
        if ended:
            log.warning("end() on an ended span (%s); ignored", self._name)
            return
        self._processor._on_ending(self)  # type: ignore[arg-type]
        self._processor.on_end(self)  # it takes no writes from here on: no copy needed

    def __exit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
                 exc_tb: TracebackType | None) -> None:
        if exc_val is not None and self.is_recording():
            if self._record_exception:
                self.record_exception(exc_val, escaped=True)
            if self._set_status_on_exception:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        super().__exit__(exc_type, exc_val, exc_tb)


class LeanTracer(trace_api.Tracer):
    """The SDK tracer's decisions (enabled, sampler, ids), making ``LeanSpan``s."""

    def __init__(self, sdk: Tracer) -> None:
        self._sdk = sdk

    def start_span(self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = (),
                   start_time: int | None = None, record_exception: bool = True,
                   set_status_on_exception: bool = True) -> trace_api.Span:
        sdk = self._sdk
        links = links or ()
        parent = trace_api.get_current_span(context).get_span_context()
        if not sdk._is_enabled():
            return trace_api.NonRecordingSpan(context=parent)
        ids = sdk.id_generator
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
            random_trace_id = ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random_trace_id = parent.trace_flags.random_trace_id
        result = sdk.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        flags = TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT
        if random_trace_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        span_context = SpanContext(trace_id, ids.generate_span_id(), is_remote=False, trace_flags=TraceFlags(flags),
                                   trace_state=result.trace_state)
        if not result.decision.is_recording():
            return trace_api.NonRecordingSpan(context=span_context)
        span_attrs = dict(result.attributes)
        if attributes:
            span_attrs.update(attributes)
        span = LeanSpan(name, span_context, parent, sdk, kind, span_attrs, links, record_exception,
                        set_status_on_exception)
        span.start(start_time, context)
        return span

    @_agnosticcontextmanager
    def start_as_current_span(self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                              attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = (),
                              start_time: int | None = None, record_exception: bool = True,
                              set_status_on_exception: bool = True, end_on_exit: bool = True
                              ) -> Iterator[trace_api.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time, record_exception,
                               set_status_on_exception)
        with trace_api.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                set_status_on_exception=set_status_on_exception) as current:
            yield current


# What LeanTracer and LeanSpan read from the SDK's tracer and its processor: partly the SDK's private
# attributes (present in 1.45, the version tested). If a later SDK drops one, the provider hands out
# the SDK's own tracer instead (slower, never broken), and says so once.
_TRACER_NEEDS = ("sampler", "id_generator", "resource", "span_processor", "instrumentation_info",
                 "_instrumentation_scope", "_span_limits", "_is_enabled")
_PROCESSOR_NEEDS = ("on_start", "_on_ending", "on_end")


def _missing(sdk: Tracer) -> list[str]:
    missing = [name for name in _TRACER_NEEDS if not hasattr(sdk, name)]
    processor = getattr(sdk, "span_processor", None)
    return missing + [f"span_processor.{name}" for name in _PROCESSOR_NEEDS if not hasattr(processor, name)]


class LeanTracerProvider(TracerProvider):
    """The SDK's provider, handing out ``LeanTracer``s (one per instrumentation scope, like the SDK's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lean: dict[int, LeanTracer] = {}  # by id of the SDK tracer, which the SDK keeps for good
        self._warned = False

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Any = None) -> trace_api.Tracer:
        sdk = super().get_tracer(instrumenting_module_name, instrumenting_library_version, schema_url, attributes)
        if not isinstance(sdk, Tracer):  # disabled (OTEL_SDK_DISABLED): the SDK's no-op tracer
            return sdk
        missing = _missing(sdk)
        if missing:
            if not self._warned:
                self._warned = True
                log.warning("this opentelemetry-sdk lacks %s: using its own (slower) spans instead of lean ones",
                            ", ".join(missing))
            return sdk
        with self._tracers_lock:
            lean = self._lean.get(id(sdk))
            if lean is None:
                lean = self._lean[id(sdk)] = LeanTracer(sdk)
        return lean
