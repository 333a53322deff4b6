"""The engine on the kernel path (forced on CPU through Triton's interpreter) gives the torch path's
tokens and logits: same model, same requests, chunked prefill, ragged batches, quantised layers."""

from __future__ import annotations

import pytest
import torch

from tests.unit.triton_env import DEVICE  # first: sets TRITON_INTERPRET before the kernels are imported
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

from engine_helpers import assert_no_leaks, run_to_completion

pytestmark = [pytest.mark.unit, pytest.mark.transformers]

# Tiny on purpose: the interpreter runs every kernel program in Python. With chunks of 6 the long
# prompts prefill over cached context; the short one decodes while they do.
PROMPTS = [[1, 17, 250, 3, 99, 41, 7, 300, 12, 56, 88, 190, 4], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]


def _run(model, **config) -> dict[str, list]:
    engine = Engine(model, None, EngineConfig(device=str(DEVICE), kv_cache_bytes=1 << 20, max_num_seqs=4, **config))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    outs = run_to_completion(engine)
    assert_no_leaks(engine)
    return outs


@pytest.mark.parametrize("kind,cache_dtype,chunk", [("llama-gqa", "auto", 6), ("qwen2", "int8", 512)])
def test_kernel_path_gives_the_torch_path_tokens(tiny_hf, kind: str, cache_dtype: str, chunk: int) -> None:
    model = load_model(tiny_hf(kind), device=str(DEVICE), require_tokenizer=False).model
    want = _run(model, kernels="torch", kv_cache_dtype=cache_dtype, prefill_chunk_size=chunk)
    got = _run(model, kernels="triton", kv_cache_dtype=cache_dtype, prefill_chunk_size=chunk)
    assert got.keys() == want.keys()
    for rid in want:
        assert [o.new_token_ids for o in got[rid]] == [o.new_token_ids for o in want[rid]]
        for a, b in zip(got[rid], want[rid]):
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)


def test_a_padded_decode_bucket_gives_the_same_logits_and_writes_nothing_more(tiny_hf) -> None:
    """What a CUDA graph replays, run eagerly here: the static buffers of a bucket of 4 holding 3
    sequences give the logits of the plain kernel-path batch, and the padded row touches no cache slot."""
    from workers.runtime.attention import DecodeItem, build_step_batch
    from workers.runtime.cuda_graphs import DecodeBuffers

    model = load_model(tiny_hf("llama-gqa"), device=str(DEVICE), require_tokenizer=False).model
    engine = Engine(model, None, EngineConfig(device=str(DEVICE), kv_cache_bytes=1 << 20, kernels="triton",
                                              cuda_graphs=False))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # every prompt prefilled: all three decode from here
    decodes = [DecodeItem(s.output_ids[-1], s.num_computed, s.block_table) for s in engine.scheduler.running]
    assert len(decodes) == 3
    want = model(build_step_batch(decodes, [], engine.cache, paged_kernels=True), engine.cache, None, engine._ops)
    cache_after = [getattr(s, n).clone() for s in engine.cache.layers for n in ("k", "v")]
    buffers = DecodeBuffers(8, engine.cache.blocks_for(engine.max_model_len), engine.cache.block_size, DEVICE)
    buffers.stage(decodes, 4)
    assert buffers.host["slots"][3].item() == -1 and buffers.host["lens"][3].item() == 0
    got = model(buffers.batch(4, max(d.position + 1 for d in decodes)), engine.cache, None, engine._ops)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    # the real rows rewrite their own slots (equal to rounding: the matmuls ran at another batch size);
    # every other slot, the ones a padded row could have hit included, is as it was
    written = torch.tensor(buffers.host["slots"][:3].tolist())
    others = torch.ones(cache_after[0].shape[0], dtype=torch.bool)
    others[written] = False
    for before, now in zip(cache_after, (getattr(s, n) for s in engine.cache.layers for n in ("k", "v"))):
        assert torch.equal(before[others.to(DEVICE)], now[others.to(DEVICE)])
        torch.testing.assert_close(now[written.to(DEVICE)], before[written.to(DEVICE)], atol=1e-5, rtol=1e-5)
