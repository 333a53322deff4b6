"""The pieces of request migration that are pure logic: the relay across a seam (tokens, text, stop
strings, usage, seeded draws) and the per-worker circuit breaker."""

from __future__ import annotations

import pytest

from controlplane.dispatch import DispatchError, WorkerRequest
from controlplane.scheduler.health import BreakerState, WorkerHealth
from controlplane.scheduler.relay import Progress, shifted_seed
from epd.worker.v1 import worker_pb2 as wpb
from workers.runtime.sampler import SamplingParams, draw_seed

pytestmark = [pytest.mark.unit]


def _chunk(tokens, text="", finished=False, reason="", completion=0):
    return wpb.TokenChunk(token_ids=tokens, text=text, finished=finished, finish_reason=reason,
                          completion_tokens=completion)


def test_a_shifted_seed_draws_what_the_original_draws_later():
    for seed in (0, 7, 2**62 + 5):
        for k in (1, 2, 17):
            assert draw_seed(shifted_seed(seed, k), 0) == draw_seed(seed, k)
            assert draw_seed(shifted_seed(seed, k), 3) == draw_seed(seed, k + 3)


def test_the_continuation_re_prefills_the_tokens_sent_and_asks_for_the_rest(default_bundle):
    tok = default_bundle.tokenizer
    req = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, stop=("zz",)))
    p = Progress(req, tok)
    assert p.continuation() is req  # nothing sent yet: the same request again
    ids = tok.encode(" hello world", add_special_tokens=False)
    p.accept(_chunk(ids, tok.decode(ids)))
    nxt = p.continuation()
    assert nxt.prompt_ids == [1, 2, 3] + ids and nxt.params.max_tokens == 10 - len(ids)
    assert nxt.params.stop == ()  # the relay applies them across the seam


def test_a_stop_string_that_spans_the_seam_ends_the_stream_there(default_bundle):
    tok = default_bundle.tokenizer
    first = tok.encode(" the cat sat", add_special_tokens=False)
    rest = tok.encode(" on the mat today", add_special_tokens=False)
    req = WorkerRequest("r", [1], SamplingParams(max_tokens=50, temperature=0.0, stop=("sat on",)))
    p = Progress(req, tok)
    # the worker held back " sat" (it may start the stop string) and sent the rest
    full = tok.decode(first)
    held = len(full) - len("sat on") + 1
    p.accept(_chunk(first, full[:held]))
    p.begin_attempt()  # the worker was lost; the next one sends the rest without stop strings
    out = p.accept(_chunk(rest, tok.decode(rest)))
    assert out is not None and out.finished and out.finish_reason == "stop"
    whole = tok.decode(first + rest)
    assert full[:held] + out.text == whole[:whole.index("sat on")]
    assert out.completion_tokens == len(p.token_ids) and out.prompt_tokens == 1


def test_across_a_seam_the_text_is_the_whole_output_decoded_once(default_bundle):
    tok = default_bundle.tokenizer
    ids = tok.encode(" serving systems split every request into stages", add_special_tokens=False)
    req = WorkerRequest("r", [1], SamplingParams(max_tokens=len(ids), temperature=0.0))
    p = Progress(req, tok)
    text = ""
    c = p.accept(_chunk(ids[:3], tok.decode(ids[:3])))
    assert c is not None
    text += c.text
    p.begin_attempt()
    c = p.accept(_chunk(ids[3:], "whatever the worker says", finished=True, reason="length"))
    assert c is not None and c.finished and c.finish_reason == "length"
    assert text + c.text == tok.decode(ids) and c.completion_tokens == len(ids)


def test_across_a_seam_a_stop_tokens_text_is_left_out_as_the_engine_leaves_it_out(default_bundle):
    """A stop token id (or EOS) ends the answer without its text; the relay fed it to its detokenizer, so
    the same request gave other text when it had moved."""
    tok = default_bundle.tokenizer
    ids = tok.encode(" Paris is the capital.", add_special_tokens=False)
    period = ids[-1]
    assert tok.decode([period]) == "."
    req = WorkerRequest("r", [1], SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=(period,)))
    p = Progress(req, tok)
    first = p.accept(_chunk(ids[:2], tok.decode(ids[:2])))
    assert first is not None
    p.begin_attempt()
    rest = p.accept(_chunk(ids[2:], "ignored after a seam", finished=True, reason="stop"))
    assert rest is not None and rest.finished and rest.finish_reason == "stop"
    assert first.text + rest.text == " Paris is the capital"
    assert rest.completion_tokens == len(ids)  # the stop token is still one of the output's tokens


def test_a_seeded_seam_moves_back_to_a_token_whose_shifted_seed_fits():
    seed = 2**63 - 1  # seed + k * GOLDEN overflows 2^63 for some k
    req = WorkerRequest("r", [1], SamplingParams(max_tokens=20, temperature=1.0, seed=seed))
    p = Progress(req, tokenizer=None)  # type: ignore[arg-type]  # text is never decoded here
    p.token_ids = list(range(5))
    seam = p.seam()
    assert seam.at + seam.replay == 5 and shifted_seed(seed, seam.at) < 2**63
    cont = p.continuation()
    assert cont.prompt_ids == [1] + list(range(seam.at)) and cont.params.max_tokens == 20 - seam.at


