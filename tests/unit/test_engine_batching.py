"""Continuous batching: a sequence's greedy output does not depend on what else is in the batch, on the
block size, on chunked prefill, or on being preempted and recomputed."""

from __future__ import annotations

import random

import pytest

from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.kv_cache import KVCacheSpec
from workers.runtime.sampler import SamplingParams

from engine_helpers import assert_no_leaks, run_to_completion

pytestmark = [pytest.mark.unit]

rng = random.Random(7)
PROMPTS = [[1] + [rng.randrange(3, 320) for _ in range(n)] for n in (5, 37, 12, 60, 21, 9)]
MAX_TOKENS = [24, 10, 30, 16, 20, 12]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def solo_outputs(tiny_bundle):
    """Each prompt run alone, block size 16, no chunking: the reference."""
    result = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, prefill_chunk_size=4096))
        engine.add_request("solo", prompt, _greedy(n))
        result.append([o.new_token_ids[0] for o in run_to_completion(engine)["solo"]])
        assert_no_leaks(engine)
    return result


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("chunk", [4096, 7])
def test_joins_and_leaves_do_not_change_outputs(tiny_bundle, solo_outputs, block_size, chunk):
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, block_size=block_size,
                                                     prefill_chunk_size=chunk, max_num_batched_tokens=64))
    # arrivals: step -> request indices; request 5 is aborted mid-way and must not disturb the others
    arrivals = {0: [0, 1], 3: [2, 3], 9: [4], 11: [5]}
    tokens: dict[str, list[int]] = {}
    batch_sizes = set()
    step = 0
    while step in arrivals or engine.has_unfinished() or step < max(arrivals):
        for i in arrivals.get(step, []):
            engine.add_request(str(i), PROMPTS[i], _greedy(MAX_TOKENS[i]))
        if step == 15:
            assert engine.abort("5")
        batch_sizes.add(len(engine.scheduler.running))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert max(batch_sizes) >= 4, "the test must actually batch"
    for i in range(5):
        assert tokens[str(i)] == solo_outputs[i], f"request {i} changed when batched"
    assert 0 < len(tokens.get("5", [])) < MAX_TOKENS[5] or "5" not in tokens
    assert_no_leaks(engine)


def test_preempted_sequences_recompute_to_the_same_output(tiny_bundle, solo_outputs):
    """A pool too small for all sequences at once: the newest are preempted, recomputed, and still match."""
    cfg = tiny_bundle.config
    per_block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8).bytes_per_block(
        ("float32",) * cfg.num_layers)
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=12 * per_block, block_size=8))
    assert engine.cache.num_blocks == 12
    for i in (1, 3, 4):  # 38+10, 61+16, 22+20 tokens: 7 + 10 + 6 blocks at the end > 12
        engine.add_request(str(i), PROMPTS[i], _greedy(MAX_TOKENS[i], prompt_logprobs=1, logprobs=1))
    outs = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    for i in (1, 3, 4):
        assert [o.new_token_ids[0] for o in outs[str(i)]] == solo_outputs[i]
        # logprobs too: each token's once, the prompt's once (with the first token, not again on the recompute)
        assert [o.logprobs is not None for o in outs[str(i)]] == [True] * MAX_TOKENS[i]
        first, *rest = outs[str(i)]
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(PROMPTS[i]) - 1
        assert all(o.prompt_logprobs is None for o in rest)
    assert_no_leaks(engine)


def test_a_prompt_is_admitted_only_when_it_fits_whole_so_chunks_never_preempt(tiny_bundle, solo_outputs):
    """Two long prompts chunked into a pool that holds each whole but not both: the second's first chunk
    fits beside the first's, but its admission waits until the first's prompt could finish, so no chunk
    preempts a half-prefilled sequence (which threw away its computed chunks, and on a prefill worker
    delayed its first token)."""
    cfg = tiny_bundle.config
    per_block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8).bytes_per_block(
        ("float32",) * cfg.num_layers)
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=12 * per_block, block_size=8,
                                                          prefill_chunk_size=8))
    assert engine.cache.num_blocks == 12
    engine.add_request("3", PROMPTS[3], _greedy(1))  # 61 tokens: 8 blocks
    engine.add_request("1", PROMPTS[1], _greedy(1))  # 38 tokens: 5 blocks; 8 + 5 > 12
    first = engine.step()  # chunk 1 of "3"; "1" may not join: 8 + 5 blocks are more than the pool
    assert first == [] and engine.stats().num_running == 1 and engine.stats().num_waiting == 1
    outs = run_to_completion(engine)
    assert engine.stats().num_preemptions == 0
    assert [o.new_token_ids[0] for o in outs["3"]] == solo_outputs[3][:1]
    assert [o.new_token_ids[0] for o in outs["1"]] == solo_outputs[1][:1]
    assert_no_leaks(engine)


def test_seeded_sampling_is_batch_invariant(tiny_bundle):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22))
    alone.add_request("s", PROMPTS[2], params)
    ref = [o.new_token_ids[0] for o in run_to_completion(alone)["s"]]
    batched = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, seed=99))
    for i in (0, 1, 3):
        batched.add_request(f"other{i}", PROMPTS[i], SamplingParams(max_tokens=8, temperature=1.0))
    batched.add_request("s", PROMPTS[2], params)
    got = [o.new_token_ids[0] for o in run_to_completion(batched)["s"]]
    assert got == ref
    assert_no_leaks(batched)
