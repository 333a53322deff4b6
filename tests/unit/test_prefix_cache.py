"""The engine's prefix cache: the allocator's index (register, match, take, evict least recently freed,
tail first), and an engine that reuses cached prefixes computing exactly what an engine without the cache
computes: same greedy tokens, logits within float32 rounding, across shared prefixes, whole-prompt hits,
output blocks (a multi-turn follow-up), eviction under a small pool, preemption, prompt logprobs and
multimodal placeholders."""

from __future__ import annotations

import random

import pytest
import torch

from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import CapacityError, InvalidRequestError
from workers.runtime.kv_cache import BlockAllocator
from workers.runtime.prefix_cache import chain_digests
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import MultimodalInput

from engine_helpers import assert_no_leaks, run_to_completion, token_ids

pytestmark = [pytest.mark.unit]

BS = 16
rng = random.Random(11)
SYSTEM = [1] + [rng.randrange(3, 320) for _ in range(70)]  # 71 tokens: four full blocks and a tail


def _greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _logits(n: int = 8) -> SamplingParams:
    return _greedy(n, return_logits=True)


def _engine(bundle, *, cache: bool = True, kv_bytes: int = 1 << 22, **kw) -> Engine:
    return Engine(bundle.model, None, EngineConfig(kv_cache_bytes=kv_bytes, prefix_caching=cache, **kw))


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, mm: MultimodalInput | None = None):
    engine.add_request(rid, prompt, params, mm)
    return run_to_completion(engine)[rid]


def _suffix(n: int) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


def _assert_same(got, want) -> None:
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-4)


# --- the allocator's index ------------------------------------------------------------------------------

def test_digests_chain_on_the_whole_prefix():
    a, b = chain_digests(list(range(40)), BS), chain_digests([7] + list(range(1, 40)), BS)
    assert len(a) == 2 and len(b) == 2  # the 8-token tail has none
    assert a[0] != b[0] and a[1] != b[1]  # the second blocks' tokens are equal, their prefixes are not
    assert chain_digests(list(range(32)), BS) == a


def test_freed_indexed_blocks_stay_findable_until_evicted_least_recently_freed_first():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    digests = [bytes([i]) * 32 for i in range(3)]
    for b, d in zip(blocks, digests):
        assert a.register(b, d)
    assert not a.register(blocks[0], bytes([9]) * 32)  # a block is indexed once
    with pytest.raises(ValueError, match="not allocated"):
        a.register(3, bytes([9]) * 32)  # and only while held
    a.free(blocks)
    assert (a.num_free, a.num_cached) == (4, 3)  # evictable blocks count as free
    assert a.match(digests) == blocks and a.match(digests[1:]) == blocks[1:2] + blocks[2:]
    assert a.match([bytes([5]) * 32] + digests) == []  # a prefix match starts at the first block
    a.take(blocks[:2])
    assert a.num_free == 2 and a.refcount(blocks[0]) == 1
    # the one never-indexed block goes first, then the least recently freed evictable one: the tail
    assert a.allocate(1) == [3]
    assert a.allocate(1) == [blocks[2]] and a.num_cached == 2 and a.match(digests) == blocks[:2]
    with pytest.raises(ValueError, match="not in the prefix cache"):
        a.take([blocks[2]])
    a.free(blocks[:2] + [blocks[2], 3])
    assert a.num_free == 4 and a.reset_prefix_cache() == 2 and a.num_cached == 0 and a.match(digests) == []
    assert sorted(a.allocate(4)) == [0, 1, 2, 3]


def test_a_digest_already_indexed_is_not_indexed_twice():
    a = BlockAllocator(2)
    x, y = a.allocate(2)
    assert a.register(x, b"d" * 32) and not a.register(y, b"d" * 32)
    a.free([x, y])
    assert a.match([b"d" * 32]) == [x] and a.num_cached == 1


# --- the engine ---------------------------------------------------------------------------------------

