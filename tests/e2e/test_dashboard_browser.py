"""The ops dashboard as a person sees it: headless Chromium against a real `epd serve`.

Chromium (Debian's) is driven over the DevTools protocol with ``websockets``. After a few requests
the page must show the pools (as the admin API reports them) and charts drawn from real numbers;
scaling decode from the page (it asks for the admin token in a dialog) must change the pool
(GET /admin/pools and /metrics agree); every resource the page loads comes from the control plane
(no CDN). A screenshot goes to test-artifacts/dashboard.png.
"""

from __future__ import annotations

import base64
import itertools
import json
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_process import Served, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
ADMIN_TOKEN = "dash-" + secrets.token_hex(16)


class DevTools:
    """A minimal DevTools-protocol client for one page target."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def eval(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise AssertionError(f"{expression!r} threw: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait_for(self, expression: str, within_s: float = 30.0) -> Any:
        deadline = time.monotonic() + within_s
        while True:
            value = self.eval(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"page never satisfied: {expression}"
            time.sleep(0.25)

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre."""
        box = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                        f" return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_ckpt) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("dashboard")
    small = {"kv_cache_bytes": 32 * 2**20}
    with serve_process({"model": str(default_ckpt), "transfer": {"codec_policy": "fp32"},
                        "api": {"admin_token": ADMIN_TOKEN},
                        # prefill takes 1 of Ray's 2 CPUs: a second prefill replica cannot be placed (pending)
                        "encode": {"num_cpus": 0.25, "engine": small}, "prefill": {"num_cpus": 1.0, "engine": small},
                        "decode": {"replicas": 1, "num_cpus": 0.25, "engine": small}}, tmp) as s:
        yield s


@pytest.fixture
def page(served: Served, tmp_path: Path) -> Iterator[DevTools]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: `make test-setup` installs it (apt-get install chromium)")
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                             "--disable-dev-shm-usage", "--remote-allow-origins=*", "--window-size=1400,1200",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        from websockets.sync.client import connect

        with connect(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"],
                     max_size=64 * 2**20, open_timeout=20) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def _admin_pools(served: Served) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{served.base}/admin/pools", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert r.status_code == 200
    return {p["pool"]: p for p in r.json()["pools"]}


