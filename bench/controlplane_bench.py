"""``epd bench controlplane``: the control plane's added latency and 1-token throughput, beside Ray Serve.

Everything runs on loopback in one run:
  our stack      ``controlplane.serve.build`` (a private redis-server, a private Ray with the three pools as
                 actors, the scheduler, the FastAPI app) served by uvicorn in a thread of this process;
                 the load comes from a separate client process (so the client's own Python does not share
                 this process's GIL with the server) speaking minimal HTTP/1.1 (``lean_http``, so the
                 client's own CPU per request stays small beside the stack's on the same cores).
  compute        the same 1-token request through a local ``workers.runtime`` Engine, one at a time, in
                 this process, in slices alternating with the stack's sequential requests (so drift in the
                 machine's speed moves both sides of the difference alike); the same dtype as the
                 workers (``--dtype``, default bfloat16).
  reference      a Ray Serve 3-hop handle chain (A -> B -> C, each passes a short string on through a
                 DeploymentHandle), in the same Ray instance, called from this process through the app's
                 handle; no Serve HTTP proxy.
Figures: median/p90 end-to-end at concurrency 1; the added latency, per request its end-to-end time minus
the time the prefill worker's engine spent on it (the response's ``Server-Timing: engine;dur=``; a one-token
request is computed whole by one engine), median and p90 (target: median <= 3 ms); and requests/s of
1-token requests at concurrency C, the median of three rounds (target >= 300 req/s at 32). The local
engine's time for the same request is printed beside the worker's: the worker's engine runs the same code,
colder (its weights leave the caches between requests while other processes run), so the local figure is
the smaller.

``--observability-cost N``: the stack exports spans over OTLP to a receiver in a child process (control
plane and workers alike), sampled as the OTEL_TRACES_SAMPLER* variables say (unset: epd's default, one new
request in ten; ``always_on``: every span); with OTEL_TRACES_EXPORTER=none, nowhere, as a default ``epd serve``;
and after the figures above runs N pairs of short throughput runs (``OBS_RUN_REQUESTS`` requests each),
metrics + tracing switched off then on (the switches live in this process; workers trace only calls that carry a trace
context, so they follow); the figure is the median of the rounds' own on/off ratios (target >= 0.95: at most
5% cost). ``--observability-tokens T`` makes those rounds' requests T tokens long (``ignore_eos``; each run
is then ``OBS_RUN_PER_CONNECTION`` requests per connection): the 1-token default is the worst case, a
request whose whole life is the control plane's overhead and four spans.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.heap import freeze_startup_heap
from controlplane.observability.server_timing import HEADER as SERVER_TIMING
from controlplane.observability.server_timing import engine_seconds

if TYPE_CHECKING:  # annotations only: the module imports these lazily, where they are used
    from controlplane.settings import Settings
    from workers.runtime.engine import DTypeName

MiB = 2**20
PROMPT = [11, 23, 37, 41, 53, 67, 79, 83]  # a short fixed prompt (token ids)
ADDED_LATENCY_TARGET_MS = 3.0
THROUGHPUT_TARGET_RPS = 300.0
OBSERVABILITY_TARGET_RATIO = 0.95
# --observability-cost: each off or on run is this many requests (or --throughput-requests, if fewer).
# Short runs, many pairs: a shared machine's speed drifts over seconds, and a pair's two runs must see
# the same machine; longer runs let the drift into single pairs' ratios.
OBS_RUN_REQUESTS = 160
# --observability-tokens T > 1: each run is this many requests per connection (a T-token request takes
# T decode steps, so fewer requests fill a run of about the same length).
OBS_RUN_PER_CONNECTION = 3
READY_TIMEOUT_S = 180.0
LATENCY_SLICES = 5  # compute / end-to-end alternations for the added-latency figure
THROUGHPUT_ROUNDS = 3  # the throughput figure is the median round's
# Serving runs weights in bfloat16; on a CPU with avx512_bf16 its matmuls are faster than float32's, so
# the compute leaves the control plane more of the cores. --dtype float32 measures the float32 engine.
DEFAULT_DTYPE: DTypeName = "bfloat16"


@dataclass
class BenchResult:
    requests: int
    throughput_requests: int
    concurrency: int
    dtype: str = DEFAULT_DTYPE  # the workers' (and the local engine's) compute dtype
    # our stack
    e2e_median_ms: float = 0.0
    e2e_p90_ms: float = 0.0
    compute_median_ms: float = 0.0  # the local engine (reference)
    worker_engine_median_ms: float = 0.0  # the prefill worker's engine, per request (Server-Timing)
    added_p90_ms: float = 0.0
    compute_ceiling_rps: float = 0.0  # the engine alone, the same requests in batches of `concurrency`
    added_median_ms: float = 0.0
    throughput_rps: float = 0.0  # the median round
    throughput_rounds_rps: list[float] = field(default_factory=list)
    # reference: Ray Serve 3-hop handle chain
    serve_median_ms: float = 0.0
    serve_p90_ms: float = 0.0
    serve_rps: float = 0.0
    # --observability-cost: req/s per round with metrics + tracing off and on, spans the receiver got
    obs_off_rps: list[float] = field(default_factory=list)
    obs_on_rps: list[float] = field(default_factory=list)
    obs_ratio: float = 0.0  # the median of the rounds' on/off ratios
    obs_round_ratios: list[float] = field(default_factory=list)
    obs_off_cpu_ms: list[float] = field(default_factory=list)  # CPU of the stack's processes per request
    obs_on_cpu_ms: list[float] = field(default_factory=list)
    obs_cpu_ratio: float = 0.0  # the median of the rounds' on/off ratios
    obs_tokens: int = 1  # completion tokens per request in those rounds (--observability-tokens)
    spans_exported: int = 0
    span_services: list[str] = field(default_factory=list)  # service.name of the processes that exported
    # correctness of every HTTP request sent: (status, completion tokens) -> count
    ok_requests: int = 0
    failures: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _payload(model: str, max_tokens: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if max_tokens > 1:
        body["ignore_eos"] = True  # exactly max_tokens, so every request costs the same
    return body


def _check(resp: Any, max_tokens: int = 1) -> str | None:
    """None if the reply is a 200 with exactly ``max_tokens`` completion tokens, else what is wrong."""
    if resp.status != 200:
        return f"HTTP {resp.status}: {resp.body[:200]!r}"
    try:
        n = resp.json()["usage"]["completion_tokens"]
    except Exception as exc:  # a malformed body is a failure to report, not a crash
        return f"bad body: {exc!r}"
    return None if n == max_tokens else f"{n} completion tokens, expected {max_tokens}"


# ---------------------------------------------------------------- the client process
# The load comes from bench.lean_http (a minimal keep-alive HTTP/1.1 client): a heavier client's CPU per
# request would be taken from the stack under test when both share the cores.
def _endpoint(url: str) -> tuple[str, int]:
    host, _, port = url.split("//", 1)[1].rstrip("/").rpartition(":")
    return host, int(port)


def _client_sequential(url: str, model: str, n: int) -> tuple[list[float], list[float], list[str]]:
    """(end-to-end seconds, the worker engine's seconds from each response's Server-Timing, errors)."""
    from bench.lean_http import Connection, post_bytes

    host, port = _endpoint(url)
    request = post_bytes(host, port, "/v1/completions", _payload(model))
    lat, engine, errors = [], [], []
    with Connection(host, port) as conn:
        conn.send(request)  # warm the connection
        for _ in range(n):
            t0 = time.perf_counter()
            resp = conn.send(request)
            lat.append(time.perf_counter() - t0)
            engine.append(engine_seconds(resp.headers.get(SERVER_TIMING, "")))
            if (err := _check(resp)) is not None:
                errors.append(err)
    return lat, engine, errors


def _client_concurrent(url: str, model: str, n: int, concurrency: int, max_tokens: int = 1
                       ) -> tuple[float, int, list[str]]:
    """(elapsed seconds, requests sent, errors) for n requests of ``max_tokens`` tokens from ``concurrency``
    connections."""
    import asyncio

    from bench.lean_http import post_bytes, send_async

    host, port = _endpoint(url)
    request = post_bytes(host, port, "/v1/completions", _payload(model, max_tokens))

    async def main() -> tuple[float, int, list[str]]:
        errors: list[str] = []
        remaining = n
        ready = asyncio.Barrier(concurrency + 1)

        async def worker() -> None:
            nonlocal remaining
            writer = None
            try:
                reader, writer = await asyncio.open_connection(host, port)
                await send_async(reader, writer, request)  # every connection open and warm before the clock
                await ready.wait()
                while remaining > 0:
                    remaining -= 1
                    if (err := _check(await send_async(reader, writer, request), max_tokens)) is not None:
                        errors.append(err)
            except BaseException:
                await ready.abort()  # a connection that fails before the clock must not leave the others waiting
                raise
            finally:
                if writer is not None:
                    writer.close()

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await ready.wait()
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0, n, errors

    return asyncio.run(main())


def _client(kind: str, *args: Any) -> Any:
    """Run ``_client_<kind>(*args)`` in a fresh Python process (``python -m`` this module) and return its result.

    A plain child process, not multiprocessing: that would leave its resource tracker running behind us."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, "-m", __name__ if __name__ != "__main__" else
                           "bench.controlplane_bench", kind, json.dumps(args)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- worker compute (the local engine)
