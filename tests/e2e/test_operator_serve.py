"""`epd serve` as an operator first meets it: what it binds, what it says, what its ops endpoints ask for.

One real deployment (Redis, a private Ray, the pools, the HTTP API) in a subprocess, with an ops token.
The tests run in file order on it; the last one stops it with Ctrl-C.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time

import httpx
import pytest

from proc_helpers import descendants
from serve_process import serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OPS_TOKEN = "ops-" + "7" * 24


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_ckpt):
    settings = {
        "model": str(default_ckpt), "api": {"ops_token": OPS_TOKEN},
        "encode": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
        "prefill": {"num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * 2**20}},
        # one CPU each: Ray (2 CPUs here) can place one decode replica beside the others, not two
        "decode": {"num_cpus": 1.0, "engine": {"kv_cache_bytes": 32 * 2**20}},
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


def test_the_private_redis_server_lets_no_one_in_without_its_password(served):
    """Its port is open to every local user: without the password, a user could read the registry, list a
    worker of its own and be sent the transfer token and prompts."""
    import redis

    pids = descendants(served.proc.pid) | {served.proc.pid}
    ports = [int(local.rsplit(":", 1)[1]) for local, name in listeners(pids) if name == "redis-server"]
    assert len(ports) == 1, listeners(pids)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=ports[0], socket_timeout=5).ping()
    # the URL, password included, is in a file only this user reads while serve runs (redis-cli -u, bench chaos)
    url_file = served.tmp / "state" / f"private-redis.{served.base.rsplit(':', 1)[1]}.url"
    assert url_file.stat().st_mode & 0o777 == 0o600
    assert redis.Redis.from_url(url_file.read_text().strip(), socket_timeout=5).ping()
    log = (served.tmp / "serve.log").read_text()
    assert f"127.0.0.1:{ports[0]}" not in log or ":***@127.0.0.1" in log  # its URL is logged masked, if at all


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
    # the access log records the dashboard's request, but not the token in its query
    log = (served.tmp / "serve.log").read_text()
    assert '"GET /dashboard?token=*** HTTP/1.1" 200' in log and OPS_TOKEN not in log


# ---------------------------------------------------------------------------------------------- vLLM's face
def _ops(served, path: str) -> httpx.Response:
    return httpx.get(f"{served.base}{path}", headers={"Authorization": f"Bearer {OPS_TOKEN}"}, timeout=10)


def _traffic(served) -> str:
    """A few answers of each kind, one refusal: the workload the board's panels are read over."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    client.completions.create(model=model, prompt="Once upon", max_tokens=4)
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    return model