def test_dashboard_shows_live_pools_and_charts_and_scales_a_pool(served: Served, page: DevTools):
    for i in range(6):  # real traffic, so the charts and the recent-requests table have numbers
        r = httpx.post(f"{served.base}/v1/chat/completions", timeout=120, json={
            "model": httpx.get(f"{served.base}/v1/models").json()["data"][0]["id"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell me about pools, part {i}."}]})
        assert r.status_code == 200

    page.call("Network.enable")
    page.call("Page.enable")
    page.call("Page.navigate", url=f"{served.base}/dashboard")
    page.wait_for("window.epdDashboard && window.epdDashboard.polls >= 1 && "
                  "document.querySelectorAll('#pools tbody tr').length === 3")

    # pools: what the page shows is what the admin API reports
    admin = _admin_pools(served)
    rows = page.eval("[...document.querySelectorAll('#pools tbody tr')].map(r => ({pool: r.dataset.pool, "
                     "desired: r.querySelector('.desired').textContent, ready: r.querySelector('.ready').textContent, "
                     "workers: r.querySelectorAll('.worker').length, text: r.textContent}))")
    assert {r["pool"] for r in rows} == {"encode", "prefill", "decode"}
    for r in rows:
        assert r["ready"] == str(admin[r["pool"]]["ready"]) == "1", r
        assert r["workers"] == len(admin[r["pool"]]["workers"]) == 1, r
        assert "serving" in r["text"]

    # charts: drawn from the requests just sent, with real (positive) numbers
    page.wait_for("Number(document.getElementById('ttft-chart').dataset.points) > 0")
    charts = page.eval("""(() => {
        const out = {};
        for (const id of ['ttft-chart', 'tpot-chart', 'kv-chart', 'kvutil-chart', 'rate-chart', 'queue-chart',
                          'stage-chart', 'prefill-kv-chart']) {
            const c = document.getElementById(id), ctx = c.getContext('2d');
            const px = ctx.getImageData(0, 0, c.width, c.height).data;
            let inked = 0; for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++;
            out[id] = {points: Number(c.dataset.points), max: Number(c.dataset.max || 0), inked};
        }
        out.ttftLegend = document.getElementById('ttft-legend').textContent;
        out.state = window.epdDashboard.state.series;
        return out; })()""")
    assert charts["ttft-chart"]["points"] > 0 and charts["ttft-chart"]["max"] > 0
    assert charts["tpot-chart"]["points"] > 0 and charts["kv-chart"]["max"] > 0
    assert charts["kvutil-chart"]["points"] == 1  # one decode worker
    assert all(charts[c]["inked"] > 500 for c in ("ttft-chart", "tpot-chart", "kv-chart", "kvutil-chart", "rate-chart",
                                                  "queue-chart", "stage-chart", "prefill-kv-chart")), charts
    assert charts["rate-chart"]["max"] > 0 and charts["stage-chart"]["points"] > 0
    assert charts["prefill-kv-chart"]["points"] == 1  # prefill KV use: one prefill worker
    assert set(charts["state"]["stages"]) >= {"queue", "prefill", "decode"}, charts["state"]["stages"].keys()
    # worker ids and figures drawn whole: the bars' columns are measured, the chips wrap
    assert page.eval("document.getElementById('kvutil-chart').dataset.labelsFit") == "true"
    assert page.eval("[...document.querySelectorAll('.worker')].every(w => w.textContent.includes(w.title))")
    ttft_p50 = max(v for v in charts["state"]["ttft_p50_ms"] if v is not None)
    assert 0 < ttft_p50 < 60_000 and "ms" in charts["ttftLegend"]
    # the recent requests, each with its journal timeline (journal writes may land a moment later)
    page.wait_for("[...document.querySelectorAll('#recent tbody tr')].filter(r => "
                  "r.textContent.includes('queued → decoding → finished') && r.querySelector('.timeline span')"
                  ").length === 6", within_s=20)

    # scale decode 1 -> 2 from the page: set the number, click Scale, give the token in the dialog
    page.eval("(() => { const i = document.querySelector('#pools tr[data-pool=decode] input'); i.value = '2';"
              " i.dispatchEvent(new Event('input')); })()")
    page.click("#pools tr[data-pool=decode] button")
    page.wait_for("document.getElementById('token-dialog').open")
    page.call("Input.insertText", text=ADMIN_TOKEN)  # the dialog focused its password field
    page.click("#token-ok")
    status = page.wait_for("document.getElementById('scale-status').dataset.result && "
                           "document.getElementById('scale-status').textContent")
    assert "target set to 2" in status
    assert _admin_pools(served)["decode"]["target"] == 2
    deadline = time.monotonic() + 90
    while _admin_pools(served)["decode"]["ready"] != 2:
        assert time.monotonic() < deadline, f"decode never reached 2 replicas: {_admin_pools(served)['decode']}"
        time.sleep(0.5)
    page.wait_for("document.querySelector('#pools tr[data-pool=decode] .ready').textContent === '2' && "
                  "document.querySelectorAll('#pools tr[data-pool=decode] .worker').length === 2", within_s=20)
    metrics = httpx.get(f"{served.base}/metrics", timeout=10).text
    model = httpx.get(f"{served.base}/v1/models").json()["data"][0]["id"]
    assert f'epd:replicas_desired{{model_name="{model}",pool="decode"}} 2.0' in metrics
    assert f'epd:replicas_ready{{model_name="{model}",pool="decode"}} 2.0' in metrics
    decode_ids = {w["worker_id"] for w in _admin_pools(served)["decode"]["workers"]}
    for wid in decode_ids:  # KV blocks per decode worker, from the registry the workers heartbeat into
        for gauge in ("epd:kv_blocks_free", "epd:kv_blocks_used"):
            assert f'{gauge}{{model_name="{model}",worker_id="{wid}"}}' in metrics, gauge
    _grafana_reads_only_exported_metrics(metrics)
    page.wait_for("Number(document.getElementById('kvutil-chart').dataset.points) === 2", within_s=20)

    # a replica Ray cannot place shows on the page with what it waits for, within seconds
    scaled = httpx.put(f"{served.base}/admin/pools/prefill", json={"replicas": 2},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert scaled.status_code == 200
    pending = page.wait_for("(() => { const p = document.querySelector("
                            "'#pools tr[data-pool=prefill] .pending.waiting');"
                            " return p && p.textContent; })()", within_s=10)
    assert "waiting for Ray resources: needs CPU 1, the cluster has 2" in pending, pending

    # the windows: 1 h and 6 h redraw the charts over their span
    for window, label in ((3600, "1 h"), (21600, "6 h")):
        page.click(f"#window button[data-window='{window}']")
        page.wait_for(f"window.epdDashboard.state.window_s === {window} && "
                      f"Number(document.getElementById('ttft-chart').dataset.points) > 0")
        assert label in page.eval("document.getElementById('totals').textContent")
    ARTIFACTS.mkdir(exist_ok=True)
    shot6h = base64.b64decode(page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
    (ARTIFACTS / "dashboard-6h.png").write_bytes(shot6h)
    page.click("#window button[data-window='300']")
    page.wait_for("window.epdDashboard.state.window_s === 300")

    # offline: everything the page loaded came from the control plane
    urls = [e["params"]["request"]["url"] for e in page.events if e.get("method") == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(served.base) for u in urls), [u for u in urls if not u.startswith(served.base)]

    ARTIFACTS.mkdir(exist_ok=True)
    shot = base64.b64decode(page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    (ARTIFACTS / "dashboard.png").write_bytes(shot)


def _grafana_reads_only_exported_metrics(text: str) -> None:
    """Every epd: series the Grafana dashboard queries is one this live control plane exports."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    exported = set()
    for family in text_string_to_metric_families(text):
        exported |= {family.name, *(s.name for s in family.samples)}
        exported |= {family.name + "_total"} if family.type == "counter" else set()
        exported |= {family.name + "_bucket"} if family.type == "histogram" else set()
    board = json.loads((Path(__file__).resolve().parents[2] / "helm/epd/dashboards/epd.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"epd:[a-z0-9_]+", e)}
    assert len(used) >= 15 and used <= exported, sorted(used - exported)


def test_a_wrong_admin_token_is_refused_and_nothing_scales(served: Served, page: DevTools):
    page.call("Page.enable")
    page.call("Page.navigate", url=f"{served.base}/dashboard")
    page.wait_for("window.epdDashboard && window.epdDashboard.polls >= 1 && "
                  "!!document.querySelector('#pools tr[data-pool=prefill] input')")
    before = _admin_pools(served)["prefill"]["target"]
    page.eval("document.querySelector('#pools tr[data-pool=prefill] input').value = '3'")
    page.click("#pools tr[data-pool=prefill] button")
    page.wait_for("document.getElementById('token-dialog').open")
    page.call("Input.insertText", text="not-the-admin-token")
    page.click("#token-ok")
    status = page.wait_for("document.getElementById('scale-status').dataset.result === 'error' && "
                           "document.getElementById('scale-status').textContent")
    assert "HTTP 401" in status
    assert _admin_pools(served)["prefill"]["target"] == before
    assert page.eval("sessionStorage.getItem('epd-admin-token')") is None  # a refused token is not kept
