"""Runs a benchmark: probe the server, warm it up, then drive each load point of the sweep.

1. ``GET /v1/models``: the server is reachable, the key accepted, and (without ``--model``) the model named.
   The prompts are built then, their lengths counted by the server's /tokenize (``server_tokens.py``).
2. Warm-up: ``warmup`` requests of their own, not measured. If every one fails the run stops with the first
   reason (a wrong model name, key or endpoint fails every request the same way).
3. Each rate of the sweep: send its requests at their arrival offsets (``arrivals.py``), at most
   ``concurrency`` in flight, wait for all, and summarise (``metrics.py``). Each load point has the same
   lengths and text of its own (``build_requests``), so a server's prefix cache cannot answer one point
   from the warm-up's or an earlier point's prompts.
Failed requests are recorded with their reasons and never stop the run.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from bench.serve.arrivals import send_offsets
from bench.serve.client import build_body, headers_for, list_models, send_request
from bench.serve.config import BenchInputError, Endpoint, ServeBenchConfig, normalize_url
from bench.serve.datasets import BenchRequest, build_requests
from bench.serve.metrics import LoadPointMetrics, RequestOutcome, compute_metrics
from bench.serve.server_tokens import ServerTokens, TokenizeUnavailable
from bench.serve.vllm_keys import flat_keys

RESULT_FORMAT = "epd-bench-serve/1"  # bumped when the JSON's shape changes


@dataclass
class LoadPoint:
    """One load point's figures and the per-request outcomes they came from."""

    metrics: LoadPointMetrics
    outcomes: list[RequestOutcome]


