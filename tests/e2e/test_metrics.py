"""``/metrics`` after a known workload, read back with prometheus_client's own parser.

The stack (tests/e2e/conftest.py) is shared with other e2e modules, so every figure is a delta over
this module's workload: request counters by route and status, and the counts of the TTFT, TPOT,
inter-token, end-to-end, per-stage and KV-transfer histograms, equal what was sent.
"""

from __future__ import annotations

import base64
import io
import time
from typing import TYPE_CHECKING

import httpx
import pytest
from openai import OpenAI
from openai.types import CompletionUsage
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:  # the fixtures come from tests/e2e/conftest.py
    from conftest import Stack

pytestmark = [pytest.mark.e2e]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
EPD_FAMILIES = {  # family name -> type, as the parser reports them
    "epd:time_to_first_token_seconds": "histogram", "epd:time_per_output_token_seconds": "histogram",
    "epd:inter_token_latency_seconds": "histogram", "epd:e2e_request_latency_seconds": "histogram",
    "epd:request_stage_seconds": "histogram", "epd:kv_transfer_seconds": "histogram",
    "epd:requests": "counter", "epd:kv_transfer_logical_bytes": "counter", "epd:kv_transfer_wire_bytes": "counter",
    "epd:kv_transfer_failures": "counter", "epd:kv_transfers": "counter", "epd:admission_rejections": "counter",
    "epd:encoder_images": "counter",
    "epd:encoder_cache_hits": "counter", "epd:prompt_tokens": "counter", "epd:generation_tokens": "counter",
    "epd:queue_depth": "gauge", "epd:scheduler_queue_depth": "gauge", "epd:requests_cut_short": "counter",
}


def _scrape(base: str) -> tuple[Samples, dict[str, str]]:
    resp = httpx.get(f"{base}/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(resp.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def _v(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` besides ``model_name`` (which every epd: series has),
    summed over the model names this test process has served."""
    return sum(value for (n, have), value in samples.items()
               if n == name and {k: v for k, v in have if k != "model_name"} == labels)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 24), (10, 90, 200)).save(buf, "PNG")
    return buf.getvalue()


def test_counters_and_histogram_counts_equal_the_workload(e2e_stack: Stack) -> None:
    base = e2e_stack.base_url.removesuffix("/v1")
    before, types = _scrape(base)
    for name, kind in EPD_FAMILIES.items():
        assert types.get(name) == kind, f"{name}: {types.get(name)!r}, expected a {kind}"
    client = OpenAI(base_url=e2e_stack.base_url, api_key=e2e_stack.api_key, max_retries=0)
    model = client.models.list().data[0].id  # GET /v1/models: 200
    usages: list[CompletionUsage] = []
    for i in range(4):
        r = client.chat.completions.create(model=model, max_tokens=5, temperature=0,
                                           messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        assert r.usage is not None
        usages.append(r.usage)
    image = "data:image/png;base64," + base64.b64encode(_png()).decode()
    r = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]}])
    assert r.usage is not None
    usages.append(r.usage)
    for i in range(3):
        stream = client.completions.create(model=model, prompt=f"Once upon a time {i}", max_tokens=6, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        usages.append([c.usage for c in stream if c.usage is not None][-1])
    headers = {"Authorization": f"Bearer {e2e_stack.api_key}", "Content-Type": "application/json"}
    bad_json = httpx.post(f"{e2e_stack.base_url}/chat/completions", content=b"{nope", headers=headers)
    unknown = httpx.post(f"{e2e_stack.base_url}/completions", headers=headers,
                         json={"model": "no-such-model", "prompt": "x", "max_tokens": 2})
    assert (bad_json.status_code, unknown.status_code) == (400, 404)
    ok = len(usages)  # 8 answered requests
    out_tokens = [u.completion_tokens for u in usages]

    expected_requests = {("/v1/chat/completions", "200"): 5, ("/v1/completions", "200"): 3,
                         ("/v1/chat/completions", "400"): 1, ("/v1/completions", "404"): 1, ("/v1/models", "200"): 1}
    deadline = time.monotonic() + 10  # the counter moves once the last byte is sent, just after the client has it
    while True:
        after, _ = _scrape(base)
        got = {k: _v(after, "epd:requests_total", route=k[0], status=k[1])
               - _v(before, "epd:requests_total", route=k[0], status=k[1]) for k in expected_requests}
        if got == expected_requests or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == expected_requests

    def delta(name: str, **labels: str) -> float:
        return _v(after, name, **labels) - _v(before, name, **labels)

    assert delta("epd:time_to_first_token_seconds_count") == ok
    assert delta("epd:e2e_request_latency_seconds_count") == ok
    assert delta("epd:time_per_output_token_seconds_count") == sum(n > 1 for n in out_tokens)
    assert delta("epd:inter_token_latency_seconds_count") == sum(n - 1 for n in out_tokens)
    assert delta("epd:generation_tokens_total") == sum(out_tokens)
    assert delta("epd:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    for stage in ("reserve", "prefill", "kv_transfer", "decode", "stream"):
        assert delta("epd:request_stage_seconds_count", stage=stage) == ok, stage
    assert delta("epd:request_stage_seconds_count", stage="encode") == 1
    assert delta("epd:kv_transfer_seconds_count", codec="fp32") == ok  # the stack's codec for every layer
    assert delta("epd:kv_transfer_wire_bytes_total", codec="fp32") > 0
    assert delta("epd:kv_transfer_logical_bytes_total", codec="fp32") > 0
    # auto on one host, CPU caches: every push through shared memory (with the count above: none went elsewhere)
    assert delta("epd:kv_transfers_total", transport="shm") == ok
    assert delta("epd:encoder_images_total") == 1
    assert delta("epd:kv_transfer_failures_total", code="UNAVAILABLE") == 0
    # a histogram's +Inf bucket is its count, and the buckets never decrease
    for name in ("epd:time_to_first_token_seconds", "epd:e2e_request_latency_seconds"):
        les = {dict(k[1])["le"] for k in after if k[0] == f"{name}_bucket"}
        buckets = sorted((float(le), _v(after, f"{name}_bucket", le=le)) for le in les)
        assert buckets[-1] == (float("inf"), _v(after, f"{name}_count"))
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
    for pool in ("encode", "prefill", "decode"):  # nothing left in flight
        assert _v(after, "epd:queue_depth", pool=pool) == 0, pool


def test_a_stream_the_client_leaves_is_counted_as_cut_short(e2e_stack: Stack) -> None:
    """Its status line said 200 before the client left; epd:requests_cut_short says it did not finish."""
    base = e2e_stack.base_url.removesuffix("/v1")
    before, _ = _scrape(base)
    headers = {"Authorization": f"Bearer {e2e_stack.api_key}"}
    model = httpx.get(f"{e2e_stack.base_url}/models", headers=headers, timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Leave early", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{e2e_stack.base_url}/completions", json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # the first token is here; leave
    deadline = time.monotonic() + 10
    while True:
        after, _ = _scrape(base)
        left = (_v(after, "epd:requests_cut_short_total", route="/v1/completions", status="499")
                - _v(before, "epd:requests_cut_short_total", route="/v1/completions", status="499"))
        if left == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == 1
    assert (_v(after, "epd:e2e_request_latency_seconds_count")
            == _v(before, "epd:e2e_request_latency_seconds_count"))  # it never finished


def test_metrics_needs_no_api_key_and_leaves_generation_guarded(e2e_stack: Stack) -> None:
    base = e2e_stack.base_url.removesuffix("/v1")
    assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
