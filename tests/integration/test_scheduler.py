"""The scheduler over real workers found through a real Redis registry: routing, waiting for decode
room, 429 when the wait would be unbounded, draining replicas skipped, the journal written."""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from controlplane.backend import BackendError, ModelInfo, Overloaded
from controlplane.cancellation import ClientGone
from controlplane.dispatch import Dispatcher, DispatchError, Route, WorkerRequest
from controlplane.scheduler.policies import get_policy
from controlplane.scheduler.scheduler import Scheduler, WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import RequestJournal, RequestState
from controlplane.state.keys import Pool
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1.worker_pb2_grpc import EncodeWorkerStub
from kvtransfer.auth import TransferSecurity
from workers.encode.service import EncodeService
from workers.run import RunningWorker, start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import on_threads, png
from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# blocks for ~300 tokens per decode worker: one 200-token request at a time
SMALL_DECODE = EngineConfig(kv_cache_bytes=20 * 4 * 2 * 16 * 4 * 64 * 4)


@pytest.fixture
def cluster(default_bundle, state_conn):  # noqa: F811
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = [start_worker("prefill", default_bundle, SECURITY, codecs=codecs),
               start_worker("decode", default_bundle, SECURITY, codecs=codecs, config=SMALL_DECODE),
               start_worker("decode", default_bundle, SECURITY, codecs=codecs, config=SMALL_DECODE)]
    registry = WorkerRegistry(state_conn, ttl=30)
    for w in workers:
        registry.register(WorkerInfo(w.identity.worker_id, Pool(w.pool), w.address,
                                     load=WorkerLoad(free_kv_blocks=20, total_kv_blocks=20)))
    dispatcher = Dispatcher(SECURITY)
    model = ModelInfo("demo", default_bundle.tokenizer, 8192, None, 64, default_bundle.eos_token_ids)
    yield default_bundle, workers, registry, dispatcher, model, state_conn
    _stop_all(dispatcher, workers, registry, state_conn)


def _stop_all(dispatcher: Dispatcher, workers: list, registry: WorkerRegistry, conn) -> None:  # noqa: ANN001
    """Close the dispatcher, deregister and stop the workers, and leave no key of the test in Redis."""
    dispatcher.close()
    for w in workers:
        registry.deregister(w.identity.worker_id, w.pool)
        w.stop()
    for key in conn.redis.scan_iter(match=conn.keys.pattern):
        conn.redis.delete(key)


def _scheduler(cluster, **settings) -> Scheduler:
    bundle, workers, registry, dispatcher, model, conn = cluster
    return Scheduler(model, WorkerView(registry, refresh_s=0.05), dispatcher, get_policy("least_loaded"),
                     SchedulerSettings(**settings), RequestJournal(conn))


def _collect(scheduler: Scheduler, req: WorkerRequest) -> list[int]:
    return [t for chunk in scheduler.generate(req) for t in chunk.token_ids]


def _collect_all(scheduler: Scheduler, reqs: list[WorkerRequest]) -> tuple[list[list[int] | None], list[BaseException]]:
    """Every request at once, each on its own thread: (tokens per request, in order; the errors raised)."""
    return on_threads(lambda i: _collect(scheduler, reqs[i]), len(reqs))


def test_requests_are_spread_and_match_the_reference(cluster):
    bundle, workers, registry, *_ = cluster
    scheduler = _scheduler(cluster)
    assert scheduler.ready() is True  # a text-only model needs prefill and decode replicas
    multimodal = _scheduler(cluster)
    multimodal.model = ModelInfo("demo", bundle.tokenizer, 8192, bundle.image_token_id, 64, ())
    assert multimodal.ready() is False  # ... and one that takes images an encode replica too
    prefill_ids = [w.identity.worker_id for w in workers if Pool(w.pool) == Pool.PREFILL]
    for worker_id in prefill_ids:  # every prefill worker just lost a call: routing passes them over, so /ready
        scheduler.health.failure(worker_id, "test: lost", lost=True)
    assert scheduler.ready() is False
    for worker_id in prefill_ids:
        scheduler.health.success(worker_id)
    assert scheduler.ready() is True
    prompts = [bundle.tokenizer.encode(f"Prompt {i}: the scheduler picks replicas") for i in range(4)]
    refs = [r.token_ids for r in generate(bundle, [GenerateRequest(prompt_ids=p, params=GREEDY) for p in prompts])]
    # start four requests before any finishes: what is in flight steers the next pick
    streams = [scheduler.generate(WorkerRequest(f"spread-{i}", p, GREEDY)) for i, p in enumerate(prompts)]
    firsts = [next(s) for s in streams]
    out = [list(f.token_ids) + [t for c in s for t in c.token_ids] for f, s in zip(firsts, streams)]
    assert out == refs
    journal = RequestJournal(cluster[5])
    history = journal.history("spread-0")
    assert [e.state for e in history] == [RequestState.QUEUED, RequestState.DECODING, RequestState.FINISHED]
    decoded_on = [journal.history(f"spread-{i}")[1].detail.split()[0] for i in range(4)]
    assert len(set(decoded_on)) == 2 and decoded_on[0] != decoded_on[1], decoded_on


