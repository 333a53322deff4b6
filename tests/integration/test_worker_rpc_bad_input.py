"""Each worker RPC called directly, the way a buggy or hostile caller might: every bad field is refused
with INVALID_ARGUMENT (or ALREADY_EXISTS) naming it, nothing is held afterwards, and a request that
shares a worker, a batch or an id with a bad one is not harmed by it."""

from __future__ import annotations

import math
import secrets
import threading
import time

import grpc
import pytest

from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.engine import EngineConfig

from dispatch_helpers import png

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
MD = SECURITY.call_metadata()
GREEDY = wpb.SamplingParams(max_tokens=4, ignore_eos=True)
BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, 1e30, -1.0]


@pytest.fixture(scope="module")
def workers(default_bundle):
    codecs = ("fp32",) * default_bundle.config.num_layers
    started = {pool: start_worker(pool, default_bundle, SECURITY, codecs=codecs,
                                  config=EngineConfig(kv_cache_bytes=64 * 2**20))
               for pool in ("encode", "prefill", "decode")}
    started["colocated"] = start_worker("decode", default_bundle, SECURITY, colocated=True,
                                        config=EngineConfig(kv_cache_bytes=64 * 2**20))
    channels = {pool: SECURITY.open_channel(w.address) for pool, w in started.items()}
    stubs = {"encode": wgrpc.EncodeWorkerStub(channels["encode"]),
             "prefill": wgrpc.PrefillWorkerStub(channels["prefill"]),
             "decode": wgrpc.DecodeWorkerStub(channels["decode"]),
             "colocated": wgrpc.DecodeWorkerStub(channels["colocated"])}
    yield default_bundle, started, stubs
    for ch in channels.values():
        ch.close()
    for w in started.values():
        w.stop()


def _refused(call, *args, code=grpc.StatusCode.INVALID_ARGUMENT, timeout=10) -> str:
    with pytest.raises(grpc.RpcError) as err:
        reply = call(*args, metadata=MD, timeout=timeout)
        if not isinstance(reply, wpb.PrefillReply | wpb.ReserveReply | wpb.EncodeReply):
            list(reply)  # a streaming call fails on its first read
    assert err.value.code() == code, (err.value.code(), err.value.details())
    return err.value.details() or ""


