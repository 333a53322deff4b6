"""`epd serve` as a user runs it: a real subprocess with Redis, Ray, three pools and the HTTP API.

Answers through the official openai client equal the single-process reference; `epd scale` changes
a pool while requests stream, and `epd status` shows it within 5 s; Ctrl-C leaves nothing running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import descendants, serve_process

from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_ckpt):
    settings = {
        "model": str(default_ckpt), "transfer": {"codec_policy": "fp32"},
        "encode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
        "prefill": {"replicas": 2, "num_cpus": 0.25, "engine": {"kv_cache_bytes": 64 * 2**20}},
        "decode": {"replicas": 2, "num_cpus": 0.25, "engine": {"kv_cache_bytes": 64 * 2**20}},
    }
    with serve_process(settings, tmp_path_factory.mktemp("serve")) as served:
        yield served.proc, served.base, served.config, served.env, served.tmp


def _cli(config: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args, "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_32_concurrent_requests_on_2_prefill_and_2_decode_replicas_all_match(served, default_bundle):
    from openai import OpenAI

    proc, base, config, env, _ = served
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompts = [f"Question {i}: what does the cache hold?" for i in range(32)]
    refs = generate(default_bundle, [GenerateRequest(messages=[{"role": "user", "content": p}], params=SamplingParams(
        max_tokens=12, temperature=0.0)) for p in prompts])
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[i]}],
                                                 max_tokens=12, temperature=0)
            results[i] = out.choices[0].message.content
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    assert [results[i] for i in range(32)] == [r.text for r in refs]
    status = json.loads(_cli(config, env, "status", "--json").stdout)
    assert {p["pool"]: p["ready"] for p in status["pools"]} == {"encode": 1, "prefill": 2, "decode": 2}


def test_scaling_decode_while_requests_stream(served, default_bundle):
    from openai import OpenAI

    proc, base, config, env, _ = served
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    results: list[str] = []
    errors: list[BaseException] = []

    def stream_one() -> None:
        try:
            parts = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                                   stream=True)
            results.append("".join(c.choices[0].delta.content or "" for c in parts if c.choices))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    long_ref = generate(default_bundle, [GenerateRequest(messages=messages, params=SamplingParams(
        max_tokens=40, temperature=0.0))])[0].text
    threads = [threading.Thread(target=stream_one) for _ in range(32)]
    for t in threads:
        t.start()
    for replicas in (3, 2):
        assert _cli(config, env, "scale", "decode", str(replicas)).returncode == 0
        deadline = time.monotonic() + 5
        while True:
            status = json.loads(_cli(config, env, "status", "--json").stdout)
            decode = next(p for p in status["pools"] if p["pool"] == "decode")
            if decode["ready"] == replicas:
                break
            assert time.monotonic() < deadline, f"status did not show decode={replicas} within 5 s: {decode}"
            time.sleep(0.25)
    for t in threads:
        t.join(120)
    assert not errors and results == [long_ref] * 32


def test_drain_stops_routing_to_a_worker_and_requests_go_on(served):
    from openai import OpenAI

    proc, base, config, env, _ = served
    status = json.loads(_cli(config, env, "status", "--json").stdout)
    decode = next(p for p in status["pools"] if p["pool"] == "decode")
    victim = decode["workers"][0]["worker_id"]
    out = _cli(config, env, "drain", victim)
    assert out.returncode == 0 and "draining" in out.stdout
    status = json.loads(_cli(config, env, "status", "--json").stdout)
    workers = {w["worker_id"]: w for w in next(p for p in status["pools"] if p["pool"] == "decode")["workers"]}
    assert workers[victim]["draining"] is True
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(4):  # served by the other decode replica
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    bad = _cli(config, env, "drain", "no-such-worker")
    assert bad.returncode == 2 and "no live worker" in bad.stderr


def test_bad_input_gets_openai_errors_and_ctrl_c_stops_everything(served):
    proc, base, config, env, tmp = served
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
