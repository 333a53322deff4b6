"""`epd serve --redis-url` while that Redis goes away and comes back (empty, as after a crash without
persistence).

During the outage routing runs on its last good snapshot of the registry: requests are served, their
wait on Redis bounded, and /ready and `epd status` say Redis is degraded; nothing crashes. Once Redis is
back the workers register again on their next heartbeat, the deployment becomes ready by itself and
requests are answered exactly as before.
"""

from __future__ import annotations

import time

import httpx
import pytest

from controlplane.state import LocalRedis
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

from serve_process import serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def test_requests_are_served_on_the_last_snapshot_while_redis_is_away(tmp_path, default_ckpt, default_bundle):
    redis = LocalRedis().start()
    port = redis.port
    settings = {"model": str(default_ckpt), "redis": {"url": redis.url, "heartbeat_ttl_s": 1.0},
                "encode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 16 * 2**20}},
                "prefill": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
                "decode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}}}
    ref = generate(default_bundle, [GenerateRequest(prompt="Redis came back", params=SamplingParams(
        max_tokens=6, temperature=0.0))])[0].text
    try:
        with serve_process(settings, tmp_path) as served:
            model = _model(served.base)
            body = {"model": model, "prompt": "Redis came back", "max_tokens": 6, "temperature": 0}
            ok = httpx.post(f"{served.base}/v1/completions", json=body, timeout=60)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref

            redis.close()  # Redis goes away
            time.sleep(3.0)  # past the scheduler's cached view of the registry and the 1 s leases
            t0 = time.monotonic()
            during = httpx.post(f"{served.base}/v1/completions", json=body, timeout=60)
            # routing runs on its last good snapshot: the request is served, its wait on Redis bounded
            assert time.monotonic() - t0 < 10, "a request waited on Redis while it was away"
            assert during.status_code == 200 and during.json()["choices"][0]["text"] == ref, during.text
            ready = httpx.get(f"{served.base}/ready", timeout=10)
            assert ready.status_code == 200 and "Redis is degraded" in ready.json().get("degraded", ""), ready.text
            status = served.cli("status")  # the admin view needs Redis; it still says how requests are served
            assert "serving degraded: Redis is degraded" in status.stdout + status.stderr, status
            assert served.proc.poll() is None, served.log_tail()

            redis = LocalRedis(port=port).start()  # back, and empty
            deadline = time.monotonic() + 30
            while "Redis" in httpx.get(f"{served.base}/ready", timeout=10).json().get("degraded", ""):
                assert time.monotonic() < deadline, "not ready again 30 s after Redis came back:\n" + served.log_tail()
                time.sleep(0.5)
            again = httpx.post(f"{served.base}/v1/completions", json=body, timeout=60)
            assert again.status_code == 200 and again.json()["choices"][0]["text"] == ref
            assert served.proc.poll() is None
    finally:
        redis.close()