def test_requests_wait_for_decode_room_and_all_complete(cluster):
    bundle = cluster[0]
    scheduler = _scheduler(cluster, queue_timeout_s=60)
    prompt = bundle.tokenizer.encode("a long prompt " * 60)[:200]
    ref = generate(bundle, [GenerateRequest(prompt_ids=prompt, params=GREEDY)])[0].token_ids
    out, errors = _collect_all(scheduler, [WorkerRequest(f"wait-{i}", prompt, GREEDY) for i in range(5)])
    assert not errors and out == [ref] * 5  # room for 2 at a time
    assert scheduler.waiting == 0


@pytest.mark.parametrize("fcfs_after_s, long_first", [(0.2, True), (30.0, False)])
def test_a_request_that_waited_past_fcfs_after_s_is_not_overtaken_by_a_later_one(cluster, fcfs_after_s, long_first):
    """Two decode replicas of 20 blocks run one request each: one leaves 5 blocks free, the other 1. A
    200-token prompt (14 blocks) waits, refused by both; a 40-token one (3 blocks) comes after and fits
    in the first. Once the long one has waited ``fcfs_after_s``, the replicas that refused it are left to
    drain for it, and the short one is placed after it; before that, the short one takes the free room
    at once (the work-conserving default for short waits)."""
    bundle, conn = cluster[0], cluster[5]
    scheduler = _scheduler(cluster, fcfs_after_s=fcfs_after_s, queue_timeout_s=60)
    holders = [scheduler.generate(WorkerRequest(name, bundle.tokenizer.encode("hold " * n)[:n],
                                                SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)))
               for name, n, m in (("holder-full", 20, 280), ("holder-roomy", 60, 180))]  # 19 and 15 blocks
    assert all(next(h).token_ids for h in holders)  # one on each replica: the second does not fit beside the first
    long = bundle.tokenizer.encode("a long prompt " * 60)[:200]  # 212 tokens: 14 blocks
    short = bundle.tokenizer.encode("a short one " * 20)[:40]  # 44 tokens: 3 blocks
    refs = [r.token_ids for r in generate(bundle, [GenerateRequest(prompt_ids=p, params=GREEDY)
                                                   for p in (long, short)])]
    out: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(name: str, prompt: list[int]) -> None:
        try:
            out[name] = _collect(scheduler, WorkerRequest(name, prompt, GREEDY))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("long", long))]
    threads[0].start()
    time.sleep(0.5)  # past 0.2 s, not past 30 s
    threads.append(threading.Thread(target=run, args=("short", short)))
    threads[1].start()
    # a one-token request takes no decode room (its token is prefill's): never held
    one = _collect(scheduler, WorkerRequest("one", short, SamplingParams(max_tokens=1, temperature=0.0)))
    one_done = time.time()
    assert one == refs[1][:1]
    for h, n in zip(holders, (279, 179)):
        assert sum(len(c.token_ids) for c in h) == n
    for t in threads:
        t.join(60)
    assert not errors and [out["long"], out["short"]] == refs
    journal = RequestJournal(conn)
    placed = {name: next(e.at for e in journal.history(name) if e.state is RequestState.DECODING)
              for name in ("long", "short")}
    assert (placed["long"] < placed["short"]) is long_first, placed
    assert one_done < placed["long"]
    assert len(scheduler.room) == 0 and scheduler.waiting == 0


def test_a_bounded_wait_ends_in_429_with_retry_after(cluster):
    bundle, workers, registry, *_ = cluster
    scheduler = _scheduler(cluster, queue_timeout_s=0.3)
    prompt = bundle.tokenizer.encode("a long prompt " * 60)[:200]
    long_params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    streams = [scheduler.generate(WorkerRequest(f"hold-{i}", prompt, long_params)) for i in range(2)]
    firsts = [next(s) for s in streams]  # both decode replicas are now full
    assert all(f.token_ids for f in firsts)
    # another prompt: one sharing the held ones' head would share their cached blocks on decode, and fit
    other = bundle.tokenizer.encode("another prompt, as long " * 40)[:200]
    with pytest.raises(Overloaded) as err:
        next(scheduler.generate(WorkerRequest("no-room", other, GREEDY)))
    assert err.value.retry_after_s >= 1.0
    one_waiting = _scheduler(cluster, queue_size=1)
    with one_waiting.admission.admit():  # one request waits: the queue is full, and one more is refused at once
        with pytest.raises(Overloaded, match=r"^1 request is already waiting for decode room, the most this server "
                                             r"queues \(scheduler.queue_size\)"):
            next(one_waiting.generate(WorkerRequest("full-queue", other, GREEDY)))
    assert one_waiting.waiting == 0
    for s in streams:  # the held requests still finish
        assert sum(len(c.token_ids) for c in s) == 79


