"""Nothing lost when a worker dies: real worker processes are killed (SIGKILL) or stopped (SIGSTOP)
under requests in flight. Every request ends with exactly the reference tokens (greedy and seeded),
and every surviving worker ends with all its KV blocks free. Past the migration limit, and with every
candidate down, the request ends in a retriable 503 that names the cause."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from controlplane.backend import BackendError, ModelInfo
from controlplane.dispatch import Dispatcher, WorkerRequest
from controlplane.scheduler.policies import get_policy
from controlplane.scheduler.scheduler import Scheduler, WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import RequestJournal, RequestState
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.runtime.generate import GenerateRequest, build_prompt, generate
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import on_threads, png
from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

TOKEN = secrets.token_urlsafe(24)
SECURITY = TransferSecurity(token=TOKEN)
SCRIPT = Path(__file__).with_name("worker_process.py")


@dataclass
class Proc:
    pool: str
    worker_id: str
    address: str
    popen: subprocess.Popen[str]

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def status(self) -> wpb.WorkerStatus:
        stub = wgrpc.PrefillWorkerStub if self.pool == "prefill" else (
            wgrpc.EncodeWorkerStub if self.pool == "encode" else wgrpc.DecodeWorkerStub)
        channel = SECURITY.open_channel(self.address)
        try:
            return stub(channel).Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=10)
        finally:
            channel.close()


def _spawn(ckpt: Path, pools: list[str], colocated: bool = False, kv_bytes: int | None = None) -> list[Proc]:
    """Start the workers at once (each loads the model in its own process)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    extra = (["colocated"] if colocated else []) + ([f"kv={kv_bytes}"] if kv_bytes is not None else [])
    popens = [subprocess.Popen([sys.executable, str(SCRIPT), pool, str(ckpt), TOKEN, *extra],
                               stdout=subprocess.PIPE, text=True, env=env) for pool in pools]
    procs = []
    for i, (pool, p) in enumerate(zip(pools, popens)):
        assert p.stdout is not None
        address = p.stdout.readline().strip()
        assert address, f"worker {pool} did not start"
        procs.append(Proc(pool, f"{pool}-{i}-{secrets.token_hex(3)}", address, p))
    return procs


def _enlist(registry: WorkerRegistry, p: Proc, free_kv_blocks: int = 100) -> None:
    """Routable from now on, with a fixed load (least_loaded picks the most free blocks first)."""
    registry.register(WorkerInfo(p.worker_id, p.pool, p.address,  # type: ignore[arg-type]  # pool names as str
                                 load=WorkerLoad(free_kv_blocks=free_kv_blocks, total_kv_blocks=100)))


@pytest.fixture
def cluster(default_ckpt, state_conn) -> Iterator[tuple[WorkerRegistry, list[Proc]]]:  # noqa: F811
    registry = WorkerRegistry(state_conn, ttl=60)
    procs: list[Proc] = []

    def start(pools: list[str], colocated: bool = False, kv_bytes: int | None = None,
              routable: bool = True) -> list[Proc]:
        """``routable=False``: started but not registered yet (``_enlist`` it later)."""
        new = _spawn(default_ckpt, pools, colocated, kv_bytes)
        procs.extend(new)
        for p in new:
            if routable:
                _enlist(registry, p)
        return new

    yield registry, start  # type: ignore[misc]  # a generator fixture; mypy cannot see pytest's protocol
    for p in procs:
        if p.popen.poll() is None:
            os.kill(p.popen.pid, signal.SIGCONT)
        p.kill()
        registry.deregister(p.worker_id, p.pool)
    for key in state_conn.redis.scan_iter(match=state_conn.keys.pattern):
        state_conn.redis.delete(key)


def _scheduler(bundle, registry, conn, colocated=False, **settings) -> Scheduler:
    s = SchedulerSettings(**{"token_idle_timeout_s": 1.5, "first_token_timeout_s": 20.0, "keepalive_s": 1.0,
                             **settings})
    dispatcher = Dispatcher(SECURITY, keepalive_s=s.keepalive_s, token_idle_timeout_s=s.token_idle_timeout_s,
                            first_token_timeout_s=s.first_token_timeout_s)
    model = ModelInfo("demo", bundle.tokenizer, 8192, bundle.image_token_id, 64, bundle.eos_token_ids)
    return Scheduler(model, WorkerView(registry, refresh_s=0.05), dispatcher, get_policy("least_loaded"), s,
                     RequestJournal(conn), colocated=colocated)


