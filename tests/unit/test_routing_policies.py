"""Routing policies are pure: same candidates, same choice; they spread load as documented."""

from __future__ import annotations

import pytest

from controlplane.scheduler.policies import Candidate, available_policies, get_policy

pytestmark = [pytest.mark.unit]


def _c(wid: str, queued=0, free=100, total=100, running=0, inflight_tokens=0, inflight_requests=0) -> Candidate:
    return Candidate(wid, f"127.0.0.1:{1000 + len(wid)}", queued, free, total, running, inflight_tokens,
                     inflight_requests)


def test_least_loaded_decode_prefers_free_blocks_then_fewer_running():
    p = get_policy("least_loaded")
    assert p.pick("decode", [_c("a", free=10), _c("b", free=50)], 10).worker_id == "b"
    assert p.pick("decode", [_c("a", running=3), _c("b", running=1)], 10).worker_id == "b"
    # what this scheduler already sent counts against a replica before its next heartbeat
    assert p.pick("decode", [_c("a", free=50, inflight_tokens=16 * 45), _c("b", free=20)], 10).worker_id == "b"
    assert p.pick("decode", [_c("b"), _c("a")], 10).worker_id == "a"  # ties: lowest id


def test_least_loaded_prefill_prefers_fewer_queued_tokens():
    p = get_policy("least_loaded")
    assert p.pick("prefill", [_c("a", queued=500), _c("b", queued=100)], 10).worker_id == "b"
    assert p.pick("prefill", [_c("a", queued=100), _c("b", queued=100, inflight_tokens=1)], 10).worker_id == "a"


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
