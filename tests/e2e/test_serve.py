"""`epd serve` as a user runs it: a real subprocess with Redis, Ray, three pools and the HTTP API.

Answers through the official openai client equal the single-process reference; `epd scale` changes
a pool while requests stream, and `epd status` shows it within 5 s; Ctrl-C leaves nothing running.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

from proc_helpers import command_line, descendants
from serve_process import chat_concurrently, in_threads, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_ckpt):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "replicas.json").write_text('{"prefill": 2, "decode": 2}')  # as the helm chart mounts it
    settings = {
        "model": str(default_ckpt), "transfer": {"codec_policy": "fp32"}, "replicas_file": str(tmp / "replicas.json"),
        "encode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
        "prefill": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 64 * 2**20}},
        "decode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 64 * 2**20}},
    }
    with serve_process(settings, tmp) as served:
        yield served


def _decode(served) -> dict[str, Any]:
    return next(p for p in served.status()["pools"] if p["pool"] == "decode")


def _wait_for_decode(served, target: int, ready: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (decode := _decode(served))["target"] != target or decode["ready"] != ready:
        assert time.monotonic() < deadline, f"decode did not reach target {target}, {ready} ready: {decode}"
        time.sleep(0.5)


def test_32_concurrent_requests_on_2_prefill_and_2_decode_replicas_all_match(served, default_bundle):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompts = [f"Question {i}: what does the cache hold?" for i in range(32)]
    refs = generate(default_bundle, [GenerateRequest(messages=[{"role": "user", "content": p}], params=SamplingParams(
        max_tokens=12, temperature=0.0)) for p in prompts])

    results = chat_concurrently(client, model, prompts, max_tokens=12, join_s=180)
    assert results == [r.text for r in refs]
    assert {p["pool"]: p["ready"] for p in served.status()["pools"]} == {"encode": 1, "prefill": 2, "decode": 2}
    # each worker says its process: one of the stack's own (a Ray worker under serve), one per worker
    workers = [w for p in served.status()["pools"] for w in p["workers"]]
    pids = {w["pid"] for w in workers}
    assert len(pids) == len(workers) and pids <= descendants(served.proc.pid), (pids, workers)
    text = served.cli("status").stdout
    assert all(f"{w['worker_id']} {w['address']} pid={w['pid']} " in text for w in workers), text
    # every replica runs the API's code, so none is flagged (the digest is taken from the same tree)
    assert {w["version"] for w in workers} == {served.status()["version"]} and "code=" not in text, text
    # each replica's own log lines reach epd serve's output (Ray forwards them), naming the replica, uncoloured
    log = served.log_tail(10**7)
    for p in served.status()["pools"]:
        for w in p["workers"]:
            assert re.search(rf"\(WorkerActor pid={w['pid']}\) INFO \[{p['pool']} \d+\] controlplane\.pools\.actor: "
                             rf"{p['pool']} replica \d+ serving at {re.escape(w['address'])}", log), log[-3000:]
    assert "\x1b[" not in log


def test_a_burst_past_every_workers_call_budget_is_served_whole(served):
    """300 streamed chats at once on 2 decode replicas of 64 calls each: every one ends with its tokens. A busy
    worker's gRPC server used to refuse streams its clients were entitled to (REFUSED_STREAM, grpc's overload
    protection), which read as a lost worker: 503 "no live decode replica" for a fifth of them; and the
    requests waiting for room starved the running streams' relay threads."""
    import asyncio
    import json
    from collections import Counter

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"model": model, "messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 32,
                "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                    tokens = usage["completion_tokens"]
            return r.status_code, tokens

    async def burst() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=served.base, timeout=300,
                                     limits=httpx.Limits(max_connections=600)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(300)))

    model = httpx.get(f"{served.base}/v1/models", timeout=10).json()["data"][0]["id"]
    results = asyncio.run(burst())
    assert Counter(results) == {(200, 32): 300}, Counter(results)
    assert {p["pool"]: p["ready"] for p in served.status()["pools"]} == {"encode": 1, "prefill": 2, "decode": 2}


def test_scaling_decode_while_requests_stream(served, default_bundle):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]

    def stream_one(_: int) -> str:
        parts = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                               stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

    long_ref = generate(default_bundle, [GenerateRequest(messages=messages, params=SamplingParams(
        max_tokens=40, temperature=0.0))])[0].text
    with in_threads(stream_one, 32, join_s=120) as results:
        for replicas in (3, 2):
            assert served.cli("scale", "decode", str(replicas)).returncode == 0
            # status shows the change within 5 s: the new target, and each replica either ready or pending
            # (a new one still loading its model); then the pool gets there (how fast is the machine's)
            shown, done = time.monotonic() + 5, time.monotonic() + 120
            while True:
                decode = next(p for p in served.status()["pools"] if p["pool"] == "decode")
                if decode["target"] == replicas and decode["ready"] + len(decode["pending"]) >= replicas:
                    break
                assert time.monotonic() < shown, f"status did not show decode={replicas} within 5 s: {decode}"
                time.sleep(0.25)
            while decode["ready"] != replicas:
                assert time.monotonic() < done, f"decode did not reach {replicas} ready replicas: {decode}"
                time.sleep(0.5)
                decode = next(p for p in served.status()["pools"] if p["pool"] == "decode")
    assert results == [long_ref] * 32


