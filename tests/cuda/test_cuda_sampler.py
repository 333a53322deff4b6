"""The sampler on CUDA: a seeded row gets the token it gets on the CPU from the same float32 logits (one uniform
from the request's CPU generator, the CDF in float64), with top_k, top_p, ties, flat rows whose top_p cut lies
past the first candidates, and non-finite rows."""

from __future__ import annotations

import torch

from tests.cuda.helpers import CUDA
from workers.runtime.sampler import SamplingParams, sample, seed_draw

pytestmark = CUDA


def test_cuda_draws_the_tokens_the_cpu_draws() -> None:
    g = torch.Generator().manual_seed(0)
    rows, vocab = 48, 32000
    scales = torch.tensor([0.05, 1.0, 4.0])[torch.arange(rows) % 3][:, None]
    logits = ((torch.randn(rows, vocab, generator=g) * scales) * 8).round() / 8  # ties, as bf16 logits have
    logits[5, 7] = float("nan")
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 1, 40, 0][i // 4 % 4],
                             top_p=[1.0, 0.95, 0.5][i // 16 % 3], seed=i) for i in range(rows)]
    def generators(step: int) -> list[torch.Generator]:
        gens = [torch.Generator() for _ in range(rows)]
        for i, gen in enumerate(gens):
            seed_draw(gen, i, step)
        return gens
    for step in range(4):
        on_cpu = sample(logits, params, generators(step))
        assert sample(logits.cuda(), params, generators(step)) == on_cpu
    assert on_cpu[5] == 7  # a NaN row keeps its argmax, which is the NaN's index
    assert len(set(on_cpu)) > rows // 2  # really sampling
