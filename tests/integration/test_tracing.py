"""One trace per request, across the ingress, the scheduler and three worker gRPC servers.

The stack's workers run in this process, but nothing hands them the caller's Python context: their
server spans are parented only on the ``traceparent`` in the call's gRPC metadata (a test below calls a
worker with a hand-written one). Those spans land in an in-memory exporter. The OTLP path is checked
against a real OTLP/gRPC receiver on loopback, with a worker in a process of its own exporting to it
from the standard OTEL_* variables, as a pool replica does.

``test_tracing_sdk_range.py`` runs this module again against the oldest opentelemetry-sdk that
pyproject.toml allows.
"""

from __future__ import annotations

import base64
import io
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags
from PIL import Image

from bench.otlp_sink import OTLPSink
from controlplane.api import create_app
from controlplane.backend import ModelInfo
from controlplane.dispatch import Dispatcher
from controlplane.observability import tracing
from controlplane.observability.metrics import OBSERVABILITY
from controlplane.scheduler.policies import get_policy
from controlplane.scheduler.scheduler import Scheduler, WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import RequestJournal
from controlplane.state.keys import Pool
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import RunningWorker, start_worker
from workers.runtime.default_model import DEFAULT_MODEL_NAME
from workers.runtime.engine import EngineConfig

from http_helpers import serve_app
from redis_fixture import redis_server  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
STAGE_SPANS = ("queue", "encode", "prefill", "decode", "stream")


class _Gate(SpanProcessor):
    """Forwards ended spans to the in-memory exporter while this module runs, then nothing."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.inner = SimpleSpanProcessor(exporter)
        self.open = True

    def on_start(self, span, parent_context=None) -> None:
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
        registry.register(WorkerInfo(w.identity.worker_id, Pool(w.pool), w.address,
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
    tracing.force_flush()
    assert len(stack.exporter.get_finished_spans()) == untraced_before  # an untraced call makes no span


@pytest.mark.parametrize("tracestate", [None, "epd=test"])
def test_a_refused_call_ends_its_server_span_with_the_error(stack: Stack, tracestate: str | None):
    """And a caller's ``tracestate`` is kept on the server span."""
    trace_id = secrets.randbits(128)
    md = SECURITY.call_metadata() + (("traceparent", f"00-{trace_id:032x}-{secrets.randbits(64):016x}-01"),)
    if tracestate is not None:
        md += (("tracestate", tracestate),)
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
    assert gen.context.trace_state.get("epd") == ("test" if tracestate else None)