def _assert_idle(workers_, default_bundle) -> None:
    """Nothing held on any worker: blocks free, no reservation, no expectation, no in-flight prefill."""
    _, started, stubs = workers_
    deadline = time.monotonic() + 5
    while True:
        statuses = [stubs[p].Status(wpb.StatusRequest(), metadata=MD, timeout=5) for p in ("prefill", "decode",
                                                                                           "colocated")]
        prefill = started["prefill"].service
        idle = (all(s.kv_blocks_free == s.kv_blocks_total and s.reservations == 0 and s.running == 0
                    and s.waiting == 0 for s in statuses)
                and prefill.embeddings.pending == 0 and not prefill._inflight
                and started["decode"].service.receiver.pending == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, (statuses, prefill.embeddings.pending, prefill._inflight)


def _good_complete(stubs, prompt: list[int]) -> list[int]:
    reply = stubs["prefill"].Prefill(wpb.PrefillRequest(request_id=f"good-{secrets.token_hex(4)}",
                                                        prompt_token_ids=prompt,
                                                        params=wpb.SamplingParams(max_tokens=1), complete=True),
                                     metadata=MD, timeout=10)
    return [reply.first_token]


@pytest.mark.parametrize("timeout_s", BAD_TIMEOUTS)
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_everywhere(workers, default_bundle, timeout_s):
    """A NaN deadline never passes: a reservation made with one was held for good."""
    _, _, stubs = workers
    ids = default_bundle.tokenizer.encode("hello there")
    for call, req in (
            (stubs["decode"].Reserve, wpb.ReserveRequest(request_id="t", prompt_token_ids=ids, params=GREEDY,
                                                         timeout_s=timeout_s)),
            (stubs["prefill"].Prefill, wpb.PrefillRequest(request_id="t", prompt_token_ids=ids, params=GREEDY,
                                                          kv_target="127.0.0.1:1", timeout_s=timeout_s)),
            (stubs["prefill"].Prefill, wpb.PrefillRequest(request_id="t", prompt_token_ids=ids, complete=True,
                                                          params=wpb.SamplingParams(max_tokens=1),
                                                          timeout_s=timeout_s)),
            (stubs["encode"].Encode, wpb.EncodeRequest(request_id="t", images=[png((1, 2, 3))],
                                                       embeddings_target="127.0.0.1:1", timeout_s=timeout_s)),
            (stubs["colocated"].Complete, wpb.CompleteRequest(request_id="t", prompt_token_ids=ids, params=GREEDY,
                                                              timeout_s=timeout_s))):
        assert "timeout_s must be seconds" in _refused(call, req)
    _assert_idle(workers, default_bundle)


@pytest.mark.parametrize("keepalive_s", [-1.0, math.nan, math.inf, 0.001, 1e9])
def test_a_keepalive_that_is_not_a_usable_interval_is_refused_and_nothing_is_held(workers, default_bundle,
                                                                                  keepalive_s):
    """Too short a keepalive would make a stream mostly keepalive chunks; a refused Generate leaves its
    reservation to the caller's Abort, as any refused Generate does."""
    _, _, stubs = workers
    ids = default_bundle.tokenizer.encode("hello there")
    assert "keepalive_s must be seconds" in _refused(
        stubs["colocated"].Complete, wpb.CompleteRequest(request_id="k", prompt_token_ids=ids, params=GREEDY,
                                                         keepalive_s=keepalive_s))
    stubs["decode"].Reserve(wpb.ReserveRequest(request_id="k", prompt_token_ids=ids, params=GREEDY), metadata=MD,
                            timeout=10)
    assert "keepalive_s must be seconds" in _refused(
        stubs["decode"].Generate, wpb.GenerateRequest(request_id="k", keepalive_s=keepalive_s))
    assert stubs["decode"].Abort(wpb.AbortRequest(request_id="k"), metadata=MD, timeout=10).found
    _assert_idle(workers, default_bundle)


@pytest.mark.parametrize("rid, fragment", [("", "request_id is required"), ("r" * 300, "at most 256")])
def test_an_empty_or_oversized_request_id_is_refused_everywhere(workers, default_bundle, rid, fragment):
    _, _, stubs = workers
    ids = default_bundle.tokenizer.encode("hello there")
    for call, req in (
            (stubs["decode"].Reserve, wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids, params=GREEDY)),
            (stubs["prefill"].Prefill, wpb.PrefillRequest(request_id=rid, prompt_token_ids=ids, complete=True,
                                                          params=wpb.SamplingParams(max_tokens=1))),
            (stubs["encode"].Encode, wpb.EncodeRequest(request_id=rid, images=[png((1, 2, 3))],
                                                       embeddings_target="127.0.0.1:1")),
            (stubs["colocated"].Complete, wpb.CompleteRequest(request_id=rid, prompt_token_ids=ids, params=GREEDY))):
        assert fragment in _refused(call, req)
    _assert_idle(workers, default_bundle)


def test_missing_targets_max_tokens_and_mismatched_image_counts_are_refused(workers, default_bundle):
    _, _, stubs = workers
    ids = default_bundle.tokenizer.encode("hello there")
    assert "max_tokens must be an integer >= 1, got 0" in _refused(stubs["decode"].Reserve, wpb.ReserveRequest(
        request_id="no-max", prompt_token_ids=ids, params=wpb.SamplingParams(ignore_eos=True)))
    assert "kv_target" in _refused(stubs["prefill"].Prefill, wpb.PrefillRequest(
        request_id="no-target", prompt_token_ids=ids, params=GREEDY))
    assert "embeddings_target" in _refused(stubs["encode"].Encode, wpb.EncodeRequest(
        request_id="no-target", images=[png((1, 2, 3))]))
    for rows, positions in ((100_000, [0]), (2, [0]), (0, [0, 1]), (len(ids) + 1, list(range(len(ids) + 1)))):
        assert "num_image_embeddings" in _refused(stubs["prefill"].Prefill, wpb.PrefillRequest(
            request_id="rows", prompt_token_ids=ids, params=GREEDY, kv_target="127.0.0.1:1",
            num_image_embeddings=rows, image_positions=positions))
    _assert_idle(workers, default_bundle)


