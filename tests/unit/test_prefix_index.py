"""The prefix-block index and the ``prefix_affinity`` policy built on it: chained hashes, contiguous
matches, the LRU bound, forgetting a worker, and routing that follows a prefix unless load says no, for
prefill and decode."""

from __future__ import annotations

import random

import pytest

from controlplane.dispatch import WorkerRequest
from controlplane.scheduler.policies import (
    Candidate,
    PrefixAffinity,
    available_policies,
    free_blocks,
    get_policy,
    pending_tokens,
    sequences,
)
from controlplane.scheduler.prefix_index import PrefixIndex, block_hashes
from controlplane.scheduler.selection import cacheable_ids
from controlplane.settings import SchedulerSettings
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.unit]

BS = 4  # small blocks keep the prompts readable


def _c(wid: str, queued: int = 0, inflight_tokens: int = 0, free: int = 100) -> Candidate:
    return Candidate(wid, f"10.0.0.1:{5000 + len(wid)}", queued, free, 100, 0, inflight_tokens, 0)


def _prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


# --- block_hashes -----------------------------------------------------------------------------------------

def test_block_hashes_one_per_full_block_and_the_partial_tail_is_ignored():
    assert len(block_hashes(list(range(10)), BS)) == 2
    assert block_hashes(list(range(8)), BS) == block_hashes(list(range(10)), BS)  # tail of 2 adds nothing
    assert block_hashes([1, 2, 3], BS) == [] and block_hashes([], BS) == []


def test_block_hashes_chain_on_the_prefix():
    a = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS)
    b = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], BS)
    assert a[0] != b[0]
    assert a[1] != b[1]  # the same second block after a different first block is a different prefix
    assert block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS) == a  # deterministic within the process
    assert block_hashes((1, 2, 3, 4), BS) == a[:1]  # any sequence of ints


def test_block_hashes_refuses_a_nonpositive_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


# --- PrefixIndex --------------------------------------------------------------------------------------------

def test_match_is_the_longest_contiguous_prefix_per_worker():
    idx = PrefixIndex(max_blocks=100, block_size=BS)
    shared = _prompt(0, 2)
    idx.record("a", idx.hashes(shared + _prompt(100, 3)))  # 5 blocks
    idx.record("b", idx.hashes(shared + _prompt(200, 1)))  # 2 shared blocks, then its own
    assert len(idx) == 2 + 3 + 1
    # every worker with at least one leading block, each with its own contiguous length
    assert idx.match(idx.hashes(shared + _prompt(100, 3) + _prompt(900, 2))) == {"a": 5, "b": 2}
    assert idx.match(idx.hashes(shared + _prompt(100, 1))) == {"a": 3, "b": 2}
    assert idx.match(idx.hashes(shared + _prompt(200, 1))) == {"a": 2, "b": 3}
    assert idx.match(idx.hashes(shared + _prompt(500, 4))) == {"a": 2, "b": 2}
    assert idx.match(idx.hashes(_prompt(700, 3))) == {}  # the first block is nobody's: the walk stops there
    assert idx.workers() == {"a", "b"}


def test_record_is_idempotent_and_a_block_lists_each_worker_once():
    idx = PrefixIndex(max_blocks=100, block_size=BS)
    h = idx.hashes(_prompt(0, 3))
    for _ in range(3):
        idx.record("a", h)
    idx.record("b", h)
    assert len(idx) == 3 and idx.match(h) == {"a": 3, "b": 3}


def test_lru_bound_evicts_the_least_recently_touched_blocks():
    idx = PrefixIndex(max_blocks=10, block_size=BS)
    old, mid, new = idx.hashes(_prompt(0, 4)), idx.hashes(_prompt(100, 4)), idx.hashes(_prompt(200, 4))
    idx.record("a", old)
    idx.record("b", mid)
    idx.record("c", new)  # 12 blocks recorded, 10 kept: two of the oldest prompt's go
    assert len(idx) == 10
    assert idx.match(mid) == {"b": 4} and idx.match(new) == {"c": 4}
    assert idx.match(old) == {"a": 2}  # its tail went first; the head, shared by more prompts, stays
    idx.record("a", old)  # touched again: now the newest, so the next eviction takes from "mid"
    assert len(idx) == 10 and idx.match(old) == {"a": 4}
    assert idx.match(mid) == {"b": 2}
    for i in range(50):
        idx.record("d", idx.hashes(_prompt(1000 + 10 * i, 2)))
        assert len(idx) <= 10
    assert idx.match(old) == {} and idx.workers() == {"d"}  # evicted blocks take their workers with them