def test_a_shared_prefix_is_reused_and_computes_what_no_cache_computes(tiny_bundle):
    engine, plain = _engine(tiny_bundle), _engine(tiny_bundle, cache=False)
    first, second = SYSTEM + _suffix(9), SYSTEM + _suffix(20)
    _assert_same(_run(engine, "a", first, _logits()), _run(plain, "a", first, _logits()))
    assert engine.stats().prefix_cache_hits == 0 and engine.stats().prefix_cache_queries == len(first)
    _assert_same(_run(engine, "b", second, _logits()), _run(plain, "b", second, _logits()))
    stats = engine.stats()
    assert stats.prefix_cache_hits == 4 * BS  # SYSTEM's four full blocks; its tail block differs
    assert stats.prefix_cache_queries == len(first) + len(second)
    assert plain.stats().prefix_cache_hits == plain.stats().prefix_cache_queries == plain.stats().cached_blocks == 0
    assert_no_leaks(engine)


def test_a_whole_prompt_hit_still_computes_its_last_block(tiny_bundle):
    """A prompt of exactly four blocks seen before: three are reused, the fourth (holding the token whose
    logits give the next token) is computed again, into a block of its own."""
    engine, plain = _engine(tiny_bundle), _engine(tiny_bundle, cache=False)
    prompt = SYSTEM[:4 * BS]
    want = _run(plain, "p", prompt, _logits())
    _assert_same(_run(engine, "p", prompt, _logits()), want)
    _assert_same(_run(engine, "p", prompt, _logits()), want)
    assert engine.stats().prefix_cache_hits == 3 * BS
    assert_no_leaks(engine)


def test_a_follow_up_reuses_the_blocks_of_the_earlier_answer(tiny_bundle):
    engine, plain = _engine(tiny_bundle), _engine(tiny_bundle, cache=False)
    turn1 = SYSTEM + _suffix(10)
    answer = [t for o in _run(engine, "t1", turn1, _greedy(40)) for t in o.new_token_ids]
    turn2 = turn1 + answer + _suffix(5)
    _assert_same(_run(engine, "t2", turn2, _logits()), _run(plain, "t2", turn2, _logits()))
    # every full block of turn 1's prompt and answer whose KV was computed (the last answer token's was not)
    assert engine.stats().prefix_cache_hits == (len(turn1) + len(answer) - 1) // BS * BS
    assert_no_leaks(engine)


def test_a_small_pool_evicts_cached_blocks_and_serves_everything_right(tiny_bundle):
    """A pool of 12 blocks and prompts of 5-6 blocks each: cached blocks are evicted to make room, old
    prefixes stop hitting, and every output matches an engine without the cache."""
    per_block = tiny_bundle.model.cfg.num_layers * 2 * BS * tiny_bundle.model.cfg.num_kv_heads \
        * tiny_bundle.model.cfg.head_dim * 4
    engine, plain = _engine(tiny_bundle, kv_bytes=12 * per_block), _engine(tiny_bundle, cache=False)
    assert engine.cache.num_blocks == 12
    prefixes = [[1] + _suffix(63) for _ in range(3)]
    order = [0, 1, 0, 2, 1, 0, 2, 2, 0]
    for i, p in enumerate(order):
        prompt = prefixes[p] + _suffix(7)
        _assert_same(_run(engine, f"r{i}", prompt, _logits(6)), _run(plain, f"r{i}", prompt, _logits(6)))
        stats = engine.stats()
        assert stats.cached_blocks <= engine.cache.num_blocks and stats.blocks_free == stats.blocks_total
    hits = engine.stats().prefix_cache_hits
    assert 0 < hits < (len(order) - 3) * 4 * BS  # some repeats hit, not all: their blocks were evicted between
    assert_no_leaks(engine)


def test_concurrent_requests_with_one_prefix_agree_with_no_cache(tiny_bundle):
    """Requests arriving together compute the prefix side by side (nothing is cached yet); later ones hit it.
    Chunked prefill and a batch of them mixed with decodes give the same tokens as without the cache."""
    engine, plain = (_engine(tiny_bundle, cache=c, prefill_chunk_size=24, max_num_batched_tokens=64)
                     for c in (True, False))
    prompts = [SYSTEM + _suffix(n) for n in (3, 17, 30, 8, 12, 25)]

    def serve(eng: Engine) -> dict[str, list[int]]:
        for i, p in enumerate(prompts[:3]):
            eng.add_request(str(i), p, _greedy(12))
        outs: dict[str, list] = {}
        for _ in range(4):
            for o in eng.step():
                outs.setdefault(o.request_id, []).append(o)
        for i, p in enumerate(prompts[3:], start=3):
            eng.add_request(str(i), p, _greedy(12))
        for rid, got in run_to_completion(eng).items():
            outs.setdefault(rid, []).extend(got)
        return token_ids(outs)

    assert serve(engine) == serve(plain)
    assert engine.stats().prefix_cache_hits >= 3 * 4 * BS  # the three late ones found SYSTEM
    assert_no_leaks(engine)
    assert_no_leaks(plain)


