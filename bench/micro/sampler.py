"""``sampler``: one sampling step over a 32,000-token vocabulary, at 1 and 32 rows, against transformers'.

The figure is ``workers.runtime.sampler.sample`` as the engine calls it: every row sampled with temperature
0.8 and top_p 0.95 (``bench.sampled``), each with its own generator seeded for that token. The reference is
what transformers' ``generate()`` does each step for the same settings: its temperature and top-p logits
processors, a softmax and one batched ``torch.multinomial``. Both read the same float32 logits on the CPU,
shaped as a trained model's are: a normal draw times 2, with 50 tokens raised 4 to 12 above it, so that
top_p's cut falls among the first hundred or so tokens. Figures are microseconds per step, on the --clock.
"""

from __future__ import annotations

import torch

from bench.micro.results import Result
from bench.micro.timing import Plan, paired, per_call_us
from bench.sampled import TEMPERATURE, TOP_P
from workers.runtime.sampler import SamplingParams, sample, seed_draw

VOCAB = 32000
ROWS = (1, 32)


def _peaked(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    for r in range(rows):
        top = torch.randperm(VOCAB, generator=g)[:50]
        logits[r, top] += torch.linspace(12.0, 4.0, 50)
    return logits


def run(plan: Plan) -> list[Result]:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = (TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(TOP_P))
    calls = 3 if plan.quick else 10
    out = []
    for rows in ROWS:
        logits = _peaked(rows)
        params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=i) for i in range(rows)]
        generators = [torch.Generator() for _ in range(rows)]
        step = [0]

        def ours() -> list[int]:
            step[0] += 1
            for i, g in enumerate(generators):
                seed_draw(g, i, step[0])
            return sample(logits, params, generators)

        def transformers_step() -> list[int]:
            scores = logits
            for warp in warpers:
                scores = warp(None, scores)  # neither warper reads input_ids
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1).tolist()

        if len(ours()) != rows or len(transformers_step()) != rows:  # warm-up, and a check that both sample
            raise RuntimeError("a sampler returned the wrong number of tokens")
        figs, refs = paired(per_call_us(ours, calls, plan.timer), per_call_us(transformers_step, calls, plan.timer),
                            plan)
        out.append(Result(f"sampler.b{rows}", "sampler", "us", "lower",
                          "transformers' temperature + top-p processors, softmax, batched multinomial",
                          tuple(figs), tuple(refs),
                          note=f"{rows} rows x {VOCAB} tokens, temperature {TEMPERATURE}, top_p {TOP_P}; "
                               f"{plan.clock} clock"))
    return out
