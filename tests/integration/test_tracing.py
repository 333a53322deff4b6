"""One trace per request, across the ingress, the scheduler and three worker gRPC servers.

The workers run in this process, but nothing hands them the caller's Python context: their server
spans are parented only on the ``traceparent`` in the call's gRPC metadata (a test below calls a
worker with a hand-written one). Spans land in an in-memory exporter; the OTLP path is checked
against a real OTLP/gRPC receiver on loopback.
"""

from __future__ import annotations

import base64
import io
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from PIL import Image

from http_helpers import serve_app

from controlplane.api import create_app
from controlplane.backend import ModelInfo
from controlplane.dispatch import Dispatcher
from controlplane.observability import tracing
from controlplane.observability.metrics import OBSERVABILITY
from bench.otlp_sink import OTLPSink
from controlplane.scheduler.policies import get_policy
from controlplane.scheduler.scheduler import Scheduler, WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import RequestJournal
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from redis_fixture import redis_server  # noqa: F401 - fixture
from workers.run import RunningWorker, start_worker
from workers.runtime.default_model import DEFAULT_MODEL_NAME
from workers.runtime.engine import EngineConfig

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
STAGE_SPANS = ("queue", "encode", "prefill", "decode", "stream")


class _Gate(SpanProcessor):
    """Forwards ended spans to the in-memory exporter while this module runs, then nothing."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.inner = SimpleSpanProcessor(exporter)
        self.open = True

    def on_start(self, span, parent_context=None) -> None:  # type: ignore[no-untyped-def]
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self.open:
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.open = False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@dataclass
class Stack:
    base: str
    workers: dict[str, RunningWorker]
    exporter: InMemorySpanExporter
    num_layers: int


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (30, 160, 90)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(default_bundle, redis_server) -> Iterator[Stack]:  # noqa: F811
    from controlplane.state import connect

    exporter = InMemorySpanExporter()
    gate = _Gate(exporter)
    tracing.add_span_processor(gate, "epd-test")
    saved = (OBSERVABILITY.metrics, OBSERVABILITY.tracing)
    OBSERVABILITY.metrics = OBSERVABILITY.tracing = True
    conn = connect(redis_server.url, f"trace-{uuid.uuid4().hex[:8]}")
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = {pool: start_worker(pool, default_bundle, SECURITY, codecs=codecs,
                                  config=EngineConfig(kv_cache_bytes=32 * 2**20))
               for pool in ("encode", "prefill", "decode")}
    registry = WorkerRegistry(conn, ttl=60)
    for w in workers.values():
        registry.register(WorkerInfo(w.identity.worker_id, w.pool, w.address,
                                     load=WorkerLoad(free_kv_blocks=100, total_kv_blocks=100)))
    model = ModelInfo(DEFAULT_MODEL_NAME, default_bundle.tokenizer, default_bundle.config.max_position_embeddings,
                      default_bundle.image_token_id, default_bundle.vision.config.num_image_tokens,
                      default_bundle.eos_token_ids)
    dispatcher = Dispatcher(SECURITY)
    scheduler = Scheduler(model, WorkerView(registry), dispatcher, get_policy("least_loaded"), SchedulerSettings(),
                          RequestJournal(conn))
    try:
        with serve_app(create_app(scheduler)) as base:
            yield Stack(base, workers, exporter, default_bundle.config.num_layers)
    finally:
        gate.open = False
        OBSERVABILITY.metrics, OBSERVABILITY.tracing = saved
        dispatcher.close()
        for w in workers.values():
            w.stop()
        for key in conn.redis.scan_iter(match=conn.keys.pattern):
            conn.redis.delete(key)
        conn.close()


def _spans_of(exporter: InMemorySpanExporter, trace_id: int, names: set[str], within_s: float = 10.0
              ) -> list[ReadableSpan]:
    """The trace's spans once every name in ``names`` has ended (server spans end after the reply)."""
    deadline = time.monotonic() + within_s
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"expected one {name!r} span, got {len(found)}: {sorted(s.name for s in spans)}"
    return found[0]