def test_a_preempted_sequence_takes_its_own_blocks_back(tiny_bundle):
    """Two long requests in a pool that cannot hold both to the end: the newer is preempted, and when it
    comes back its computed blocks are still cached, so it recomputes only its tail."""
    per_block = tiny_bundle.model.cfg.num_layers * 2 * BS * tiny_bundle.model.cfg.num_kv_heads \
        * tiny_bundle.model.cfg.head_dim * 4
    engine, plain = _engine(tiny_bundle, kv_bytes=8 * per_block), _engine(tiny_bundle, cache=False,
                                                                          kv_bytes=8 * per_block)
    prompts = {"a": [1] + _suffix(40), "b": [1] + _suffix(40)}
    results = []
    for eng in (engine, plain):
        for rid, p in prompts.items():
            eng.add_request(rid, p, _greedy(50))
        results.append(token_ids(run_to_completion(eng)))
    assert engine.stats().num_preemptions >= 1 and plain.stats().num_preemptions >= 1
    assert results[0] == results[1]
    assert engine.stats().prefix_cache_hits >= 2 * BS  # the preempted one's prompt blocks, at least
    assert_no_leaks(engine)


def test_prompt_logprobs_skip_the_lookup_and_stay_whole(tiny_bundle):
    engine, plain = _engine(tiny_bundle), _engine(tiny_bundle, cache=False)
    prompt = SYSTEM + _suffix(4)
    _run(engine, "warm", prompt, _greedy(2))
    got = _run(engine, "lp", prompt, _greedy(2, prompt_logprobs=2))
    want = _run(plain, "lp", prompt, _greedy(2, prompt_logprobs=2))
    assert len(got[0].prompt_logprobs) == len(prompt) - 1
    for a, b in zip(got[0].prompt_logprobs, want[0].prompt_logprobs):
        assert a.top == b.top or [t for t, _ in a.top] == [t for t, _ in b.top]
        assert abs(a.logprob - b.logprob) < 1e-4
    assert engine.stats().prefix_cache_queries == len(prompt)  # only the first request looked
    assert_no_leaks(engine)


def test_blocks_from_the_first_image_on_are_never_shared(tiny_bundle):
    """Two prompts with the same token ids but different image embeddings: the blocks before the image are
    shared, the rest are computed from each request's own embeddings, as an engine without the cache does."""
    engine, plain = _engine(tiny_bundle), _engine(tiny_bundle, cache=False)
    hidden = tiny_bundle.config.hidden_size
    prompt = SYSTEM[:40] + [5] * 4 + SYSTEM[40:] + _suffix(10)  # the placeholders at 40..43, in block 2
    positions = tuple(range(40, 44))
    images = [MultimodalInput(torch.randn(4, hidden, generator=torch.Generator().manual_seed(s)), positions)
              for s in (1, 2)]
    outs = []
    for i, mm in enumerate(images):
        got = _run(engine, f"i{i}", prompt, _logits(), mm)
        _assert_same(got, _run(plain, f"i{i}", prompt, _logits(), mm))
        outs.append(got[0].logits)
    assert (outs[0] - outs[1]).abs().max() > 1e-3  # the images matter
    assert engine.stats().prefix_cache_hits == 2 * BS  # blocks 0 and 1, before the image
    assert_no_leaks(engine)


