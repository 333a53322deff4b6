"""Keep the cyclic garbage collector off what a process loaded at start-up.

A control-plane or worker process holds hundreds of thousands of long-lived Python objects once its
imports (Ray, grpc, torch, FastAPI, pydantic) and its model are loaded. CPython's full (generation 2)
collection walks all of them with the GIL held, stalling every request thread of the process. It runs
whenever the objects that survived younger collections pass a quarter of the long-lived total, so any
per-request allocation that lives a moment (a span queued for export, a journal record) brings it on
more often. Frozen, those start-up objects are never walked again.

``freeze_startup_heap`` collects once, then moves every object alive into the permanent generation
(``gc.freeze``), which later collections skip. Objects created afterwards are collected as before. The
cost: cyclic garbage among the frozen objects is never reclaimed, which for start-up state (modules,
the model, servers, settings) is none to speak of. Call it once, when a long-running process has
finished starting; not in code that tests call over and over in one process.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect, then exempt everything alive from later collections. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects exempted from garbage collection (gc.freeze)", process, frozen)
    return frozen
