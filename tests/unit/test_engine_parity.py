"""The engine against HF transformers on the same checkpoints: logits within 1e-4 (float32) at prefill
and at each of 32 greedy decode steps, identical greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.runtime import engine as engine_module
from workers.runtime.attention import PrefillItem, build_step_batch
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.kv_cache import DenseLayerStorage
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import MultimodalInput

from engine_helpers import TINY_KINDS, assert_no_leaks, run_to_completion

pytestmark = [pytest.mark.unit, pytest.mark.transformers]

TOL = 1e-4
PROMPT = [1, 17, 250, 3, 99, 41, 7, 300, 12, 56, 88, 190, 4, 4, 31, 222, 9, 65, 140, 77, 23]


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _hf_greedy(hf, n: int, ids: list[int] | None = None, inputs_embeds: torch.Tensor | None = None):
    """HF greedy generation of exactly ``n`` tokens with raw logits; eos disabled (our ignore_eos)."""
    hf.generation_config.eos_token_id = None
    length = len(ids) if ids is not None else inputs_embeds.shape[1]
    with torch.no_grad():
        return hf.generate(input_ids=None if ids is None else torch.tensor([ids]), inputs_embeds=inputs_embeds,
                           attention_mask=torch.ones(1, length, dtype=torch.long), max_new_tokens=n,
                           do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_prefill_logits_match_hf_at_every_position(tiny_hf, kind):
    path = tiny_hf(kind)
    bundle = load_model(path, require_tokenizer=False)
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22))
    blocks = engine.cache.allocator.allocate(engine.cache.blocks_for(len(PROMPT)))
    batch = build_step_batch([], [PrefillItem(PROMPT, 0, blocks, want_logits=True)], engine.cache)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(PROMPT)))
    ours = bundle.model(batch, engine.cache)
    engine.cache.allocator.free(blocks)
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", list(TINY_KINDS))
@pytest.mark.parametrize("chunk", [512, 5])
def test_greedy_decode_matches_hf_for_32_steps(tiny_hf, kind, chunk):
    path = tiny_hf(kind)
    bundle = load_model(path, require_tokenizer=False)
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, prefill_chunk_size=chunk,
                                                     block_size=8))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                                   return_logits=True))
    outs = run_to_completion(engine)["r"]
    ref = _hf_greedy(_hf(path), 32, PROMPT)
    ref_tokens = ref.sequences[0, len(PROMPT):].tolist()
    assert [o.new_token_ids[0] for o in outs] == ref_tokens
    assert len(outs) == 32 and len(ref.logits) == 32
    worst = max((o.logits - ref_logits[0].float()).abs().max().item() for o, ref_logits in zip(outs, ref.logits))
    assert worst <= TOL, f"max |logit diff| over 32 steps = {worst}"
    assert_no_leaks(engine)


def test_image_embeddings_match_hf_inputs_embeds(tiny_hf):
    """Embeddings spliced at placeholder positions give the logits HF gives for the same inputs_embeds."""
    path = tiny_hf("llama-gqa")
    bundle = load_model(path, require_tokenizer=False)
    hf = _hf(path)
    placeholder = 5
    prompt = [1, 20, 21] + [placeholder] * 6 + [30, 31, 32]
    positions = tuple(range(3, 9))
    embeds = torch.randn(6, bundle.config.hidden_size, generator=torch.Generator().manual_seed(3))
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, prefill_chunk_size=4))
    engine.add_request("mm", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    return_logits=True), MultimodalInput(embeds, positions))
    outs = run_to_completion(engine)["mm"]
    with torch.no_grad():
        inputs = hf.get_input_embeddings()(torch.tensor([prompt]))
        inputs[0, list(positions)] = embeds
    ref = _hf_greedy(hf, 8, inputs_embeds=inputs)
    assert [o.new_token_ids[0] for o in outs] == ref.sequences[0, -8:].tolist()
    assert max((o.logits - ref_logits[0]).abs().max().item() for o, ref_logits in zip(outs, ref.logits)) <= TOL
    assert_no_leaks(engine)


def test_bfloat16_engine_tracks_hf_bfloat16(tiny_hf):
    """bf16 runs end to end; its first-step logits stay close to HF's own bf16 logits."""
    path = tiny_hf("llama-gqa")
    bundle = load_model(path, dtype=torch.bfloat16, require_tokenizer=False)
    engine = Engine(bundle.model, None, EngineConfig(dtype="bfloat16", kv_cache_bytes=1 << 22))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                   return_logits=True))
    outs = run_to_completion(engine)["r"]
    with torch.no_grad():
        ref = _hf(path, torch.bfloat16)(torch.tensor([PROMPT])).logits[0, -1].float()
    layer = engine.cache.layers[0]
    assert isinstance(layer, DenseLayerStorage) and layer.k.dtype == torch.bfloat16
    assert (outs[0].logits - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    assert_no_leaks(engine)


def test_default_model_matches_hf(default_ckpt, default_bundle):
    """`epd model init` output loads in transformers as it is and gives the engine's logits."""
    prompt = default_bundle.tokenizer.encode("The quick brown fox")
    engine = Engine(default_bundle.model, default_bundle.tokenizer, EngineConfig())
    engine.add_request("d", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   return_logits=True))
    outs = run_to_completion(engine)["d"]
    ref = _hf_greedy(_hf(default_ckpt), 8, prompt)
    assert [o.new_token_ids[0] for o in outs] == ref.sequences[0, len(prompt):].tolist()
    assert max((o.logits - ref_logits[0]).abs().max().item() for o, ref_logits in zip(outs, ref.logits)) <= TOL
    assert_no_leaks(engine)


