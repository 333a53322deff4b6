"""The colocated worker (the aggregated baseline) on a real gRPC server, driven by the real Dispatcher.

Greedy outputs equal the single-process ``generate()`` for text and images, one at a time and
concurrently; bad input is refused with a status that names it; a client that goes away frees the
request's blocks; the disaggregated KV-push RPCs are refused.
"""

from __future__ import annotations

import secrets
import threading
import time

import grpc
import pytest

from controlplane.dispatch import Dispatcher, DispatchError, Route, WorkerRequest
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.generate import GenerateRequest, build_prompt, generate
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import png, run_request

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated(default_bundle):
    worker = start_worker("decode", default_bundle, SECURITY, config=EngineConfig(kv_cache_bytes=64 * 2**20),
                          colocated=True)
    dispatcher = Dispatcher(SECURITY)
    yield default_bundle, worker, dispatcher, Route(worker.address)
    dispatcher.close()
    worker.stop()


def _status(address: str) -> wpb.WorkerStatus:
    with SECURITY.open_channel(address) as ch:
        return wgrpc.DecodeWorkerStub(ch).Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)


def _assert_idle(address: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        s = _status(address)
        if (s.kv_blocks_free, s.running, s.waiting) == (s.kv_blocks_total, 0, 0):
            return
        assert time.monotonic() < deadline, f"colocated worker still busy: {s}"
        time.sleep(0.05)


def test_the_route_is_colocated_without_a_prefill_worker():
    assert Route("127.0.0.1:1").colocated and not Route("127.0.0.1:1", "127.0.0.1:2").colocated


def test_text_request_matches_the_reference(colocated):
    bundle, worker, dispatcher, route = colocated
    greq = GenerateRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], params=GREEDY)
    ids, _ = build_prompt(bundle, greq)
    ref = generate(bundle, [greq])[0]
    tokens, text, last = run_request(dispatcher, route, WorkerRequest("co-text-1", ids, GREEDY))
    assert tokens == ref.token_ids and text == ref.text
    assert last.finished and last.finish_reason == "length"
    assert (last.prompt_tokens, last.completion_tokens) == (len(ids), 16)
    _assert_idle(worker.address)


def test_image_request_matches_the_reference(colocated):
    bundle, worker, dispatcher, route = colocated
    images = (png((200, 30, 30)), png((30, 30, 200)))
    greq = GenerateRequest(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                   {"type": "text", "text": "Compare them."}]}],
                           images=images, params=GREEDY)
    ids, mm = build_prompt(bundle, greq)
    ref = generate(bundle, [greq])[0]
    tokens, _, _ = run_request(dispatcher, route, WorkerRequest("co-image-1", ids, GREEDY, images, mm.positions))
    assert tokens == ref.token_ids
    _assert_idle(worker.address)


def test_concurrent_requests_all_match(colocated):
    bundle, worker, dispatcher, route = colocated
    greqs = [GenerateRequest(prompt=f"Request number {i} asks about block {i * 7}.", params=GREEDY) for i in range(8)]
    refs = generate(bundle, greqs)
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        ids, _ = build_prompt(bundle, greqs[i])
        got[i] = run_request(dispatcher, route, WorkerRequest(f"co-many-{i}", ids, GREEDY))[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(8)] == [r.token_ids for r in refs]
    _assert_idle(worker.address)


@pytest.mark.parametrize("req, fragment", [
    (WorkerRequest("co-bad-1", [], GREEDY), "empty"),
    (WorkerRequest("co-bad-2", [10**7], GREEDY), "token ids"),
    (WorkerRequest("co-bad-3", [5, 6, 7], GREEDY, (b"not an image",), (1,)), "placeholder"),
    (WorkerRequest("co-bad-4", [5, 6, 7], SamplingParams(max_tokens=10**6)), "context"),
])
def test_bad_requests_are_refused_with_a_reason_and_hold_nothing(colocated, req, fragment):
    _, worker, dispatcher, route = colocated
    with pytest.raises(DispatchError) as info:
        run_request(dispatcher, route, req)
    assert info.value.stage == "complete"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert fragment in info.value.message
    _assert_idle(worker.address)