def test_draining_replicas_get_no_new_work(cluster):
    bundle, workers, registry, *_ = cluster
    drained = workers[1]
    registry.set_draining(drained.identity.worker_id, "decode")
    scheduler = _scheduler(cluster)
    for i in range(3):
        _collect(scheduler, WorkerRequest(f"drain-{i}", bundle.tokenizer.encode("hello"), GREEDY))
    details = [RequestJournal(cluster[5]).history(f"drain-{i}")[1].detail for i in range(3)]
    assert all(drained.identity.worker_id not in d for d in details)


def test_every_decode_replica_drained_is_a_503_that_says_so(cluster):
    bundle, workers, registry, *_ = cluster
    for w in workers[1:]:
        registry.set_draining(w.identity.worker_id, "decode")
    with pytest.raises(BackendError) as info:
        _collect(_scheduler(cluster), WorkerRequest("all-drained", bundle.tokenizer.encode("hello"), GREEDY))
    assert info.value.status == 503 and info.value.retry_after_s is not None
    assert "every decode replica is draining (2)" in str(info.value) and "epd drain --undo" in str(info.value)


def test_a_replica_that_refuses_because_it_drains_is_skipped_not_counted_lost(cluster):
    """Between a replica starting to drain and routing hearing of it (the pool manager drains the service
    before Redis), its Reserve refuses with UNAVAILABLE. That is the live worker's own answer: the request
    goes to the other replica, and the refusing one is not marked suspect (its breaker stays closed)."""
    bundle, workers, registry, dispatcher, *_ = cluster
    refusing, other = workers[1], workers[2]
    refusing.service.Drain(None, None)  # the service drains; the registry does not know yet
    registry.register(WorkerInfo(other.identity.worker_id, Pool.DECODE, other.address,  # fewer free: tried second
                                 load=WorkerLoad(free_kv_blocks=10, total_kv_blocks=20)))
    scheduler = _scheduler(cluster)
    for i in range(4):
        _collect(scheduler, WorkerRequest(f"refused-{i}", bundle.tokenizer.encode("hello"), GREEDY))
    details = [RequestJournal(cluster[5]).history(f"refused-{i}")[-2].detail for i in range(4)]
    assert all(other.identity.worker_id in d and refusing.identity.worker_id not in d for d in details), details
    assert scheduler.health.routable(refusing.identity.worker_id)
    assert all(e.state != RequestState.MIGRATING for i in range(4)
               for e in RequestJournal(cluster[5]).history(f"refused-{i}"))


def test_a_prefill_replica_that_refuses_because_it_drains_costs_no_move(default_bundle, state_conn):  # noqa: F811
    """The same for a prefill replica: its refusal comes inside the attempt (after Reserve). The request
    goes to the other prefill replica without a move counted (three refusals used to reach the migration
    limit and end in a 503) and without the refusing worker marked suspect."""
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = [start_worker("prefill", default_bundle, SECURITY, codecs=codecs),
               start_worker("prefill", default_bundle, SECURITY, codecs=codecs),
               start_worker("decode", default_bundle, SECURITY, codecs=codecs, config=SMALL_DECODE)]
    refusing, other = workers[0], workers[1]
    registry = WorkerRegistry(state_conn, ttl=30)
    for w, queued in ((refusing, 0), (other, 500), (workers[2], 0)):  # routing tries the refusing one first
        registry.register(WorkerInfo(w.identity.worker_id, Pool(w.pool), w.address,
                                     load=WorkerLoad(queued_tokens=queued, free_kv_blocks=20, total_kv_blocks=20)))
    refusing.service.Drain(None, None)  # type: ignore[attr-defined]  # every worker service drains; Redis not told
    dispatcher = Dispatcher(SECURITY)
    model = ModelInfo("demo", default_bundle.tokenizer, 8192, None, 64, default_bundle.eos_token_ids)
    scheduler = Scheduler(model, WorkerView(registry, refresh_s=0.05), dispatcher, get_policy("least_loaded"),
                          SchedulerSettings(migration_limit=0), RequestJournal(state_conn))
    try:
        for i in range(3):
            assert len(_collect(scheduler, WorkerRequest(f"p-refused-{i}", default_bundle.tokenizer.encode("hello"),
                                                         GREEDY))) == 12
            history = RequestJournal(state_conn).history(f"p-refused-{i}")
            assert RequestState.MIGRATING not in [e.state for e in history]
            assert other.identity.worker_id in history[-2].detail, history[-2].detail
        assert scheduler.health.routable(refusing.identity.worker_id)
    finally:
        _stop_all(dispatcher, workers, registry, state_conn)


