"""Cache-aware routing (``prefix_affinity``) over real workers found through a real Redis registry: a prompt
sharing a prefix with an earlier one goes to the prefill and decode workers that got it, against the load
numbers least_loaded goes by, and their prefix caches serve it with the reference's tokens."""

from __future__ import annotations

import secrets

import pytest

from controlplane.backend import ModelInfo
from controlplane.dispatch import Dispatcher, WorkerRequest
from controlplane.scheduler.policies import get_policy
from controlplane.scheduler.scheduler import Scheduler, WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import RequestJournal
from controlplane.state.keys import Pool
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = ("You route requests for a shipping company. Answer in one short sentence, name the port and the "
          "ship, and never guess a date you were not given. ") * 3
STUBS: dict[str, type[wgrpc.PrefillWorkerStub] | type[wgrpc.DecodeWorkerStub]] = {
    "prefill": wgrpc.PrefillWorkerStub, "decode": wgrpc.DecodeWorkerStub}


@pytest.fixture
def cluster(default_bundle, state_conn):  # noqa: F811
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = {f"{pool}-{i}": start_worker(pool, default_bundle, SECURITY, codecs=codecs)
               for pool in ("prefill", "decode") for i in range(2)}
    registry = WorkerRegistry(state_conn, ttl=30)
    dispatcher = Dispatcher(SECURITY)
    yield default_bundle, workers, registry, dispatcher, state_conn
    dispatcher.close()
    for w in workers.values():
        registry.deregister(w.identity.worker_id, w.pool)
        w.stop()
    for key in state_conn.redis.scan_iter(match=state_conn.keys.pattern):
        state_conn.redis.delete(key)


def _report(registry: WorkerRegistry, workers: dict, loads: dict[str, WorkerLoad]) -> None:
    """Each worker's heartbeat, with the load numbers the test wants routing to see."""
    for name, load in loads.items():
        w = workers[name]
        registry.register(WorkerInfo(w.identity.worker_id, Pool(w.pool), w.address, load=load))


def _status(worker) -> wpb.WorkerStatus:  # noqa: ANN001
    with SECURITY.open_channel(worker.address) as ch:
        return STUBS[worker.pool](ch).Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_loaded"])
def test_a_shared_prefix_follows_its_workers_against_their_load(cluster, policy):
    bundle, workers, registry, dispatcher, conn = cluster
    block = workers["prefill-0"].service.engine.cache.block_size
    view = WorkerView(registry, refresh_s=0.0)
    model = ModelInfo("demo", bundle.tokenizer, 8192, None, 64, bundle.eos_token_ids)
    scheduler = Scheduler(model, view, dispatcher, get_policy(policy), SchedulerSettings(), RequestJournal(conn))
    system = bundle.tokenizer.encode(SYSTEM)
    prompts = [system + bundle.tokenizer.encode(f" Question {i}: where is the Aurora?") for i in range(2)]
    refs = [r.token_ids for r in generate(bundle, [GenerateRequest(prompt_ids=p, params=GREEDY) for p in prompts])]
    free = lambda n: WorkerLoad(free_kv_blocks=n, total_kv_blocks=1000)  # noqa: E731
    # "-1" of each pool is the least loaded, so the first request goes there
    _report(registry, workers, {"prefill-0": WorkerLoad(queued_tokens=300), "prefill-1": WorkerLoad(),
                                "decode-0": free(900), "decode-1": free(1000)})
    before = {name: _status(w) for name, w in workers.items()}
    first = [t for chunk in scheduler.generate(WorkerRequest("aff-0", prompts[0], GREEDY)) for t in chunk.token_ids]
    # now "-1" of each pool is the busier one, well within the balance thresholds
    _report(registry, workers, {"prefill-0": WorkerLoad(), "prefill-1": WorkerLoad(queued_tokens=300),
                                "decode-0": free(1000), "decode-1": free(900)})
    second = [t for chunk in scheduler.generate(WorkerRequest("aff-1", prompts[1], GREEDY)) for t in chunk.token_ids]
    assert [first, second] == refs
    journal = RequestJournal(conn)
    routes = [journal.history(f"aff-{i}")[1].detail for i in range(2)]
    ids = {name: w.identity.worker_id for name, w in workers.items()}
    assert all(f"decode={ids['decode-1']}" in r and f"prefill={ids['prefill-1']}" in r for r in routes[:1]), routes
    gained = {name: _status(w).prefix_cache_hits - before[name].prefix_cache_hits for name, w in workers.items()}
    shared = len(system) // block * block
    if policy == "prefix_affinity":
        # the second followed the first: both of its workers found the system prompt's blocks cached
        assert f"decode={ids['decode-1']}" in routes[1] and f"prefill={ids['prefill-1']}" in routes[1], routes
        assert gained["prefill-1"] >= shared - block and gained["decode-1"] >= shared - block, gained
    else:
        # least_loaded went by the load numbers: workers whose caches were empty computed and took it all
        assert f"decode={ids['decode-0']}" in routes[1] and f"prefill={ids['prefill-0']}" in routes[1], routes
        assert gained == dict.fromkeys(workers, 0), gained
