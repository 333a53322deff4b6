"""``epd bench chaos``'s Deployment: an `epd serve` in its own session (so a terminal's Ctrl-C reaches it only
through the bench), stopped with everything it started when the bench is interrupted while it starts."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from pathlib import Path

import pytest

from bench.chaos.deployment import Deployment

from proc_helpers import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_interrupt_while_the_stack_starts_stops_all_of_it(tmp_path: Path, default_ckpt: Path) -> None:
    dep = Deployment(default_ckpt, 1, tmp_path)
    seen: set[int] = set()

    def interrupt_once_serve_has_children() -> None:  # Redis or Ray started: the stack is half up
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if dep.proc is not None and (kids := descendants(dep.proc.pid)):
                seen.update(kids)
                time.sleep(1.0)
                seen.update(descendants(dep.proc.pid))
                _thread.interrupt_main()
                return
            time.sleep(0.1)

    # Ctrl-C as a plain Python process takes it. _thread.interrupt_main runs the SIGINT handler, and an earlier
    # test in this pytest worker may have left another one there (a library's own), which raises nothing.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_once_serve_has_children, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            dep.start()
        assert dep.proc is not None and dep.proc.poll() is not None, "epd serve still runs"
        assert seen, "the interrupt came before epd serve started anything"
        end = time.monotonic() + 30
        while (alive := [p for p in seen if Path(f"/proc/{p}").exists()]) and time.monotonic() < end:
            time.sleep(0.2)
        assert not alive, f"left running: {alive}"
    finally:
        signal.signal(signal.SIGINT, handler)
        dep.stop()  # what a failed check left
