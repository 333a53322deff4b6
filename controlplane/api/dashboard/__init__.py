"""The ops dashboard at ``/dashboard``: one static page, its own JS (charts drawn on <canvas>, no CDN,
works offline) and one JSON endpoint it polls every two seconds.

  GET /dashboard             the page (index.html, dashboard.js, dashboard.css from this folder)
  GET /dashboard/api/state?window=300|3600|21600
                             pools (replicas desired/ready/pending with what each pending one waits for,
                             each worker's health, load and KV blocks, the pool's KV use), time series over
                             the window (requests/s, errors/s and error %, queue depth: waiting and in
                             flight, TTFT/TPOT/E2E and per-stage p50/p90, KV transfer MB/s; from
                             ``observability.timeline``), and the recent requests with their stage times
                             and journal transitions

The page and its data show load, not secrets (no worker addresses, no prompts); with ``api.ops_token`` set
they need it (``auth.OpsAuth``);
scaling goes through the admin API (``PUT /admin/pools/{pool}``), and the page asks for the admin
token before it sends one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from fastapi import APIRouter, HTTPException
from starlette.responses import FileResponse, JSONResponse, Response

from controlplane.observability.metrics import REQUEST_LOG, TIMELINE, RequestRecord
from controlplane.observability.timeline import WINDOWS_S

if TYPE_CHECKING:
    from controlplane.admin import PoolView
    from controlplane.state.journal import RequestJournal

HERE = Path(__file__).resolve().parent
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
WINDOW_S = 300  # the recent-requests table, and the charts' default window
RECENT = 15


def dashboard_router(pools: Callable[[], list[PoolView]], journal: RequestJournal | None) -> APIRouter:
    router = APIRouter(prefix="/dashboard", include_in_schema=False)

    @router.get("")
    @router.get("/")
    async def page() -> Response:
        return FileResponse(HERE / "index.html", media_type="text/html")

    @router.get("/{asset}")
    async def asset(asset: str) -> Response:
        if asset not in ASSETS:
            raise HTTPException(404, f"no dashboard asset {asset!r}")
        return FileResponse(HERE / asset, media_type=ASSETS[asset])

    @router.get("/api/state")
    async def state(window: int = 300) -> Response:
        if window not in WINDOWS_S:
            raise HTTPException(400, f"window must be one of {', '.join(map(str, WINDOWS_S))} seconds, not {window}")
        return JSONResponse(await anyio.to_thread.run_sync(dashboard_state, pools, journal, None, window))

    return router


def dashboard_state(pools: Callable[[], list[PoolView]], journal: RequestJournal | None,
                    now: float | None = None, window_s: int = WINDOW_S) -> dict[str, Any]:
    now = time.time() if now is None else now
    try:
        pool_rows, pools_error = [_pool(p) for p in pools()], None
    except Exception as exc:  # Redis away: the page says so and keeps the charts
        pool_rows, pools_error = [], f"cannot read pools: {exc}"
    records = REQUEST_LOG.recent(since=now - WINDOW_S)
    recent = [_request(r, journal) for r in reversed(records[-RECENT:])]
    view = TIMELINE.view(window_s, now)
    bucket_s = (view["t"][1] - view["t"][0]) if len(view["t"]) > 1 else float(window_s)
    answered = round(sum(view["requests_per_s"]) * bucket_s)
    errors = round(sum(view["errors_per_s"]) * bucket_s)
    return {"now": now, "window_s": window_s, "bucket_s": bucket_s, "pools": pool_rows, "pools_error": pools_error,
            "series": series(view), "totals": {"requests": answered, "errors": errors}, "recent": recent}


def series(view: dict[str, Any]) -> dict[str, Any]:
    """The charts' series from a ``Timeline.view``: rates, queue depths, KV throughput, TTFT/TPOT/E2E
    quantiles and each stage's p50 / p90 (``stages``: stage -> {"p50_ms": [...], "p90_ms": [...]})."""
    lat = view["latency"]
    n = len(view["t"])
    none = [None] * n
    stages = {m.removeprefix("stage:").removesuffix("_p50_ms"):
              {"p50_ms": v, "p90_ms": lat[m.replace("_p50_", "_p90_")]}
              for m, v in lat.items() if m.startswith("stage:") and m.endswith("_p50_ms")}
    return {**{k: v for k, v in view.items() if k != "latency"},
            "ttft_p50_ms": lat.get("ttft_p50_ms", none), "ttft_p90_ms": lat.get("ttft_p90_ms", none),
            "tpot_p50_ms": lat.get("tpot_p50_ms", none), "e2e_p50_ms": lat.get("e2e_p50_ms", none),
            "e2e_p90_ms": lat.get("e2e_p90_ms", none), "stages": stages}


def _pool(view: PoolView) -> dict[str, Any]:
    workers = [{"worker_id": w.worker_id, "draining": w.draining, "running": w.running,
                "queued_tokens": w.queued_tokens, "kv_used": w.total_kv_blocks - w.free_kv_blocks,
                "kv_total": w.total_kv_blocks, "preemptions": w.preemptions} for w in view.workers]
    pending = [{"name": r.name, "waiting_s": r.waiting_s, "placed": r.placed, "reason": r.reason}
               for r in view.pending]
    kv_total = sum(w.total_kv_blocks for w in view.workers)
    kv_used = sum(w.total_kv_blocks - w.free_kv_blocks for w in view.workers)
    return {"pool": view.pool, "target": view.target, "ready": view.ready, "workers": workers, "pending": pending,
            "problem": view.problem, "kv_usage": kv_used / kv_total if kv_total else None,
            "not_needed": view.not_needed}


def _request(r: RequestRecord, journal: RequestJournal | None) -> dict[str, Any]:
    out = asdict(r)
    entries: list[dict[str, Any]] = []
    if journal is not None:
        try:
            entries = [{"state": e.state.value, "at": e.at, "detail": e.detail} for e in journal.history(r.request_id)]
        except Exception:  # the journal is best effort
            entries = []
    out["journal"] = entries
    return out
