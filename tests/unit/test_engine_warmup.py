"""The start-up warm-up (workers.runtime.warmup): it runs the largest steps the limits allow, gives every
block back, and changes no later output, greedy or seeded."""

from __future__ import annotations

import pytest

from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.sampler import SamplingParams
from workers.runtime.warmup import warmup_shapes

from engine_helpers import assert_no_leaks, run_to_completion, token_ids

pytestmark = [pytest.mark.unit]

PROMPTS = [[1, 5, 9, 200, 31, 7, 44], [1] + list(range(3, 60)), [1, 300, 2, 3]]


def test_shapes_fill_the_token_budget_in_chunks_within_the_context_and_the_pool():
    chunks, context, decode_context = warmup_shapes(2048, 512, 64, 8192, 32768)
    assert chunks == (512, 512, 512, 512) and context == 8192 - 512 and decode_context == 512
    # a pool smaller than the context: one table of the whole pool; the decodes share it out evenly
    chunks, context, decode_context = warmup_shapes(100, 64, 4, 4096, 256)
    assert chunks == (64, 36) and context == 256 - 64 and decode_context == 64
    # no more chunks than sequences; a context shorter than a chunk
    assert warmup_shapes(1000, 10, 3, 8, 64) == ((8, 8, 8), 0, 8)


def _outputs(engine: Engine) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, ignore_eos=True))
    out = token_ids(run_to_completion(engine))
    assert_no_leaks(engine)
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_warm_up_changes_no_output_and_frees_its_blocks(tiny_bundle, kv_dtype):
    config = EngineConfig(kv_cache_bytes=1 << 21, kv_cache_dtype=kv_dtype, max_num_seqs=8,
                          max_num_batched_tokens=96, prefill_chunk_size=32, seed=3)
    cold = Engine(tiny_bundle.model, None, config)
    warm = Engine(tiny_bundle.model, None, config)
    shapes = warm.warm_up()
    assert shapes.prefill_chunks == (32, 32, 32) and shapes.decode_seqs == 8
    assert warm.stats().blocks_free == warm.stats().blocks_total and warm.stats().steps == 0
    assert _outputs(warm) == _outputs(cold)


def test_warm_up_refuses_an_engine_that_holds_a_request(tiny_bundle):
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 21))
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before the engine serves"):
        engine.warm_up()
    engine.abort("r")
    assert_no_leaks(engine)