def test_a_count_changed_in_the_replicas_file_scales_the_pool_while_it_serves(served):
    """What `helm upgrade --set settings.decode.replicas=3` does to the pod: the mounted file changes, and the
    running control plane scales decode (no restart: the other pools' workers stay the same)."""
    replicas_file = served.tmp / "replicas.json"
    prefill_before = {w["worker_id"] for p in served.status()["pools"] if p["pool"] == "prefill" for w in p["workers"]}
    replicas_file.write_text('{"prefill": 2, "decode": 3}')
    _wait_for_decode(served, 3, 3, within_s=120)
    assert served.cli("scale", "decode", "2").returncode == 0  # epd scale after the file: it wins
    _wait_for_decode(served, 2, 2, within_s=120)
    replicas_file.write_text('{"prefill": 2, "decode": ')  # a bad edit: refused, logged, nothing changes
    time.sleep(4.5)  # more than two of the watch's polls (every 2 s)
    assert served.log_tail(100000).count(f"replicas file {replicas_file}: not JSON") == 1  # logged once
    replicas_file.write_text('{"decode": 3, "prefill": 2}')  # fixed: new text, decode's count as applied before
    time.sleep(4.5)
    assert _decode(served)["target"] == 2  # so the later epd scale stays
    replicas_file.write_text('{"prefill": 2, "decode": 2}')  # back to the module's size
    assert _decode(served)["ready"] == 2
    prefill_after = {w["worker_id"] for p in served.status()["pools"] if p["pool"] == "prefill" for w in p["workers"]}
    assert prefill_after == prefill_before and len(prefill_after) == 2


def test_drain_stops_routing_to_a_worker_and_requests_go_on_and_undo_brings_it_back(served):
    from openai import OpenAI

    decode = next(p for p in served.status()["pools"] if p["pool"] == "decode")
    victim = decode["workers"][0]["worker_id"]
    out = served.cli("drain", victim)
    assert out.returncode == 0 and "draining" in out.stdout
    workers = {w["worker_id"]: w for w in next(p for p in served.status()["pools"] if p["pool"] == "decode")["workers"]}
    assert workers[victim]["draining"] is True
    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(4):  # served by the other decode replica
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    bad = served.cli("drain", "no-such-worker")
    assert bad.returncode == 2 and "no live worker" in bad.stderr

    # undo: the drained worker serves again. Drain the other one; only the resumed worker can serve then.
    other = next(w["worker_id"] for w in decode["workers"] if w["worker_id"] != victim)
    out = served.cli("drain", "--undo", victim)
    assert out.returncode == 0 and "serving" in out.stdout, out.stderr
    assert served.cli("drain", other).returncode == 0
    workers = {w["worker_id"]: w for w in next(p for p in served.status()["pools"] if p["pool"] == "decode")["workers"]}
    assert (workers[victim]["draining"], workers[other]["draining"]) == (False, True)
    for _ in range(4):
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    assert served.cli("drain", "--undo", other).returncode == 0
    bad = served.cli("drain", "--undo", "no-such-worker")
    assert bad.returncode == 2 and "no live worker" in bad.stderr


def test_bad_input_gets_openai_errors_and_ctrl_c_stops_everything(served):
    proc, base = served.proc, served.base
    bad = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    wrong_admin = httpx.get(f"{base}/admin/pools", headers={"Authorization": "Bearer wrong"})
    assert wrong_admin.status_code == 401
    children = descendants(proc.pid)
    assert children, "serve should have started redis-server and Ray"
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(60)
    time.sleep(2)
    alive = [p for p in children if Path(f"/proc/{p}").exists()]
    assert alive == [], f"processes left after Ctrl-C: {alive}"


def test_sigterm_while_the_pools_start_stops_everything_started_so_far(tmp_path, default_ckpt):
    """A SIGTERM during start-up (Kubernetes stopping a pod that is not ready yet) unwinds as Ctrl-C does:
    what started so far is stopped, and the process exits. It is sent as soon as the private redis-server
    runs. (Once Ray's driver is up, Ray's own SIGTERM handler exits with 15; epd's, set before, with 130.)"""
    import json
    import subprocess
    import sys

    from serve_process import free_port

    config = tmp_path / "epd.yaml"
    config.write_text(json.dumps({"model": str(default_ckpt), "mode": "colocated", "api": {"port": free_port()},
                                  "decode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}}}))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "serve", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "EPD_STATE_DIR": str(tmp_path / "state")})
    try:
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while not _runs("redis-server", seen := seen | descendants(proc.pid)):  # Ray comes next
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        seen |= descendants(proc.pid)
        assert proc.poll() is None, "it was ready before the SIGTERM could land in its start-up"
        proc.send_signal(signal.SIGTERM)
        # unwound, not killed by the signal: 130 (epd's KeyboardInterrupt), or 15 once Ray's driver set its own
        # SIGTERM handler (sys.exit(15)); either way build() stops what it started
        assert proc.wait(90) in (130, 15), log.read_text()[-3000:]
        time.sleep(2)
        left = [p for p in seen | descendants(proc.pid) if Path(f"/proc/{p}").exists()]
        assert left == [], f"processes left after a SIGTERM during start-up: {left}\n" + log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _runs(program: str, pids: set[int]) -> bool:
    return any(program in command_line(pid) for pid in pids)  # "" for one gone meanwhile
