"""Request handling in the engine: refusal before allocation, queueing on a full pool, abort, stop rules,
and the per-layer KV-ready hook."""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from workers.runtime.engine import Engine, EngineConfig, LayerKVReady
from workers.runtime.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError, RequestTooLargeError
from workers.runtime.kv_cache import KVCacheSpec
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import FinishReason, MultimodalInput

from engine_helpers import assert_no_leaks, run_to_completion, token_ids

pytestmark = [pytest.mark.unit]


def _engine(tiny_bundle, blocks: int | None = None, **kw) -> Engine:
    cfg = tiny_bundle.config
    block_size = kw.pop("block_size", 16)
    budget = 1 << 22
    if blocks is not None:
        budget = blocks * KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size).bytes_per_block(
            ("float32",) * cfg.num_layers)
    return Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=budget, block_size=block_size, **kw))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_stats_answer_while_a_step_waits_in_a_layer_hook(tiny_bundle):
    """A worker's status (its heartbeat) reads the engine's stats: a step held up in a prefill layer hook
    (a transfer waiting for budget) must not hold it up too."""
    engine = _engine(tiny_bundle)
    inside, release = threading.Event(), threading.Event()

    def hook(event: LayerKVReady) -> None:
        inside.set()
        release.wait(10)
    engine.add_layer_hook(hook)
    engine.add_request("r", [5] * 20, _greedy(1))
    stepping = threading.Thread(target=engine.step)
    stepping.start()
    try:
        assert inside.wait(30)
        with ThreadPoolExecutor(1) as pool:
            stats = pool.submit(engine.stats).result(timeout=5)
        assert stats.num_running == 1 and stats.num_waiting == 0
    finally:
        release.set()
        stepping.join(30)
    engine.remove_layer_hook(hook)
    assert token_ids(run_to_completion(engine)) == {} and engine.stats().num_running == 0


def test_prompt_longer_than_context_is_refused_before_allocation(tiny_bundle):
    engine = _engine(tiny_bundle, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="context is 64 tokens; the request needs 80"):
        engine.add_request("long", [5] * 70, _greedy(10))
    assert engine.stats().blocks_free == engine.stats().blocks_total
    assert engine.stats().num_waiting == 0
    engine.add_request("ok", [5] * 20, _greedy(4))  # the engine is still usable
    assert len(run_to_completion(engine)["ok"]) == 4
    assert_no_leaks(engine)


def test_request_bigger_than_the_pool_is_refused(tiny_bundle):
    engine = _engine(tiny_bundle, blocks=4)  # 64 tokens
    with pytest.raises(RequestTooLargeError, match=r"needs KV cache for 70 tokens \(60 prompt \+ 10 max_tokens\), "
                                                    r"more than a worker.s KV pool holds \(64 tokens"):
        engine.add_request("big", [5] * 60, _greedy(10))
    assert_no_leaks(engine)


def test_a_request_without_max_tokens_runs_as_far_as_a_small_pool_holds(tiny_bundle):
    """A chat without max_tokens asks for the rest of the model's context. A pool smaller than that context
    refused every such request; it now runs to what the pool holds and finishes "length" there, as it
    would at the context's end. A max_tokens the client set is still refused when the pool cannot hold it."""
    engine = _engine(tiny_bundle, blocks=4)  # 64 tokens, less than the model's context
    assert engine.max_model_len > 64
    ceiling = dataclasses.replace(_greedy(engine.max_model_len - 10), to_context=True)
    engine.add_request("chat", [5] * 10, ceiling)
    (outs,) = run_to_completion(engine).values()
    assert outs[-1].finish_reason == FinishReason.LENGTH and sum(len(o.new_token_ids) for o in outs) == 64 - 10
    assert_no_leaks(engine)
    with pytest.raises(RequestTooLargeError):
        engine.add_request("explicit", [5] * 10, _greedy(engine.max_model_len - 10))
    small = dataclasses.replace(_greedy(3), to_context=True)
    assert engine.fit(10, small) is small  # a ceiling that fits is left as it is
    with pytest.raises(RequestTooLargeError):  # the prompt alone is more than the pool: nothing to run
        engine.add_request("long", [5] * 70, dataclasses.replace(_greedy(5), to_context=True))
    assert_no_leaks(engine)


@pytest.mark.parametrize("ids, params, message", [
    ([], _greedy(4), "prompt is empty"),
    ([1, 2, 10_000], _greedy(4), r"token ids must be in \[0, 320\)"),
    ([1, -1], _greedy(4), r"token ids must be in \[0, 320\)"),
])
def test_malformed_requests_are_refused(tiny_bundle, ids, params, message):
    engine = _engine(tiny_bundle)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", ids, params)
    assert_no_leaks(engine)


def test_duplicate_request_id_is_refused_and_the_first_survives(tiny_bundle):
    engine = _engine(tiny_bundle)
    engine.add_request("same", [1, 2, 3], _greedy(3))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("same", [1, 2, 3, 4], _greedy(3))
    assert len(run_to_completion(engine)["same"]) == 3
    assert_no_leaks(engine)


def test_bad_multimodal_input_is_refused(tiny_bundle):
    engine = _engine(tiny_bundle)
    hidden = tiny_bundle.config.hidden_size
    with pytest.raises(InvalidRequestError, match="embeddings for"):
        engine.add_request("mm", [1, 5, 5, 6], _greedy(2), MultimodalInput(torch.zeros(3, hidden), (1, 2)))
    with pytest.raises(InvalidRequestError, match=f"must be \\[n, {hidden}\\]"):
        engine.add_request("mm", [1, 5, 5, 6], _greedy(2), MultimodalInput(torch.zeros(2, 7), (1, 2)))
    with pytest.raises(InvalidRequestError, match="inside the prompt"):
        engine.add_request("mm", [1, 5, 5, 6], _greedy(2), MultimodalInput(torch.zeros(2, hidden), (3, 9)))
    assert_no_leaks(engine)


