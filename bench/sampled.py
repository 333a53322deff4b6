"""The sampled decode rows of ``epd bench engine`` (CPU and CUDA): one setting for the engine and for
transformers' ``generate()``."""

from __future__ import annotations

from typing import Any

from workers.runtime.sampler import SamplingParams

# The sampled rows' settings, for the engine and for transformers' generate() (top_k off in both).
TEMPERATURE, TOP_P = 0.8, 0.95


def decode_params(tokens: int, sampled: bool, seed: int) -> SamplingParams:
    """A decode row's request: greedy, or sampled with its own seed; exactly ``tokens`` tokens."""
    if sampled:
        return SamplingParams(max_tokens=tokens, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True, seed=seed)
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def hf_sampling(sampled: bool) -> dict[str, Any]:
    """transformers ``generate()`` arguments for a greedy or a sampled row."""
    return {"do_sample": True, "top_k": 0, "temperature": TEMPERATURE, "top_p": TOP_P} if sampled else \
        {"do_sample": False}