def _lp(token: int) -> wpb.TokenLogprobs:
    return wpb.TokenLogprobs(logprob=-token / 8, top_ids=[token], top_logprobs=[-token / 8])


def test_logprobs_stay_with_their_tokens_when_replayed_tokens_are_dropped_after_a_seam(default_bundle):
    seed = 2**63 - 1  # the seam moves back, so the next attempt replays tokens already sent
    req = WorkerRequest("r", [1], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, logprobs=1))
    p = Progress(req, default_bundle.tokenizer)
    sent = [40, 41, 42, 43, 44]
    first = p.accept(wpb.TokenChunk(token_ids=sent, logprobs=[_lp(t) for t in sent]))
    assert first is not None and [t.logprob for t in first.logprobs] == [-t / 8 for t in sent]
    seam = p.seam()
    assert seam.replay > 0
    p.begin_attempt()
    again = sent[seam.at:] + [45, 46]  # the new worker sends the replayed tokens, then new ones
    out = p.accept(wpb.TokenChunk(token_ids=again, logprobs=[_lp(t) for t in again]))
    assert out is not None and out.token_ids == (45, 46)
    assert [(t.logprob, t.top) for t in out.logprobs] == [(-45 / 8, ((45, -45 / 8),)), (-46 / 8, ((46, -46 / 8),))]


def test_prompt_logprobs_come_once_with_the_first_chunk_and_a_continuation_does_not_ask_again(default_bundle):
    req = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, prompt_logprobs=0))
    p = Progress(req, default_bundle.tokenizer)
    first = p.accept(wpb.TokenChunk(token_ids=[5], prompt_logprobs=[_lp(2), _lp(3)]))
    assert first is not None and first.prompt_logprobs is not None
    assert [t.logprob for t in first.prompt_logprobs] == [-2 / 8, -3 / 8]
    assert p.continuation().params.prompt_logprobs is None
    later = p.accept(wpb.TokenChunk(token_ids=[6]))
    assert later is not None and later.prompt_logprobs is None
    with pytest.raises(DispatchError, match="sent 1 prompt logprobs for a 3-token prompt"):
        Progress(req, default_bundle.tokenizer).accept(wpb.TokenChunk(token_ids=[5], prompt_logprobs=[_lp(2)]))
    aborted = Progress(req, default_bundle.tokenizer).accept(wpb.TokenChunk(finished=True, finish_reason="abort"))
    assert aborted is not None and aborted.finish_reason == "abort"  # no token: not taken for the first chunk


def test_a_chunk_whose_logprobs_do_not_match_its_tokens_is_a_worker_error(default_bundle):
    p = Progress(WorkerRequest("r", [1], SamplingParams(max_tokens=4, logprobs=0)), default_bundle.tokenizer)
    with pytest.raises(DispatchError, match="sent 1 logprobs for 2 tokens"):
        p.accept(wpb.TokenChunk(token_ids=[5, 6], logprobs=[_lp(5)]))
    with pytest.raises(DispatchError, match="sent 0 logprobs for 1 tokens"):  # a worker that knows no logprobs
        p.accept(wpb.TokenChunk(token_ids=[7]))


def test_the_breaker_opens_on_a_lost_worker_and_lets_one_probe_through_after_a_while():
    now = [0.0]
    h = WorkerHealth(failures=3, open_s=5.0, clock=lambda: now[0])
    h.failure("w", "call failed")
    h.failure("w", "call failed")
    assert h.routable("w")  # two failures: still closed
    h.failure("w", "call failed")
    assert not h.routable("w") and h.state("w") is BreakerState.OPEN
    now[0] = 6.0
    assert h.state("w") is BreakerState.HALF_OPEN and h.routable("w")
    h.begin("w")  # the probe
    assert not h.routable("w")  # one at a time
    h.failure("w", "still failing")
    assert h.state("w") is BreakerState.OPEN
    now[0] = 12.0
    h.begin("w")
    h.success("w")
    assert h.state("w") is BreakerState.CLOSED and h.suspects() == []
    h.failure("x", "stream broke", lost=True)
    assert [s.worker_id for s in h.suspects()] == ["x"]


def test_ready_forgets_a_suspect_the_registry_no_longer_lists():
    from controlplane.backend import ModelInfo
    from controlplane.scheduler.policies import get_policy
    from controlplane.scheduler.scheduler import Scheduler
    from controlplane.scheduler.worker_view import WorkerView
    from controlplane.settings import SchedulerSettings

    class Registry:
        def live_workers(self, pool: str) -> list:
            return []

    view = WorkerView(Registry(), clock=lambda: 0.0)  # type: ignore[arg-type]  # a stand-in registry
    scheduler = Scheduler(ModelInfo("m", None, 64, None, 0, ()), view, None, get_policy("least_loaded"),  # type: ignore[arg-type]  # no tokenizer or dispatcher: neither is used
                          SchedulerSettings())
    scheduler.health.failure("gone-1", "stream broke", lost=True)
    assert scheduler.health.suspects() and scheduler.degraded() is None  # replaced: not listed any more
    assert scheduler.health.suspects() == []