def test_an_image_and_text_request_is_one_trace_with_every_stage_parented_across_processes(stack: Stack):
    trace_id, client_span = secrets.randbits(128), secrets.randbits(64)
    traceparent = f"00-{trace_id:032x}-{client_span:016x}-01"
    image = "data:image/png;base64," + base64.b64encode(_png()).decode()
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 6, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "What colour is it?"}]}]}
    before = {s.context.trace_id for s in stack.exporter.get_finished_spans()}
    with httpx.stream("POST", f"{stack.base}/v1/chat/completions", json=body, timeout=120,
                      headers={"traceparent": traceparent}) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    expected = {"POST /v1/chat/completions", *STAGE_SPANS, "EncodeWorker/Encode", "PrefillWorker/Prefill",
                "kv-transfer", "wait-embeddings", "DecodeWorker/Generate"}
    spans = _spans_of(stack.exporter, trace_id, expected)
    assert expected <= {s.name for s in spans}, sorted(s.name for s in spans)

    # one trace: every span this request made carries the client's trace id, and no other trace began
    new_traces = {s.context.trace_id for s in stack.exporter.get_finished_spans()} - before
    assert new_traces == {trace_id}
    root = _one(spans, "POST /v1/chat/completions")
    assert root.kind == SpanKind.SERVER and root.parent is not None and root.parent.span_id == client_span
    assert root.attributes["http.response.status_code"] == 200
    by_id = {s.context.span_id: s for s in spans}
    for name in STAGE_SPANS:  # each stage hangs off the request's root span
        assert _one(spans, name).parent.span_id == root.context.span_id, name
    for client, server, pool in (("encode", "EncodeWorker/Encode", "encode"),
                                 ("prefill", "PrefillWorker/Prefill", "prefill"),
                                 ("decode", "DecodeWorker/Generate", "decode")):
        c, s = _one(spans, client), _one(spans, server)
        assert c.kind == SpanKind.CLIENT and s.kind == SpanKind.SERVER
        assert s.parent.span_id == c.context.span_id, f"{server} is not a child of the {client} call"
        assert s.parent.is_remote, f"{server} was parented through a local context, not gRPC metadata"
        assert s.attributes["epd.pool"] == pool
        assert s.attributes["epd.worker_id"] == stack.workers[pool].identity.worker_id
    kv = _one(spans, "kv-transfer")
    assert by_id[kv.parent.span_id].name == "PrefillWorker/Prefill"
    assert by_id[_one(spans, "wait-embeddings").parent.span_id].name == "PrefillWorker/Prefill"
    assert kv.attributes["epd.kv.codec"] == "fp32" and kv.attributes["epd.kv.layers"] == stack.num_layers
    assert kv.attributes["epd.kv.wire_bytes"] > 0 and kv.attributes["epd.kv.logical_bytes"] > 0
    assert _one(spans, "prefill").attributes["epd.kv.wire_bytes"] == kv.attributes["epd.kv.wire_bytes"]
    assert _one(spans, "EncodeWorker/Encode").attributes["epd.images"] == 1
    # stages are well ordered in time: encode/prefill end before the stream does
    assert _one(spans, "prefill").end_time <= _one(spans, "stream").end_time
    assert all(s.status.is_ok for s in spans), [(s.name, s.status.description) for s in spans if not s.status.is_ok]


def test_a_request_without_traceparent_starts_its_own_single_trace(stack: Stack):
    before = {s.context.trace_id for s in stack.exporter.get_finished_spans()}
    r = httpx.post(f"{stack.base}/v1/completions", timeout=60,
                   json={"model": DEFAULT_MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in stack.exporter.get_finished_spans() if s.context.trace_id not in before]
        if {"DecodeWorker/Generate", "stream"} <= {s.name for s in spans} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len({s.context.trace_id for s in spans}) == 1
    root = _one(spans, "POST /v1/completions")
    assert root.parent is None
    assert "encode" not in {s.name for s in spans}  # text only: no encode stage


def test_worker_continues_a_hand_written_traceparent_from_grpc_metadata(stack: Stack):
    trace_id, parent = secrets.randbits(128), secrets.randbits(64)
    md = SECURITY.call_metadata() + (("traceparent", f"00-{trace_id:032x}-{parent:016x}-01"),)
    with SECURITY.open_channel(stack.workers["decode"].address) as ch:
        stub = wgrpc.DecodeWorkerStub(ch)
        stub.Status(wpb.StatusRequest(), metadata=md, timeout=10)
        spans = _spans_of(stack.exporter, trace_id, {"DecodeWorker/Status"})
        status = _one(spans, "DecodeWorker/Status")
        assert status.parent.span_id == parent and status.parent.is_remote and status.kind == SpanKind.SERVER
        untraced_before = len(stack.exporter.get_finished_spans())
        stub.Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=10)  # no traceparent
    tracing.force_flush()  # worker spans are built off the request path: whatever is pending arrives now
    assert len(stack.exporter.get_finished_spans()) == untraced_before  # an untraced call makes no span


