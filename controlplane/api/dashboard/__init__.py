"""The ops dashboard at ``/dashboard``: one static page, its own JS (charts drawn on <canvas>, no CDN,
works offline) and one JSON endpoint it polls every two seconds.

  GET /dashboard             the page (index.html, dashboard.js, dashboard.css from this folder)
  GET /dashboard/api/state   pools (replicas desired/ready, each worker's health and load, KV blocks),
                             time series of the last five minutes in 5 s buckets (TTFT p50/p90, TPOT
                             p50, requests, KV transfer bytes/s), and the recent requests with their
                             stage times and journal transitions

The page and its data need no token (they show load, not secrets: no worker addresses, no prompts);
scaling goes through the admin API (``PUT /admin/pools/{pool}``), and the page asks for the admin
token before it sends one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import anyio.to_thread
from fastapi import APIRouter, HTTPException
from starlette.responses import FileResponse, JSONResponse, Response

from controlplane.observability.metrics import REQUEST_LOG, RequestRecord

if TYPE_CHECKING:
    from controlplane.admin import PoolView
    from controlplane.state.journal import RequestJournal

HERE = Path(__file__).resolve().parent
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
WINDOW_S = 300.0
BUCKET_S = 5.0
RECENT = 15


def dashboard_router(pools: Callable[[], list["PoolView"]], journal: "RequestJournal | None") -> APIRouter:
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
    async def state() -> Response:
        return JSONResponse(await anyio.to_thread.run_sync(dashboard_state, pools, journal))  # reads Redis

    return router


def dashboard_state(pools: Callable[[], list["PoolView"]], journal: "RequestJournal | None",
                    now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    try:
        pool_rows, pools_error = [_pool(p) for p in pools()], None
    except Exception as exc:  # Redis away: the page says so and keeps the charts
        pool_rows, pools_error = [], f"cannot read pools: {exc}"
    records = REQUEST_LOG.recent(since=now - WINDOW_S)
    recent = [_request(r, journal) for r in reversed(records[-RECENT:])]
    return {"now": now, "pools": pool_rows, "pools_error": pools_error, "series": series(records, now),
            "totals": {"requests": len(records), "errors": sum(r.status >= 400 for r in records)},
            "recent": recent}


def _pool(view: "PoolView") -> dict[str, Any]:
    workers = [{"worker_id": w.worker_id, "draining": w.draining, "running": w.running,
                "queued_tokens": w.queued_tokens, "kv_used": w.total_kv_blocks - w.free_kv_blocks,
                "kv_total": w.total_kv_blocks} for w in view.workers]
    pending = [{"name": r.name, "waiting_s": r.waiting_s, "placed": r.placed, "reason": r.reason}
               for r in view.pending]
    kv_total = sum(w.total_kv_blocks for w in view.workers)
    kv_used = sum(w.total_kv_blocks - w.free_kv_blocks for w in view.workers)
    return {"pool": view.pool, "target": view.target, "ready": view.ready, "workers": workers, "pending": pending,
            "problem": view.problem, "kv_usage": kv_used / kv_total if kv_total else None,
            "not_needed": view.not_needed}


def _request(r: RequestRecord, journal: "RequestJournal | None") -> dict[str, Any]:
    out = asdict(r)
    entries: list[dict[str, Any]] = []
    if journal is not None:
        try:
            entries = [{"state": e.state.value, "at": e.at, "detail": e.detail} for e in journal.history(r.request_id)]
        except Exception:  # the journal is best effort
            entries = []
    out["journal"] = entries
    return out


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def series(records: list[RequestRecord], now: float) -> dict[str, list[float | None]]:
    """Per BUCKET_S bucket of the last WINDOW_S seconds (oldest first), by each request's finish time."""
    n = int(WINDOW_S / BUCKET_S)
    start = now - n * BUCKET_S
    buckets: list[list[RequestRecord]] = [[] for _ in range(n)]
    for r in records:
        done = r.started_at + (r.e2e_s or 0.0)
        i = math.floor((done - start) / BUCKET_S)
        if 0 <= i < n:
            buckets[i].append(r)
    out: dict[str, list[float | None]] = {"t": [], "ttft_p50_ms": [], "ttft_p90_ms": [], "tpot_p50_ms": [],
                                          "requests_per_s": [], "kv_logical_mb_s": [], "kv_wire_mb_s": []}
    for i, b in enumerate(buckets):
        ttft = [r.ttft_s * 1e3 for r in b if r.ttft_s is not None]
        tpot = [r.tpot_s * 1e3 for r in b if r.tpot_s is not None]
        out["t"].append(start + (i + 1) * BUCKET_S)
        out["ttft_p50_ms"].append(_quantile(ttft, 0.5))
        out["ttft_p90_ms"].append(_quantile(ttft, 0.9))
        out["tpot_p50_ms"].append(_quantile(tpot, 0.5))
        out["requests_per_s"].append(len(b) / BUCKET_S)
        out["kv_logical_mb_s"].append(sum(r.kv_logical_bytes for r in b) / BUCKET_S / 1e6)
        out["kv_wire_mb_s"].append(sum(r.kv_wire_bytes for r in b) / BUCKET_S / 1e6)
    return out
