"""The three worker services on real gRPC servers, driven the way the control plane drives them.

Greedy outputs through encode -> prefill -> decode (KV and embeddings over the wire) equal the
single-process ``generate()``; failures surface with their stage and status and leave no blocks held.
"""

from __future__ import annotations

import secrets
import threading

import grpc
import pytest

from controlplane.dispatch import Dispatcher, DispatchError, Route, WorkerRequest
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.generate import GenerateRequest, build_prompt, generate
from workers.runtime.sampler import SamplingParams, TokenLogprobs
from workers.service_base import logprobs_from_proto

from dispatch_helpers import on_threads, png, run_request

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(default_bundle):
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = {pool: start_worker(pool, default_bundle, SECURITY, codecs=codecs,
                                  config=EngineConfig(kv_cache_bytes=64 * 2**20))
               for pool in ("encode", "prefill", "decode")}
    dispatcher = Dispatcher(SECURITY)
    yield default_bundle, workers, dispatcher, Route(workers["decode"].address, workers["prefill"].address,
                                                     workers["encode"].address)
    dispatcher.close()
    for w in workers.values():
        w.stop()


def _status(address: str, stub_cls) -> wpb.WorkerStatus:
    with SECURITY.open_channel(address) as ch:
        return stub_cls(ch).Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)


def _assert_clean(workers) -> None:
    for pool, stub in (("decode", wgrpc.DecodeWorkerStub), ("prefill", wgrpc.PrefillWorkerStub)):
        s = _status(workers[pool].address, stub)
        assert (s.kv_blocks_free, s.reservations, s.running, s.waiting) == (s.kv_blocks_total, 0, 0, 0), (pool, s)


def test_text_request_matches_the_reference(stack):
    bundle, workers, dispatcher, route = stack
    greq = GenerateRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], params=GREEDY)
    ids, _ = build_prompt(bundle, greq)
    ref = generate(bundle, [greq])[0]
    tokens, text, last = run_request(dispatcher, route, WorkerRequest("text-1", ids, GREEDY))
    assert tokens == ref.token_ids and text == ref.text
    assert last.finished and last.finish_reason == "length" and last.completion_tokens == 16
    assert last.prompt_tokens == len(ids)
    # same host, so the KV went through shared memory, its control on the decode worker's bulk connection
    assert workers["prefill"].service.sender.transport == "auto"
    assert workers["decode"].service.receiver.bulk.connections == 1
    _assert_clean(workers)


def test_a_prefill_worker_on_the_tcp_transport_matches_the_reference(stack):
    """The decode worker listens for bulk TCP connections; a prefill worker set to ``tcp`` pushes over one."""
    bundle, workers, dispatcher, route = stack
    codecs = ("fp32",) * bundle.config.num_layers
    prefill = start_worker("prefill", bundle, SECURITY, codecs=codecs, transport="tcp",
                           config=EngineConfig(kv_cache_bytes=64 * 2**20))
    try:
        greq = GenerateRequest(messages=[{"role": "user", "content": "Name three rivers."}], params=GREEDY)
        ids, _ = build_prompt(bundle, greq)
        ref = generate(bundle, [greq])[0]
        tcp_route = Route(route.decode, prefill.address, route.encode)
        decode_receiver = workers["decode"].service.receiver
        assert decode_receiver.bulk is not None
        before = decode_receiver.bulk.connections  # the stack's own prefill worker's (shm control rides one)
        for i in range(2):  # the second reuses the first's connection
            tokens, text, _ = run_request(dispatcher, tcp_route, WorkerRequest(f"tcp-{i}", ids, GREEDY))
            assert tokens == ref.token_ids and text == ref.text
        assert decode_receiver.bulk.connections == before + 1
    finally:
        prefill.stop()
    _assert_clean(workers)