@contextmanager
def _local_engine(dtype: DTypeName = "float32") -> Iterator[tuple[Any, Any]]:
    """(engine, 1-token greedy params) over the demo model in ``dtype``, torch on one thread while it is open.

    The replicas run with a fractional Ray CPU share, where Ray sets OMP_NUM_THREADS=1: the compute is
    measured with the same one thread, or "added latency" would count the thread difference too."""
    import torch

    from workers.runtime.default_model import ensure_default_checkpoint
    from workers.runtime.engine import DTYPES, Engine, EngineConfig
    from workers.runtime.loader import load_model
    from workers.runtime.sampler import SamplingParams

    bundle = load_model(ensure_default_checkpoint(), dtype=DTYPES[dtype])  # as a replica loads it
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(dtype=dtype), bundle.eos_token_ids)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield engine, SamplingParams(max_tokens=1, temperature=0.0)
    finally:
        torch.set_num_threads(threads)


def measure_compute(engine: Any, params: Any, n: int) -> list[float]:
    """Seconds per 1-token request through the local engine, add_request..finished, one at a time."""
    out = []
    for i in range(n + 3):  # 3 warm-up requests
        t0 = time.perf_counter()
        engine.add_request(f"c{i}", list(PROMPT), params)
        done = False
        while not done:
            done = any(o.finished for o in engine.step())
        if i >= 3:
            out.append(time.perf_counter() - t0)
    return out


