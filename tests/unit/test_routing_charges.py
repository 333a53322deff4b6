"""What the routing view charges a worker per attempt (controlplane.scheduler.worker_view.Charge): decode
holds prompt and generated tokens in KV blocks, prefill its prompt until done; each charge goes back once,
and least_loaded then spreads sequences of unequal length evenly by the blocks they hold."""

from __future__ import annotations

import pytest

from controlplane.dispatch import WorkerRequest
from controlplane.scheduler.attempt import Attempt
from controlplane.scheduler.health import WorkerHealth
from controlplane.scheduler.policies import PrefixAffinity, get_policy
from controlplane.scheduler.selection import RouteSelector
from controlplane.scheduler.worker_view import WorkerView
from controlplane.state.registry import Pool, WorkerInfo, WorkerLoad, WorkerRecord
from epd.worker.v1 import worker_pb2 as wpb
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.unit]


class _Registry:
    """Two idle workers per pool, as their last heartbeats reported them."""

    def live_workers(self, pool: str) -> list[WorkerRecord]:
        load = WorkerLoad(queued_tokens=0, free_kv_blocks=100, total_kv_blocks=100, running=0)
        return [WorkerRecord(WorkerInfo(worker_id=f"{pool}-{x}", pool=Pool(pool), address=f"127.0.0.1:{i + 1}",
                                        load=load), heartbeat_at=0.0, lease_expires_at=1e12)
                for i, x in enumerate("ab")]


def _view() -> WorkerView:
    return WorkerView(_Registry(), refresh_s=1e9, clock=lambda: 0.0, block_size=16)  # type: ignore[arg-type]  # a stand-in registry


def _row(view: WorkerView, pool: str, worker_id: str) -> tuple[int, int, int]:
    c = next(c for c in view.candidates(pool) if c.worker_id == worker_id)
    return c.inflight_tokens, c.inflight_requests, c.inflight_blocks


def test_a_decode_charge_grows_with_generated_tokens_and_goes_back_once():
    view = _view()
    charge = view.begin("decode-a", 20, kv=True)
    assert _row(view, "decode", "decode-a") == (20, 1, 2)
    charge.grow(12)  # 32 tokens: still two blocks
    assert _row(view, "decode", "decode-a") == (32, 1, 2)
    charge.grow(1)
    assert _row(view, "decode", "decode-a") == (33, 1, 3)
    other = view.begin("decode-a", 5, kv=True)
    charge.release()
    charge.release()  # once only
    charge.grow(50)  # after release: nothing
    assert _row(view, "decode", "decode-a") == (5, 1, 1)
    other.release()
    assert view._inflight == {}


def test_a_prefill_charge_counts_tokens_not_blocks_and_ignores_generated_ones():
    view = _view()
    charge = view.begin("prefill-a", 700)
    charge.grow(10)
    assert _row(view, "prefill", "prefill-a") == (700, 1, 0)
    charge.release()
    assert _row(view, "prefill", "prefill-a") == (0, 0, 0) and view._inflight == {}


def test_least_loaded_balances_decode_by_blocks_held_including_generated_tokens():
    """Eight requests, two long-running: after they generated, new work goes where fewer blocks are held."""
    view, policy = _view(), get_policy("least_loaded")
    charges = {}
    for i in range(8):
        pick = policy.pick("decode", view.candidates("decode"), 20)
        charges[i] = view.begin(pick.worker_id, 20, kv=True)
    held = sorted(c.worker_id for c in charges.values())
    assert held == ["decode-a"] * 4 + ["decode-b"] * 4  # alternating while equal
    for c in charges.values():
        if c.worker_id == "decode-a":
            c.grow(200 if c is charges[0] else 10)  # one long sequence on "a"
        else:
            c.grow(10)
    picks = [policy.pick("decode", view.candidates("decode"), 20).worker_id for _ in range(3)]
    assert picks == ["decode-b"] * 3  # "a" holds 20 blocks, "b" 8: requests alone (4 and 4) would tie
    for c in charges.values():
        c.release()
    assert view._inflight == {}