def test_forget_worker_drops_it_and_blocks_only_it_held():
    idx = PrefixIndex(max_blocks=100, block_size=BS)
    shared, own = idx.hashes(_prompt(0, 2)), idx.hashes(_prompt(0, 2) + _prompt(50, 2))
    idx.record("a", own)
    idx.record("b", shared)
    idx.forget_worker("a")
    assert len(idx) == 2 and idx.match(own) == {"b": 2} and idx.workers() == {"b"}
    idx.forget_worker("nobody")  # unknown: nothing happens
    idx.forget_worker("b")
    assert len(idx) == 0 and idx.match(own) == {}


@pytest.mark.parametrize("kwargs, field", [({"max_blocks": 0}, "max_blocks"), ({"block_size": 0}, "block_size"),
                                           ({"max_blocks": -5}, "max_blocks")])
def test_index_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PrefixIndex(**kwargs)


# --- the prefix_affinity policy --------------------------------------------------------------------------

def _policy() -> PrefixAffinity:
    return PrefixAffinity(PrefixIndex(max_blocks=1000, block_size=BS), PrefixIndex(max_blocks=1000, block_size=BS))


def test_registered_and_the_default():
    assert "prefix_affinity" in available_policies()
    assert isinstance(get_policy("prefix_affinity"), PrefixAffinity)
    assert SchedulerSettings(routing_policy="prefix_affinity").routing_policy == "prefix_affinity"
    assert SchedulerSettings().routing_policy == "prefix_affinity"
    assert SchedulerSettings(routing_policy="least_loaded").routing_policy == "least_loaded"
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        SchedulerSettings(routing_policy="fastest")


def test_prefill_follows_the_worker_that_got_the_prefix():
    p = _policy()
    system = _prompt(0, 8)
    cands = [_c("a"), _c("b", queued=300), _c("c", queued=600)]
    first = p.pick("prefill", cands, 40, prompt_ids=system + _prompt(100, 2))
    assert first.worker_id == "a" and first.cached_tokens == 0  # nothing indexed yet: least loaded
    # "a" is now the busiest, within the balance thresholds; the prompt sharing its prefix still goes there,
    # and says what it likely finds cached there (the 8 system blocks)
    cands = [_c("a", queued=900), _c("b", queued=300), _c("c", queued=600)]
    follow = p.pick("prefill", cands, 40, prompt_ids=system + _prompt(200, 2))
    assert (follow.worker_id, follow.cached_tokens) == ("a", 32)
    # an unrelated prompt goes by load, and is recorded there: its next turn follows it, not the load
    assert p.pick("prefill", cands, 40, prompt_ids=_prompt(5000, 10)).worker_id == "b"
    cands = [_c("a", queued=900), _c("b", queued=600), _c("c", queued=300)]
    assert p.pick("prefill", cands, 54, prompt_ids=_prompt(5000, 10) + _prompt(7000, 3) + [1, 2]).worker_id == "b"
    assert p.pick("prefill", cands, 40, prompt_ids=_prompt(9000, 10)).worker_id == "c"


def test_longest_match_wins_and_ties_go_to_the_least_loaded():
    p = _policy()
    system = _prompt(0, 4)
    p.index.record("a", p.index.hashes(system + _prompt(100, 4)))
    p.index.record("b", p.index.hashes(system))
    cands = [_c("a", queued=500), _c("b", queued=0), _c("c", queued=0)]
    assert p.pick("prefill", cands, 32, prompt_ids=system + _prompt(100, 4)).worker_id == "a"  # 8 blocks vs 4
    cands = [_c("a", queued=500), _c("b", queued=200), _c("c", queued=0)]
    # "a" and "b" both hold the 4 system blocks and nothing more: the less loaded of the two, not "c",
    # which is the least loaded of all but matches nothing
    assert p.pick("prefill", cands, 24, prompt_ids=system + _prompt(900, 2)).worker_id == "b"