def test_an_undecodable_image_is_refused_by_name(colocated, default_bundle):
    _, worker, dispatcher, route = colocated
    n = default_bundle.vision.config.num_image_tokens
    ids = [5] + [default_bundle.image_token_id] * n + [6]
    req = WorkerRequest("co-bad-image", ids, GREEDY, (b"\x89PNG but not really",), tuple(range(1, n + 1)))
    with pytest.raises(DispatchError) as info:
        run_request(dispatcher, route, req)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "image 1 of 1: " in info.value.message
    _assert_idle(worker.address)


def test_a_client_that_goes_away_frees_the_blocks(colocated, default_bundle):
    _, worker, dispatcher, route = colocated
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = dispatcher.run(WorkerRequest("co-gone", list(range(5, 60)), long), route)
    first = next(stream)
    assert first.token_ids
    assert _status(worker.address).running == 1
    stream.close()  # cancels the call; the worker's callback aborts the request
    _assert_idle(worker.address)


def test_kv_push_rpcs_are_refused(colocated):
    _, worker, _, _ = colocated
    with SECURITY.open_channel(worker.address) as ch:
        stub = wgrpc.DecodeWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Reserve(wpb.ReserveRequest(request_id="r", prompt_token_ids=[1, 2]),
                         metadata=SECURITY.call_metadata(), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "colocated" in info.value.details()


def test_a_draining_worker_refuses_new_requests_until_it_resumes(default_bundle):
    worker = start_worker("decode", default_bundle, SECURITY, config=EngineConfig(kv_cache_bytes=16 * 2**20),
                          colocated=True)
    dispatcher = Dispatcher(SECURITY)
    try:
        with SECURITY.open_channel(worker.address) as ch:
            assert wgrpc.DecodeWorkerStub(ch).Drain(wpb.DrainRequest(), metadata=SECURITY.call_metadata(),
                                                    timeout=5).draining
        with pytest.raises(DispatchError) as info:
            run_request(dispatcher, Route(worker.address), WorkerRequest("co-drain", [5, 6, 7], GREEDY))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.message
        assert info.value.lost == ()  # the worker's own refusal: not a broken worker to move away from
        with SECURITY.open_channel(worker.address) as ch:  # resumed, it serves again
            stub = wgrpc.DecodeWorkerStub(ch)
            with pytest.raises(grpc.RpcError) as refused:  # the KV-transfer token guards Resume as every RPC
                stub.Resume(wpb.ResumeRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not stub.Resume(wpb.ResumeRequest(), metadata=SECURITY.call_metadata(), timeout=5).draining
        tokens, _, last = run_request(dispatcher, Route(worker.address), WorkerRequest("co-resumed", [5, 6, 7], GREEDY))
        assert tokens and last is not None and last.finished
    finally:
        dispatcher.close()
        worker.stop()


def test_a_consumer_slower_than_the_idle_limit_does_not_make_its_worker_look_hung(default_bundle):
    """The idle clock runs only while the dispatcher waits for the worker: a caller that holds each chunk
    longer than ``token_idle_timeout_s`` (its relay threads starved under a burst) reads what the channel
    buffered meanwhile. Counting its own pace made a healthy worker 'hung' and moved every stream away."""
    worker = start_worker("decode", default_bundle, SECURITY, config=EngineConfig(kv_cache_bytes=16 * 2**20),
                          colocated=True)
    dispatcher = Dispatcher(SECURITY, token_idle_timeout_s=0.3, first_token_timeout_s=10.0)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        tokens = []
        for chunk in dispatcher.run(WorkerRequest("slow-reader", [5, 6, 7], params), Route(worker.address)):
            tokens.extend(chunk.token_ids)
            time.sleep(0.8)  # longer than the idle limit, after every chunk
        assert len(tokens) == 4
        (reference,) = generate(default_bundle, [GenerateRequest(prompt_ids=[5, 6, 7], params=params)])
        assert tokens == reference.token_ids
    finally:
        dispatcher.close()
        worker.stop()
