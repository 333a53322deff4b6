"""How the pool manager starts a pool's replicas: all at once, or one after another when they share a GPU
(each sizes its KV pool from what the GPU holds, and one loading beside it would count against it). Pure
logic: each wave's start is stood in for; tests/integration/test_ray_gpu_placement.py starts real ones."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.pools import PoolManager, WorkerStartError
from controlplane.settings import PoolSettings, Settings
from controlplane.state import Pool

pytestmark = [pytest.mark.unit]


class Targets:
    def __init__(self, target: int | None) -> None:
        self.target = target

    def get_target(self, pool: Pool) -> int | None:
        return self.target


def manager(decode: dict[str, Any], target: int | None, failures: dict[int, str] | None = None,
            after_wave: Any = None) -> tuple[PoolManager, list[tuple[int, int]]]:
    """A manager whose waves are stood in for: each records (size, replicas still queued behind it), makes
    its replicas serve except those ``failures`` names (wave index -> error), then runs ``after_wave``."""
    m = PoolManager(Settings(mode="colocated", decode=decode), "redis://127.0.0.1:1/0", "waves", "token")
    m.targets = Targets(target)  # type: ignore[assignment]  # only get_target is read
    waves: list[tuple[int, int]] = []

    def start_wave(pool: Pool, ps: PoolSettings, n: int) -> list[str]:
        errors = [failures[len(waves)]] if failures and len(waves) in failures else []
        waves.append((n, m._queued[pool]))
        m._replicas[pool].extend(object() for _ in range(n - len(errors)))  # type: ignore[misc]  # stand-ins
        if after_wave is not None:
            after_wave(m)
        return errors
    m._start_wave = start_wave  # type: ignore[method-assign]
    return m, waves


@pytest.mark.parametrize(("decode", "waves"), [
    ({}, [(3, 0)]),                                                          # CPU replicas: all at once
    ({"num_gpus": 1, "engine": {"device": "cuda"}}, [(3, 0)]),               # a GPU each
    ({"num_gpus": 0.5, "engine": {"device": "cuda"}}, [(1, 2), (1, 1), (1, 0)]),  # half a GPU each
    ({"num_gpus": 0, "engine": {"device": "cuda"}}, [(1, 2), (1, 1), (1, 0)]),    # no reservation: one GPU for all
])
def test_replicas_that_share_a_gpu_start_one_after_another(decode, waves) -> None:
    m, got = manager(decode, target=3)
    m._start_replicas(Pool.DECODE, 3)
    assert got == waves and len(m.replicas("decode")) == 3 and m._queued[Pool.DECODE] == 0
    assert m.problem("decode") is None


def test_a_failed_start_leaves_the_queued_ones_unbegun_and_says_so() -> None:
    m, got = manager({"num_gpus": 0.5}, target=3, failures={0: "waves-decode-0: out of GPU memory"})
    with pytest.raises(WorkerStartError) as err:
        m._start_replicas(Pool.DECODE, 3)
    assert got == [(1, 2)]  # the loop's backoff retries; n starts of 180 s each would hold the pool's lock
    assert str(err.value).startswith("1 of 3 decode replicas failed to start:\nwaves-decode-0: out of GPU memory")
    assert m.problem("decode") == "1 of 3 replicas failed to start; last: waves-decode-0: out of GPU memory"
    assert m._queued[Pool.DECODE] == 0


def test_no_wave_begins_once_the_target_drops_or_the_manager_stops() -> None:
    def drop(m: PoolManager) -> None:
        m.targets.target = len(m.replicas("decode"))  # type: ignore[attr-defined]  # the stand-in's
    m, got = manager({"num_gpus": 0.5}, target=3, after_wave=drop)
    m._start_replicas(Pool.DECODE, 3)
    assert got == [(1, 2)] and m.problem("decode") is None

    m, got = manager({"num_gpus": 0.5}, target=3, after_wave=lambda m: m._stop.set())
    m._start_replicas(Pool.DECODE, 3)
    assert got == [(1, 2)]


def test_a_scale_down_says_which_workers_it_is_stopping_until_they_are_stopped(monkeypatch) -> None:
    """The admin API refuses to resume (undo the drain of) a worker a scale-down is stopping: the manager says
    so from before the replicas leave its list until they are stopped, and of those only."""
    from types import SimpleNamespace

    import controlplane.pools.manager as manager_module

    m, _ = manager({}, target=1)
    calls = SimpleNamespace(remote=lambda *args: None)
    replicas = [SimpleNamespace(worker_id=f"w{i}", started_at=float(i), actor=SimpleNamespace(drain=calls, stop=calls),
                                pool=Pool.DECODE, name=f"r{i}") for i in range(3)]
    m._replicas[Pool.DECODE] = list(replicas)  # type: ignore[arg-type]  # stand-ins
    m._remove_dead = lambda pool: None  # type: ignore[method-assign]
    m.registry = SimpleNamespace(live_workers=lambda pool: [])  # type: ignore[assignment]  # none drained
    monkeypatch.setattr(manager_module.ray, "get", lambda ref, timeout=None: True)  # each drain ends clean
    during_drain: list[list[bool]] = []
    during_stop: list[list[bool]] = []
    drain = SimpleNamespace(remote=lambda t: during_drain.append([m.stopping(r.worker_id) for r in replicas]))
    for r in replicas:
        r.actor.drain = drain
    m._stop_replicas = lambda victims: during_stop.append([m.stopping(r.worker_id) for r in replicas])  # type: ignore[method-assign]
    m._reconcile_locked(Pool.DECODE)
    assert during_drain == [[False, True, True]] * 2 and during_stop == [[False, True, True]]  # the newest two
    assert not any(m.stopping(r.worker_id) for r in replicas) and list(m.replicas("decode")) == [replicas[0]]