def measure_compute_ceiling(engine: Any, params: Any, n: int, batch: int) -> float:
    """Requests/s of the local engine, the same 1-token requests added ``batch`` at a time and stepped to
    completion: what the prefill replica's compute could serve with no control plane."""
    def run(total: int, tag: str) -> float:
        t0 = time.perf_counter()
        for start in range(0, total, batch):
            for i in range(start, min(total, start + batch)):
                engine.add_request(f"{tag}{i}", list(PROMPT), params)
            while engine.has_unfinished():
                engine.step()
        return total / (time.perf_counter() - t0)

    run(batch, "w")  # warm-up
    return run(n, "k")


# ---------------------------------------------------------------- our stack
def _settings(port: int, dtype: DTypeName = DEFAULT_DTYPE) -> Settings:
    import secrets

    from controlplane.settings import Settings

    engine = {"kv_cache_bytes": 64 * MiB, "dtype": dtype}
    pool = {"replicas": 1, "num_cpus": 0.25, "engine": engine}
    return Settings.load(None, {
        "encode": pool, "prefill": pool, "decode": pool,
        "transfer": {"codec_policy": "fp32" if dtype == "float32" else "bf16"},
        # a fixed admin token: build() then writes no token file under the user's home
        "api": {"host": "127.0.0.1", "port": port, "admin_token": secrets.token_urlsafe(32)},
    })


class _Server:
    """uvicorn serving ``app`` in a background thread of this process."""

    def __init__(self, app: Any, port: int) -> None:
        import uvicorn

        from controlplane.api.http_protocol import BoundedHeadHttpTools  # as epd serve runs it

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    http=BoundedHeadHttpTools))
        self.thread = threading.Thread(target=self.server.run, name="bench-uvicorn", daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _wait_ready(url: str) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no reply"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/ready", timeout=5.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"the API at {url} was not ready within {READY_TIMEOUT_S:.0f} s ({last})")


