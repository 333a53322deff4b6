"""``scheduler``: one routing decision over 64 workers per pool, in microseconds, against an empty call.

A decision is what the scheduler does per request attempt before any RPC: read the decode pool's
candidates from the ``WorkerView`` (its cached registry snapshot plus this scheduler's in-flight
counts), let the routing policy pick one, then the same for the prefill pool. The view is the real
``WorkerView`` over 64 decode and 64 prefill workers whose load numbers look like a busy deployment
(16k-block KV pools, some nearly full, queued tokens, running requests, in-flight work); its clock is
frozen, so the timed part never rereads the registry (the Redis read is the ``redis`` benchmark's
``list`` figure). The reference is an empty Python call with the same arguments, in the same loop, on the same --clock.

No prefix-block index exists in the scheduler yet: routing does not look at cached prefix blocks, so the
issue's "100k indexed blocks" cannot be measured; this figure is the decision without one.
"""

from __future__ import annotations

import random

from controlplane.bench.micro.results import Result
from controlplane.bench.micro.timing import Plan, paired, per_call_us
from controlplane.scheduler.policies import available_policies, get_policy
from controlplane.scheduler.scheduler import WorkerView
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRecord

WORKERS = 64
TOTAL_BLOCKS = 16384  # a 256 MiB pool of a 7B-class model's 16-token blocks, roughly
PROMPT_TOKENS = 1024
NO_BLOCK_INDEX = ("no prefix-block index exists yet: the issue's '100k indexed blocks' is not measured; "
                  "this is the decision over 64 workers' load numbers alone")


class _SnapshotRegistry:
    """The one registry method ``WorkerView`` reads, answering from fixed records (no Redis in the timed part)."""

    def __init__(self, records: dict[str, list[WorkerRecord]]) -> None:
        self._records = records

    def live_workers(self, pool: str) -> list[WorkerRecord]:
        return list(self._records[str(pool)])


def _records(pool: str, rng: random.Random) -> list[WorkerRecord]:
    out = []
    for i in range(WORKERS):
        free = rng.randint(0, TOTAL_BLOCKS)
        load = WorkerLoad(queued_tokens=rng.randint(0, 8192), free_kv_blocks=free, total_kv_blocks=TOTAL_BLOCKS,
                          running=rng.randint(0, 32))
        info = WorkerInfo(worker_id=f"{pool}-{i:03d}", pool=pool, address=f"10.0.{i // 250}.{i % 250 + 1}:50051",
                          load=load)
        out.append(WorkerRecord(info, heartbeat_at=0.0, lease_expires_at=1e12))
    return out


def build_view(seed: int = 0) -> WorkerView:
    """A real ``WorkerView`` over 64 decode and 64 prefill workers, a third of them with work in flight."""
    rng = random.Random(seed)
    registry = _SnapshotRegistry({p: _records(p, rng) for p in ("decode", "prefill")})
    view = WorkerView(registry, refresh_s=1e9, clock=lambda: 0.0)  # type: ignore[arg-type]
    for pool in ("decode", "prefill"):
        view.candidates(pool)  # fills the cache once
        for i in range(0, WORKERS, 3):
            view.begin(f"{pool}-{i:03d}", rng.randint(16, 4096))
    return view


def decide(view: WorkerView, policy, tokens: int = PROMPT_TOKENS) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """Mirror of the scheduler's per-attempt picks: decode first, then prefill (nothing excluded)."""
    exclude: set[str] = set()
    decode = policy.pick("decode", [c for c in view.candidates("decode") if c.worker_id not in exclude], tokens)
    prefill = policy.pick("prefill", [c for c in view.candidates("prefill") if c.worker_id not in exclude], tokens)
    return decode.worker_id, prefill.worker_id


def _empty(view: WorkerView, policy, tokens: int = PROMPT_TOKENS) -> None:  # type: ignore[no-untyped-def]
    return None


def run(plan: Plan) -> list[Result]:
    calls = 100 if plan.quick else 300
    view = build_view()
    out = []
    for name in available_policies():
        policy = get_policy(name)
        decide(view, policy)  # warm-up (and a check that it picks)
        figs, refs = paired(per_call_us(lambda: decide(view, policy), calls, plan.timer),
                            per_call_us(lambda: _empty(view, policy), calls, plan.timer), plan)
        out.append(Result(f"scheduler.{name}", "scheduler", "us", "lower",
                          "an empty Python call with the same arguments", tuple(figs), tuple(refs),
                          note=f"{WORKERS} decode + {WORKERS} prefill workers; {plan.clock} clock; {NO_BLOCK_INDEX}"))
    return out