def test_full_pool_queues_requests_and_serves_them_all(tiny_bundle):
    """Six requests that each end up needing 3 of the pool's 6 blocks: the rest wait, all finish, and each
    produces what it produces alone in a large pool."""
    prompts = {str(i): [1] + [10 + i] * 30 for i in range(6)}
    big = _engine(tiny_bundle)
    for rid, prompt in prompts.items():
        big.add_request(rid, prompt, _greedy(12))
    expected = {rid: [o.new_token_ids[0] for o in outs] for rid, outs in run_to_completion(big).items()}

    engine = _engine(tiny_bundle, blocks=6)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _greedy(12))
    peak_running = 0
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        stats = engine.stats()
        peak_running = max(peak_running, stats.num_running)
    assert 2 <= peak_running <= 3
    assert got == expected
    assert_no_leaks(engine)


def test_abort_frees_blocks_of_running_and_waiting_requests(tiny_bundle):
    engine = _engine(tiny_bundle, blocks=4)
    engine.add_request("running", [1] * 40, _greedy(20))
    engine.add_request("waiting", [1] * 40, _greedy(20))
    engine.step()
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 1
    assert engine.stats().blocks_free < 4
    assert engine.abort("waiting") and engine.abort("running")
    assert not engine.abort("running")  # second abort is a no-op
    assert not engine.abort("never-existed")
    assert engine.step() == []
    assert_no_leaks(engine)


def test_stop_token_ids_eos_and_max_tokens(tiny_bundle):
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22), eos_token_ids=())
    engine.add_request("free", [1, 2, 3, 4], _greedy(12))
    free_tokens = [o.new_token_ids[0] for o in run_to_completion(engine)["free"]]
    stop_at = free_tokens[5]
    first = free_tokens.index(stop_at)

    engine.add_request("stop", [1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0.0,
                                                            stop_token_ids=(stop_at,)))
    outs = run_to_completion(engine)["stop"]
    assert [o.new_token_ids[0] for o in outs] == free_tokens[:first + 1]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP

    eos_engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22), eos_token_ids=(stop_at,))
    eos_engine.add_request("eos", [1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0.0))
    assert len(run_to_completion(eos_engine)["eos"]) == first + 1
    eos_engine.add_request("ign", [1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = run_to_completion(eos_engine)["ign"]
    assert len(outs) == 12 and outs[-1].finish_reason is FinishReason.LENGTH
    assert_no_leaks(engine)
    assert_no_leaks(eos_engine)


def test_stop_string_cuts_text_and_finishes(default_bundle):
    engine = Engine(default_bundle.model, default_bundle.tokenizer, EngineConfig(kv_cache_bytes=1 << 24))
    prompt = default_bundle.tokenizer.encode("Hello")
    engine.add_request("free", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    free_text = "".join(o.text for o in run_to_completion(engine)["free"])
    stop = free_text[6:9]
    assert stop and stop in free_text
    engine.add_request("s", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))
    outs = run_to_completion(engine)["s"]
    assert "".join(o.text for o in outs) == free_text[:free_text.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert_no_leaks(engine)


def test_layer_hook_sees_each_layer_in_order_with_its_final_kv(tiny_bundle):
    engine = _engine(tiny_bundle, block_size=8, prefill_chunk_size=16)
    events: list[LayerKVReady] = []
    snapshots: dict[tuple[int, str, int], torch.Tensor] = {}

    def hook(ev: LayerKVReady) -> None:
        events.append(ev)
        for c in ev.chunks:  # copy what the transfer would send: this chunk's keys at this layer
            k, _ = engine.cache.read_tokens(ev.layer, list(c.blocks), c.end, torch.float32)
            snapshots[(ev.layer, c.request_id, c.start)] = k[c.start:c.end].clone()

    engine.add_layer_hook(hook)
    engine.add_request("a", list(range(1, 41)), _greedy(3))  # 40 tokens: chunks of 16, 16, 8
    final_k: dict[int, torch.Tensor] = {}
    while engine.has_unfinished():
        outs = engine.step()
        seq = engine._seqs.get("a")
        if seq is not None and seq.num_computed == 40 and not final_k:
            for layer in range(tiny_bundle.config.num_layers):
                final_k[layer] = engine.cache.read_tokens(layer, seq.block_table, 40, torch.float32)[0].clone()
        del outs
    layers = tiny_bundle.config.num_layers
    assert [e.layer for e in events] == list(range(layers)) * 3  # decode steps do not fire the hook
    assert [(c.start, c.end, c.last) for e in events[::layers] for c in e.chunks] == [
        (0, 16, False), (16, 32, False), (32, 40, True)]
    for (layer, _, start), k in snapshots.items():
        assert torch.equal(k, final_k[layer][start:start + k.shape[0]])
    assert_no_leaks(engine)


def test_a_pool_smaller_than_the_context_is_warned_of_at_start(tiny_bundle, caplog):
    with caplog.at_level(logging.WARNING, logger="workers.runtime.engine"):
        engine = _engine(tiny_bundle, blocks=4)  # 64 tokens
    said = [r.getMessage() for r in caplog.records if "KV pool holds" in r.getMessage()]
    assert said == [f"the KV pool holds 64 tokens, fewer than the model's context of {engine.max_model_len}: a "
                    "request that needs more is refused (context_length_exceeded), one without max_tokens stops "
                    "where the pool ends; give the pool more room (engine.kv_cache_bytes, or "
                    "gpu_memory_utilization on CUDA)"]
