"""Routing policies are pure: same candidates, same choice; they spread load as documented."""

from __future__ import annotations

import random

import pytest

from controlplane.scheduler.policies import (
    Candidate,
    available_policies,
    compute_key,
    decode_key,
    free_blocks,
    get_policy,
    pending_tokens,
    sequences,
)

pytestmark = [pytest.mark.unit]


def _c(wid: str, queued=0, free=100, total=100, running=0, inflight_tokens=0, inflight_requests=0,
       inflight_blocks=0) -> Candidate:
    return Candidate(wid, f"127.0.0.1:{1000 + len(wid)}", queued, free, total, running, inflight_tokens,
                     inflight_requests, inflight_blocks)


def test_least_loaded_decode_prefers_free_blocks_then_fewer_running():
    p = get_policy("least_loaded")
    assert p.pick("decode", [_c("a", free=10), _c("b", free=50)], 10).worker_id == "b"
    assert p.pick("decode", [_c("a", running=3), _c("b", running=1)], 10).worker_id == "b"
    # what this scheduler holds there counts against a replica before its next heartbeat shows it
    assert p.pick("decode", [_c("a", free=50, inflight_blocks=90), _c("b", free=20)], 10).worker_id == "b"
    assert p.pick("decode", [_c("a", inflight_requests=2), _c("b", running=1)], 10).worker_id == "b"
    assert p.pick("decode", [_c("b"), _c("a")], 10).worker_id == "a"  # ties: lowest id


def test_least_loaded_decode_counts_what_a_worker_holds_once():
    p = get_policy("least_loaded")
    # the heartbeat already shows this scheduler's 30 blocks on "a": not counted twice (50 free, not 20)
    a, b = _c("a", free=50, inflight_blocks=30, inflight_requests=3, running=3), _c("b", free=45)
    assert p.pick("decode", [a, b], 10).worker_id == "a"
    # blocks count, not requests: two long sequences (generated tokens included) outweigh four short ones
    long, short = _c("a", inflight_blocks=40, inflight_requests=2), _c("b", inflight_blocks=12, inflight_requests=4)
    assert p.pick("decode", [long, short], 10).worker_id == "b"
    # a heartbeat older than the work this scheduler finished since still bounds what the worker holds
    assert p.pick("decode", [_c("a", free=60), _c("b", free=90, inflight_blocks=35)], 10).worker_id == "b"


def test_least_loaded_prefill_prefers_fewer_tokens_to_compute():
    p = get_policy("least_loaded")
    assert p.pick("prefill", [_c("a", queued=500), _c("b", queued=100)], 10).worker_id == "b"
    assert p.pick("prefill", [_c("a", queued=100), _c("b", queued=100, inflight_tokens=101)], 10).worker_id == "a"
    # the reported queue and this scheduler's own prompts overlap: the larger counts, not the sum
    assert p.pick("prefill", [_c("a", queued=300, inflight_tokens=300), _c("b", inflight_tokens=400)],
                  10).worker_id == "a"


def test_round_robin_cycles_per_pool():
    p = get_policy("round_robin")
    cands = [_c("b"), _c("a"), _c("c")]
    assert [p.pick("decode", cands, 1).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert p.pick("prefill", cands, 1).worker_id == "a"


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'; known: least_loaded, round_robin"):
        get_policy("fastest")
    assert available_policies() == ("least_loaded", "round_robin", "prefix_affinity")


def test_load_only_policies_ignore_prompt_ids():
    cands = [_c("a", queued=500), _c("b", queued=100)]
    assert get_policy("least_loaded").pick("prefill", cands, 4, prompt_ids=[1, 2, 3, 4]).worker_id == "b"
    assert get_policy("round_robin").pick("prefill", cands, 4, prompt_ids=[1, 2, 3, 4]).worker_id == "a"


def test_least_loaded_sort_keys_are_the_load_helpers_inlined():
    """decode_key and compute_key are free_blocks / pending_tokens / sequences written out for speed: the same
    order on every candidate, including where reported and in-flight load cross."""
    rng = random.Random(7)
    for i in range(2000):
        total = rng.randint(1, 64)
        c = _c(f"w{i}", queued=rng.randint(0, 50), free=rng.randint(0, total), total=total,
               running=rng.randint(0, 8), inflight_tokens=rng.randint(0, 50),
               inflight_requests=rng.randint(0, 8), inflight_blocks=rng.randint(0, total))
        assert decode_key(c) == (-free_blocks(c), sequences(c), c.worker_id)
        assert compute_key(c) == (pending_tokens(c), sequences(c), c.worker_id)