@dataclass
class BenchResult:
    """A whole benchmark: the target, the effective configuration and one ``LoadPoint`` per swept rate."""

    config: ServeBenchConfig
    base_url: str
    model: str
    endpoint: Endpoint
    started_at: str
    points: list[LoadPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # things the user should know (printed by the CLI)

    def to_json(self, include_requests: bool = True) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg["api_key"] = "***" if self.config.api_key else None
        cfg["rates"] = [None if math.isinf(r) else r for r in self.config.rates]
        ds = cfg["dataset"]
        for key in ("path", "tokenizer"):
            ds[key] = None if ds[key] is None else str(ds[key])
        out: dict[str, Any] = {"format": RESULT_FORMAT, "base_url": self.base_url, "model": self.model,
                               "endpoint": self.endpoint, "dataset": self.config.dataset.name,
                               "started_at": self.started_at, "config": cfg, "notes": self.notes, "points": []}
        started = datetime.fromisoformat(self.started_at)
        for p in self.points:
            flat = flat_keys(p.metrics, p.outcomes, self.config, self.model, self.endpoint, started)
            # vLLM's flat keys beside ours; where a name is both, vLLM's spelling of it ("inf" for request_rate)
            entry = {**p.metrics.to_json(), **flat}
            if include_requests:
                entry["requests"] = [_request_json(o) for o in p.outcomes]
            out["points"].append(entry)
        if len(self.points) == 1:  # one load point: vLLM's keys at the top too, where its tools read them
            out = {**flat_keys(self.points[0].metrics, self.points[0].outcomes, self.config, self.model,
                               self.endpoint, started), **out}
        return out


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _request_json(o: RequestOutcome) -> dict[str, Any]:
    return {"success": o.success, "sent_at_s": o.sent_at, "ttft_ms": _ms(o.ttft_s), "tpot_ms": _ms(o.tpot_s),
            "e2e_ms": _ms(o.e2e_s), "prompt_tokens": o.prompt_tokens, "output_tokens": o.output_tokens,
            "error": o.error}


class _Progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the bar is a convenience; the run does not need it
                return
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="req", dynamic_ncols=True, leave=True)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _drive(client: httpx.AsyncClient, url: str, bodies: list[tuple[dict[str, Any], int]],
                 headers: dict[str, str], offsets: list[float], concurrency: int | None, timeout_s: float,
                 progress: _Progress) -> tuple[list[RequestOutcome], float]:
    """Send ``bodies[i]`` at ``offsets[i]`` seconds (with at most ``concurrency`` in flight); returns the
    outcomes in request order and the duration from the first send to the last end."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    start = time.perf_counter()

    async def one(i: int) -> RequestOutcome:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body, prompt_len = bodies[i]
        if sem is None:
            sent = time.perf_counter()
            outcome = await send_request(client, url, body, headers, prompt_len=prompt_len, timeout_s=timeout_s)
        else:
            async with sem:
                sent = time.perf_counter()
                outcome = await send_request(client, url, body, headers, prompt_len=prompt_len,
                                             timeout_s=timeout_s)
        outcome.sent_at = sent - start
        progress.update()
        return outcome

    outcomes = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    return list(outcomes), time.perf_counter() - start


async def arun_serve_bench(config: ServeBenchConfig) -> BenchResult:
    """The async form of ``run_serve_bench``."""
    config.validate()
    base = normalize_url(config.url)
    endpoint = config.resolved_endpoint()
    headers = headers_for(config.api_key)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(10.0, config.request_timeout_s))
    # no pool cap: a request queued inside the client would have its wait counted as server latency
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        models = await list_models(client, base, headers, config.model is not None)
        model = config.model or models[0]
        result = BenchResult(config, base, model, endpoint,
                             datetime.now(UTC).isoformat(timespec="seconds"))
        if config.model is not None and models and config.model not in models:
            result.notes.append(f"model {config.model!r} is not among the server's models {models}")
        sets = await asyncio.to_thread(_requests, config, base, model, headers, endpoint, result.notes)
        url = f"{base}/chat/completions" if endpoint == "chat" else f"{base}/completions"
        per_point = [[(build_body(r, model, endpoint, temperature=config.temperature, ignore_eos=config.ignore_eos),
                       r.prompt_len) for r in requests] for requests in sets]
        if config.warmup:
            warm = [per_point[-1][i % len(per_point[-1])] for i in range(config.warmup)]
            outcomes, _ = await _drive(client, url, warm, headers, [0.0] * len(warm), config.concurrency,
                                       config.request_timeout_s, _Progress(False, 0, ""))
            failed = [o for o in outcomes if not o.success]
            if len(failed) == len(outcomes):
                raise BenchInputError(f"all {len(outcomes)} warm-up requests to {url} failed, the first with: "
                                      f"{failed[0].error} (check --model, --api-key and --endpoint)")
            if failed:
                result.notes.append(f"{len(failed)} of {len(outcomes)} warm-up requests failed: {failed[0].error}")
        for rate, bodies in zip(config.rates, per_point):
            offsets = send_offsets(len(bodies), rate, config.burstiness, config.seed)
            label = "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"
            if config.concurrency:
                label += f" c<={config.concurrency}"
            bar = _Progress(config.progress, len(bodies), label)
            try:
                outcomes, duration = await _drive(client, url, bodies, headers, offsets, config.concurrency,
                                                  config.request_timeout_s, bar)
            finally:
                bar.close()
            metrics = compute_metrics(outcomes, duration, config.slo,
                                      request_rate=None if math.isinf(rate) else rate,
                                      max_concurrency=config.concurrency, burstiness=config.burstiness)
            result.points.append(LoadPoint(metrics, outcomes))
    return result


def _requests(config: ServeBenchConfig, base: str, model: str, headers: dict[str, str], endpoint: Endpoint,
              notes: list[str]) -> list[list[BenchRequest]]:
    """The prompts of each load point, then the warm-up's when there is one; their lengths counted by the
    server's tokenizer (its /tokenize) unless ``--tokenizer`` is given. A server without /tokenize gets word
    prompts of approximate length, and a note says so; so do prompts that repeat across load points."""
    src: ServerTokens | None = None
    if config.dataset.tokenizer is None:
        try:
            whole = config.dataset.name in ("random", "sharegpt")  # a whole prompt is one text: count it whole
            src = ServerTokens(base.removesuffix("/v1"), model, headers, endpoint, config.request_timeout_s, whole)
        except TokenizeUnavailable as exc:
            notes.append(f"exact prompt lengths need the server's /tokenize or --tokenizer ({exc}); prompts are "
                         f"common words, about one token each")
    points = len(config.rates)
    try:
        sets = [build_requests(config.dataset, config.seed, src, point) for point in range(points)]
        if config.warmup:  # a point's worth, as the one after the last (ShareGPT: conversations no point sends)
            sets.append(build_requests(config.dataset, config.seed, src, points)[:config.warmup])
    except TokenizeUnavailable as exc:
        raise BenchInputError(f"the server's /tokenize failed while building prompts: {exc}") from None
    finally:
        if src is not None:
            src.close()
    seen: set[str] = set()
    repeated = 0
    for requests in sets:
        texts = {r.text for r in requests}
        repeated += len(texts & seen)
        seen |= texts
    if repeated:
        notes.append(f"{repeated} prompts repeat one of an earlier load point or the warm-up (the dataset holds "
                     f"too few): a server with a prefix cache may answer them from it")
    return sets


def run_serve_bench(config: ServeBenchConfig) -> BenchResult:
    """Run the benchmark described by ``config`` against its server and return every figure.

    Raises ``BenchInputError`` (bad flags, an unreadable or malformed dataset, an unreachable server, a
    refused key, every warm-up request failing). Requests that fail during the measured run are counted in
    the result, not raised. Must not be called from a running event loop (use ``arun_serve_bench``).
    """
    return asyncio.run(arun_serve_bench(config))
