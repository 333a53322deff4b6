"""``engine``: one prefill step and decode steps at batch 1, 8 and 32, against HF transformers.

Same checkpoint (the built-in demo model unless ``--model``), same dtype (float32), same process, same
torch thread count, measured in the same repeat:
  prefill    one engine step that prefills a 512-token prompt (128 with --quick) into the paged cache,
             against one transformers forward over the same tokens (no cache, logits of the last only);
  decode bN  8 (--quick: 4) engine decode steps of N running sequences (32-token prompts, prefilled before
             the timer), against as many transformers forwards of [N, 1] tokens on its DynamicCache
             (prefilled the same way). Figures are tokens per second, so the ratio is the speed-up.
Times are on the --clock (CPU time by default). The engine is built once (a 64 MiB KV pool, touched
before timing) and reused across repeats. Each try is long enough (tens to hundreds of ms) that one
try per side per repeat is taken; the median of the repeats does the filtering.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.micro.results import Result
from bench.micro.timing import Plan, paired
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.loader import LoadedModel, load_model
from workers.runtime.sampler import SamplingParams

BATCHES = (1, 8, 32)
PROMPT = 32


class TransformersMissing(RuntimeError):
    """HF transformers (a dev dependency) is not installed; the reference cannot be measured."""


def _prompt(length: int, vocab: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1234 + salt)
    return torch.randint(10, vocab, (length,), generator=g).tolist()


class _EngineSide:
    def __init__(self, bundle: LoadedModel, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.vocab = bundle.config.vocab_size
        # no prefix cache: each timed prefill sends the same prompt, and must compute all of it
        cfg = EngineConfig(kv_cache_bytes=64 * 2**20, max_num_seqs=64, max_num_batched_tokens=4096,
                           prefix_caching=False)
        self.engine = Engine(bundle.model, bundle.tokenizer, cfg, bundle.eos_token_ids)
        for storage in self.engine.cache.layers:  # fault the pool's pages in now, not in a timed step
            for t in storage.pool_tensors():
                t.view(torch.uint8).fill_(0)
        self._n = 0

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill(self, length: int) -> float:
        """Seconds of the one step that prefills a ``length``-token prompt (its first token included)."""
        self._n += 1
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.engine.add_request(f"p{self._n}", _prompt(length, self.vocab), params)
        start = self.clock()
        self.engine.step()
        elapsed = self.clock() - start
        if self.engine.has_unfinished():
            raise RuntimeError(f"a {length}-token prefill took more than one engine step")
        return elapsed

    def decode(self, batch: int, steps: int) -> float:
        """Seconds of ``steps`` decode steps of ``batch`` sequences (their prefill not timed)."""
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            self._n += 1
            self.engine.add_request(f"d{self._n}", _prompt(PROMPT, self.vocab, i), params)
        sched = self.engine.scheduler
        while self.engine.stats().num_waiting or any(s.num_computed < len(s.prompt_ids) for s in sched.running):
            self.engine.step()
        start = self.clock()
        ran = 0
        while self.engine.has_unfinished():
            self.engine.step()
            ran += 1
        elapsed = self.clock() - start
        if ran != steps:
            raise RuntimeError(f"expected {steps} decode steps at batch {batch}, the engine ran {ran}")
        return elapsed


class _HFSide:
    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.clock = clock
        try:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise TransformersMissing("HF transformers is not installed (the bench extra: pip install transformers); "
                                      "the engine benchmark needs it as its reference") from None
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.vocab = int(self.model.config.vocab_size)
        # transformers 5 renamed past_key_values to cache (the old name warns); 4.x knows only the old one
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _cache_of(self, out: Any) -> Any:
        return out.cache if self._cache_arg == "cache" else out.past_key_values

    @torch.inference_mode()
    def prefill(self, length: int) -> float:
        ids = torch.tensor([_prompt(length, self.vocab)])
        start = self.clock()
        self.model(ids, use_cache=False, logits_to_keep=1)
        return self.clock() - start

    @torch.inference_mode()
    def decode(self, batch: int, steps: int) -> float:
        ids = torch.tensor([_prompt(PROMPT, self.vocab, i) for i in range(batch)])
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        start = self.clock()
        for _ in range(steps):
            out = self.model(nxt, use_cache=True, **{self._cache_arg: self._cache_of(out)})
            nxt = out.logits[:, -1:].argmax(-1)
        return self.clock() - start


def run(plan: Plan) -> list[Result]:
    from workers.runtime.default_model import ensure_default_checkpoint

    path = plan.model if plan.model is not None else ensure_default_checkpoint()
    hf = _HFSide(path, plan.timer)
    bundle = load_model(path, dtype=torch.float32, with_vision=False)
    eng = _EngineSide(bundle, plan.timer)
    length = 128 if plan.quick else 512
    steps = 4 if plan.quick else 8
    threads = torch.get_num_threads()
    where = f"{path.name}, float32, {threads} thread(s), {plan.clock} clock"
    eng.decode(1, 2), hf.decode(1, 2), eng.prefill(length), hf.prefill(length)  # warm-up
    plan = dataclasses.replace(plan, inner=1, min_side_s=0.0)  # each try is long already; the median does the rest
    out = []
    figs, refs = paired(lambda: eng.prefill(length), lambda: hf.prefill(length), plan)
    out.append(Result("engine.prefill", "engine", "tok/s", "higher", f"HF transformers forward, {length} tokens",
                      tuple(length / s for s in figs), tuple(length / s for s in refs),
                      note=f"one {length}-token prompt; {where}"))
    for b in BATCHES:
        figs, refs = paired(lambda: eng.decode(b, steps), lambda: hf.decode(b, steps), plan)
        out.append(Result(f"engine.decode.b{b}", "engine", "tok/s", "higher",
                          f"HF transformers forward on its KV cache, batch {b}",
                          tuple(b * steps / s for s in figs), tuple(b * steps / s for s in refs),
                          note=f"{steps} decode steps after {PROMPT}-token prompts; {where}"))
    if eng.engine.cache.allocator.num_free != eng.engine.cache.num_blocks:
        raise RuntimeError("the engine leaked KV blocks during the benchmark")
    return out
