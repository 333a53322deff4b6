"""Shared helpers for engine tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from workers.runtime.engine import Engine
from workers.runtime.sampler import SamplingParams

# name -> (transformers config class name, kwargs)
TINY_KINDS: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
}


def write_tiny_hf(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random transformers checkpoint (float32) of the given kind, saved as HF does."""
    import transformers

    cls_name, extra = TINY_KINDS[kind]
    config = getattr(transformers, cls_name)(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **extra)
    model_cls = transformers.Qwen2ForCausalLM if cls_name == "Qwen2Config" else transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # HF zero-inits biases; give Qwen2's q/k/v biases real values to test them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder)
    return folder


def assert_no_leaks(engine: Engine) -> None:
    """Nothing queued, nothing running, every block back in the free list."""
    stats = engine.stats()
    assert stats.num_waiting == 0 and stats.num_running == 0, stats
    assert stats.blocks_free == stats.blocks_total, f"{stats.blocks_total - stats.blocks_free} KV blocks leaked"
    assert not engine._seqs, f"requests left behind: {list(engine._seqs)}"


def run_to_completion(engine: Engine) -> dict[str, list]:
    """Step until idle; returns request id -> list of RequestOutput."""
    outs: dict[str, list] = {}
    for _ in range(100_000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def token_ids(outs: dict[str, list]) -> dict[str, list[int]]:
    """``run_to_completion``'s outputs as request id -> its token ids."""
    return {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}


def run_joining(engine: Engine, requests: list[tuple[list[int], SamplingParams]], every: int) -> dict[str, list[int]]:
    """Step until idle, adding request i (id ``str(i)``) one at a time every ``every`` steps while the others
    run and finish at their own lengths; returns request id -> its token ids."""
    got: dict[str, list[int]] = {}
    pending = list(range(len(requests)))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i = pending.pop(0)
            engine.add_request(str(i), *requests[i])
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return got


def run_alone(make_engine: Callable[[], Engine],
              requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Each request i (id ``str(i)``) alone in a fresh engine; returns request id -> its token ids."""
    got: dict[str, list[int]] = {}
    for i, (prompt, params) in enumerate(requests):
        engine = make_engine()
        engine.add_request(str(i), prompt, params)
        got.update(token_ids(run_to_completion(engine)))
    return got