def test_a_request_no_decode_replica_can_ever_hold_is_refused_at_once(cluster):
    scheduler = _scheduler(cluster, queue_timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(BackendError) as info:  # ~300 tokens of room per replica; this needs 612
        _collect(scheduler, WorkerRequest("too-big", [5] * 600, GREEDY))
    assert info.value.status == 400 and "more than a worker's KV pool holds" in str(info.value)
    assert info.value.code == "context_length_exceeded"  # what clients and frameworks look for
    assert time.monotonic() - started < 10  # refused, not left to wait out the 30 s queue timeout
    assert scheduler.waiting == 0
    assert [e.state for e in RequestJournal(cluster[5]).history("too-big")][-1] == RequestState.FAILED


def test_a_request_past_the_request_timeout_is_cut_off_with_504_and_frees_its_blocks(cluster):
    """scheduler.request_timeout_s is the deadline of every worker call a request makes."""
    bundle, workers, *_ = cluster
    scheduler = _scheduler(cluster, request_timeout_s=0.15)
    long = SamplingParams(max_tokens=280, temperature=0.0, ignore_eos=True)  # seconds of decoding here
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        _collect(scheduler, WorkerRequest("deadline", bundle.tokenizer.encode("hello"), long))
    assert info.value.status == 504 and "timed out" in str(info.value), info.value
    assert time.monotonic() - started < 10
    assert [e.state for e in RequestJournal(cluster[5]).history("deadline")][-1] == RequestState.FAILED
    assert scheduler.view._inflight == {}  # the routing counts dropped too
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the workers abort it and free its blocks
        stats = [w.service.engine.stats() for w in workers]
        if all(s.blocks_free == s.blocks_total and s.num_reservations == 0 for s in stats):
            break
        time.sleep(0.05)
    assert all(s.blocks_free == s.blocks_total and s.num_reservations == 0 for s in stats), stats
    # with the default deadline the same request runs to its end
    assert len(_collect(_scheduler(cluster), WorkerRequest("in-time", bundle.tokenizer.encode("hello"), long))) == 280


def test_the_journal_ends_every_request_refused_or_left(cluster):
    """A 503 for a missing pool ends in FAILED naming the pool; a client that closes its stream ends in
    ABORTED. Both were left at 'queued' / 'decoding' for good."""
    bundle, *_ = cluster
    scheduler = _scheduler(cluster)
    journal = RequestJournal(cluster[5])
    ids = bundle.tokenizer.encode("describe it")
    with pytest.raises(BackendError) as info:  # this cluster has no encode pool
        _collect(scheduler, WorkerRequest("no-encode", ids, GREEDY, (b"png",), (0,)))
    assert info.value.status == 503 and "no live encode replica" in str(info.value)
    last = journal.history("no-encode")[-1]
    assert last.state == RequestState.FAILED and "encode" in last.detail
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    stream = scheduler.generate(WorkerRequest("left", ids, long))
    assert next(stream).token_ids
    # what the ingress does when the client goes away (generate() is a generator, declared an Iterator)
    stream.close()  # type: ignore[attr-defined]  # declared as an Iterator
    assert [e.state for e in journal.history("left")][-1] == RequestState.ABORTED
    assert scheduler.view._inflight == {}


def test_an_unexpected_error_in_dispatch_fails_the_request_and_drops_the_routing_counts(cluster):
    bundle, workers, registry, _, model, conn = cluster

    class Broken(Dispatcher):
        def run(self, req, route, on_started=lambda: None):
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    broken = Broken(SECURITY)
    try:
        scheduler = Scheduler(model, WorkerView(registry, refresh_s=0.05), broken, get_policy("least_loaded"),
                              SchedulerSettings(), RequestJournal(conn))
        with pytest.raises(UnicodeEncodeError):
            _collect(scheduler, WorkerRequest("broken", bundle.tokenizer.encode("hello"), GREEDY))
        assert scheduler.view._inflight == {} and scheduler.waiting == 0
        assert [e.state for e in RequestJournal(conn).history("broken")][-1] == RequestState.FAILED
    finally:
        broken.close()


def test_a_broken_path_with_no_worker_lost_names_the_path(cluster):
    """A link between two live workers broke (a KV push's bulk connection cut): the request moves, and what it
    says names the attempt's workers, not '(unknown)' as a worker lost."""
    bundle, workers, registry, _, model, conn = cluster

    class BrokenLink(Dispatcher):
        def run(self, req, route, on_started=lambda: None):
            raise DispatchError("prefill", grpc.StatusCode.UNAVAILABLE, "bulk TCP connection to 127.0.0.1:1 failed")

    broken = BrokenLink(SECURITY)
    try:
        scheduler = Scheduler(model, WorkerView(registry, refresh_s=0.05), broken, get_policy("least_loaded"),
                              SchedulerSettings(migration_limit=0), RequestJournal(conn))
        with pytest.raises(BackendError) as err:
            _collect(scheduler, WorkerRequest("link", bundle.tokenizer.encode("hello"), GREEDY))
        assert err.value.status == 503
        assert re.search(r"Last: prefill failed on the path decode=\S+ prefill=\S+( encode=\S+)?: bulk TCP "
                         r"connection to 127.0.0.1:1 failed$", str(err.value)), str(err.value)
    finally:
        broken.close()


def test_a_prefill_that_answers_nothing_is_named_lost_not_the_decode_waiting_for_it(cluster):
    """A prefill worker alive (its keepalive answers) but serving nothing, here held at its door: the decode
    stream is silent past the first-token limit because it has no KV to start from. The prefill worker is the
    one named lost, so the request moves off it, where decode, healthy, was blamed and its breaker opened."""
    bundle, workers, *_ = cluster
    prefill = workers[0].service
    impatient = Dispatcher(SECURITY, first_token_timeout_s=2.0)
    route = Route(decode=workers[1].address, prefill=workers[0].address)
    req = WorkerRequest("wedged", bundle.tokenizer.encode("hello there"), GREEDY, timeout_s=60.0)
    try:
        with prefill._inflight_lock:  # the prefill worker takes no request meanwhile
            with pytest.raises(DispatchError) as err:
                list(impatient.run(req, route))
        assert (err.value.stage, err.value.lost) == ("prefill", (workers[0].address,)), err.value
        assert "answered nothing for 2 s while decode waited for its KV" in err.value.message
        deadline = time.monotonic() + 10
        while not _idle(workers):  # the aborts reached both: nothing held
            assert time.monotonic() < deadline, [w.service.engine.stats() for w in workers]
            time.sleep(0.05)
    finally:
        impatient.close()


def test_a_worker_at_its_call_cap_makes_requests_wait_not_fail(cluster):
    """More requests than a worker's call budget: the rest wait in the bounded queue (then 429), never
    a 502. (Past its HTTP/2 stream limit a worker refuses streams, which once surfaced as 502s.)"""
    bundle, workers, registry, _, model, conn = cluster
    capped = Dispatcher(SECURITY, max_calls_per_worker=2)
    try:
        scheduler = Scheduler(model, WorkerView(registry, refresh_s=0.05), capped, get_policy("least_loaded"),
                              SchedulerSettings(queue_timeout_s=60), RequestJournal(conn))
        one = SamplingParams(max_tokens=1, temperature=0.0)
        prompts = [bundle.tokenizer.encode(f"request {i} waits for a call slot") for i in range(10)]
        params = [one if i % 2 else GREEDY for i in range(10)]  # one-token (prefill only) and decoded
        refs = [r.token_ids for r in generate(bundle, [GenerateRequest(prompt_ids=p, params=q)
                                                          for p, q in zip(prompts, params)])]
        out, errors = _collect_all(scheduler, [WorkerRequest(f"capped-{i}", prompts[i], params[i])
                                               for i in range(10)])
        assert not errors, errors
        assert out == refs
        assert all((w.slots_taken, w.calls) == (0, 0) for w in capped.held())  # every slot given back

        # with no time to wait, the overflow is a 429, never a server error: four long requests take both
        # decode workers' two slots each; the fifth finds every decode worker at its cap
        impatient = Scheduler(model, WorkerView(registry, refresh_s=0.05), capped, get_policy("least_loaded"),
                              SchedulerSettings(queue_timeout_s=0.05), RequestJournal(conn))
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        holders = [impatient.generate(WorkerRequest(f"hold-{i}", prompts[i], long)) for i in range(4)]
        for h in holders:
            assert next(h).token_ids  # started: its decode slot is held until it ends
        with pytest.raises(Overloaded) as err:
            next(impatient.generate(WorkerRequest("over", prompts[4], long)))
        assert err.value.retry_after_s >= 1.0
        for h in holders:  # the held requests still finish
            assert sum(len(c.token_ids) for c in h) == 39
        assert all((w.slots_taken, w.calls) == (0, 0) for w in capped.held())
    finally:
        capped.close()


class _CountingRegistry(WorkerRegistry):
    """The real registry, counting (and slowing) its pool reads, so concurrent rereads would overlap."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0
        self.fail = False  # the read fails as a lost Redis connection would

    def live_workers(self, pool):
        self.reads += 1
        time.sleep(0.05)
        if self.fail:
            raise ConnectionError("redis went away")
        return super().live_workers(pool)


def test_a_stale_snapshot_is_reread_by_one_thread_while_the_others_route_on_it(state_conn):  # noqa: F811
    registry = _CountingRegistry(state_conn, ttl=30)
    ids = [f"pf-{i}" for i in range(4)]
    try:
        for i in range(3):
            registry.register(WorkerInfo(ids[i], Pool.PREFILL, f"127.0.0.1:{9000 + i}", load=WorkerLoad()))
        now = [0.0]
        view = WorkerView(registry, refresh_s=0.2, clock=lambda: now[0])
        assert sorted(c.worker_id for c in view.candidates("prefill")) == ids[:3] and registry.reads == 1
        registry.register(WorkerInfo(ids[3], Pool.PREFILL, "127.0.0.1:9003", load=WorkerLoad()))
        now[0] = 1.0  # stale
        got: list[list[str]] = []
        gate = threading.Barrier(16)

        def route() -> None:
            gate.wait()
            got.append(sorted(c.worker_id for c in view.candidates("prefill")))

        threads = [threading.Thread(target=route) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert registry.reads == 2  # one reread for sixteen callers
        assert len(got) == 16 and all(seen in (ids[:3], ids) for seen in got)
        assert sorted(c.worker_id for c in view.candidates("prefill")) == ids
    finally:
        for worker_id in ids:
            registry.deregister(worker_id, "prefill")


def test_a_failed_reread_raises_to_its_caller_and_the_next_one_tries_again(state_conn):  # noqa: F811
    registry = _CountingRegistry(state_conn, ttl=30)
    try:
        registry.register(WorkerInfo("pf-0", Pool.PREFILL, "127.0.0.1:9000", load=WorkerLoad()))
        now = [0.0]
        view = WorkerView(registry, refresh_s=0.2, clock=lambda: now[0])
        view.candidates("prefill")
        now[0] = 1.0
        registry.fail = True
        with pytest.raises(ConnectionError):
            view.candidates("prefill")
        registry.fail = False
        assert [c.worker_id for c in view.candidates("prefill")] == ["pf-0"]  # not stuck "rereading"
        assert registry.reads == 3
    finally:
        registry.deregister("pf-0", "prefill")


def _idle(workers: list) -> bool:  # noqa: ANN001
    stats = [w.service.engine.stats() for w in workers]
    return all(s.blocks_free == s.blocks_total and s.num_reservations == 0 for s in stats)


def test_a_request_cancelled_while_it_waits_for_decode_room_leaves_the_queue_at_once(cluster):
    """The ingress cancels a request whose client left before its first token: one waiting for decode room
    (queue_timeout_s is 60 s here) stops waiting, where it held its place in the queue and pushed live clients
    into 429s, and ends in ClientGone, journaled as aborted, with the queue empty again."""
    bundle = cluster[0]
    scheduler = _scheduler(cluster, queue_timeout_s=60)
    prompt = bundle.tokenizer.encode("a long prompt " * 60)[:200]
    held = [scheduler.generate(WorkerRequest(f"full-{i}", prompt, SamplingParams(
        max_tokens=80, temperature=0.0, ignore_eos=True))) for i in range(2)]
    assert all(next(s).token_ids for s in held)  # both decode replicas are now full
    # another prompt: one sharing the held ones' head would share their cached blocks on decode, and fit
    waiter = WorkerRequest("gone-waiting", bundle.tokenizer.encode("another prompt, as long " * 40)[:200], GREEDY)
    outcome: list[BaseException | list[int]] = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(scheduler, waiter)))
    thread.start()
    deadline = time.monotonic() + 30
    while scheduler.waiting != 1:
        assert time.monotonic() < deadline, "the request never waited for room"
        time.sleep(0.01)
    waiter.cancel.cancel()
    thread.join(30)
    assert isinstance(outcome[0], ClientGone) and "before the request was routed" in str(outcome[0]), outcome
    assert scheduler.waiting == 0
    events = RequestJournal(cluster[5]).history("gone-waiting")
    assert events[-1].state == RequestState.ABORTED, events
    for s in held:  # the requests that filled the room are served in full
        assert sum(len(c.token_ids) for c in s) == 79


def _outcome(scheduler: Scheduler, req: WorkerRequest) -> BaseException | list[int]:
    try:
        return _collect(scheduler, req)
    except BaseException as exc:  # noqa: BLE001  (the test asserts which)
        return exc


@pytest.mark.parametrize("max_tokens", [12, 1], ids=["decode", "prefill-only"])
def test_a_request_cancelled_once_the_workers_hold_it_is_aborted_there(cluster, max_tokens: int):
    """Cancelled at the moment the workers hold it (the decode reservation made; for a one-token request,
    the prefill call's slot taken): the call it waits in is cancelled, it ends in ClientGone without a token,
    and the workers free everything it held. A later request is served as usual."""
    bundle, workers, _, dispatcher, *_ = cluster
    route = Route(decode=workers[1].address, prefill=workers[0].address)
    req = WorkerRequest("gone-in-flight", bundle.tokenizer.encode("a long prompt " * 100)[:400],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    with pytest.raises(ClientGone):
        for chunk in dispatcher.run(req, route, on_started=req.cancel.cancel):
            pytest.fail(f"a chunk came after the cancel: {chunk}")
    deadline = time.monotonic() + 10
    while not _idle(workers):
        assert time.monotonic() < deadline, [w.service.engine.stats() for w in workers]
        time.sleep(0.05)
    assert len(_collect(_scheduler(cluster), WorkerRequest("after", bundle.tokenizer.encode("hello"), GREEDY))) == 12


def _runner(dispatcher: Dispatcher, req: WorkerRequest, route: Route,
            outcome: list[BaseException | list]) -> Callable[[], None]:
    """A function that runs ``req`` through ``dispatcher`` and appends its chunks, or what it raised, to
    ``outcome``."""
    def run() -> None:
        try:
            outcome.append(list(dispatcher.run(req, route)))
        except BaseException as exc:  # noqa: BLE001  (the test asserts which)
            outcome.append(exc)
    return run


@pytest.mark.parametrize("kind", ["decode", "prefill-only", "colocated"])
def test_a_cancel_from_another_thread_ends_the_worker_call_being_waited_in(cluster, kind: str):
    """As the ingress does when a client leaves: the cancel comes from another thread while the dispatcher is
    blocked in the worker call of the request's first chunk (the worker that computes it is held still, so
    the call cannot finish first). The call ends at once in ClientGone, and the workers free what it held."""
    bundle, workers, _, dispatcher, *_ = cluster
    extra = []
    if kind == "colocated":
        codecs = ("fp32",) * bundle.config.num_layers
        extra.append(start_worker("decode", bundle, SECURITY, codecs=codecs, config=SMALL_DECODE, colocated=True))
        route, held = Route(decode=extra[0].address), extra[0]
    else:
        route, held = Route(decode=workers[1].address, prefill=workers[0].address), workers[0]
    req = WorkerRequest(f"gone-{kind}", bundle.tokenizer.encode("a long prompt " * 60)[:200],
                        SamplingParams(max_tokens=1 if kind == "prefill-only" else 12, temperature=0.0,
                                       ignore_eos=True))
    loop = held.service.loop  # type: ignore[attr-defined]  # every engine-running service has one
    outcome: list[BaseException | list] = []
    run = _runner(dispatcher, req, route, outcome)
    try:
        with loop._cycle_lock:  # the engine admits and steps nothing meanwhile
            thread = threading.Thread(target=run)
            thread.start()
            deadline = time.monotonic() + 30
            while loop.active == 0:  # the call reached the worker, which holds it still
                assert time.monotonic() < deadline, "the request never reached the worker"
                time.sleep(0.005)
            req.cancel.cancel()
            thread.join(30)
            assert not thread.is_alive() and isinstance(outcome[0], ClientGone), outcome
        deadline = time.monotonic() + 10
        while not _idle([*workers, *extra]) or loop.active:
            assert time.monotonic() < deadline, [w.service.engine.stats() for w in [*workers, *extra]]
            time.sleep(0.05)
    finally:
        for w in extra:
            w.stop()


def _image_request(bundle, rid: str, max_tokens: int) -> WorkerRequest:  # noqa: ANN001
    n = bundle.vision.config.num_image_tokens
    head, tail = bundle.tokenizer.encode("Look:"), bundle.tokenizer.encode(" what colour is it?")
    return WorkerRequest(rid, head + [bundle.image_token_id] * n + tail,
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                         images=(png((200, 40, 40)),), image_positions=tuple(range(len(head), len(head) + n)),
                         timeout_s=120.0)


def _calls_on(dispatcher: Dispatcher, address: str) -> int:
    return sum(w.calls for w in dispatcher.held() if w.address == address)


def _running_on(encoder: EncodeWorkerStub) -> int:
    """The encode worker's Status ``running``, over its gRPC service."""
    return encoder.Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=10).running


