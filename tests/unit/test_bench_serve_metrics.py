"""The benchmark's figures from synthetic timings with known answers (vLLM's definitions), and the streaming
client's timing of a scripted SSE answer under an injected clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from bench.serve.client import send_request
from bench.serve.config import SLO, parse_slo
from bench.serve.metrics import Dist, RequestOutcome, compute_metrics

pytestmark = [pytest.mark.unit]


def _ok(ttft: float, e2e: float, out: int, itl: list[float] | None = None, prompt: int = 10) -> RequestOutcome:
    return RequestOutcome(True, ttft_s=ttft, e2e_s=e2e, itl_s=itl or [], output_tokens=out, prompt_tokens=prompt)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert _ok(0.1, 1.0, 10).tpot_s == pytest.approx(0.9 / 9)
    assert _ok(0.2, 0.2, 1).tpot_s is None  # one token: no TPOT
    assert RequestOutcome(False, ttft_s=0.1, e2e_s=1.0, output_tokens=5).tpot_s is None


def test_percentiles_mean_and_std_match_numpy_linear_interpolation():
    d = Dist.of_seconds([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (d.count, d.p50, d.p90, d.p99) == (100, pytest.approx(50.5), pytest.approx(90.1), pytest.approx(99.01))
    assert d.mean == pytest.approx(50.5)
    assert d.std == pytest.approx(float(np.std(np.arange(1, 101))))
    assert Dist.of_seconds([]) == Dist(0, None, None, None, None, None)
    assert Dist.of_seconds([0.004]).p99 == pytest.approx(4.0)


def test_load_point_figures_from_known_timings():
    outs = [_ok(0.100, 1.000, 10, [0.1] * 9, prompt=100),   # tpot 100 ms
            _ok(0.300, 0.700, 5, [0.1] * 4, prompt=50),     # tpot 100 ms
            _ok(0.050, 0.050, 1, [], prompt=20),            # no tpot
            RequestOutcome(False, e2e_s=0.2, error="HTTP 502: boom"),
            RequestOutcome(False, e2e_s=0.3, error="HTTP 502: boom"),
            RequestOutcome(False, e2e_s=0.1, error="connection lost mid-stream (RemoteProtocolError)")]
    m = compute_metrics(outs, 2.0, SLO(), request_rate=3.0)
    assert (m.num_requests, m.completed, m.failed) == (6, 3, 3)
    assert m.failure_reasons == {"HTTP 502: boom": 2, "connection lost mid-stream (RemoteProtocolError)": 1}
    assert list(m.failure_reasons) == ["HTTP 502: boom", "connection lost mid-stream (RemoteProtocolError)"]
    assert (m.total_input_tokens, m.total_output_tokens) == (170, 16)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(8.0)
    assert m.total_token_throughput == pytest.approx(93.0)
    assert m.ttft_ms.count == 3 and m.ttft_ms.mean == pytest.approx(150.0) and m.ttft_ms.p50 == pytest.approx(100.0)
    assert m.tpot_ms.count == 2 and m.tpot_ms.mean == pytest.approx(100.0)
    assert m.itl_ms.count == 13 and m.itl_ms.p99 == pytest.approx(100.0)
    assert m.e2e_ms.p50 == pytest.approx(700.0) and m.e2e_ms.mean == pytest.approx(1750 / 3)
    # no SLO: goodput is the request throughput, every completed request is "good"
    assert (m.good_requests, m.goodput, m.slo_attainment) == (3, pytest.approx(1.5), {"all": 0.5})


def test_goodput_and_attainment_count_every_bound_and_every_sent_request():
    outs = [_ok(0.100, 1.000, 10),  # ttft 100, tpot 100, e2e 1000
            _ok(0.300, 0.700, 5),   # ttft 300, tpot 100, e2e 700
            _ok(0.050, 0.450, 5),   # ttft 50, tpot 100, e2e 450
            _ok(0.050, 0.050, 1),   # ttft 50, no tpot, e2e 50
            _ok(0.100, 0.500, 2),   # ttft 100, tpot 400
            RequestOutcome(False, e2e_s=0.01, error="x")]
    m = compute_metrics(outs, 4.0, parse_slo(["ttft:200", "tpot:100"]))
    # meeting ttft <= 200: #1 #3 #4 #5; tpot <= 100 (bound inclusive): #1 #2 #3 #4; both: #1 #3 #4
    assert m.good_requests == 3
    assert m.goodput == pytest.approx(0.75)
    assert m.slo_attainment == {"all": pytest.approx(3 / 6), "ttft": pytest.approx(4 / 6),
                                "tpot": pytest.approx(4 / 6)}
    assert m.slo_ms == {"ttft": 200.0, "tpot": 100.0}
    e2e = compute_metrics(outs, 4.0, parse_slo("e2e:500"))
    assert e2e.good_requests == 3 and e2e.slo_attainment == {"all": 0.5, "e2e": 0.5}  # #3 #4 #5


def test_a_run_where_everything_failed_has_no_latencies():
    m = compute_metrics([RequestOutcome(False, error="HTTP 500: x")] * 3, 1.0, parse_slo("ttft:10"))
    assert (m.completed, m.failed, m.goodput, m.ttft_ms.mean, m.slo_attainment["all"]) == (0, 3, 0.0, None, 0.0)
    assert json.dumps(m.to_json(), allow_nan=False)  # nulls, never NaN


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _sse(clock: _Clock, events: list[tuple[float, str]], *, close_early: bool = False) -> httpx.MockTransport:
    """A transport whose answer is ``events`` (time, data payload); the clock reads ``time`` while each
    event is processed."""

    async def body() -> AsyncIterator[bytes]:
        for at, data in events:
            clock.t = 100.0 + at
            yield f"data: {data}\n\n".encode()
        if close_early:
            raise httpx.RemoteProtocolError("peer closed connection")

    return httpx.MockTransport(lambda request: httpx.Response(200, content=body(),
                                                                headers={"content-type": "text/event-stream"}))


def _run(transport: httpx.MockTransport, clock: _Clock, chat: bool = False) -> RequestOutcome:
    body = {"model": "m", "stream": True, ("messages" if chat else "prompt"): "hi"}

    async def go() -> RequestOutcome:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://x/v1/completions", body, {}, prompt_len=7, timeout_s=30,
                                      clock=clock)
    return asyncio.run(go())


def _text(t: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": finish}]})


def _delta(content: str | None, role: str | None = None, finish: str | None = None) -> str:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_client_times_first_token_gaps_and_end_and_takes_usage_tokens():
    clock = _Clock()
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}})
    o = _run(_sse(clock, [(0.25, _text("a")), (0.30, _text("bc")), (0.45, _text("d")), (0.50, _text("", "length")),
                          (0.52, usage), (0.53, "[DONE]")]), clock)
    assert o.success and o.error is None
    assert o.ttft_s == pytest.approx(0.25)
    assert o.itl_s == pytest.approx([0.05, 0.15])  # one gap per text chunk
    assert o.e2e_s == pytest.approx(0.50)  # the finishing event: the usage event and [DONE] carry no token
    assert (o.output_tokens, o.prompt_tokens) == (5, 12)  # usage wins over the 3 chunks
    assert o.tpot_s == pytest.approx((0.50 - 0.25) / 4)


def test_chat_role_chunk_is_not_the_first_token_and_chunks_count_without_usage():
    clock = _Clock()
    o = _run(_sse(clock, [(0.01, _delta("", role="assistant")), (0.2, _delta("x")), (0.3, _delta("y")),
                          (0.35, _delta(None, finish="stop")), (0.4, "[DONE]")]), clock, chat=True)
    assert o.success and o.ttft_s == pytest.approx(0.2) and o.itl_s == pytest.approx([0.1])
    assert (o.output_tokens, o.prompt_tokens) == (2, 7)  # no usage: one token per text chunk, the client's length


def test_an_answer_with_no_text_times_its_first_token_at_the_event_that_ends_it():
    """An immediate end-of-sequence streams no text. Its TTFT is when that token's event came, not None: a
    None TTFT left the request out of the TTFT figures and passed any TTFT SLO, whatever its latency."""
    clock = _Clock()
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    o = _run(_sse(clock, [(9.0, _text("", "stop")), (9.1, usage), (9.2, "[DONE]")]), clock)
    assert o.success and o.ttft_s == pytest.approx(9.0) and o.e2e_s == pytest.approx(9.0)
    assert o.meets(SLO(ttft_ms=500)) == {"ttft": False}
    assert RequestOutcome(True, ttft_s=None, e2e_s=1.0).meets(SLO(ttft_ms=500)) == {"ttft": False}
    assert RequestOutcome(True, ttft_s=0.1, e2e_s=1.0, output_tokens=1).meets(SLO(tpot_ms=1)) == {"tpot": True}


def test_reasoning_and_tool_call_deltas_are_output_on_chat():
    clock = _Clock()
    reasoning = json.dumps({"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]})
    tool = json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]})
    o = _run(_sse(clock, [(0.1, reasoning), (0.2, reasoning), (0.3, tool), (0.4, _delta("x")),
                          (0.5, _delta(None, finish="tool_calls")), (0.6, "[DONE]")]), clock, chat=True)
    assert o.success and o.ttft_s == pytest.approx(0.1) and o.itl_s == pytest.approx([0.1, 0.1, 0.1])
    assert o.output_tokens == 4


def test_an_aborted_answer_and_a_stream_with_no_answer_are_failures():
    clock = _Clock()
    o = _run(_sse(clock, [(0.1, _text("a")), (0.2, _text("", "abort"))]), clock)
    assert not o.success and o.error == "finish_reason abort"
    o = _run(_sse(clock, [(0.1, _text("a")), (0.2, _text("", "abort")), (0.3, "[DONE]")]), clock)
    assert not o.success and o.error == "finish_reason abort"
    o = _run(_sse(clock, [(0.1, "[DONE]")]), clock)
    assert not o.success and o.error == "stream carried no answer (no event with a choice)"


@pytest.mark.parametrize("event, reason", [
    ({"choices": "oops"}, "malformed event: choices is a str"),
    ({"choices": [{"index": 0, "text": 7}]}, "malformed event"),
    ({"choices": [5]}, "malformed event"),
    ({"object": "error", "message": "model is overloaded"}, "error event: model is overloaded"),
])
def test_malformed_and_old_style_error_events_fail_the_request_without_raising(event, reason):
    clock = _Clock()
    o = _run(_sse(clock, [(0.1, json.dumps(event)), (0.2, "[DONE]")]), clock)
    assert not o.success and o.error is not None and o.error.startswith(reason), o.error


def test_a_chunk_with_a_null_error_field_is_a_normal_chunk():
    clock = _Clock()
    chunk = json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}], "error": None})
    o = _run(_sse(clock, [(0.1, chunk), (0.2, "[DONE]")]), clock)
    assert o.success and o.ttft_s == pytest.approx(0.1)


def test_client_counts_in_band_errors_and_broken_streams_as_failures():
    clock = _Clock()
    err = json.dumps({"error": {"message": "decode worker failed", "type": "server_error"}})
    o = _run(_sse(clock, [(0.1, _text("a")), (0.2, err), (0.3, "[DONE]")]), clock)
    assert not o.success and o.error == "error event: decode worker failed"
    o = _run(_sse(clock, [(0.1, _text("a")), (0.2, _text("b"))], close_early=True), clock)
    assert not o.success and o.error == "connection lost mid-stream (RemoteProtocolError)"
    o = _run(_sse(clock, [(0.1, _text("a"))]), clock)
    assert not o.success and o.error == "stream ended without [DONE] or a finish_reason"
    o = _run(_sse(clock, [(0.1, "{not json")]), clock)
    assert not o.success and o.error.startswith("malformed event")
    status = httpx.MockTransport(lambda r: httpx.Response(429, json={"error": {"message": "queue full"}}))
    o = _run(status, clock)
    assert not o.success and o.error == "HTTP 429: queue full"
