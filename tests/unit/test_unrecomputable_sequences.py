"""A disaggregated decode engine cannot recompute a sequence whose prompt KV came from images it never saw.
When the pool runs out, such a sequence is preempted only if no running sequence can be recomputed (even one
already in this step's batch goes first), and then it is evicted: finished with a RecomputeError, its
blocks freed, for the control plane to move it (tests/integration/test_image_eviction.py)."""

from __future__ import annotations

import pytest

from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import RecomputeError
from workers.runtime.kv_cache import KVCacheSpec
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import FinishReason

from engine_helpers import assert_no_leaks, run_to_completion

pytestmark = [pytest.mark.unit]

BS = 16


def _engine(bundle, blocks: int) -> Engine:
    cfg = bundle.config
    per_block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS).bytes_per_block(
        ("float32",) * cfg.num_layers)
    return Engine(bundle.model, None, EngineConfig(kv_cache_bytes=blocks * per_block, decode_headroom_tokens=0))


def _adopt(engine: Engine, rid: str, image: bool, max_tokens: int = 30) -> None:
    """A 20-token prompt whose KV "arrived" (the blocks hold whatever they held), with an image at 3 or none."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reservation = engine.reserve(rid, 20, max_tokens, 3 if image else None)
    engine.add_prefilled(reservation, [1] + [5] * 19, 7, params)


def test_a_text_sequence_already_in_the_batch_is_preempted_before_an_image_one(tiny_bundle):
    """Five blocks, two sequences of two blocks that both need a third at the same step: the older (text)
    takes the last free block, then the newer (image) needs one. The text one is taken out of the batch and
    preempted (before, the newest, the image one, was preempted and recomputed without its image)."""
    engine = _engine(tiny_bundle, 5)
    _adopt(engine, "text", image=False)
    _adopt(engine, "image", image=True)
    outs: dict[str, list] = {}
    waited: set[str] = set()
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        waited.update(s.request_id for s in engine.scheduler.waiting)
    assert waited == {"text"}  # only the text sequence was ever preempted
    assert all(o.error is None for seq in outs.values() for o in seq)
    for rid in ("text", "image"):
        assert outs[rid][-1].finish_reason is FinishReason.LENGTH and outs[rid][-1].num_output_tokens == 30
    assert_no_leaks(engine)


def test_with_only_image_sequences_the_newest_is_evicted_and_says_why(tiny_bundle):
    engine = _engine(tiny_bundle, 5)
    _adopt(engine, "first", image=True)
    _adopt(engine, "second", image=True)
    outs = run_to_completion(engine)
    last = outs["second"][-1]
    assert last.finished and last.finish_reason is FinishReason.ABORT and not last.new_token_ids
    assert isinstance(last.error, RecomputeError) and "cannot recompute request 'second'" in str(last.error)
    assert outs["first"][-1].finish_reason is FinishReason.LENGTH and outs["first"][-1].num_output_tokens == 30
    assert engine.stats().num_preemptions == 1
    assert_no_leaks(engine)