def _requests(bundle, n: int, max_tokens: int = 48,
              images: bool = False) -> tuple[list[WorkerRequest], list[list[int]]]:
    """Half greedy, half seeded sampling, with their reference tokens from generate()."""
    reqs, refs = [], []
    for i in range(n):
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=1000 + i, ignore_eos=True))
        content: list = [{"type": "text", "text": f"Request {i}: tell me about serving systems."}]
        imgs: tuple[bytes, ...] = ()
        if images:
            imgs = (png((40 * i % 255, 90, 30)),)
            content = [{"type": "image"}] + content
        greq = GenerateRequest(messages=[{"role": "user", "content": content}], images=imgs, params=params)
        ids, mm = build_prompt(bundle, greq)
        refs.append(generate(bundle, [greq])[0].token_ids)
        reqs.append(WorkerRequest(f"mig-{secrets.token_hex(4)}-{i}", ids, params, imgs,
                                  mm.positions if mm is not None else ()))
    return reqs, refs


class Streams:
    """Requests run on threads; ``progress[i]`` counts the tokens request i received so far."""

    def __init__(self, scheduler: Scheduler, reqs: list[WorkerRequest]) -> None:
        self.progress = [0] * len(reqs)
        self.result: tuple[list, list[BaseException]] | None = None

        def one(i: int) -> list[int]:
            out: list[int] = []
            for chunk in scheduler.generate(reqs[i]):
                out.extend(chunk.token_ids)
                self.progress[i] = len(out)
            return out

        self._thread = threading.Thread(target=lambda: setattr(self, "result", on_threads(one, len(reqs))))
        self._thread.start()

    def wait_until(self, cond, timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        while not cond(self.progress):
            assert time.monotonic() < end, f"no progress: {self.progress}"
            time.sleep(0.005)

    def join(self, timeout_s: float = 120) -> tuple[list, list[BaseException]]:
        self._thread.join(timeout_s)
        assert self.result is not None, "requests still running past their deadline"
        return self.result


def _all_free(procs: list[Proc]) -> None:
    """Every live worker's blocks are all free and it holds no reservation (within a few seconds)."""
    for p in procs:
        if p.popen.poll() is not None:
            continue
        end = time.monotonic() + 10
        while True:
            s = p.status()
            if s.kv_blocks_free == s.kv_blocks_total and s.reservations == 0 and s.running == 0:
                break
            assert time.monotonic() < end, f"{p.pool} {p.worker_id} holds blocks: {s}"
            time.sleep(0.1)


def _migrated(conn, reqs: list[WorkerRequest]) -> int:
    journal = RequestJournal(conn)
    return sum(any(e.state is RequestState.MIGRATING for e in journal.history(r.request_id)) for r in reqs)


def _decode_moves() -> float:
    from controlplane.observability import metrics
    return sum(sample.value for metric in metrics.MIGRATIONS.collect() for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels.get("stage") == "decode")


def test_decode_worker_killed_mid_stream(default_bundle, cluster, state_conn):  # noqa: F811
    registry, start = cluster
    procs = start(["prefill", "decode", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn)
    reqs, refs = _requests(default_bundle, 6)
    moved_before = _decode_moves()
    streams = Streams(scheduler, reqs)
    streams.wait_until(lambda p: all(n >= 2 for n in p))
    victim = procs[1]
    os.kill(victim.popen.pid, signal.SIGSTOP)  # freeze it mid-stream, then kill it: its streams die mid-way
    victim.kill()
    out, errors = streams.join()
    assert not errors and out == refs
    assert _migrated(state_conn, reqs) >= 1
    assert _decode_moves() - moved_before >= _migrated(state_conn, reqs)  # epd:request_migrations_total, per move
    _all_free(procs)


def test_decode_worker_hung_by_sigstop(default_bundle, cluster, state_conn):  # noqa: F811
    registry, start = cluster
    procs = start(["prefill", "decode", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn)
    reqs, refs = _requests(default_bundle, 4)
    streams = Streams(scheduler, reqs)
    streams.wait_until(lambda p: all(n >= 2 for n in p))
    hung = procs[1]
    os.kill(hung.popen.pid, signal.SIGSTOP)
    began = time.monotonic()
    out, errors = streams.join()
    assert not errors and out == refs
    assert time.monotonic() - began < 30  # detected by the idle limit (1.5 s here), not a request deadline
    assert _migrated(state_conn, reqs) >= 1
    assert hung.worker_id in [s.worker_id for s in scheduler.health.suspects()]
    os.kill(hung.popen.pid, signal.SIGCONT)  # back: the requests that left it are aborted there too
    _all_free(procs)


def test_prefill_worker_killed_mid_prefill(default_bundle, cluster, state_conn):  # noqa: F811
    registry, start = cluster
    procs = start(["prefill", "prefill", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn)
    victim = procs[0]
    os.kill(victim.popen.pid, signal.SIGSTOP)  # the requests routed to it wait inside Prefill ...
    reqs, refs = _requests(default_bundle, 4)
    streams = Streams(scheduler, reqs)
    time.sleep(0.5)
    victim.kill()  # ... and lose it there
    out, errors = streams.join()
    assert not errors and out == refs
    assert _migrated(state_conn, reqs) >= 1
    _all_free(procs)


def test_encode_worker_killed(default_bundle, cluster, state_conn):  # noqa: F811
    registry, start = cluster
    procs = start(["encode", "encode", "prefill", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn)
    victim = procs[0]
    os.kill(victim.popen.pid, signal.SIGSTOP)
    reqs, refs = _requests(default_bundle, 4, max_tokens=16, images=True)
    streams = Streams(scheduler, reqs)
    time.sleep(0.5)
    victim.kill()
    out, errors = streams.join()
    assert not errors and out == refs
    assert _migrated(state_conn, reqs) >= 1
    _all_free(procs)


def test_colocated_worker_killed_mid_stream(default_bundle, cluster, state_conn):  # noqa: F811
    registry, start = cluster
    procs = start(["decode", "decode"], colocated=True)
    scheduler = _scheduler(default_bundle, registry, state_conn, colocated=True)
    reqs, refs = _requests(default_bundle, 4)
    streams = Streams(scheduler, reqs)
    streams.wait_until(lambda p: all(n >= 2 for n in p))
    os.kill(procs[0].popen.pid, signal.SIGSTOP)
    procs[0].kill()
    out, errors = streams.join()
    assert not errors and out == refs
    assert _migrated(state_conn, reqs) >= 1
    _all_free(procs)


def _moved_to_context(default_bundle, cluster, state_conn, colocated: bool, kv_blocks: list[int],  # noqa: F811
                      prefill_blocks: int | None = None, prefill_left: bool = True):
    """A request without max_tokens streams on a big decode worker, which dies after more tokens than a
    128-token pool holds; decode workers of ``kv_blocks`` blocks each (16 tokens a block) take over, the
    first of them picked first. ``prefill_blocks``: a prefill worker that small joins then and is picked
    first; ``prefill_left=False``: the first prefill worker leaves the registry then. Returns the request,
    its tokens and the prompt's length."""
    registry, start = cluster
    procs = start(["decode"] if colocated else ["prefill", "decode"], colocated=colocated)
    per_block = _bytes_per_block(default_bundle)
    spares = [start(["decode"], colocated=colocated, kv_bytes=n * per_block, routable=False)[0] for n in kv_blocks]
    if prefill_blocks is not None:
        spares += start(["prefill"], kv_bytes=prefill_blocks * per_block, routable=False)
    assert [p.status().kv_blocks_total for p in spares] == kv_blocks + [prefill_blocks] * (prefill_blocks is not None)
    scheduler = _scheduler(default_bundle, registry, state_conn, colocated=colocated)
    greq = GenerateRequest(messages=[{"role": "user", "content": "Tell me about serving systems."}],
                           params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    ids, _ = build_prompt(default_bundle, greq)
    limit = default_bundle.config.max_position_embeddings
    request = WorkerRequest(f"ctx-{secrets.token_hex(4)}", ids, SamplingParams(
        max_tokens=limit - len(ids), temperature=0.0, ignore_eos=True, to_context=True))
    chunks: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            chunks.extend(scheduler.generate(request))
        except BaseException as exc:  # the assertion below names it
            errors.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    end = time.monotonic() + 60
    while sum(len(c.token_ids) for c in chunks) < 128 - len(ids) + 8:  # past what 8 blocks hold
        assert time.monotonic() < end and thread.is_alive(), f"no progress: {errors}"
        time.sleep(0.005)
    for i, p in enumerate(spares):
        _enlist(registry, p, free_kv_blocks=100 - i)  # the first spare looks the least loaded
    if prefill_blocks is not None:  # the first prefill worker looks busier than the small one
        _enlist(registry, procs[0], free_kv_blocks=50)
    if not prefill_left:
        registry.deregister(procs[0].worker_id, procs[0].pool)
    os.kill(procs[-1].popen.pid, signal.SIGSTOP)  # freeze it mid-stream, then kill it
    procs[-1].kill()
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    tokens = [t for c in chunks for t in c.token_ids]
    ref = generate(default_bundle, [dataclasses.replace(greq, params=SamplingParams(
        max_tokens=len(tokens), temperature=0.0, ignore_eos=True))])[0]
    assert tokens == ref.token_ids and "".join(c.text for c in chunks) == ref.text
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[-1].completion_tokens == len(tokens)
    _all_free([*procs[:-1], *spares])
    return request, tokens, len(ids)


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_request_for_as_many_tokens_as_fit_moved_to_a_smaller_pool_finishes_length(
        default_bundle, cluster, state_conn, colocated):  # noqa: F811
    """No max_tokens (``to_context``): the request runs as far as its decode worker's KV pool holds. When that
    worker dies after more tokens than the only other one's pool holds, the stream ends with what it has and
    finish_reason "length", not with an error after its 200; the small worker holds nothing afterwards."""
    request, tokens, prompt = _moved_to_context(default_bundle, cluster, state_conn, colocated, [8])
    assert len(tokens) > 128 - prompt
    journal = RequestJournal(state_conn).history(request.request_id)
    assert RequestState.MIGRATING in [e.state for e in journal]
    assert journal[-1].state is RequestState.FINISHED and "no room after the move" in journal[-1].detail


def test_a_moved_request_skips_a_pool_too_small_for_it_and_goes_on_where_it_fits(
        default_bundle, cluster, state_conn):  # noqa: F811
    """The small replica is picked first and refuses; the request goes on on the bigger one, to that one's
    own limit (32 blocks: 512 tokens in all), and finishes "length" there."""
    request, tokens, prompt = _moved_to_context(default_bundle, cluster, state_conn, False, [8, 32])
    assert len(tokens) == 32 * 16 - prompt
    journal = RequestJournal(state_conn).history(request.request_id)
    assert "no room after the move" not in journal[-1].detail


def test_a_moved_request_skips_a_prefill_pool_too_small_for_it(default_bundle, cluster, state_conn):  # noqa: F811
    """After the move, the least-loaded prefill replica's pool (8 blocks) cannot hold the prompt so far; the
    request goes on through the other prefill replica, to the new decode worker's limit (32 blocks)."""
    request, tokens, prompt = _moved_to_context(default_bundle, cluster, state_conn, False, [32], prefill_blocks=8)
    assert len(tokens) == 32 * 16 - prompt
    journal = RequestJournal(state_conn).history(request.request_id)
    assert "no room after the move" not in journal[-1].detail


def test_a_moved_request_with_only_a_too_small_prefill_pool_left_finishes_length(
        default_bundle, cluster, state_conn):  # noqa: F811
    request, tokens, prompt = _moved_to_context(default_bundle, cluster, state_conn, False, [32], prefill_blocks=8,
                                                prefill_left=False)
    assert 8 * 16 - prompt < len(tokens) < 32 * 16 - prompt
    journal = RequestJournal(state_conn).history(request.request_id)
    assert journal[-1].state is RequestState.FINISHED and "no room after the move" in journal[-1].detail
    assert "no other prefill replica is left" in journal[-1].detail


def _bytes_per_block(bundle) -> int:
    from workers.runtime.engine import Engine, EngineConfig
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=64 * 2**20))
    return 64 * 2**20 // engine.cache.num_blocks


def test_past_the_migration_limit_a_retriable_error_names_the_cause(default_bundle, cluster, state_conn):  # noqa: F811
    registry, start = cluster
    procs = start(["prefill", "decode", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn, migration_limit=0)
    reqs, _ = _requests(default_bundle, 2)
    streams = Streams(scheduler, reqs)
    streams.wait_until(lambda p: all(n >= 2 for n in p))
    os.kill(procs[1].popen.pid, signal.SIGSTOP)
    procs[1].kill()
    out, errors = streams.join()
    assert errors, "a request on the killed worker must fail past a limit of 0"
    for err in errors:
        assert isinstance(err, BackendError) and err.status == 503 and err.retry_after_s
        assert "migration limit" in str(err) and procs[1].worker_id in str(err)
    _all_free(procs)
    # every decode candidate down: 503 with Retry-After at once, not a wait for room
    procs[2].kill()
    began = time.monotonic()
    with pytest.raises(BackendError) as down:
        list(scheduler.generate(WorkerRequest("all-down", reqs[0].prompt_ids, reqs[0].params)))
    assert down.value.status == 503 and down.value.retry_after_s and time.monotonic() - began < 10


def test_a_request_never_waits_past_its_deadline(default_bundle, cluster, state_conn):  # noqa: F811
    """Hang detection slower than the request's deadline: the deadline still ends it, with 504."""
    registry, start = cluster
    procs = start(["prefill", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn, request_timeout_s=2.0, keepalive_s=60.0,
                           token_idle_timeout_s=60.0, first_token_timeout_s=60.0)
    reqs, _ = _requests(default_bundle, 1)
    os.kill(procs[1].popen.pid, signal.SIGSTOP)  # the only decode worker hangs
    began = time.monotonic()
    with pytest.raises(BackendError) as err:
        list(scheduler.generate(reqs[0]))
    assert err.value.status == 504 and "timed out" in str(err.value)
    assert time.monotonic() - began < 6.0
    os.kill(procs[1].popen.pid, signal.SIGCONT)
    _all_free(procs)


def test_a_retry_that_meets_its_own_earlier_attempt_waits_for_it(default_bundle, cluster, state_conn):  # noqa: F811
    """A prefill worker still holding an earlier attempt of a request (its abort not yet landed) answers
    the retry ALREADY_EXISTS; the request waits for that attempt to let go (the failed call's abort ends
    it), as for room, then completes with the reference tokens instead of failing."""
    registry, start = cluster
    procs = start(["prefill", "decode"])
    scheduler = _scheduler(default_bundle, registry, state_conn)
    reqs, refs = _requests(default_bundle, 1, max_tokens=8)
    rid = reqs[0].request_id
    n = default_bundle.vision.config.num_image_tokens
    held = wpb.PrefillRequest(request_id=rid, prompt_token_ids=[5] + [default_bundle.image_token_id] * n + [6],
                              params=wpb.SamplingParams(max_tokens=4), kv_target=procs[1].address,
                              num_image_embeddings=n, image_positions=list(range(1, n + 1)), timeout_s=20)
    channel = SECURITY.open_channel(procs[0].address)
    try:  # the earlier attempt: waits for embeddings no encoder sends, until its caller leaves at 1.5 s
        earlier = wgrpc.PrefillWorkerStub(channel).Prefill.future(held, metadata=SECURITY.call_metadata(),
                                                                  timeout=1.5)
        time.sleep(0.3)  # it reaches the worker (a prefill waiting for embeddings is not yet the engine's)
        out = [t for chunk in scheduler.generate(reqs[0]) for t in chunk.token_ids]
        # the failed call's abort reached the earlier attempt (or its caller left): it let go either way
        assert earlier.exception() is not None
        assert earlier.exception().code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        channel.close()
    assert out == refs[0]
    _all_free(procs)