# ---------------------------------------------------------------- reference: Ray Serve 3-hop chain
def _serve_chain(n: int, m: int, concurrency: int) -> tuple[list[float], float]:
    from ray import serve

    opts = {"ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 64}

    @serve.deployment(**opts)
    class HopC:
        def __call__(self, s: str) -> str:
            return s

    @serve.deployment(**opts)
    class HopB:
        def __init__(self, nxt: Any) -> None:
            self.nxt = nxt

        async def __call__(self, s: str) -> str:
            return await self.nxt.remote(s)

    @serve.deployment(**opts)
    class HopA:
        def __init__(self, nxt: Any) -> None:
            self.nxt = nxt

        async def __call__(self, s: str) -> str:
            return await self.nxt.remote(s)

    serve_log = logging.getLogger("ray.serve")
    level = serve_log.level
    serve_log.setLevel(logging.WARNING)  # Serve's INFO lines would interleave with the table
    serve.start(proxy_location="Disabled")
    try:
        handle = serve.run(HopA.bind(HopB.bind(HopC.bind())),  # type: ignore[attr-defined]  # @serve.deployment adds bind
                           name="epd-bench-chain", route_prefix=None)
        for _ in range(5):
            assert handle.remote("ping").result() == "ping"
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            reply = handle.remote("ping").result()
            lat.append(time.perf_counter() - t0)
            if reply != "ping":
                raise RuntimeError(f"the Serve chain answered {reply!r}")
        remaining = [m]
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                handle.remote("ping").result()

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda _: handle.remote("ping").result(), range(concurrency)))  # warm
            t0 = time.perf_counter()
            futures = [pool.submit(worker) for _ in range(concurrency)]
            for f in futures:
                f.result()
            elapsed = time.perf_counter() - t0
        return lat, m / elapsed
    finally:
        serve.shutdown()
        serve_log.setLevel(level)


# ---------------------------------------------------------------- the whole run
def measure(requests: int = 200, throughput_requests: int = 640, concurrency: int = 32,
            log: Any = None, observability_rounds: int = 0, dtype: DTypeName = DEFAULT_DTYPE,
            observability_tokens: int = 1) -> BenchResult:
    """Run every figure; leaves no process, Ray or Redis behind."""
    if observability_rounds > 0 and os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() != "none":
        return _with_otlp_receiver(lambda: _measure(requests, throughput_requests, concurrency, log,
                                                    observability_rounds, dtype, observability_tokens))
    return _measure(requests, throughput_requests, concurrency, log, observability_rounds, dtype, observability_tokens)


def _with_otlp_receiver(run: Any) -> BenchResult:
    """Run with OTEL_EXPORTER_OTLP_ENDPOINT naming an OTLP receiver in a child process (Ray, started
    inside, passes the variable on to the replicas, so they export too)."""
    from bench.otlp_sink import OTLPSinkProcess

    sink = OTLPSinkProcess()  # its own process, as a collector would be
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER")}
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
    os.environ.pop("OTEL_TRACES_EXPORTER", None)
    try:
        res = run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        received, services = sink.stop()
    res.spans_exported, res.span_services = received, services
    return res