def _held_encoder(bundle) -> tuple[RunningWorker, EncodeService, threading.Event, threading.Event]:  # noqa: ANN001
    """An encode worker whose real encoder waits, once a call reaches it, until ``release`` is set (at most
    30 s): (the worker, its service, ``entered`` set when a call reached the encoder, ``release``)."""
    encoder = start_worker("encode", bundle, SECURITY, codecs=("fp32",) * bundle.config.num_layers)
    service = encoder.service
    assert isinstance(service, EncodeService)
    entered, release = threading.Event(), threading.Event()
    embed = service.embed

    def held_embed(images: list[bytes]):  # noqa: ANN202
        entered.set()
        release.wait(30)
        return embed(images)
    service.embed = held_embed  # type: ignore[method-assign]  # holds the real encoder still, then runs it
    return encoder, service, entered, release


@pytest.mark.parametrize("max_tokens", [12, 1], ids=["decode", "prefill-only"])
@pytest.mark.parametrize("why", ["client-left", "prefill-refused"])
def test_an_encode_call_ends_with_its_request_not_at_its_deadline(cluster, why: str, max_tokens: int):
    """An image request's Encode call ends when the request does: its client left while the image was being
    encoded (the encoder held still meanwhile), or its prefill worker refused it (draining). The call's
    deadline is 120 s; without the cancel the encode worker kept retrying a push that no prefill worker would
    take until then, holding the call (the dispatcher's slot on it and a server thread). The worker reports
    the call in Status's ``running`` while it runs (a drain waits for it), and 0 once it ended; it pushed
    nothing."""
    bundle, workers, _, dispatcher, *_ = cluster
    encoder, service, entered, release = _held_encoder(bundle)
    channel = SECURITY.open_channel(encoder.address)
    status = EncodeWorkerStub(channel)
    route = Route(decode=workers[1].address, prefill=workers[0].address, encode=encoder.address)
    req = _image_request(bundle, f"encode-{why}-{max_tokens}", max_tokens)
    outcome: list[BaseException | list] = []
    run = _runner(dispatcher, req, route, outcome)
    try:
        if why == "prefill-refused":
            workers[0].service.identity.draining = True
            release.set()
            run()
            assert outcome and getattr(outcome[0], "stage", None) == "prefill", outcome
        else:
            thread = threading.Thread(target=run)
            thread.start()
            assert entered.wait(30), "the Encode call never reached the worker"
            assert _running_on(status) == 1  # a drain would wait for it
            req.cancel.cancel()
            thread.join(30)
            assert not thread.is_alive() and isinstance(outcome[0], ClientGone), outcome
            release.set()
        deadline = time.monotonic() + 10
        while _calls_on(dispatcher, encoder.address) or _running_on(status):
            assert time.monotonic() < deadline, (dispatcher.held(), _running_on(status))
            time.sleep(0.05)
        assert service.encoded == 0  # it pushed nothing
        while not _idle(workers):
            assert time.monotonic() < deadline, [w.service.engine.stats() for w in workers]
            time.sleep(0.05)
    finally:
        release.set()
        workers[0].service.identity.draining = False
        channel.close()
        encoder.stop()


