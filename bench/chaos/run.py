"""``epd bench chaos``: a steady greedy load through a live ``epd serve`` (``replicas`` per pool) while,
in turn, Redis is restarted, one replica of each pool is killed (SIGKILL) and one decode replica is
stopped (SIGSTOP for ``stop_s``, then SIGCONT). Each answer is compared with the single-process
``generate()`` of the same prompt; at the end the workers' KV blocks must all be free again.

  1. start     ``epd serve`` as a user starts it; references from ``generate()`` meanwhile.
  2. baseline  ``baseline_s`` of fault-free load (its p99 is the bound's base).
  3. faults    ``PLAN`` in order, each followed by ``settle_s`` of quiet load.
  4. drain     the load runs on until ``requests`` were sent, then stops; blocks are read until free.
  5. report    completed / failed / migrated (from the request journal), agreement, blocks left,
               recovery time per fault, p50/p99 before, during and after each.
With ``soak_minutes``: capacity is measured (closed loop), then a steady 70% of it runs for that long
while each process's RSS and the blocks in use are sampled; growth after warm-up is reported. The
workers reach their memory peak before they serve (``engine.warmup``), so the soak's own warm-up is
its first ``SOAK_WARMUP_S`` (or a fifth of a shorter soak). The deployment keeps the journals of the last
``SOAK_JOURNAL_CAP`` requests (``redis.journal_cap``), which the capacity probe and the warm-up fill, so
Redis's bounded journal is at its cap before growth is measured rather than filling during it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.chaos.deployment import Deployment
from bench.chaos.faults import PLAN, FaultKind, FaultResult, inject
from bench.chaos.load import LoadDriver, Outcome, Workload
from bench.chaos.procs import descendants, listening_pid, memory_bytes, process_name
from bench.chaos.report import ChaosReport, SoakReport, SoakSample, Window, fault_figures, kind_counts
from bench.chaos.workload import GreedyWorkload, MixedWorkload, prompt_texts
from controlplane.settings import RedisSettings, SchedulerSettings

SOAK_WARMUP_S = 60.0
SOAK_JOURNAL_CAP = 500
SOAK_KV_CACHE_BYTES = 64 * 2**20  # per prefill and decode replica: many times what the greedy load holds
# the CPU default: 4 requests at the demo model's whole context (8k tokens, float32 KV) per replica, as the
# mixed load's long prompts fill a quarter to all of it; at 64 MiB one such prompt filled a replica
SOAK_MIX_KV_CACHE_BYTES = 256 * 2**20
SOAK_RETRIES_ON_429 = 5  # the soak's clients retry a "full; retry later" as OpenAI's client does (2 there)


@dataclass(frozen=True)
class ChaosConfig:
    model: Path | None = None
    requests: int = 300
    concurrency: int = 8
    max_tokens: int = 32
    prompts: int = 16
    replicas: int = 2
    baseline_s: float = 20.0
    settle_s: float = 10.0
    stop_s: float = 10.0
    soak_minutes: float | None = None
    mix: bool = False  # the soak sends MixedWorkload's kinds instead of greedy completions only
    idle_s: float = 60.0  # the soak samples memory once more this long after its load ends (0: not)
    keep_log: Path | None = None  # copy epd serve's log here at the end


def _references(model: Path | None, n: int, max_tokens: int) -> tuple[list[list[int]], list[str], bool]:
    """``n`` prompts' token ids, ``generate()``'s greedy text for each, and whether the model takes images."""
    from workers.runtime.default_model import ensure_default_checkpoint
    from workers.runtime.generate import GenerateRequest, generate
    from workers.runtime.loader import load_model
    from workers.runtime.sampler import SamplingParams

    folder = model or ensure_default_checkpoint()
    bundle = load_model(folder)
    assert bundle.tokenizer is not None
    prompts = [bundle.tokenizer.encode(text) for text in prompt_texts(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    refs = generate(bundle, [GenerateRequest(prompt_ids=p, params=params) for p in prompts])
    return prompts, [r.text for r in refs], bundle.vision is not None


def _detection_s(kind: FaultKind) -> float:
    s = SchedulerSettings()
    return {FaultKind.KILL: 0.0, FaultKind.STOP: s.token_idle_timeout_s,
            FaultKind.REDIS: RedisSettings().command_budget_s}[kind]


def _blocks_held(dep: Deployment) -> dict[str, str]:
    """Each prefill and decode worker still holding KV blocks: its id -> "N blocks, M running"."""
    return {w.worker_id: f"{w.total_kv_blocks - w.free_kv_blocks} blocks, {w.running} running"
            for pool in ("prefill", "decode") for w in dep.workers(pool) if w.free_kv_blocks < w.total_kv_blocks}


def _blocks_used(dep: Deployment) -> int:
    return sum(w.total_kv_blocks - w.free_kv_blocks for pool in ("prefill", "decode") for w in dep.workers(pool))


def _wait_blocks_free(dep: Deployment, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        used = _blocks_used(dep)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


def _migrated(dep: Deployment, outcomes: list[Outcome]) -> int:
    from controlplane.state import connect
    from controlplane.state.journal import RequestJournal, RequestState

    url_file = dep.folder / "state" / f"private-redis.{dep.port}.url"  # written by epd serve (mode 0600)
    try:
        url = url_file.read_text().strip()
    except OSError:
        return -1
    conn = connect(url, RedisSettings().prefix)
    try:
        journal = RequestJournal(conn)
        return sum(any(e.state is RequestState.MIGRATING for e in journal.history(o.request_id))
                   for o in outcomes if o.request_id)
    finally:
        conn.close()


def chaos(cfg: ChaosConfig, say: Callable[[str], None] = print) -> ChaosReport:
    with tempfile.TemporaryDirectory(prefix="epd-chaos-") as tmp:
        dep = Deployment(cfg.model, cfg.replicas, Path(tmp))
        say(f"starting epd serve ({cfg.replicas} replicas per pool) ...")
        dep.start()
        results: list[FaultResult] = []
        try:
            prompts, refs, _ = _references(cfg.model, cfg.prompts, cfg.max_tokens)
            greedy = GreedyWorkload(dep.base, dep.model_name(), prompts, refs, cfg.max_tokens)
            driver = LoadDriver(greedy, cfg.concurrency).start()
            time.sleep(cfg.baseline_s)
            for spec in PLAN:
                say(f"fault: {spec.describe()}")
                results.append(inject(dep, spec, cfg.stop_s))
                say(f"  whole again after {results[-1].recovery_s:.1f} s")
                time.sleep(cfg.settle_s)
            while driver.count < cfg.requests:
                time.sleep(0.5)
            driver.stop()
            outcomes = list(driver.outcomes)
            leaked = _wait_blocks_free(dep)
            held = _blocks_held(dep) if leaked else {}
            migrated = _migrated(dep, outcomes)
        finally:
            dep.stop()
            if cfg.keep_log is not None:
                cfg.keep_log.write_text(dep.log_path.read_text(errors="replace"))
    first = results[0].at if results else float("inf")
    warm = min(o.start for o in outcomes) + min(5.0, cfg.baseline_s / 4) if outcomes else 0.0
    fault_free = Window.of([o for o in outcomes if warm <= o.start and o.end < first])
    figures = [fault_figures(r, outcomes, fault_free, _detection_s(r.spec.kind), cfg.settle_s) for r in results]
    ok = [o for o in outcomes if o.ok]
    errors = [o.error or f"HTTP {o.status}" for o in outcomes if not o.ok][:5]
    return ChaosReport(len(outcomes), len(ok), len(outcomes) - len(ok), migrated, sum(o.match for o in ok), leaked,
                       fault_free, figures, errors, [(o.start, o.end, o.status, o.error) for o in outcomes], held)


def _labels(dep: Deployment, pids: list[int]) -> dict[int, str]:
    """A name per process: ``decode <worker id>`` for a worker (found by its port), else its command line."""
    names = {}
    for pool in ("encode", "prefill", "decode"):
        for w in dep.workers(pool):
            pid = listening_pid(w.port)
            if pid is not None:
                names[pid] = f"{pool} {w.worker_id}"
    return {p: names.get(p) or f"{process_name(p)} ({p})" for p in pids}


def _sample(dep: Deployment, labels: dict[int, str], at_s: float, served: int) -> SoakSample:
    mem = {name: m for p, name in labels.items() if (m := memory_bytes(p)) is not None}
    return SoakSample(round(at_s, 1), {k: m[0] for k, m in mem.items()}, _blocks_used(dep),
                      {f"decode {w.worker_id}": w.running for w in dep.workers("decode")},
                      {k: m[1] for k, m in mem.items()}, served)


def _growth(first: dict[str, int], last: dict[str, int]) -> dict[str, float]:
    return {k: 100.0 * (last[k] - v) / v for k, v in first.items() if k in last and v}


def soak(cfg: ChaosConfig, say: Callable[[str], None] = print, sample_s: float = 15.0) -> SoakReport:
    assert cfg.soak_minutes is not None
    with tempfile.TemporaryDirectory(prefix="epd-soak-") as tmp:
        dep = Deployment(cfg.model, cfg.replicas, Path(tmp), extra={"redis": {"journal_cap": SOAK_JOURNAL_CAP}},
                         kv_cache_bytes=SOAK_MIX_KV_CACHE_BYTES if cfg.mix else SOAK_KV_CACHE_BYTES)
        say(f"starting epd serve ({cfg.replicas} replicas per pool) ...")
        dep.start()
        idle: SoakSample | None = None
        try:
            prompts, refs, vision = _references(cfg.model, cfg.prompts, cfg.max_tokens)
            card = dep.model_card()
            greedy = GreedyWorkload(dep.base, card["id"], prompts, refs, cfg.max_tokens)
            workload: Workload = MixedWorkload(greedy, int(card["max_model_len"]), vision) if cfg.mix else greedy
            probe = LoadDriver(workload, cfg.concurrency, retries_on_429=SOAK_RETRIES_ON_429).start()
            time.sleep(20.0)
            probe.stop()
            capacity = len(probe.outcomes) / max(1e-9, probe.outcomes[-1].end - probe.outcomes[0].start)
            rate = 0.7 * capacity
            baseline = _wait_blocks_free(dep)
            say(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {cfg.soak_minutes:g} min"
                + (" (mixed load)" if cfg.mix else ""))
            assert dep.proc is not None
            labels = _labels(dep, [dep.proc.pid, *sorted(descendants(dep.proc.pid))])
            driver = LoadDriver(workload, cfg.concurrency * 2, rate, retries_on_429=SOAK_RETRIES_ON_429).start()
            began = time.monotonic()
            samples: list[SoakSample] = []
            while time.monotonic() - began < cfg.soak_minutes * 60:
                samples.append(_sample(dep, labels, time.monotonic() - began, driver.count))
                time.sleep(sample_s)
            driver.stop()
            ended = time.monotonic()
            samples.append(_sample(dep, labels, ended - began, driver.count))  # the load's last state
            end_blocks = _wait_blocks_free(dep)
            preemptions = {f"{pool} {w.worker_id}": w.preemptions for pool in ("prefill", "decode")
                           for w in dep.workers(pool)}
            if cfg.idle_s > 0:
                say(f"load stopped; memory again after {cfg.idle_s:g} s idle ...")
                time.sleep(max(0.0, ended + cfg.idle_s - time.monotonic()))
                idle = _sample(dep, labels, time.monotonic() - began, driver.count)
        finally:
            dep.stop()
            if cfg.keep_log is not None:
                cfg.keep_log.write_text(dep.log_path.read_text(errors="replace"))
    warmup_s = min(SOAK_WARMUP_S, cfg.soak_minutes * 60 / 5)
    warm = next((s for s in samples if s.at_s >= warmup_s), samples[0])
    last = samples[-1]
    outs = driver.outcomes
    return SoakReport(cfg.soak_minutes, round(capacity, 3), round(rate, 3), len(outs), sum(not o.ok for o in outs),
                      sum(o.match for o in outs), _growth(warm.rss, last.rss), baseline, end_blocks, samples,
                      warm.at_s, SOAK_JOURNAL_CAP, mix=cfg.mix, checked=sum(o.checked and o.ok for o in outs),
                      anon_growth_pct=_growth(warm.anon, last.anon), kinds=kind_counts(outs), idle=idle,
                      idle_s=cfg.idle_s if idle is not None else 0.0,
                      errors=[f"{o.kind}: {o.error}" for o in outs if not o.ok][:5],
                      retried=sum(o.retries > 0 for o in outs), retries=sum(o.retries for o in outs),
                      retries_on_429=SOAK_RETRIES_ON_429, preemptions=preemptions)