class _Dispatcher:
    """Each request's first chunk at once: the attempt's prefill charge is taken and, with that chunk, given back."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view
        self.prefill_rows: list[tuple[int, int, int]] = []  # the prefill pool's load, seen during each prefill

    def run(self, req, route, on_started=lambda: None):  # Dispatcher.run's shape
        self.prefill_rows.append(_row(self.view, "prefill", "prefill-a"))
        yield wpb.TokenChunk(token_ids=[1])


def test_prefix_affinity_charges_a_worker_only_the_prompt_it_does_not_cache():
    """A prefill worker caching a long prefix computes only the suffix, so its load is charged only that, and
    concurrent prompts sharing the prefix keep going to it: charged whole prompts, five of them in flight
    (5,440 tokens against none) would make the pool look imbalanced and send the next elsewhere, to compute
    the prefix again."""
    view, policy, health = _view(), PrefixAffinity(), WorkerHealth()
    selector, dispatcher = RouteSelector(view, policy, health, colocated=False), _Dispatcher(view)
    shared = list(range(1024))
    first = WorkerRequest("r0", shared + [5000 + i for i in range(64)], SamplingParams())
    with Attempt.open(view, health, dispatcher, selector.select(first, set()), first, 10.0):  # type: ignore[arg-type]  # the stand-in
        pass
    attempts = []
    for n in range(1, 7):
        req = WorkerRequest(f"r{n}", shared + [6000 + 100 * n + i for i in range(64)], SamplingParams())
        selection = selector.select(req, set())
        assert selection is not None and selection.prefill is not None
        assert (selection.prefill.worker_id, selection.prefill.cached_tokens) == ("prefill-a", 1024)
        assert (selection.decode.worker_id, selection.decode.cached_tokens) == ("decode-a", 1024)
        attempts.append(Attempt.open(view, health, dispatcher, selection, req, 10.0))  # type: ignore[arg-type]
    # the first computed its whole prompt; each later one 64 tokens, counted while it ran
    assert dispatcher.prefill_rows == [(1088, 1, 0)] + [(64, 1, 0)] * 6
    assert _row(view, "decode", "decode-a") == (6 * 64, 6, 6 * 4)  # decode takes 4 blocks of its own for each
    for attempt in attempts:
        attempt.close()
    assert view._inflight == {}


def test_a_worker_at_the_call_cap_is_left_out_while_another_is_open():
    """prefix_affinity would follow the cached prefix to a worker whose calls are all taken; the selector leaves
    it out while another is under the cap, and keeps every one when all are at it (the attempt then waits)."""
    view, policy, health = _view(), PrefixAffinity(), WorkerHealth()
    selector = RouteSelector(view, policy, health, colocated=False, max_calls=2)
    shared = list(range(1024))
    req = lambda n: WorkerRequest(f"r{n}", shared + [7000 + 100 * n + i for i in range(64)], SamplingParams())  # noqa: E731
    first = selector.select(req(0), set())
    assert first is not None and first.prefill is not None
    charges = [c for _ in range(2) for c in (view.begin("prefill-a", 64), view.begin("decode-a", 64, kv=True))]
    second = selector.select(req(1), set())  # both "-a" workers at the cap of 2
    assert second is not None and second.prefill is not None
    assert (second.decode.worker_id, second.prefill.worker_id) == ("decode-b", "prefill-b")
    charges += [c for _ in range(2) for c in (view.begin("prefill-b", 1088), view.begin("decode-b", 1088, kv=True))]
    third = selector.select(req(2), set())  # every worker at the cap: the policy chooses among all
    assert third is not None and third.prefill is not None
    assert (third.decode.worker_id, third.prefill.worker_id) == ("decode-a", "prefill-a")
    for c in charges:
        c.release()
