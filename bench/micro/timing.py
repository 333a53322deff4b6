"""Paired timing: each repeat measures the figure and its reference back to back, on a chosen clock.

The machine this suite runs on may be shared, and its speed drifts within a run. Measuring figure and
reference in the same repeat (alternating which goes first) makes each repeat's ratio see the same
machine; the spread of those ratios is what a later run is compared against.

Clocks. ``wall`` is elapsed time (``perf_counter``). ``cpu`` is this process's CPU time
(``process_time``): for work done on this process's own threads (codec, scheduler, engine) it is the same
as wall time on an idle machine, and it does not count time the OS gave to other processes, which on a
busy 2-core box is most of the noise. With more than one torch thread it sums their CPU time, so a
figure becomes "per CPU-second". Benchmarks that wait on another process (transfers, Redis) always use
wall time: their cost is partly in the other process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ClockName = Literal["cpu", "wall"]
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
WALL: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class Plan:
    """What to measure and how much: ``repeats`` paired repeats (the spread), each side the best of at least
    ``inner`` tries (more, up to ``max_inner``, until ``min_side_s`` of wall time is spent); ``quick`` shrinks
    every size (a smoke run); ``clock`` times the in-process benchmarks; ``model`` is the engine's checkpoint."""

    repeats: int = 5
    inner: int = 2
    quick: bool = False
    model: Path | None = None
    clock: ClockName = "cpu"
    min_side_s: float = 0.05
    max_inner: int = 64

    def __post_init__(self) -> None:
        if self.repeats < 2:
            raise ValueError(f"repeats must be >= 2 (a spread needs two), got {self.repeats}")
        if self.inner < 1:
            raise ValueError(f"inner must be >= 1, got {self.inner}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")

    @property
    def timer(self) -> Callable[[], float]:
        """The clock the in-process benchmarks read (seconds)."""
        return CLOCKS[self.clock]


def best(fn: Callable[[], float], tries: int, min_seconds: float = 0.0, max_tries: int = 64) -> float:
    """The smallest cost ``fn`` returns (seconds, or another cost where less is better) over at least ``tries``
    calls, more while less than ``min_seconds`` of wall time has passed (at most ``max_tries``).

    A fast operation (a 1 ms memcpy) timed once is at the mercy of every other process on the machine;
    the best of many tries within a fixed time much less so.
    """
    start = WALL()
    lowest = fn()
    n = 1
    while n < tries or (n < max_tries and WALL() - start < min_seconds):
        lowest = min(lowest, fn())
        n += 1
    return lowest


def seconds_of(fn: Callable[[], object], clock: Callable[[], float] = WALL) -> Callable[[], float]:
    """A callable that runs ``fn`` once and returns the seconds it took on ``clock``."""

    def timed() -> float:
        start = clock()
        fn()
        return clock() - start

    return timed


def per_call_us(fn: Callable[[], object], calls: int, clock: Callable[[], float] = WALL) -> Callable[[], float]:
    """A callable returning the mean microseconds per call of ``fn`` over ``calls`` calls in a tight loop."""

    def timed() -> float:
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls * 1e6

    return timed


def paired(figure: Callable[[], float], reference: Callable[[], float], plan: Plan,
           ref_inner: int | None = None) -> tuple[list[float], list[float]]:
    """``plan.repeats`` (figure cost, reference cost) pairs, each the best of its tries (see :class:`Plan`);
    ``ref_inner`` fixes the reference's tries, for a reference that takes its own best-of internally.

    Costs are whatever the callables return (seconds, usually); the first side alternates per repeat.
    """
    def fig() -> float:
        return best(figure, plan.inner, plan.min_side_s, plan.max_inner)

    def ref() -> float:
        if ref_inner is not None:
            return best(reference, ref_inner)
        return best(reference, plan.inner, plan.min_side_s, plan.max_inner)

    figs, refs = [], []
    for i in range(plan.repeats):
        if i % 2 == 0:
            figs.append(fig())
            refs.append(ref())
        else:
            refs.append(ref())
            figs.append(fig())
    return figs, refs
