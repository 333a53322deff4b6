"""Resolves a codec policy for an engine; ``auto`` runs sample prompts to measure each layer's error."""

from __future__ import annotations

import torch

from kvtransfer.policy import AutoPolicy, Calibration, ExplicitPolicy, calibrate, parse_policy
from workers.runtime.engine import Engine, LayerKVReady
from workers.runtime.kv_cache import block_slots
from workers.runtime.sampler import SamplingParams


def sample_kv(engine: Engine, prompts: list[list[int]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Prefill each prompt and collect its full blocks per layer as (keys, values) [n, block, heads, dim]
    (a prompt run twice is sampled twice)."""
    cfg = engine.model.cfg
    bs = engine.cache.block_size
    samples: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(cfg.num_layers)]

    taken: dict[tuple[int, str], int] = {}  # (layer, request) -> its blocks [0, n) are sampled

    def grab(event: LayerKVReady) -> None:
        for c in event.chunks:
            # whole blocks completed so far, from the first not sampled (a prompt's first chunk may start
            # past blocks its engine had cached: they are sampled too, read from the cache)
            lo, hi = taken.get((event.layer, c.request_id), 0), c.end // bs
            if hi <= lo:
                continue
            taken[event.layer, c.request_id] = hi
            slots = block_slots(list(c.blocks[lo:hi]), bs, engine.cache.device)  # on the cache's device
            k, v = engine.cache.layers[event.layer].gather(slots, engine.model.dtype)
            shape = (hi - lo, bs, cfg.num_kv_heads, cfg.head_dim)
            samples[event.layer].append((k.view(shape).clone(), v.view(shape).clone()))

    engine.add_layer_hook(grab)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"calibrate-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.remove_layer_hook(grab)
    return samples


def resolve_codecs(spec: str, engine: Engine, sample_prompts: list[list[int]] | None = None) -> Calibration:
    """The codec per layer for ``spec``; ``auto`` needs sample prompts with at least one full block."""
    policy = parse_policy(spec)
    num_layers = engine.model.cfg.num_layers
    if isinstance(policy, ExplicitPolicy):
        return Calibration(policy.resolve(num_layers))
    assert isinstance(policy, AutoPolicy)
    if not sample_prompts:
        raise ValueError("the auto codec policy needs sample prompts to calibrate on")
    return calibrate(sample_kv(engine, sample_prompts), policy)
