"""A request leaves no reference cycle behind, served whole or cancelled at any point, on every KV transport.

What a cycle holds (a KV stream with its buffers, an exception whose traceback keeps the model's frames and
their activations, a reservation's state) stays allocated until Python's next full garbage collection,
which a busy worker runs rarely: its memory then grew with each request between them. So everything a
request creates must be freed by reference counting alone when it ends. The three workers, their gRPC
servers and the dispatcher run in this process, with the cyclic collector off while the requests run;
then a collection must find nothing of epd's.
"""

from __future__ import annotations

import collections
import gc
import secrets
import threading
import time
from collections.abc import Callable

import pytest
import torch

from controlplane.dispatch import Dispatcher, Route, WorkerRequest
from controlplane.pools.replica import worker_status
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.generate import GenerateRequest, build_prompt
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import run_request

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
OURS = ("controlplane", "workers", "kvtransfer", "epd")


def _ids(bundle, text: str) -> list[int]:
    greq = GenerateRequest(messages=[{"role": "user", "content": text}], params=SamplingParams())
    return build_prompt(bundle, greq)[0]


def _ours(obj: object) -> str | None:
    """What ``obj`` is, when it is epd's (an object of its modules, a frame of its code) or a tensor."""
    if isinstance(obj, torch.Tensor):
        return "torch.Tensor"
    if type(obj).__name__ == "frame":
        path = obj.f_code.co_filename  # type: ignore[attr-defined]
        return f"frame {obj.f_code.co_name}" if any(f"/{p}/" in path for p in OURS) else None  # type: ignore[attr-defined]
    module = type(obj).__module__ or ""
    return f"{module}.{type(obj).__qualname__}" if module.split(".")[0] in OURS else None


def _cycles_of(run: Callable[[], None]) -> collections.Counter[str]:
    """What of epd's a full collection finds after ``run()`` with the cyclic collector off (nothing, when every
    object it made was freed by reference counting)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage, to be looked at
    try:
        run()
        gc.collect()
        return collections.Counter(what for what in map(_ours, gc.garbage) if what is not None)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("transport", ["auto", "grpc", "tcp"])
def test_requests_served_whole_or_cancelled_leave_no_cycle(default_bundle, transport):
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = {pool: start_worker(pool, default_bundle, SECURITY, codecs=codecs, transport=transport,
                                  config=EngineConfig(kv_cache_bytes=64 * 2**20))
               for pool in ("prefill", "decode")}
    dispatcher = Dispatcher(SECURITY)
    route = Route(workers["decode"].address, workers["prefill"].address, None)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    cancels: list[str] = []

    def whole(i: int) -> None:
        run_request(dispatcher, route, WorkerRequest(f"whole-{i}", _ids(default_bundle, f"rivers {i} " * 20), greedy))

    def closed_after_first(i: int) -> None:  # the client leaves after its first token
        chunks = dispatcher.run(WorkerRequest(f"first-{i}", _ids(default_bundle, f"lakes {i} " * 20), long), route)
        next(chunks)
        chunks.close()

    def cancelled_in_prefill(i: int, delay_s: float) -> None:  # the client leaves during a long prefill
        req = WorkerRequest(f"prefill-{i}", _ids(default_bundle, f"mountains {i} " * 400), long)
        timer = threading.Timer(delay_s, req.cancel.cancel)
        timer.start()
        try:
            for _ in dispatcher.run(req, route):
                pass
        except Exception as exc:  # ClientGone, or a stage's failure the cancel caused
            cancels.append(type(exc).__name__)
        timer.join()

    try:
        whole(0)  # warm: channels, pooled connections and segments are made once, on purpose

        def requests() -> None:
            for i in range(1, 6):
                whole(i)
            for i in range(3):
                closed_after_first(i)
            for i, delay_s in enumerate((0.01, 0.05, 0.1, 0.2, 0.4)):
                cancelled_in_prefill(i, delay_s)
            for pool in ("prefill", "decode"):  # every request over: nothing held on either side
                s = worker_status(workers[pool])
                assert (s.running, s.waiting, s.reservations) == (0, 0, 0), (pool, s)

        found = _cycles_of(requests)
        assert cancels, "no request was cancelled: the test did not exercise the cancel paths"
        assert not found, f"reference cycles of epd's objects (freed only by a full collection): {found}"
    finally:
        dispatcher.close()
        for w in workers.values():
            w.stop()


@pytest.mark.parametrize("handshake", [False, True], ids=["before-handshake", "after-handshake"])
def test_a_push_its_sender_cancels_leaves_no_cycle(handshake):
    """The receiver's request iterator raises an RpcError when the sender cancels; grpc's server keeps it on
    the call's state, so its traceback (this push's frames, which hold the call's context) made a cycle. It
    showed only when a cancel hit a push at the right moment (the test above, on a busy machine)."""
    from kv_helpers import AUTH, TOKEN, Frames, OpenPush, Rig, tiny_model

    security = TransferSecurity(token=TOKEN)
    rig = Rig(tiny_model(), security, security)

    def cancelled_push() -> None:
        pending = rig.reserve()
        push = OpenPush(rig.channel, AUTH)
        if handshake:
            push.send(Frames(rig.layout, pending.rid).handshake())
        time.sleep(0.3)  # the handler waits for the next message (the handshake, or the first chunk)
        push.future.cancel()
        if handshake:
            assert not pending.outcome().ok  # the claimed reservation failed with the cancel
        else:
            time.sleep(0.3)
        rig.engine.release(pending.reservation)

    try:
        cancelled_push()  # warm: the channel and its threads are made once

        def pushes() -> None:
            for _ in range(3):
                cancelled_push()
            time.sleep(0.2)  # the handler threads have returned

        found = _cycles_of(pushes)
        assert not found, f"reference cycles of epd's objects (freed only by a full collection): {found}"
    finally:
        rig.close()