def test_falls_back_to_least_loaded_when_the_pool_is_imbalanced():
    p = _policy()
    prompt = _prompt(0, 8)
    p.index.record("a", p.index.hashes(prompt))
    gap = PrefixAffinity.BALANCE_ABS_TOKENS
    # over both thresholds: the least loaded wins even though "a" holds the whole prompt
    imbalanced = [_c("a", queued=gap + 100), _c("b", queued=50)]
    assert p.imbalanced("prefill", imbalanced)
    assert p.pick("prefill", imbalanced, 32, prompt_ids=prompt).worker_id == "b"
    # in-flight tokens count as load too
    assert p.pick("prefill", [_c("a", inflight_tokens=gap + 100), _c("b", queued=50)], 32,
                  prompt_ids=_prompt(0, 8)).worker_id == "b"
    assert p.index.match(p.index.hashes(prompt)) == {"a": 8, "b": 8}  # the fallback's choice was recorded too
    # both tests must hold: a big absolute gap that is small relative to the load is not imbalance,
    # nor is a big ratio between small loads
    for balanced in ([_c("a", queued=10 * gap), _c("b", queued=8 * gap)], [_c("a", queued=gap), _c("b", queued=1)]):
        fresh = _policy()
        fresh.index.record("a", fresh.index.hashes(prompt))
        assert not fresh.imbalanced("prefill", balanced)
        assert fresh.pick("prefill", balanced, 32, prompt_ids=prompt).worker_id == "a"


def test_a_match_under_half_the_prompt_is_no_match():
    p = _policy()
    template = _prompt(0, 2)  # a chat template's fixed head, say: 8 tokens
    p.index.record("a", p.index.hashes(template + _prompt(100, 2)))
    cands = [_c("a", queued=10), _c("b")]
    half = p.pick("prefill", cands, 16, prompt_ids=template + _prompt(900, 2))  # 8 of 16 tokens cached on "a"
    assert (half.worker_id, half.cached_tokens) == ("a", 8)  # enough
    short = p.pick("prefill", cands, 24, prompt_ids=template + _prompt(500, 4))  # 8 of 24
    assert (short.worker_id, short.cached_tokens) == ("b", 0)  # least loaded, as with no match


def test_never_returns_a_non_candidate():
    p = _policy()
    prompt = _prompt(0, 6)
    p.index.record("gone", p.index.hashes(prompt))
    p.index.record("b", p.index.hashes(prompt[:4 * BS]))
    cands = [_c("b", queued=100), _c("c")]
    assert p.pick("prefill", cands, 24, prompt_ids=prompt).worker_id == "b"  # the best *candidate* match
    p2 = _policy()
    p2.index.record("gone", p2.index.hashes(prompt))
    assert p2.pick("prefill", [_c("b", queued=100), _c("c")], 24, prompt_ids=prompt).worker_id == "c"


def test_workers_absent_at_two_sweeps_are_forgotten():
    p = _policy()
    p.SWEEP_EVERY = 4  # an instance setting keeps the test short
    p.index.record("gone", p.index.hashes(_prompt(0, 3)))
    cands = [_c("a"), _c("b")]
    for i in range(4):  # first sweep: "gone" is noted missing, not yet forgotten
        p.pick("prefill", cands, 8, prompt_ids=_prompt(1000 + 100 * i, 2))
    assert "gone" in p.index.workers()
    for i in range(4):  # second sweep: still missing, so forgotten, and its blocks with it
        p.pick("prefill", cands, 8, prompt_ids=_prompt(2000 + 100 * i, 2))
    assert "gone" not in p.index.workers() and p.index.match(p.index.hashes(_prompt(0, 3))) == {}
    assert p.index.workers() == {"a"}  # every pick went by load (no matches, equal loads: lowest id)


def test_a_whole_prompt_hit_stops_short_of_its_last_token():
    p = _policy()
    prompt = _prompt(0, 8)
    p.index.record("a", p.index.hashes(prompt))
    # the engine's rule: whole blocks, short of the last token, so 7 of the 8 blocks
    assert p.pick("prefill", [_c("a", queued=30), _c("b")], 32, prompt_ids=prompt).cached_tokens == 28