@pytest.mark.parametrize("max_tokens", [12, 1])
def test_logprobs_through_the_workers_equal_the_references(stack, max_tokens):
    """Sampled at temperature 0.8 with logprobs=4 and prompt_logprobs=2: the first token's figures come from the
    prefill worker (over the KV transfer's finish to decode, or in the Prefill reply of a one-token request),
    the rest from decode, and the prompt's from the Prefill reply onto the first chunk; all of them equal
    ``generate()``'s exactly (a lossless cache: the same logits)."""
    bundle, workers, dispatcher, route = stack
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=11, ignore_eos=True, logprobs=4,
                            prompt_logprobs=2)
    greq = GenerateRequest(messages=[{"role": "user", "content": "Count to five."}], params=params)
    ids, _ = build_prompt(bundle, greq)
    ref = generate(bundle, [greq])[0]
    assert len(ref.logprobs) == max_tokens and all(len(t.top) == 4 for t in ref.logprobs)
    assert len(ref.prompt_logprobs) == len(ids) - 1 and all(len(t.top) == 2 for t in ref.prompt_logprobs)
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] = []
    prompt: list[list[TokenLogprobs]] = []
    for chunk in dispatcher.run(WorkerRequest(f"logprobs-{max_tokens}", ids, params), route):
        assert len(chunk.logprobs) == len(chunk.token_ids)
        tokens.extend(chunk.token_ids)
        logprobs.extend(logprobs_from_proto(m) for m in chunk.logprobs)
        prompt.append([logprobs_from_proto(m) for m in chunk.prompt_logprobs])
    assert tokens == ref.token_ids
    assert logprobs == ref.logprobs
    assert prompt[0] == ref.prompt_logprobs and not any(prompt[1:])  # the prompt's, once, from the prefill worker
    _assert_clean(workers)


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_prefill_worker_that_fails_after_its_kv_landed_is_named_alone(stack, fault):
    """Prompt logprobs come in the Prefill reply, which the dispatcher waits for at decode's first token. A
    prefill worker that dies (its call breaks) or goes silent after its KV landed is the one named lost; the
    decode worker, which served, is not."""
    bundle, workers, _, route = stack
    codecs = ("fp32",) * bundle.config.num_layers
    prefill = start_worker("prefill", bundle, SECURITY, codecs=codecs, config=EngineConfig(kv_cache_bytes=64 * 2**20))
    release = threading.Event()
    streamer = prefill.service.streamer  # type: ignore[attr-defined]  # a prefill worker's service has one
    real_finish = streamer.finish

    def finish_then_fail(*args, **kwargs):
        result = real_finish(*args, **kwargs)  # the KV landed: decode goes on with its first token
        if fault == "dies":
            prefill.server.stop(0)  # every call on it breaks, this one too
        release.wait(30)
        return result

    streamer.finish = finish_then_fail
    dispatcher = Dispatcher(SECURITY, first_token_timeout_s=1.0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    ours = Route(route.decode, prefill.address, route.encode)
    try:
        with pytest.raises(DispatchError) as caught:
            for _ in dispatcher.run(WorkerRequest(f"prefill-{fault}", bundle.tokenizer.encode("hi there"), params),
                                    ours):
                pass
    finally:
        release.set()
        dispatcher.close()
        prefill.stop()
    assert caught.value.stage == "prefill", caught.value
    assert caught.value.lost == (prefill.address,), caught.value  # not the decode worker
    _assert_clean(workers)


def test_image_request_matches_the_reference(stack):
    bundle, workers, dispatcher, route = stack
    images = (png((200, 30, 30)), png((30, 30, 200)))
    greq = GenerateRequest(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                   {"type": "text", "text": "Compare them."}]}],
                           images=images, params=GREEDY)
    ids, mm = build_prompt(bundle, greq)
    ref = generate(bundle, [greq])[0]
    tokens, _, _ = run_request(dispatcher, route, WorkerRequest("image-1", ids, GREEDY, images, mm.positions))
    assert tokens == ref.token_ids
    # the same images again come from the encoder's cache
    tokens, _, _ = run_request(dispatcher, route, WorkerRequest("image-2", ids, GREEDY, images, mm.positions))
    assert tokens == ref.token_ids
    _assert_clean(workers)