def _measure(requests: int, throughput_requests: int, concurrency: int, log: Any,
             observability_rounds: int, dtype: DTypeName = DEFAULT_DTYPE, observability_tokens: int = 1) -> BenchResult:
    from controlplane.serve import build

    say = log or (lambda msg: None)
    res = BenchResult(requests, throughput_requests, concurrency, dtype=dtype, obs_tokens=observability_tokens)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    say("starting the stack (redis-server, Ray, three pools, API)")
    dep = build(_settings(port, dtype))
    try:
        with _Server(dep.app, port), _local_engine(dtype) as (engine, params):
            _wait_ready(url)
            model = _served_model(url)
            freeze_startup_heap("benchmark control plane")  # as `epd serve` does once the stack is up
            # Compute and end-to-end in alternating slices, so a machine that slows down (or speeds up)
            # during the run moves both the same way instead of landing in the difference.
            compute: list[float] = []
            lat: list[float] = []
            worker: list[float] = []
            per = max(1, requests // LATENCY_SLICES)
            for i in range(LATENCY_SLICES):
                say(f"latency slice {i + 1}/{LATENCY_SLICES}: {per} requests through a local engine ({dtype}), "
                    f"then {per} sequential requests through the stack")
                compute += measure_compute(engine, params, per)
                part, timed, errors = _client("sequential", url, model, per)
                lat += part
                worker += timed
                res.failures += errors
                res.ok_requests += len(part) - len(errors)
            res.compute_median_ms = _quantile(compute, 0.5) * 1e3
            res.e2e_median_ms = _quantile(lat, 0.5) * 1e3
            res.e2e_p90_ms = _quantile(lat, 0.9) * 1e3
            added = [e - w for e, w in zip(lat, worker) if w == w]  # NaN: a response without Server-Timing
            if len(added) < len(lat):
                res.failures.append(f"{len(lat) - len(added)} responses had no Server-Timing engine time")
            if added:
                res.worker_engine_median_ms = _quantile([w for w in worker if w == w], 0.5) * 1e3
                res.added_median_ms = _quantile(added, 0.5) * 1e3
                res.added_p90_ms = _quantile(added, 0.9) * 1e3
            say(f"compute ceiling: {throughput_requests} requests through the local engine, {concurrency} at a time")
            res.compute_ceiling_rps = measure_compute_ceiling(engine, params, throughput_requests, concurrency)
            for i in range(THROUGHPUT_ROUNDS):
                say(f"our stack: {throughput_requests} requests at concurrency {concurrency} "
                    f"(round {i + 1}/{THROUGHPUT_ROUNDS})")
                elapsed, sent, errors = _client("concurrent", url, model, throughput_requests, concurrency)
                res.failures += errors
                res.ok_requests += sent - len(errors)
                res.throughput_rounds_rps.append(sent / elapsed)
            res.throughput_rps = _quantile(res.throughput_rounds_rps, 0.5)
            if observability_rounds:
                n = (min(throughput_requests, OBS_RUN_REQUESTS) if observability_tokens == 1 else
                     min(throughput_requests, OBS_RUN_PER_CONNECTION * concurrency))
                _observability_cost(res, url, model, n, concurrency, observability_rounds, say, observability_tokens)
        say("reference: Ray Serve 3-hop handle chain")
        slat, res.serve_rps = _serve_chain(requests, throughput_requests, concurrency)
        res.serve_median_ms = _quantile(slat, 0.5) * 1e3
        res.serve_p90_ms = _quantile(slat, 0.9) * 1e3
    finally:
        dep.close()
    return res


def _observability_cost(res: BenchResult, url: str, model: str, n: int, concurrency: int, rounds: int,
                        say: Any, tokens: int = 1) -> None:
    """Throughput runs on the running stack, off and on in ABBA order. The figure is the median of the
    rounds' own on/off ratios: each round's two runs are back to back, so the machine's speed, which
    drifts over minutes, moves both alike (a ratio of medians over all rounds mixed the
    drift in)."""
    from controlplane.observability import tracing
    from controlplane.observability.metrics import OBSERVABILITY

    saved = (OBSERVABILITY.metrics, OBSERVABILITY.tracing)
    try:
        for i in range(rounds):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                OBSERVABILITY.metrics = OBSERVABILITY.tracing = on
                say(f"observability cost: round {i + 1}/{rounds}, metrics + tracing {'on' if on else 'off'}, "
                    f"{n} requests of {tokens} token{'s' if tokens > 1 else ''}")
                cpu0 = _stack_cpu_s()
                elapsed, sent, errors = _client("concurrent", url, model, n, concurrency, tokens)
                cpu = _stack_cpu_s() - cpu0
                res.failures += errors
                res.ok_requests += sent - len(errors)
                (res.obs_on_rps if on else res.obs_off_rps).append(sent / elapsed)
                (res.obs_on_cpu_ms if on else res.obs_off_cpu_ms).append(cpu / max(1, sent) * 1e3)
    finally:
        OBSERVABILITY.metrics, OBSERVABILITY.tracing = saved
    tracing.force_flush()
    time.sleep(6.0)  # the replicas' batch processors flush on their own schedule (OTEL_BSP_SCHEDULE_DELAY)
    res.obs_round_ratios = [on / max(1e-9, off) for on, off in zip(res.obs_on_rps, res.obs_off_rps)]
    res.obs_ratio = _quantile(res.obs_round_ratios, 0.5)
    res.obs_cpu_ratio = _quantile([on / max(1e-9, off) for on, off in zip(res.obs_on_cpu_ms, res.obs_off_cpu_ms)],
                                  0.5)


def _stack_cpu_s() -> float:
    """CPU seconds (user + system) so far of this process (API, scheduler, dispatcher) and the
    replicas among its descendants: a cost figure that other load on the machine hardly moves."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    mine, frontier = {me}, {me}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - mine
        mine |= frontier
    total = 0.0
    for pid in mine:
        try:
            if pid != me and b"WorkerActor" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


def _served_model(url: str) -> str:
    import httpx

    return str(httpx.get(url + "/v1/models", timeout=10.0).json()["data"][0]["id"])


def format_table(r: BenchResult) -> str:
    rows = [
        ("figure", "value", "reference (same run)", "ref value", "vs target"),
        ("E2E median, c=1", f"{r.e2e_median_ms:.2f} ms", "Ray Serve 3-hop, median", f"{r.serve_median_ms:.2f} ms",
         ""),
        ("E2E p90, c=1", f"{r.e2e_p90_ms:.2f} ms", "Ray Serve 3-hop, p90", f"{r.serve_p90_ms:.2f} ms", ""),
        ("worker engine median", f"{r.worker_engine_median_ms:.2f} ms", "local engine, same request, median",
         f"{r.compute_median_ms:.2f} ms", ""),
        ("added latency p90", f"{r.added_p90_ms:.2f} ms", "", "", ""),
        ("added latency median", f"{r.added_median_ms:.2f} ms", "Ray Serve 3-hop, median",
         f"{r.serve_median_ms:.2f} ms",
         f"target <= {ADDED_LATENCY_TARGET_MS:g} ms: "
         f"{'met' if r.added_median_ms <= ADDED_LATENCY_TARGET_MS else 'MISSED'}"),
        (f"1-token req/s, c={r.concurrency}", f"{r.throughput_rps:.0f} req/s", f"Ray Serve 3-hop, c={r.concurrency}",
         f"{r.serve_rps:.0f} req/s",
         f"target >= {THROUGHPUT_TARGET_RPS:g} req/s: "
         f"{'met' if r.throughput_rps >= THROUGHPUT_TARGET_RPS else 'MISSED'}"
         + ("" if r.concurrency == 32 else " (target is at c=32)")),
        (f"engine alone, batches of {r.concurrency}", f"{r.compute_ceiling_rps:.0f} req/s",
         "(the compute ceiling of one prefill replica, one thread)", "", ""),
    ]
    if r.obs_on_rps:
        per = "" if r.obs_tokens == 1 else f", {r.obs_tokens}-token requests"
        rows.append((f"req/s c={r.concurrency}{per}, metrics+tracing on", f"{_quantile(r.obs_on_rps, 0.5):.0f} req/s",
                     "the same, both off", f"{_quantile(r.obs_off_rps, 0.5):.0f} req/s",
                     f"ratio {r.obs_ratio:.3f}, target >= {OBSERVABILITY_TARGET_RATIO:g}: "
                     f"{'met' if r.obs_ratio >= OBSERVABILITY_TARGET_RATIO else 'MISSED'}"))
        rows.append(("stack CPU per request, on", f"{_quantile(r.obs_on_cpu_ms, 0.5):.2f} ms", "the same, both off",
                     f"{_quantile(r.obs_off_cpu_ms, 0.5):.2f} ms", f"ratio {r.obs_cpu_ratio:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import sys

    rounds = args.observability_cost  # flags checked by bench.cli
    res = measure(args.requests, args.throughput_requests, args.concurrency,
                  log=lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True), observability_rounds=rounds,
                  dtype=args.dtype, observability_tokens=args.observability_tokens)
    print(f"control plane, 1-token requests, prompt {len(PROMPT)} tokens, demo model in {res.dtype}; "
          f"{res.requests} sequential, {res.throughput_requests} at concurrency {res.concurrency}")
    print(format_table(res))
    if res.obs_on_rps:
        services = ", ".join(res.span_services) or "nobody"
        per = "" if res.obs_tokens == 1 else f" ({res.obs_tokens}-token requests)"
        print(f"observability rounds{per}, on/off: " + ", ".join(f"{x:.3f}" for x in res.obs_round_ratios))
        print("observability rounds, req/s off: " + ", ".join(f"{x:.0f}" for x in res.obs_off_rps)
              + "; on: " + ", ".join(f"{x:.0f}" for x in res.obs_on_rps)
              + f"; spans exported over OTLP: {res.spans_exported} from {services}")
        print("stack CPU per request, ms, off: " + ", ".join(f"{x:.2f}" for x in res.obs_off_cpu_ms)
              + "; on: " + ", ".join(f"{x:.2f}" for x in res.obs_on_cpu_ms))
    print("throughput rounds, req/s: " + ", ".join(f"{x:.0f}" for x in res.throughput_rounds_rps))
    tokens = "one token" if res.obs_tokens == 1 or not res.obs_on_rps else "the tokens they asked for"
    print(f"{res.ok_requests} requests answered 200 with {tokens}; {len(res.failures)} failed")
    for err in res.failures[:5]:
        print(f"  failure: {err}")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(asdict(res), indent=2) + "\n")
    return 1 if res.failures else 0


if __name__ == "__main__":  # the client process (see _client)
    _clients: dict[str, Callable[..., object]] = {"sequential": _client_sequential, "concurrent": _client_concurrent}
    print(json.dumps(_clients[sys.argv[1]](*json.loads(sys.argv[2]))))
