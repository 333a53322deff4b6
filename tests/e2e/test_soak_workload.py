"""The soak's mixed load (``epd bench chaos --soak M --mix``) against the real stack (three workers, the HTTP
API): every kind and every malformed variant ends as its kind says it must, greedy answers equal
``generate()``'s, and afterwards no worker holds a block, a reservation or a sequence.

The soak itself (``bench/chaos/run.py``) starts a whole ``epd serve`` for minutes, so the suite runs its load
here, on the shared stack, and its report's arithmetic in tests/unit/test_soak_report.py.
"""

from __future__ import annotations

import copy
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

from bench.chaos.workload import KINDS, MALFORMED, GreedyWorkload, MixedWorkload, prompt_texts
from workers.runtime.default_model import DEFAULT_MODEL_NAME
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

if TYPE_CHECKING:  # the fixtures come from tests/e2e/conftest.py
    from conftest import Stack

pytestmark = [pytest.mark.e2e]
MAX_TOKENS = 6


def _workloads(stack: Stack) -> tuple[GreedyWorkload, MixedWorkload]:
    tok = stack.bundle.tokenizer
    assert tok is not None
    prompts = [tok.encode(text) for text in prompt_texts(4)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    refs = [r.text for r in generate(stack.bundle, [GenerateRequest(prompt_ids=p, params=params) for p in prompts])]
    assert len(set(refs)) == len(refs), "prompts with the same answer could not tell one request's from another's"
    base = stack.base_url.removesuffix("/v1")
    greedy = GreedyWorkload(base, DEFAULT_MODEL_NAME, prompts, refs, MAX_TOKENS, api_key=stack.api_key)
    card = httpx.get(f"{stack.base_url}/models", headers=greedy.headers, timeout=10).json()["data"][0]
    return greedy, MixedWorkload(greedy, int(card["max_model_len"]), images=stack.bundle.vision is not None)


def test_every_kind_of_the_mixed_load_ends_as_it_must(e2e_stack: Stack) -> None:
    _, mixed = _workloads(e2e_stack)
    assert mixed.images, "the demo model takes images: the image kinds must be in the load"
    wanted = {kind: 1 if kind == "cancel_prefill" else 2 for kind, _ in KINDS if kind not in ("malformed", "long")}
    wanted.update({f"malformed/{v}": 1 for v in MALFORMED})
    wanted.update({"long/streamed": 1, "long/whole": 1})  # long prompts take seconds each here: one of each
    chosen: list[int] = []
    counts: Counter[str] = Counter()
    for n in range(2000):
        kind, variant, rng = mixed.kind_of(n)
        if kind == "long":  # the request's own draws say whether it streams (a copy: n is drawn again to send)
            variant = "streamed" if mixed._served(kind, copy.deepcopy(rng))[1]["stream"] else "whole"
        key = f"{kind}/{variant}" if variant else kind
        if counts[key] < wanted.get(key, 0):
            chosen.append(n)
            counts[key] += 1
    assert dict(counts) == wanted

    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda n: mixed.send(client, n), chosen))
    failed = [(o.kind, o.status, o.error) for o in outcomes if not o.ok]
    assert failed == []
    assert {o.kind for o in outcomes} == {k for k, _ in KINDS}
    greedy = [o for o in outcomes if o.checked]
    assert len(greedy) >= 4 and all(o.match for o in greedy), [(o.kind, o.match) for o in greedy]
    refused = [o.status for o in outcomes if o.kind == "malformed"]
    assert len(refused) == len(MALFORMED) and all(400 <= s < 500 for s in refused), refused
    e2e_stack.assert_workers_idle(within_s=15)
