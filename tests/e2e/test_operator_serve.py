"""`epd serve` as an operator first meets it: what it binds, what it says, what its ops endpoints ask for.

One real deployment (Redis, a private Ray, the pools, the HTTP API) in a subprocess, with an ops token.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess

import httpx
import pytest
from serve_process import descendants, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OPS_TOKEN = "ops-" + "7" * 24


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_ckpt):
    settings = {
        "model": str(default_ckpt), "api": {"ops_token": OPS_TOKEN},
        "encode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
        "prefill": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
        "decode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
    }
    with serve_process(settings, tmp_path_factory.mktemp("operator")) as served:
        yield served


def listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process name) of every listening TCP socket that one of ``pids`` holds."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            name = re.search(r'\(\("([^"]+)"', line)
            found.append((line.split()[3], name.group(1) if name else "?"))
    return found


def is_loopback(local: str) -> bool:
    host = local.rsplit(":", 1)[0].strip("[]")
    if host == "*":
        return False
    addr = ipaddress.ip_address(host)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_every_listener_of_the_stack_is_on_loopback(served):
    pids = descendants(served.proc.pid) | {served.proc.pid}
    found = listeners(pids)
    names = {name for _, name in found}
    # the stack really is up: Ray's own servers and the API are among them
    assert {"gcs_server", "raylet"} <= names, found
    assert any(local.endswith(":" + served.base.rsplit(":", 1)[1]) for local, _ in found), found
    outside = [(local, name) for local, name in found if not is_loopback(local)]
    assert not outside, f"listening beyond loopback: {outside}"


def test_is_loopback_reads_ss_addresses():
    assert is_loopback("127.0.0.1:80") and is_loopback("[::ffff:127.0.0.1]:5") and is_loopback("[::1]:5")
    assert not is_loopback("0.0.0.0:80") and not is_loopback("*:80") and not is_loopback("192.0.2.2:80")
    assert not is_loopback("[::]:80")


def test_metrics_and_dashboard_need_the_ops_token(served):
    base = served.base
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {OPS_TOKEN}"})
    assert ok.status_code == 200 and "epd:" in ok.text
    assert httpx.get(f"{base}/dashboard").status_code == 401
    assert httpx.get(f"{base}/dashboard/api/state").status_code == 401
    assert httpx.get(f"{base}/dashboard", params={"token": OPS_TOKEN}).status_code == 200
    assert httpx.get(f"{base}/dashboard/api/state", headers={"Authorization": f"Bearer {OPS_TOKEN}"}).status_code == 200
    assert httpx.get(f"{base}/dashboard/dashboard.js").status_code == 200  # code, no data
    assert httpx.get(f"{base}/health").status_code == 200  # probes stay open