def test_decode_follows_the_prefix_in_its_own_index_unless_blocks_held_are_imbalanced():
    p = _policy()
    prompt = _prompt(0, 8)
    # nothing indexed: least loaded's choice (most free blocks), recorded in the decode pool's own index
    assert p.pick("decode", [_c("a", free=50), _c("b", free=40)], 32, prompt_ids=prompt).worker_id == "a"
    assert p.indexes["decode"].workers() == {"a"} and len(p.index) == 0
    # "a" holds the prompt's blocks: it wins though it holds more, within the balance thresholds
    held = p.pick("decode", [_c("a", free=20), _c("b", free=90)], 33, prompt_ids=prompt + [7])
    assert (held.worker_id, held.cached_tokens) == ("a", 32)
    # blocks held are the decode pool's load: 100 vs 10 of 100 is imbalanced only past the gap in blocks
    gap = PrefixAffinity.BALANCE_ABS_TOKENS // PrefixAffinity.BLOCK_SIZE
    total = gap + 100
    big = [_c("a", free=0)._replace(total_kv_blocks=total), _c("b", free=gap + 90)._replace(total_kv_blocks=total)]
    assert p.imbalanced("decode", big) and not p.imbalanced("prefill", big)
    assert p.pick("decode", big, 33, prompt_ids=prompt + [7]).worker_id == "b"


def test_encode_is_least_loaded_unchanged():
    p, ll = _policy(), get_policy("least_loaded")
    prompt = _prompt(0, 8)
    p.index.record("a", p.index.hashes(prompt))
    encode = [_c("a", queued=500), _c("b", queued=100)]
    assert p.pick("encode", encode, 32, prompt_ids=prompt).worker_id == ll.pick("encode", encode, 32).worker_id == "b"
    assert len(p.index) == 8 and p.index.workers() == {"a"} and len(p.indexes["decode"]) == 0  # not recorded


def test_without_prompt_ids_it_is_least_loaded():
    p = _policy()
    cands = [_c("a", queued=500), _c("b", queued=100)]
    assert p.pick("prefill", cands, 32).worker_id == "b"
    assert len(p.index) == 0


def test_routing_sees_the_prompt_up_to_its_first_image():
    ids = list(range(40))
    plain = WorkerRequest("r", ids, SamplingParams())
    assert cacheable_ids(plain) is ids
    with_images = WorkerRequest("r", ids, SamplingParams(), images=(b"x", b"y"), image_positions=(30, 31, 12, 13))
    assert cacheable_ids(with_images) == ids[:12]


def test_a_requests_decode_and_prefill_picks_hash_its_prompt_once():
    hashed: list[int] = []

    class Counting(PrefixIndex):
        def hashes(self, token_ids):  # PrefixIndex.hashes, counted
            hashed.append(len(token_ids))
            return super().hashes(token_ids)

    p = PrefixAffinity(Counting(max_blocks=1000, block_size=BS), Counting(max_blocks=1000, block_size=BS))
    prompt = _prompt(0, 8)
    p.pick("decode", [_c("a"), _c("b")], 32, prompt_ids=prompt)
    p.pick("prefill", [_c("a"), _c("b")], 32, prompt_ids=prompt)
    assert hashed == [32]
    p.pick("prefill", [_c("a"), _c("b")], 32, prompt_ids=list(prompt))  # an equal prompt, another object
    assert hashed == [32, 32]
    hashes = p.index.hashes(prompt)
    assert p.index.match(hashes) == {"a": 8} and p.indexes["decode"].match(hashes) == {"a": 8}


def test_where_nothing_matches_it_chooses_as_least_loaded():
    """Prompts sharing no block: every pick, in every pool, is least_loaded's, with nothing guessed cached."""
    rng = random.Random(3)
    p, ll = _policy(), get_policy("least_loaded")
    for n in range(300):
        cands = [Candidate(f"w{i}", f"10.0.0.{i}:1", rng.randint(0, 9000), free := rng.randint(0, 400), 400,
                           rng.randint(0, 8), rng.randint(0, 9000), rng.randint(0, 8), rng.randint(0, 400 - free))
                 for i in range(rng.randint(1, 6))]
        prompt = _prompt(100_000 * (n + 1), rng.randint(0, 12))
        pool = rng.choice(["prefill", "decode", "encode"])
        got = p.pick(pool, cands, len(prompt), prompt_ids=prompt)
        assert got == ll.pick(pool, cands, len(prompt)) and got.cached_tokens == 0


