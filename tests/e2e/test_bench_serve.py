"""``epd bench serve`` end to end: against the real stack (three workers, uvicorn), against a small HTTP server
that fails requests in every way a stream can fail, and with bad input through the real CLI.

The live run's JSON is checked against what the stack itself saw: the tokens the backend relayed for the new
requests and the request/token counters of its ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from bench.serve import DatasetConfig, ServeBenchConfig, parse_slo, run_serve_bench, write_report

if TYPE_CHECKING:  # the fixtures come from tests/e2e/conftest.py
    from conftest import Stack

pytestmark = [pytest.mark.e2e]
EPD = str(Path(sys.executable).with_name("epd"))


def _epd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EPD, "bench", "serve", *args], capture_output=True, text=True, timeout=timeout)


def _counters(base_url: str) -> dict[str, float]:
    """Every counter sample of the stack's /metrics, as 'name{label=value,...}' -> value, summed over
    ``model_name``: the label is process-wide (the last app created binds it), so in a test process that has
    served more than one model the stack's requests may be counted under another test's model name."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).raise_for_status().text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                    key = f"{s.name}{{{labels}}}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_a_short_run_against_the_live_stack_matches_what_the_stack_counted(e2e_stack: Stack, tmp_path: Path):
    seen = set(e2e_stack.backend.tokens)
    before = _counters(e2e_stack.base_url)
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    run = _epd("--url", e2e_stack.base_url, "--api-key", e2e_stack.api_key, "--num-prompts", "12",
               "--input-len", "24", "--output-len", "6", "--range-ratio", "0.5", "--rate", "40", "--seed", "3",
               "--warmup", "1", "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(out),
               "--plot-dir", str(plots))
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "12 sent, 12 completed, 0 failed" in run.stdout
    assert "12/12" in run.stderr  # the progress bar
    data = json.loads(out.read_text())
    (point,) = data["points"]
    reqs = point["requests"]
    assert (point["num_requests"], point["completed"], point["failed"], len(reqs)) == (12, 12, 0, 12)
    assert data["model"] == e2e_stack.backend.model.name and data["endpoint"] == "completions"
    assert all(1 <= r["output_tokens"] <= 9 and r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"] for r in reqs)
    assert point["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert point["slo_attainment"]["all"] == 1.0 and point["good_requests"] == 12

    # the warm-up request went first, with a prompt of its own as long as the first measured one's (every set
    # of prompts draws the same lengths), so the stack saw it and then the measured requests
    new = [ids for rid, ids in e2e_stack.backend.tokens.items() if rid not in seen]
    assert len(new) == 13
    warm_output = len(new[0])
    assert sum(map(len, new[1:])) == point["total_output_tokens"]
    after = _counters(e2e_stack.base_url)
    ok = 'epd:requests_total{route=/v1/completions,status=200}'
    assert _delta(before, after, ok) == 13
    assert _delta(before, after, "epd:generation_tokens_total{}") == point["total_output_tokens"] + warm_output
    prompts = point["total_input_tokens"] + reqs[0]["prompt_tokens"]
    assert _delta(before, after, "epd:prompt_tokens_total{}") == prompts
    assert data["format"] == "epd-bench-serve/1"

    for name in ("latency_cdf.png", "slo_attainment.png", "goodput.png"):
        with Image.open(plots / name) as img:
            assert img.format == "PNG" and img.size[0] > 300
    e2e_stack.assert_workers_idle()


def test_multimodal_chat_requests_through_the_python_api(e2e_stack: Stack, tmp_path: Path):
    cfg = ServeBenchConfig(e2e_stack.base_url, api_key=e2e_stack.api_key, warmup=0, progress=False, seed=1,
                           dataset=DatasetConfig("multimodal", num_prompts=3, input_len=8, output_len=4,
                                                 image_sizes=((40, 30), (64, 64))),
                           rates=(float("inf"),), concurrency=2, slo=parse_slo("e2e:60000"))
    result = run_serve_bench(cfg)
    (point,) = result.points
    m = point.metrics
    assert result.endpoint == "chat" and (m.completed, m.failed) == (3, 0), m.failure_reasons
    # the server's usage counts the image placeholder tokens: more than the 8 text words per prompt
    assert all(o.prompt_tokens > 8 for o in point.outcomes)
    written = write_report(result, tmp_path / "mm.json", tmp_path / "plots")
    assert [p.name for p in written] == ["mm.json", "latency_cdf.png", "slo_attainment.png", "goodput.png"]
    e2e_stack.assert_workers_idle()


def test_bad_input_gets_a_clear_message_and_exit_2(e2e_stack: Stack, tmp_path: Path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"conversations": [')
    live = ["--url", e2e_stack.base_url, "--api-key", e2e_stack.api_key, "--no-progress"]
    cases = [
        (["--url", "localhost:8000"], "bad URL 'localhost:8000'"),
        (["--url", f"http://127.0.0.1:{dead}"], f"cannot reach http://127.0.0.1:{dead}/v1"),
        ([*live, "--dataset", "sharegpt", "--dataset-path", str(bad_json)], "malformed dataset file"),
        ([*live, "--dataset", "sharegpt", "--dataset-path", str(tmp_path / "none.json")], "cannot read dataset"),
        ([*live, "--goodput", "ttft:-1"], "impossible SLO 'ttft:-1'"),
        ([*live, "--goodput", "foo:3"], "bad SLO 'foo:3'"),
        ([*live, "--rate", "fast"], "bad rate 'fast'"),
        (["--url", e2e_stack.base_url, "--no-progress"], "refused the API key (HTTP 401)"),
        ([*live, "--model", "no-such-model", "--num-prompts", "1"], "all 2 warm-up requests"),
    ]
    procs = [(subprocess.Popen([EPD, "bench", "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True), message) for args, message in cases]
    for proc, message in procs:
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2, (message, stderr)
        assert message in stderr and stderr.startswith("epd bench serve: error: "), stderr
        assert "Traceback" not in stderr


@dataclass
class FlakyServer:
    """A tiny HTTP/1.1 server on 127.0.0.1 (raw asyncio streams, one connection per request): GET /v1/models,
    and POST /v1/completions streaming 4 tokens, where the n-th POST fails by n % 4: 0 succeeds, 1 drops the
    connection after 2 tokens, 2 answers 500, 3 sends an in-band error event after 2 tokens."""

    url: str
    posts: list[int]


def _chunk(data: str) -> bytes:
    payload = f"data: {data}\n\n".encode()
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, posts: list[int]) -> None:
    try:
        method, path, _ = (await reader.readline()).decode().split(" ", 2)
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            length = int(value) if key.strip().lower() == "content-length" else length
        await reader.readexactly(length)
        if method == "GET" and path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "flaky", "object": "model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            return
        if not path.startswith("/v1/"):  # /tokenize: this server has none (the bench falls back to word prompts)
            writer.write(b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            return
        kind = len(posts) % 4
        posts.append(kind)
        if kind == 2:
            body = json.dumps({"error": {"message": "boom", "type": "server_error"}}).encode()
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        for i in range(4):
            if i == 2 and kind == 1:
                await writer.drain()
                writer.transport.abort()  # mid-stream, no terminating chunk
                return
            if i == 2 and kind == 3:
                writer.write(_chunk(json.dumps({"error": {"message": "backend exploded", "type": "server_error"}})))
                writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
                return
            writer.write(_chunk(json.dumps({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})))
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(_chunk(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4,
                                                                 "total_tokens": 9}})))
        writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
    finally:
        if not writer.transport.is_closing():
            await writer.drain()
            writer.close()


@pytest.fixture
def flaky_server() -> Iterator[FlakyServer]:
    loop = asyncio.new_event_loop()
    posts: list[int] = []
    server = loop.run_until_complete(asyncio.start_server(lambda r, w: _handle(r, w, posts), "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, name="flaky-http", daemon=True)
    thread.start()
    try:
        yield FlakyServer(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", posts)
    finally:
        async def stop() -> None:
            server.close()
            await server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_server_that_fails_mid_run_is_counted_not_fatal(flaky_server: FlakyServer, tmp_path: Path):
    cfg = ServeBenchConfig(flaky_server.url, warmup=0, progress=False, rates=(200.0,),
                           dataset=DatasetConfig("random", num_prompts=12, input_len=5, output_len=4),
                           slo=parse_slo("ttft:60000"))
    result = run_serve_bench(cfg)
    assert result.model == "flaky" and len(flaky_server.posts) == 12
    m = result.points[0].metrics
    assert (m.num_requests, m.completed, m.failed) == (12, 3, 9)
    assert m.failure_reasons.pop("HTTP 500: boom") == 3
    assert m.failure_reasons.pop("error event: backend exploded") == 3
    ((dropped, count),) = m.failure_reasons.items()
    assert count == 3 and dropped.startswith("connection lost mid-stream"), dropped
    assert (m.total_output_tokens, m.total_input_tokens) == (12, 15)  # from the usage events of the 3 that finished
    assert m.ttft_ms.count == 3 and m.itl_ms.count == 9  # 4 chunks each: 3 gaps
    assert m.slo_attainment == {"all": 0.25, "ttft": 0.25} and m.good_requests == 3
    data = json.loads(write_report(result, tmp_path / "r.json")[0].read_text())
    assert sum(not r["success"] for r in data["points"][0]["requests"]) == 9

    # the CLI survives it as well, and reports the failures in its table
    run = _epd("--url", flaky_server.url, "--num-prompts", "8", "--warmup", "0", "--no-progress")
    assert run.returncode == 0, run.stderr
    assert "8 sent, 2 completed, 6 failed" in run.stdout and "2 x HTTP 500: boom" in run.stdout


def test_prompts_that_must_repeat_across_load_points_are_noted(flaky_server: FlakyServer, tmp_path: Path):
    """Three conversations for two points of two and a warm-up: two prompts repeat an earlier one's, and the
    result says so (a prefix-caching server may answer those from its cache). Random prompts never repeat."""
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"question {i} " * 4},
                                                       {"from": "gpt", "value": "an answer " * 4}]}
                                    for i in range(3)]))
    cfg = ServeBenchConfig(flaky_server.url, warmup=1, progress=False, rates=(200.0, 200.0),
                           dataset=DatasetConfig("sharegpt", num_prompts=2, path=sharegpt))
    result = run_serve_bench(cfg)
    assert len(flaky_server.posts) == 5 and len(result.points) == 2
    assert "2 prompts repeat one of an earlier load point or the warm-up (the dataset holds too few): a server " \
           "with a prefix cache may answer them from it" in result.notes
    random = run_serve_bench(replace(cfg, warmup=0,  # (the flaky server would fail a warm-up now)
                                     dataset=DatasetConfig("random", num_prompts=2, input_len=5, output_len=4)))
    assert not [n for n in random.notes if "repeat" in n]
