"""The dispatcher forgets a worker that is gone for good, over real worker gRPC servers: after replace
cycles it holds channels for live workers only; a stream in flight on a forgotten worker ends normally
(not CANCELLED) and its channel is closed once it ends; forgetting an unknown address changes nothing."""

from __future__ import annotations

import secrets
from typing import Any

import grpc
import pytest

from controlplane.dispatch import Dispatcher, Route, WorkerRequest
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import run_request

pytestmark = [pytest.mark.integration]

TOKEN = secrets.token_urlsafe(24)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_bytes=32 * 2**20)
WORKERS = TransferSecurity(token=TOKEN)  # the workers' own (a prefill worker opens channels to decode)


class Recording(TransferSecurity):
    """The real credentials, remembering every channel the dispatcher opens (address, channel)."""

    def __init__(self) -> None:
        super().__init__(token=TOKEN)
        self.opened: list[tuple[str, grpc.Channel]] = []

    def open_channel(self, target: str, options: Any = ()) -> grpc.Channel:
        ch = super().open_channel(target, options)
        self.opened.append((target, ch))
        return ch


def closed(ch: grpc.Channel) -> bool:
    try:
        ch.unary_unary("/epd.test/Nothing")(b"", timeout=0.5)  # type: ignore[arg-type]  # raw bytes, no serializer
    except ValueError:  # grpc refuses any call on a closed channel
        return True
    except grpc.RpcError:  # the call went out (and failed: no such method)
        return False
    return False


def test_after_replace_cycles_only_live_workers_are_held(default_bundle):
    security = Recording()
    dispatcher = Dispatcher(security)
    worker = start_worker("decode", default_bundle, WORKERS, config=CONFIG, colocated=True)
    prompt = [5, 6, 7, 8]
    try:
        for cycle in range(4):  # each cycle: a request on the replica, then a fresh one replaces it
            req = WorkerRequest(f"c-{cycle}", prompt, GREEDY)
            tokens, _, last = run_request(dispatcher, Route(worker.address), req)
            assert len(tokens) == 12 and last.finished
            fresh = start_worker("decode", default_bundle, WORKERS, config=CONFIG, colocated=True)
            worker.stop()
            dispatcher.forget(worker.address)
            worker = fresh
        run_request(dispatcher, Route(worker.address), WorkerRequest("last", prompt, GREEDY))
        assert [w.address for w in dispatcher.held()] == [worker.address]
        assert [(w.calls, w.slots_taken, w.retired) for w in dispatcher.held()] == [(0, 0, False)]
        assert len(security.opened) == 5
        for address, ch in security.opened:  # the four replaced workers' channels closed, the live one open
            assert closed(ch) == (address != worker.address), address
    finally:
        dispatcher.close()
        worker.stop()


def test_a_stream_in_flight_on_a_forgotten_worker_ends_normally_then_its_channel_closes(default_bundle):
    security = Recording()
    dispatcher = Dispatcher(security)
    codecs = ("fp32",) * default_bundle.config.num_layers
    prefill = start_worker("prefill", default_bundle, WORKERS, codecs=codecs, config=CONFIG)
    decode = start_worker("decode", default_bundle, WORKERS, codecs=codecs, config=CONFIG)
    route = Route(decode.address, prefill.address)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [default_bundle.tokenizer.encode("the stream outlives the forget"),
               default_bundle.tokenizer.encode("a call that starts after it")]
    refs = [r.token_ids for r in generate(default_bundle, [GenerateRequest(prompt_ids=p, params=params)
                                                           for p in prompts])]
    try:
        stream = dispatcher.run(WorkerRequest("in-flight", prompts[0], params), route)
        first = next(stream)
        dispatcher.forget(decode.address)
        dispatcher.forget(prefill.address)
        held = {w.address: w for w in dispatcher.held()}
        assert held[decode.address].retired and held[decode.address].calls == 1  # kept for its stream
        # a call to the forgotten worker meanwhile still works, on the same channel
        again, _, _ = run_request(dispatcher, route, WorkerRequest("meanwhile", prompts[1], params))
        assert again == refs[1]
        tokens = list(first.token_ids) + [t for chunk in stream for t in chunk.token_ids]  # no CANCELLED
        assert tokens == refs[0]
        assert dispatcher.held() == ()
        # decode's one channel served both streams (prefill's call had ended: its channel may have closed
        # at the forget, then a fresh one served the second request and closed after it)
        assert [a for a, _ in security.opened].count(decode.address) == 1
        assert all(closed(ch) for _, ch in security.opened)
        opened = len(security.opened)
        # a later call opens a fresh channel, closed again when it ends (the address is known as gone)
        later, _, _ = run_request(dispatcher, route, WorkerRequest("later", prompts[1], params))
        assert later == refs[1] and dispatcher.held() == ()
        assert len(security.opened) == opened + 2 and all(closed(ch) for _, ch in security.opened)
        dispatcher.serving(decode.address)  # it serves again: its channel is kept from now on
        dispatcher.serving(prefill.address)
        run_request(dispatcher, route, WorkerRequest("kept", prompts[1], params))
        assert sorted(w.address for w in dispatcher.held()) == sorted([decode.address, prefill.address])
    finally:
        dispatcher.close()
        decode.stop()
        prefill.stop()


def test_forgetting_an_unknown_address_changes_nothing(default_bundle):
    security = Recording()
    dispatcher = Dispatcher(security)
    worker = start_worker("decode", default_bundle, WORKERS, config=CONFIG, colocated=True)
    try:
        run_request(dispatcher, Route(worker.address), WorkerRequest("known", [5, 6, 7], GREEDY))
        before = dispatcher.held()
        dispatcher.forget("127.0.0.1:1")  # never called
        dispatcher.forget("not even an address")
        assert dispatcher.held() == before and len(security.opened) == 1
        ((_, ch),) = security.opened
        assert not closed(ch)
        tokens, _, _ = run_request(dispatcher, Route(worker.address), WorkerRequest("still", [5, 6, 7], GREEDY))
        assert len(tokens) == 12 and len(security.opened) == 1  # the same channel
    finally:
        dispatcher.close()
        worker.stop()