def test_a_reset_forgets_every_prefix_and_indexes_nothing_of_a_running_sequence(tiny_bundle):
    engine, plain = _engine(tiny_bundle), _engine(tiny_bundle, cache=False)
    prompt = SYSTEM + _suffix(9)
    engine.add_request("running", prompt, _greedy(40))
    engine.step()  # its prompt computed and indexed; it decodes on
    assert engine.stats().cached_blocks == len(prompt) // BS
    assert engine.reset_prefix_cache() == len(prompt) // BS
    run_to_completion(engine)
    assert engine.stats().cached_blocks == 0  # the blocks it filled after the reset were not indexed
    _assert_same(_run(engine, "after", prompt, _logits()), _run(plain, "after", prompt, _logits()))
    assert engine.stats().prefix_cache_hits == 0  # nothing of the first request was found
    assert_no_leaks(engine)


def test_a_reservation_takes_the_cached_prefix_and_leaves_only_the_rest_to_arrive(tiny_bundle):
    """A decode engine that holds a prompt's prefix reserves its blocks as they are (``cached_blocks``: the
    push skips them), short of the block with the last token and of the first image's; a reservation that does
    not fit gives them back, still cached."""
    engine = _engine(tiny_bundle)
    prompt = SYSTEM + _suffix(9)  # 80 tokens: five full blocks
    _run(engine, "first", prompt, _greedy(2))
    free, hits = engine.stats().blocks_free, engine.stats().prefix_cache_hits
    res = engine.reserve("r", len(prompt), 8, None, prompt)
    assert res.cached_blocks == 4 and len(res.blocks) == 5  # the fifth holds the last token: it is sent
    assert engine.stats().blocks_free == free - 5 and engine.stats().prefix_cache_hits == hits + 4 * BS
    image = engine.reserve("i", len(prompt), 8, 20, prompt)  # an image at 20: only block 0 is its text's
    assert image.cached_blocks == 1 and image.blocks[0] == res.blocks[0]
    assert engine.cache.allocator.refcount(res.blocks[0]) == 2
    assert engine.reserve("plain", len(prompt), 8).cached_blocks == 0  # no prompt ids, no lookup
    with pytest.raises(InvalidRequestError, match="79 prompt token ids for a reservation of 80"):
        engine.reserve("short", len(prompt), 8, None, prompt[:-1])
    for rid in ("r", "i", "plain"):
        assert engine.abort(rid)
    roomy = _engine(tiny_bundle, decode_headroom_tokens=10**6)
    _run(roomy, "first", prompt, _greedy(2))
    cached = roomy.stats().cached_blocks
    with pytest.raises(CapacityError):
        roomy.reserve("r", len(prompt), 10**6, None, prompt)
    assert roomy.stats().blocks_free == roomy.stats().blocks_total and roomy.stats().cached_blocks == cached
    assert_no_leaks(engine)


def test_a_reservation_can_trade_its_cached_blocks_for_fresh_ones(tiny_bundle):
    """For a sender that sends every block: fresh blocks replace the cached ones, which go back to the cache;
    when the push cannot be pointed at them, or none is free, nothing changes."""
    engine = _engine(tiny_bundle)
    prompt = SYSTEM + _suffix(9)
    _run(engine, "first", prompt, _greedy(2))
    res = engine.reserve("r", len(prompt), 8, None, prompt)
    assert res.cached_blocks == 4
    kept = engine.without_cached(res, lambda blocks: False)  # a push already streams into the old blocks
    assert kept is res and engine.stats().blocks_free == engine.stats().blocks_total - 5
    seen: list[tuple[int, ...]] = []

    def point(blocks: tuple[int, ...]) -> bool:
        seen.append(blocks)
        return True

    swapped = engine.without_cached(res, point)
    assert swapped.cached_blocks == 0 and seen == [swapped.blocks] and swapped.blocks[4:] == res.blocks[4:]
    assert not set(swapped.blocks[:4]) & set(res.blocks[:4])
    assert all(engine.cache.allocator.refcount(b) == 0 for b in res.blocks[:4])  # evictable again
    assert engine.stats().cached_blocks >= 5 and engine.stats().blocks_free == engine.stats().blocks_total - 5
    with pytest.raises(InvalidRequestError, match="no live reservation"):
        engine.without_cached(res, lambda blocks: True)  # the old one is gone
    assert engine.release(swapped)
    assert_no_leaks(engine)