def test_concurrent_requests_all_match(stack):
    bundle, workers, dispatcher, route = stack
    prompts = [bundle.tokenizer.encode(f"Request number {i}: " + "the cache moves " * (i % 5 + 1)) for i in range(12)]
    refs = [r.token_ids for r in generate(bundle, [GenerateRequest(prompt_ids=p, params=GREEDY) for p in prompts])]
    results, errors = on_threads(
        lambda i: run_request(dispatcher, route, WorkerRequest(f"conc-{i}", prompts[i], GREEDY))[0], len(prompts))
    assert not errors, errors
    assert results == refs
    _assert_clean(workers)


def _one_token(bundle, dispatcher, route, i, greq, params):
    ids, mm = build_prompt(bundle, greq)
    return run_request(dispatcher, route,
                       WorkerRequest(f"one-{i}", ids, params, greq.images, mm.positions if mm else ()))


def test_one_token_requests_finish_on_prefill_without_touching_decode(stack):
    bundle, workers, dispatcher, route = stack
    one = SamplingParams(max_tokens=1, temperature=0.0)
    images = (png((20, 160, 90)),)
    cases = [GenerateRequest(prompt="The first token only", params=one),
             GenerateRequest(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                    "text": "Colour?"}]}],
                             images=images, params=one)]
    engine = workers["decode"].service.engine
    reserves: list[str] = []
    real_reserve = engine.reserve

    def counted_reserve(rid: str, *args: object) -> object:  # counts, then reserves
        reserves.append(rid)
        return real_reserve(rid, *args)

    engine.reserve = counted_reserve
    try:
        outcomes = [_one_token(bundle, dispatcher, route, i, greq, one) for i, greq in enumerate(cases)]
        assert reserves == []  # the decode worker held nothing for them
        run_request(dispatcher, route, WorkerRequest("two-tokens", [5, 6, 7], SamplingParams(max_tokens=2)))
        assert reserves == ["two-tokens"]  # two tokens do go through decode
    finally:
        del engine.reserve
    for (tokens, text, last), ref in zip(outcomes, generate(bundle, cases)):
        assert tokens == ref.token_ids and text == ref.text
        assert last.finished and last.finish_reason == ref.finish_reason.value and last.completion_tokens == 1
    with SECURITY.open_channel(route.prefill) as ch:  # complete=true is only for one token
        with pytest.raises(grpc.RpcError) as rpc:
            wgrpc.PrefillWorkerStub(ch).Prefill(wpb.PrefillRequest(request_id="two", prompt_token_ids=[5, 6],
                                                                   params=wpb.SamplingParams(max_tokens=2),
                                                                   complete=True, timeout_s=5),
                                                metadata=SECURITY.call_metadata(), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one-token" in rpc.value.details()
    _assert_clean(workers)


def test_failures_name_their_stage_and_release_everything(stack):
    bundle, workers, dispatcher, route = stack
    ids = bundle.tokenizer.encode("Hello")
    with pytest.raises(DispatchError) as err:  # an undecodable image after a good one: named by its place
        list(dispatcher.run(WorkerRequest("bad-image", ids + [bundle.image_token_id] * 128, GREEDY,
                                          (png((1, 2, 3)), b"not an image"), tuple(range(len(ids), len(ids) + 128))),
                            route))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("image 2 of 2: image data (12 bytes"), err.value.message
    with pytest.raises(DispatchError) as err:  # a prompt longer than the context
        list(dispatcher.run(WorkerRequest("too-long", [5] * 9000, GREEDY), route))
    assert err.value.stage == "reserve" and err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "context" in err.value.message
    with SECURITY.open_channel(route.prefill) as ch:  # KV pushed to a decode worker that reserved nothing
        with pytest.raises(grpc.RpcError) as rpc:
            wgrpc.PrefillWorkerStub(ch).Prefill(wpb.PrefillRequest(request_id="orphan", prompt_token_ids=ids,
                                                                   params=wpb.SamplingParams(max_tokens=4),
                                                                   kv_target=route.decode, timeout_s=5),
                                                metadata=SECURITY.call_metadata(), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and "no reservation" in rpc.value.details()
    with SECURITY.open_channel(route.decode) as ch:  # no credential
        with pytest.raises(grpc.RpcError) as rpc:
            wgrpc.DecodeWorkerStub(ch).Status(wpb.StatusRequest(), timeout=5)
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_clean(workers)
    tokens, _, _ = run_request(dispatcher, route, WorkerRequest("after", ids, GREEDY))  # still serving
    assert len(tokens) == 16


def test_a_full_decode_pool_refuses_at_reserve(default_bundle):
    codecs = ("fp32",) * default_bundle.config.num_layers
    decode = start_worker("decode", default_bundle, SECURITY, codecs=codecs,
                          config=EngineConfig(kv_cache_bytes=16 * 2**20))
    try:
        with SECURITY.open_channel(decode.address) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            held = stub.Reserve(wpb.ReserveRequest(request_id="a", prompt_token_ids=[5] * 2000,
                                                   params=wpb.SamplingParams(max_tokens=8), timeout_s=30),
                                metadata=SECURITY.call_metadata(), timeout=5)
            assert held.num_blocks == 125
            with pytest.raises(grpc.RpcError) as rpc:
                stub.Reserve(wpb.ReserveRequest(request_id="b", prompt_token_ids=[5] * 2000,
                                                params=wpb.SamplingParams(max_tokens=8), timeout_s=30),
                             metadata=SECURITY.call_metadata(), timeout=5)
            assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert stub.Abort(wpb.AbortRequest(request_id="a"), metadata=SECURITY.call_metadata(), timeout=5).found
            s = stub.Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)
            assert s.kv_blocks_free == s.kv_blocks_total and s.reservations == 0
    finally:
        decode.stop()


def test_a_reservation_whose_kv_landed_with_nobody_to_generate_is_released(default_bundle):
    """The caller reserved, prefill pushed the KV, and then the caller was gone (its Generate never came and
    its Abort was lost, as under a burst that broke its calls). The blocks go back once the KV has waited
    ``unclaimed_grace_s`` for a Generate, not at twice the request's timeout (20 minutes by default)."""
    import time

    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = {pool: start_worker(pool, default_bundle, SECURITY, codecs=codecs,
                                  config=EngineConfig(kv_cache_bytes=16 * 2**20)) for pool in ("prefill", "decode")}
    from workers.decode.service import DecodeService
    service = workers["decode"].service
    assert isinstance(service, DecodeService)
    service.unclaimed_grace_s = 0.5
    ids = default_bundle.tokenizer.encode("Hello there")
    try:
        with SECURITY.open_channel(workers["decode"].address) as dch, \
                SECURITY.open_channel(workers["prefill"].address) as pch:
            decode = wgrpc.DecodeWorkerStub(dch)
            held = decode.Reserve(wpb.ReserveRequest(request_id="orphan", prompt_token_ids=ids,
                                                     params=wpb.SamplingParams(max_tokens=8), timeout_s=600),
                                  metadata=SECURITY.call_metadata(), timeout=5)
            wgrpc.PrefillWorkerStub(pch).Prefill(wpb.PrefillRequest(
                request_id="orphan", prompt_token_ids=ids, params=wpb.SamplingParams(max_tokens=8),
                kv_target=held.kv_target, timeout_s=600), metadata=SECURITY.call_metadata(), timeout=30)
            s = decode.Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)
            assert s.reservations == 1 and s.kv_blocks_free < s.kv_blocks_total  # landed, held for a Generate
            deadline = time.monotonic() + 10
            while (s.reservations, s.kv_blocks_free) != (0, s.kv_blocks_total):
                assert time.monotonic() < deadline, f"the orphaned reservation is still held: {s}"
                time.sleep(0.1)
                s = decode.Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)
            with pytest.raises(grpc.RpcError) as late:  # a Generate after the grace finds nothing
                list(decode.Generate(wpb.GenerateRequest(request_id="orphan"), metadata=SECURITY.call_metadata(),
                                     timeout=5))
            assert late.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for w in workers.values():
            w.stop()