def test_the_imbalance_test_counts_load_as_the_routing_helpers_do():
    """``imbalanced`` inlines pending_tokens (prefill) and blocks held, total - free_blocks (decode)."""
    rng = random.Random(5)
    p = _policy()
    for _ in range(500):
        cands = [Candidate(f"w{i}", "a:1", rng.randint(0, 9000), rng.randint(0, 600), 600, rng.randint(0, 80),
                           rng.randint(0, 9000), rng.randint(0, 80), rng.randint(0, 600))
                 for i in range(rng.randint(1, 5))]
        for pool, loads, gap in (("prefill", [pending_tokens(c) for c in cands], p.BALANCE_ABS_TOKENS),
                                 ("decode", [c.total_kv_blocks - free_blocks(c) for c in cands],
                                  p.BALANCE_ABS_TOKENS // p.BLOCK_SIZE)):
            most, least = max(loads), min(loads)
            busiest, idlest = max(sequences(c) for c in cands), min(sequences(c) for c in cands)
            assert p.imbalanced(pool, cands) == (
                most - least > gap and most > least * p.BALANCE_REL
                or busiest - idlest > p.BALANCE_ABS_REQUESTS and busiest > idlest * p.BALANCE_REL)


def test_a_replica_far_ahead_in_requests_loses_its_affinity():
    p = _policy()
    prompt = _prompt(0, 8)
    p.index.record("a", p.index.hashes(prompt))
    busy = [_c("a")._replace(inflight_requests=p.BALANCE_ABS_REQUESTS + 1), _c("b")._replace(running=0)]
    assert p.imbalanced("prefill", busy) and p.pick("prefill", busy, 32, prompt_ids=prompt).worker_id == "b"
    p = _policy()  # ("b" was recorded against the prompt just now)
    p.index.record("a", p.index.hashes(prompt))
    near = [_c("a")._replace(inflight_requests=p.BALANCE_ABS_REQUESTS), _c("b")]
    assert not p.imbalanced("prefill", near) and p.pick("prefill", near, 32, prompt_ids=prompt).worker_id == "a"


def test_a_decode_replica_without_room_for_the_rest_of_the_prompt_gives_way():
    p = _policy()
    prompt = _prompt(0, 8)
    p.indexes["decode"].record("a", p.index.hashes(prompt))
    # 8 cached blocks of a 44-token prompt: 12 tokens (3 blocks) to hold; "a" has 2 free, "b" 5
    tight = [_c("a", free=2), _c("b", free=5)]
    assert p.pick("decode", tight, 44, prompt_ids=prompt + _prompt(900, 3)).worker_id == "b"
    p = _policy()  # ("b" was recorded against the prompt just now)
    p.indexes["decode"].record("a", p.index.hashes(prompt))
    roomy = [_c("a", free=3), _c("b", free=5)]
    held = p.pick("decode", roomy, 44, prompt_ids=prompt + _prompt(900, 3))
    assert (held.worker_id, held.cached_tokens) == ("a", 32)


def test_a_replica_left_out_of_some_picks_stays_indexed():
    """A decode replica that refused some requests for room is not their candidate, but is still others'."""
    p = _policy()
    p.SWEEP_EVERY = 4
    p.indexes["decode"].record("full", p.index.hashes(_prompt(0, 3)))
    for i in range(16):  # four sweeps; "full" is a candidate of each period's first pick only, never a sweep's
        cands = [_c("a"), _c("full", free=0)] if i % 4 == 0 else [_c("a")]
        p.pick("decode", cands, 8, prompt_ids=_prompt(1000 + 100 * i, 2))
    assert "full" in p.indexes["decode"].workers()
    for i in range(8):  # two sweep periods in which it is nobody's candidate: forgotten
        p.pick("decode", [_c("a")], 8, prompt_ids=_prompt(5000 + 100 * i, 2))
    assert "full" not in p.indexes["decode"].workers()
