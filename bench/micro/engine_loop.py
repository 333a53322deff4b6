"""``engine-loop``: what a worker's hand-off to its engine costs a one-token request, beyond the engine's time.

A prefill worker's gRPC handler gives the request to ``workers.engine_loop.EngineLoop`` and waits for its
output. Two ways, on the demo model in bfloat16 with one torch thread, one request at a time on an idle
loop:
  handoff   ``submit`` wakes the loop thread, which steps and wakes the handler (the path a busy worker
            takes);
  run_here  the handler steps the idle engine itself (``run_here``: what the prefill worker does now).
The figure per request is its wall time from ``submit`` to its output in hand, minus the engine time the
loop reports for it (``RequestOutput.engine_seconds``): the hand-off alone. The reference is a raw
thread round trip measured in the same repeat: an item through a ``queue.Queue`` to a waiting thread and
back, the least a hand-off to another thread and back can cost. Wall clock throughout (hand-offs are
waits, not CPU).
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from typing import TYPE_CHECKING

from bench.micro.results import Result
from bench.micro.timing import Plan

if TYPE_CHECKING:  # annotations only: torch and the engine load inside run()
    from workers.engine_loop import EngineLoop
    from workers.runtime.sampler import SamplingParams

PROMPT = [11, 23, 37, 41, 53, 67, 79, 83]


def _raw_round_trip_us(n: int) -> float:
    """Median microseconds of an item to a waiting thread and back."""
    there: queue.Queue = queue.Queue()
    back: queue.Queue = queue.Queue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        there.put(i)
        back.get()
        out.append((time.perf_counter() - t0) * 1e6)
    there.put(None)
    t.join(5)
    return statistics.median(out)


def _handoff_us(loop: EngineLoop, params: SamplingParams, n: int, here: bool, tag: str) -> float:
    """Median microseconds beyond the engine's own time, per one-token request."""
    out = []
    for i in range(n):
        rid = f"{tag}-{i}"
        t0 = time.perf_counter()
        q = loop.submit(rid, PROMPT, params, wake=not here)
        if here:
            loop.run_here(rid)
        item = q.get(timeout=30)
        wall = time.perf_counter() - t0
        if not getattr(item, "finished", False):
            raise RuntimeError(f"request {rid} did not finish in one output: {item!r}")
        out.append((wall - item.engine_seconds) * 1e6)
    return statistics.median(out)


def run(plan: Plan) -> list[Result]:
    import torch

    from workers.engine_loop import EngineLoop
    from workers.runtime.default_model import ensure_default_checkpoint
    from workers.runtime.engine import Engine, EngineConfig
    from workers.runtime.loader import load_model
    from workers.runtime.sampler import SamplingParams

    path = plan.model if plan.model is not None else ensure_default_checkpoint()
    bundle = load_model(path, dtype=torch.bfloat16, with_vision=False)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(dtype="bfloat16", kv_cache_bytes=64 * 2**20),
                    bundle.eos_token_ids)
    loop = EngineLoop(engine, name="micro-engine-loop")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    n = 10 if plan.quick else 60
    results: dict[str, tuple[list[float], list[float]]] = {"handoff": ([], []), "run_here": ([], [])}
    try:
        _handoff_us(loop, params, 3, False, "warm")  # first steps allocate
        for r in range(plan.repeats):
            for name in (("handoff", "run_here") if r % 2 == 0 else ("run_here", "handoff")):
                figs, refs = results[name]
                refs.append(_raw_round_trip_us(n))
                figs.append(_handoff_us(loop, params, n, name == "run_here", f"{name}{r}"))
        if engine.cache.allocator.num_free != engine.cache.num_blocks:
            raise RuntimeError("the engine leaked KV blocks during the benchmark")
    finally:
        loop.stop()
    where = f"{path.name}, bfloat16, {torch.get_num_threads()} thread(s), wall clock, {n} requests per repeat"
    notes = {"handoff": "submit wakes the loop thread, which wakes the handler (a busy worker's path)",
             "run_here": "the handler steps the idle engine itself (the prefill worker's one-token path)"}
    return [Result(f"engine-loop.{name}", "engine-loop", "us", "lower",
                   "a raw thread round trip (queue.Queue there and back)", tuple(figs), tuple(refs),
                   note=f"one-token requests, time beyond the engine's own; {notes[name]}; {where}")
            for name, (figs, refs) in results.items()]