@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_logprobs_are_hfs_log_softmax_of_the_chosen_and_the_most_likely_tokens(tiny_hf, kind):
    """``logprobs=5``: each output token's log-probability and the five most likely tokens', as log_softmax of
    HF's logits at that step; sampling at temperature 0.7 reports the model's own distribution (vLLM's raw
    logprobs), so the figures are those of HF's greedy run over the tokens drawn (teacher-forced here)."""
    path = tiny_hf(kind)
    bundle = load_model(path, require_tokenizer=False)
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, block_size=8))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True,
                                                   logprobs=5))
    outs = run_to_completion(engine)["r"]
    drawn = [o.new_token_ids[0] for o in outs]
    with torch.no_grad():
        ref = torch.log_softmax(_hf(path)(torch.tensor([PROMPT + drawn])).logits[0].float(), dim=-1)
    assert len(outs) == 16
    for step, o in enumerate(outs):
        lp = ref[len(PROMPT) - 1 + step]
        assert o.logprobs is not None and len(o.logprobs.top) == 5
        assert abs(o.logprobs.logprob - lp[drawn[step]].item()) <= TOL
        ids = [i for i, _ in o.logprobs.top]
        values = [v for _, v in o.logprobs.top]
        assert values == sorted(values, reverse=True)
        assert max(abs(v - lp[i].item()) for i, v in o.logprobs.top) <= TOL  # each is that token's
        assert max(abs(a - b) for a, b in zip(values, lp.topk(5).values.tolist())) <= TOL  # and they are the top
        assert len(set(ids)) == 5
    assert_no_leaks(engine)


@pytest.mark.parametrize("chunk, rows", [(512, 128), (5, 128), (512, 4)])
def test_prompt_logprobs_are_hfs_log_softmax_at_the_position_before_each_prompt_token(tiny_hf, chunk, rows,
                                                                                     monkeypatch):
    """``prompt_logprobs=3``: every prompt token after the first with its log-probability under the positions
    before it and the three most likely tokens', as HF's log_softmax gives them, sent once with the first
    output token; chunked prefill (5 tokens a step) gathers them chunk by chunk. A request beside it that does
    not ask gets none."""
    monkeypatch.setattr(engine_module, "PROMPT_LOGITS_ROWS", rows)  # 4: the logits taken a few rows at a time
    path = tiny_hf("llama-gqa")
    bundle = load_model(path, require_tokenizer=False)
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22, block_size=8, prefill_chunk_size=chunk))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    engine.add_request("other", PROMPT[:9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = run_to_completion(engine)
    with torch.no_grad():
        ref = torch.log_softmax(_hf(path)(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    first, *rest = outs["r"]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(PROMPT) - 1
    assert all(o.prompt_logprobs is None for o in rest) and all(o.prompt_logprobs is None for o in outs["other"])
    for i, got in enumerate(first.prompt_logprobs):
        lp = ref[i]  # position i predicts prompt token i + 1
        assert abs(got.logprob - lp[PROMPT[i + 1]].item()) <= TOL
        assert max(abs(a - b) for (_, a), b in zip(got.top, lp.topk(3).values.tolist())) <= TOL
        assert max(abs(v - lp[t].item()) for t, v in got.top) <= TOL
    assert_no_leaks(engine)