@pytest.mark.parametrize("path", ["deferred", "sdk"])
def test_a_refused_call_ends_its_server_span_with_the_error(stack: Stack, path: str):
    """Both ways a worker makes its server span: recorded off the request path, and the SDK's own (taken
    for a traceparent with a tracestate, which the SDK parses and passes on)."""
    trace_id = secrets.randbits(128)
    md = SECURITY.call_metadata() + (("traceparent", f"00-{trace_id:032x}-{secrets.randbits(64):016x}-01"),)
    if path == "sdk":
        md += (("tracestate", "epd=test"),)
    with SECURITY.open_channel(stack.workers["decode"].address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            wgrpc.DecodeWorkerStub(ch).Generate(wpb.GenerateRequest(request_id="nobody-reserved-this"), metadata=md,
                                                timeout=10).next()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    spans = _spans_of(stack.exporter, trace_id, {"DecodeWorker/Generate"})
    gen = _one(spans, "DecodeWorker/Generate")
    assert not gen.status.is_ok and "no reservation" in (gen.status.description or "")
    assert gen.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert gen.attributes["epd.messages"] == 0
    assert gen.context.trace_state.get("epd") == ("test" if path == "sdk" else None)


def test_a_kv_transfer_failure_is_counted_once_and_marks_its_spans(stack: Stack, default_bundle):
    """A decode worker whose layout differs (8-token blocks against 16) refuses the push at the handshake."""
    from controlplane.dispatch import DispatchError, Route, WorkerRequest
    from controlplane.observability.metrics import REGISTRY
    from workers.runtime.sampler import SamplingParams

    bad = start_worker("decode", default_bundle, SECURITY, codecs=("fp32",) * stack.num_layers,
                       config=EngineConfig(kv_cache_bytes=16 * 2**20, block_size=8))
    dispatcher = Dispatcher(SECURITY)
    def failures() -> float:
        return REGISTRY.get_sample_value("epd:kv_transfer_failures_total", {"code": "FAILED_PRECONDITION"}) or 0.0

    before = failures()
    try:
        with tracing.tracer().start_as_current_span("test-root") as root:
            req = WorkerRequest("kv-fail-" + uuid.uuid4().hex[:8], [1, 2, 3, 4, 5], SamplingParams(max_tokens=3),
                                timeout_s=20)
            with pytest.raises(DispatchError) as err:
                list(dispatcher.run(req, Route(bad.address, stack.workers["prefill"].address)))
    finally:
        dispatcher.close()
        bad.stop()
    # whichever side reports first (decode's Generate may end before prefill's reply arrives)
    assert err.value.stage in ("prefill", "decode") and err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert failures() - before == 1  # prefill and decode both failed; one request, one count
    trace_id = root.get_span_context().trace_id
    failed = {"kv-transfer", "prefill", "PrefillWorker/Prefill", "decode", "DecodeWorker/Generate"}
    spans = _spans_of(stack.exporter, trace_id, failed)
    for name in failed:
        assert not _one(spans, name).status.is_ok, name
    assert "layout mismatch" in (_one(spans, "DecodeWorker/Generate").status.description or "")


# ---------------------------------------------------------------- exporters from OTEL_* variables
def test_exporters_follow_the_standard_otel_variables():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    assert tracing.exporter_from_env({}) is None
    assert tracing.exporter_from_env({"OTEL_TRACES_EXPORTER": "none",
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}) is None
    assert tracing.exporter_from_env({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) is None
    assert isinstance(tracing.exporter_from_env({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    otlp = tracing.exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert isinstance(otlp, OTLPSpanExporter)
    otlp.shutdown()
    with pytest.raises(tracing.TracingConfigError, match="OTEL_TRACES_EXPORTER.*'zipkin'.*otlp, console, none"):
        tracing.exporter_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(tracing.TracingConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL.*grpc"):
        tracing.exporter_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


def test_otlp_exporter_from_the_environment_delivers_spans_to_a_collector(monkeypatch):
    sink = OTLPSink().start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        exporter = tracing.exporter_from_env()
        assert exporter is not None
        provider = TracerProvider()  # a private provider: the global one belongs to the rest of the suite
        provider.add_span_processor(BatchSpanProcessor(exporter))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("outer") as outer:
            with tracer.start_as_current_span("inner"):
                pass
        assert provider.force_flush(10_000)
        provider.shutdown()
        names = {s.name: s for s in sink.spans}
        assert set(names) == {"outer", "inner"} and sink.received == 2
        assert names["inner"].parent_span_id == f"{outer.get_span_context().span_id:016x}"
        assert names["inner"].trace_id == names["outer"].trace_id
    finally:
        sink.stop()


def test_stop_exporting_sends_what_was_recorded_and_nothing_after():
    """A closing deployment's exporter delivers its last spans, then takes no more (a later deployment in
    the same process has its own)."""
    exporter = InMemorySpanExporter()
    assert tracing.setup_tracing("epd-test", exporter=exporter)
    tracing.tracer().start_span("before").end()
    tracing.stop_exporting()
    assert [s.name for s in exporter.get_finished_spans()] == ["before"]
    tracing.tracer().start_span("after").end()
    tracing.force_flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["before"]