def test_a_trace_its_client_did_not_sample_records_no_span_anywhere(stack: Stack):
    """Parent-based sampling (the default samplers): the client's unsampled flag holds at the ingress,
    the scheduler's stages and every worker the request reached."""
    trace_id = secrets.randbits(128)
    r = httpx.post(f"{stack.base}/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{trace_id:032x}-{secrets.randbits(64):016x}-00"},
                   json={"model": DEFAULT_MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    marker = secrets.randbits(128)  # a sampled call after it: once its span is here, the request's would be too
    md = SECURITY.call_metadata() + (("traceparent", f"00-{marker:032x}-{secrets.randbits(64):016x}-01"),)
    with SECURITY.open_channel(stack.workers["decode"].address) as ch:
        wgrpc.DecodeWorkerStub(ch).Status(wpb.StatusRequest(), metadata=md, timeout=10)
    assert _spans_of(stack.exporter, marker, {"DecodeWorker/Status"})
    tracing.force_flush()
    assert [s.name for s in stack.exporter.get_finished_spans() if s.context.trace_id == trace_id] == []


def test_a_stream_its_caller_stops_reading_is_not_a_server_failure(stack: Stack):
    """A caller that closes a response stream early (it had what it needed, or left) leaves the server
    span's status unset, as OpenTelemetry's RPC conventions do for CANCELLED, and marks it cancelled."""
    from workers.tracing import TracingInterceptor

    class Context:  # what the interceptor asks of a servicer context at the end of a call
        def code(self) -> None:
            return None

        def details(self) -> None:
            return None

    trace_id = secrets.randbits(128)
    carrier = {"traceparent": f"00-{trace_id:032x}-{secrets.randbits(64):016x}-01"}
    run = TracingInterceptor("decode")._streaming(lambda request, context: iter(range(5)), carrier, "Test/Stream", {})
    stream = run(None, Context())
    assert next(stream) == 0
    stream.close()  # the caller stops reading
    span = _one(_spans_of(stack.exporter, trace_id, {"Test/Stream"}), "Test/Stream")
    assert span.status.status_code is StatusCode.UNSET, span.status
    assert span.attributes["epd.cancelled"] is True and span.attributes["epd.messages"] == 1


def test_a_kv_transfer_failure_is_counted_once_and_marks_its_spans(stack: Stack, default_bundle):
    """A decode worker whose layout differs (8-token blocks against 16) refuses the push at the handshake."""
    from controlplane.dispatch import DispatchError, Route, WorkerRequest
    from controlplane.observability.metrics import MODEL, REGISTRY
    from workers.runtime.sampler import SamplingParams

    bad = start_worker("decode", default_bundle, SECURITY, codecs=("fp32",) * stack.num_layers,
                       config=EngineConfig(kv_cache_bytes=16 * 2**20, block_size=8))
    dispatcher = Dispatcher(SECURITY)
    def failures() -> float:
        labels = {"code": "FAILED_PRECONDITION", "model_name": MODEL.value}
        return REGISTRY.get_sample_value("epd:kv_transfer_failures_total", labels) or 0.0

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


@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"])
def test_malformed_otlp_headers_are_refused_without_showing_them(var: str) -> None:
    """The SDK would log the malformed entry whole (often an Authorization header); epd names its position."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", var: "x-tenant=a,authorization Bearer s3cret"}
    with pytest.raises(tracing.TracingConfigError, match=f"{var}: entry 2 of 2 is not name=value") as err:
        tracing.exporter_from_env(env)
    assert "s3cret" not in str(err.value)
    fine = tracing.exporter_from_env({**env, var: "x-tenant=a, authorization=Bearer%20s3cret"})
    assert fine is not None
    fine.shutdown()


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


# ---------------------------------------------------------------- samplers from OTEL_* variables
def _sampled(provider: TracerProvider, parent_flags: int | None, n: int) -> int:
    """How many of ``n`` spans ``provider`` records: roots (``parent_flags`` None) or children of a remote
    parent with those trace flags."""
    tracer = provider.get_tracer("test")
    count = 0
    for _ in range(n):
        ctx = None
        if parent_flags is not None:
            parent = SpanContext(secrets.randbits(128), secrets.randbits(64), is_remote=True,
                                 trace_flags=TraceFlags(parent_flags))
            ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        span = tracer.start_span("s", context=ctx)
        count += span.is_recording()
        span.end()
    return count


def test_the_default_sampler_follows_the_parent_and_traces_a_tenth_of_new_requests(monkeypatch):
    for key in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(key, raising=False)
    assert tracing.DEFAULT_SAMPLER == "parentbased_traceidratio" and tracing.DEFAULT_SAMPLER_RATIO == 0.1
    provider = TracerProvider(sampler=tracing.sampler_from_env(), shutdown_on_exit=False)
    assert _sampled(provider, 0x01, 200) == 200  # a caller that sampled its trace
    assert _sampled(provider, 0x00, 200) == 0  # one that did not
    roots = _sampled(provider, None, 4000)  # binomial(4000, 0.1): mean 400, sd 19
    assert 300 < roots < 500, roots


@pytest.mark.parametrize(("env", "roots", "unsampled_parent"), [
    ({"OTEL_TRACES_SAMPLER": "always_on"}, 300, 300),
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, 300, 0),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, 0, 0),
    ({"OTEL_TRACES_SAMPLER": "ALWAYS_OFF"}, 0, 0),
])
def test_a_sampler_named_in_the_environment_is_the_sdks_own(monkeypatch, env, roots, unsampled_parent):
    for key in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert tracing.sampler_from_env() is None  # the SDK's TracerProvider reads the variables itself
    provider = TracerProvider(sampler=tracing.sampler_from_env(), shutdown_on_exit=False)
    assert _sampled(provider, None, 300) == roots
    assert _sampled(provider, 0x00, 300) == unsampled_parent


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER='jaeger_remote': unsupported sampler"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
     "OTEL_TRACES_SAMPLER_ARG='1.5': traceidratio takes a probability from 0 to 1"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "ten percent"},
     "OTEL_TRACES_SAMPLER_ARG='ten percent'"),
    ({"OTEL_TRACES_SAMPLER_ARG": "0.5"}, "OTEL_TRACES_SAMPLER_ARG='0.5' is set but OTEL_TRACES_SAMPLER is not"),
])
def test_a_sampler_the_sdk_would_ignore_is_refused_by_name(env, message):
    with pytest.raises(tracing.TracingConfigError, match=message.replace("(", r"\(")):
        tracing.sampler_from_env(env)
    with pytest.raises(tracing.TracingConfigError):  # before any exporter is made
        tracing.setup_tracing("epd-test", exporter=InMemorySpanExporter(), env=env)


# ---------------------------------------------------------------- across processes, to a real collector
def test_a_worker_in_its_own_process_exports_its_span_under_the_callers_trace(default_ckpt: Path):
    """Configured only by OTEL_EXPORTER_OTLP_ENDPOINT (so with the default sampler), a worker process
    sends its server span to the collector as the child of this process's client span, in one trace; a
    call whose caller did not sample its trace leaves nothing there."""
    sink = OTLPSink().start()
    token = secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, TRACED_WORKER_TOKEN=token)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("traced_worker_process.py")),
                             str(default_ckpt)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.startswith("ADDRESS "), f"the worker process did not start: {line!r}"
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": "epd-test-caller"}), shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint)))
        security = TransferSecurity(token=token)
        unsampled = NonRecordingSpan(SpanContext(secrets.randbits(128), secrets.randbits(64), is_remote=False,
                                                 trace_flags=TraceFlags(0)))
        with security.open_channel(line.split()[1]) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            with provider.get_tracer("test").start_as_current_span("status-call", kind=SpanKind.CLIENT) as call:
                stub.Status(wpb.StatusRequest(), metadata=tracing.grpc_metadata(security.call_metadata(), call),
                            timeout=10)
            stub.Status(wpb.StatusRequest(), metadata=tracing.grpc_metadata(security.call_metadata(), unsampled),
                        timeout=10)
        assert provider.force_flush(10_000)
        provider.shutdown()
        proc.stdin.close()  # the worker stops and flushes its spans
        assert proc.wait(60) == 0
        trace_id = f"{call.get_span_context().trace_id:032x}"
        spans = {s.name: s for s in sink.spans if s.trace_id == trace_id}
        assert set(spans) == {"status-call", "DecodeWorker/Status"}, sink.spans
        client, server = spans["status-call"], spans["DecodeWorker/Status"]
        assert (client.service, server.service) == ("epd-test-caller", "epd-test-worker")
        assert server.parent_span_id == client.span_id and client.parent_span_id == ""
        unsampled_id = f"{unsampled.get_span_context().trace_id:032x}"
        assert [s for s in sink.spans if s.trace_id == unsampled_id] == []
        assert sink.received == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        sink.stop()