def test_tokenize_and_detokenize_answer_as_vllm_does(served):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = httpx.post(f"{served.base}/tokenize", json={"model": model, "prompt": "The cache holds blocks."}).json()
    assert out["count"] == len(out["tokens"]) > 3 and out["max_model_len"] > 0 and out["token_strs"] is None
    back = httpx.post(f"{served.base}/detokenize", json={"model": model, "tokens": out["tokens"]}).json()
    assert back["prompt"].endswith("The cache holds blocks.")
    # the ids /tokenize gives are the prompt the model sees: usage.prompt_tokens of the same prompt
    done = client.completions.create(model=model, prompt="The cache holds blocks.", max_tokens=2)
    assert done.usage.prompt_tokens == out["count"]
    chat = httpx.post(f"{served.base}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.usage.prompt_tokens == chat["count"]
    assert httpx.post(f"{served.base}/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    bad = httpx.post(f"{served.base}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]


def test_every_series_carries_model_name_and_vllm_gauges_exist(served):
    from promql_subset import parse_exposition

    model = _traffic(served)
    series = [s for s in parse_exposition(_ops(served, "/metrics").text) if s.name.startswith("epd:")]
    assert series and all(s.labels.get("model_name") == model for s in series), \
        sorted({s.name for s in series if s.labels.get("model_name") != model})
    names = {s.name for s in series}
    assert {"epd:kv_cache_usage_perc", "epd:num_requests_running", "epd:num_requests_waiting"} <= names
    usage = [s for s in series if s.name == "epd:kv_cache_usage_perc"]
    assert {s.labels["pool"] for s in usage} >= {"decode"}


def test_every_grafana_panel_query_finds_series_in_a_live_scrape(served):
    import json
    from pathlib import Path

    from promql_subset import Evaluator, parse_exposition

    model = _traffic(served)
    time.sleep(2)  # the pool gauges are cached for a second
    evaluator = Evaluator(parse_exposition(_ops(served, "/metrics").text))
    board = json.loads((Path(__file__).resolve().parents[2] / "helm/epd/dashboards/epd.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "instance", "model_name"} <= set(variables)
    escaped = re.escape(model).replace("\\", "\\\\")  # a regex inside a PromQL string, as Grafana writes it
    values = {"$namespace": ".*", "$instance": ".*", "$model_name": escaped, "$__rate_interval": "1m"}

    def render(expr: str) -> str:
        for name, value in values.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, expr
        return expr

    titles = {p["title"] for p in board["panels"]}
    assert {"Request rate", "Error rate", "Queue depth"} <= titles
    empty = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            if not evaluator.evaluate(render(target["expr"])):
                empty.append((panel["title"], target["expr"]))
            for var in ("$namespace", "$instance", "$model_name"):
                assert var in target["expr"], (panel["title"], target["expr"], var)
    assert not empty, empty
    # the model variable lists the served model
    query = variables["model_name"]["query"]["query"]
    selector = render(re.fullmatch(r"label_values\((.*), model_name\)", query).group(1))
    assert {dict(s)["model_name"] for s in evaluator.evaluate(selector)} == {model}
    assert len(evaluator.names_used) >= 20


# ---------------------------------------------------------------------------------------------- say what happens
def test_the_ready_line_names_the_model_the_mode_and_the_pool_sizes(served):
    model = httpx.get(f"{served.base}/v1/models").json()["data"][0]["id"]
    line = next(ln for ln in (served.tmp / "serve.log").read_text().splitlines() if ln.startswith("epd: serving"))
    want = f"epd: serving {model} (disaggregated: encode 1, prefill 1, decode 1) on {served.base}"
    assert line.startswith(want), line


def test_an_unplaceable_replica_shows_what_it_waits_for_within_seconds(served):
    import json

    scaled = served.cli("scale", "decode", "2")
    assert scaled.returncode == 0, scaled.stderr
    deadline = time.monotonic() + 10
    while True:
        decode = next(p for p in served.status()["pools"] if p["pool"] == "decode")
        if decode["pending"]:
            break
        assert time.monotonic() < deadline, decode
        time.sleep(0.3)
    (pending,) = decode["pending"]
    assert not pending["placed"] and pending["needs"] == {"CPU": 1.0}, pending
    assert pending["reason"].startswith("waiting for Ray resources: needs CPU 1, the cluster has 2"), pending
    assert decode["target"] == 2 and decode["ready"] == 1
    table = served.cli("status").stdout
    assert "pending" in table and "waiting for Ray resources: needs CPU 1" in table, table
    state = _ops(served, "/dashboard/api/state").json()
    shown = next(p for p in state["pools"] if p["pool"] == "decode")
    assert shown["pending"] and shown["pending"][0]["reason"] == pending["reason"]
    gauges = _ops(served, "/metrics").text
    assert re.search(r'epd:replicas_pending\{model_name="[^"]+",pool="decode"\} 1\.0', gauges), gauges[-2000:]
    # scaling back gives the start up at once: nothing pending, nothing started
    assert served.cli("scale", "decode", "1").returncode == 0
    deadline = time.monotonic() + 10
    while next(p for p in served.status()["pools"] if p["pool"] == "decode")["pending"]:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert json.dumps(served.status()).count('"ready": 1') >= 3


def test_scaling_a_needed_pool_to_zero_asks_for_force(served):
    refused = served.cli("scale", "decode", "0")
    assert refused.returncode != 0
    assert "every request" in refused.stderr and "--force" in refused.stderr, refused.stderr
    assert next(p for p in served.status()["pools"] if p["pool"] == "decode")["target"] == 1
    forced = served.cli("scale", "encode", "0", "--force")
    assert forced.returncode == 0, forced.stderr
    assert next(p for p in served.status()["pools"] if p["pool"] == "encode")["target"] == 0


def test_ctrl_c_says_what_shutdown_waits_for(served):
    import signal

    served.proc.send_signal(signal.SIGINT)
    served.proc.wait(90)
    lines = [ln for ln in (served.tmp / "serve.log").read_text().splitlines() if ln.startswith("epd: stop")]
    assert any(ln.startswith("epd: stopping: the pools (encode 0, prefill 1, decode 1;") and "then the local Ray" in ln
               for ln in lines), lines
    assert any("private redis-server" in ln for ln in lines), lines
    assert lines[-1].startswith("epd: stopped in "), lines