@pytest.mark.parametrize("max_tokens", [12, 1], ids=["decode", "prefill-only"])
def test_a_cancel_before_the_prefill_worker_holds_an_image_request_still_ends_its_prefill(cluster, max_tokens: int):
    """The client leaves while the image is being encoded and before the prefill worker has taken the request
    (it is held at the door meanwhile): the Abort sent then finds nothing there, and the encode is cancelled,
    so the embeddings the prefill would wait for never come. The Prefill call is cancelled with the request, so
    the worker, once it takes the request, sees its caller gone and lets go at once, not at the deadline
    (120 s here)."""
    bundle, workers, _, dispatcher, *_ = cluster
    encoder, service, entered, release = _held_encoder(bundle)
    prefill = workers[0].service
    route = Route(decode=workers[1].address, prefill=workers[0].address, encode=encoder.address)
    req = _image_request(bundle, f"early-cancel-{max_tokens}", max_tokens)
    outcome: list[BaseException | list] = []
    thread = threading.Thread(target=_runner(dispatcher, req, route, outcome))
    try:
        with prefill._inflight_lock:  # the prefill worker takes no request meanwhile
            thread.start()
            assert entered.wait(30), "the Encode call never reached the worker"
            req.cancel.cancel()
            thread.join(30)
            assert not thread.is_alive() and isinstance(outcome[0], ClientGone), outcome
        release.set()
        deadline = time.monotonic() + 10
        while (prefill.embeddings.pending or _calls_on(dispatcher, workers[0].address)
               or _calls_on(dispatcher, encoder.address)):
            assert time.monotonic() < deadline, (prefill.embeddings.pending, dispatcher.held())
            time.sleep(0.05)
        while not _idle(workers):
            assert time.monotonic() < deadline, [w.service.engine.stats() for w in workers]
            time.sleep(0.05)
    finally:
        release.set()
        encoder.stop()