def test_a_tiny_temperature_is_greedy_and_does_not_fail_the_batch(workers, default_bundle):
    """1e-38 overflowed the logits to inf and softmax to NaN, which failed every request in the step."""
    _, _, stubs = workers
    ids = default_bundle.tokenizer.encode("The cache moves between workers")
    greedy = _good_complete(stubs, ids)
    for temperature in (1e-38, 1e-45, 1e-6):
        reply = stubs["prefill"].Prefill(wpb.PrefillRequest(
            request_id=f"tiny-{temperature}", prompt_token_ids=ids, complete=True,
            params=wpb.SamplingParams(max_tokens=1, temperature=temperature)), metadata=MD, timeout=10)
        assert [reply.first_token] == greedy
    # a long greedy stream shares the colocated engine's batches with tiny-temperature requests
    long = stubs["colocated"].Complete(wpb.CompleteRequest(request_id="long", prompt_token_ids=ids,
                                                           params=wpb.SamplingParams(max_tokens=200, ignore_eos=True)),
                                       metadata=MD, timeout=60)
    first = next(long)
    tiny = list(stubs["colocated"].Complete(wpb.CompleteRequest(
        request_id="tiny", prompt_token_ids=ids, params=wpb.SamplingParams(max_tokens=20, temperature=1e-38)),
        metadata=MD, timeout=60))
    assert tiny[-1].finished and tiny[0].token_ids[0] == greedy[0]
    rest = list(long)
    assert rest[-1].finished and len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 200
    _assert_idle(workers, default_bundle)


def test_a_second_prefill_with_a_live_id_is_refused_and_the_first_finishes(workers, default_bundle):
    """The duplicate used to abort the original's engine request and KV stream on its way out."""
    _, started, stubs = workers
    prompt = [5 + i % 50 for i in range(1500)]
    stubs["decode"].Reserve(wpb.ReserveRequest(request_id="dup", prompt_token_ids=prompt, params=GREEDY,
                                               timeout_s=30), metadata=MD, timeout=10)
    results: dict[str, object] = {}

    def original() -> None:
        try:
            results["reply"] = stubs["prefill"].Prefill(wpb.PrefillRequest(
                request_id="dup", prompt_token_ids=prompt, params=GREEDY, kv_target=started["decode"].address,
                timeout_s=30), metadata=MD, timeout=60)
        except grpc.RpcError as exc:
            results["error"] = exc
    thread = threading.Thread(target=original)
    thread.start()
    deadline = time.monotonic() + 10
    while "dup" not in started["prefill"].service._inflight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "already being prefilled" in _refused(stubs["prefill"].Prefill, wpb.PrefillRequest(
        request_id="dup", prompt_token_ids=prompt, params=GREEDY, kv_target=started["decode"].address),
        code=grpc.StatusCode.ALREADY_EXISTS)
    thread.join(60)
    assert "error" not in results, results.get("error")
    tokens = [t for c in stubs["decode"].Generate(wpb.GenerateRequest(request_id="dup"), metadata=MD, timeout=30)
              for t in c.token_ids]
    assert len(tokens) == 4
    _assert_idle(workers, default_bundle)


def test_a_prefill_waiting_for_embeddings_is_let_go_when_its_caller_leaves(workers, default_bundle):
    """No encoder ever pushes; the caller gives up after 0.5 s; the worker lets the wait go then, not at
    its own 20 s timeout, and a second call with the same id meanwhile is ALREADY_EXISTS."""
    bundle, started, stubs = workers
    n = bundle.vision.config.num_image_tokens
    ids = [5] + [bundle.image_token_id] * n + [6]
    req = wpb.PrefillRequest(request_id="emb", prompt_token_ids=ids, params=GREEDY,
                             kv_target=started["decode"].address, num_image_embeddings=n,
                             image_positions=list(range(1, n + 1)), timeout_s=20)
    future = stubs["prefill"].Prefill.future(req, metadata=MD, timeout=0.5)
    time.sleep(0.2)
    assert "already being prefilled" in _refused(stubs["prefill"].Prefill, req, code=grpc.StatusCode.ALREADY_EXISTS)
    with pytest.raises(grpc.RpcError) as err:
        future.result()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    started_wait = time.monotonic()
    _assert_idle(workers, default_bundle)
    assert time.monotonic() - started_wait < 5


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_past_20_are_refused_by_every_worker_that_samples(workers, default_bundle, field):
    _, _, stubs = workers
    ids = default_bundle.tokenizer.encode("hello there")
    params, one = wpb.SamplingParams(max_tokens=4), wpb.SamplingParams(max_tokens=1)
    for p in (params, one):
        setattr(p, field, 21)
    for call, req in (
            (stubs["decode"].Reserve, wpb.ReserveRequest(request_id="lp", prompt_token_ids=ids, params=params)),
            (stubs["prefill"].Prefill, wpb.PrefillRequest(request_id="lp", prompt_token_ids=ids, complete=True,
                                                          params=one)),
            (stubs["colocated"].Complete, wpb.CompleteRequest(request_id="lp", prompt_token_ids=ids,
                                                              params=params))):
        assert f"{field} must be an integer in [0, 20], got 21" in _refused(call, req)
    _assert_idle(workers, default_bundle)
