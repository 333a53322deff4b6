"""Keeps ``epd serve``'s own redis-server up: if it exits, a new one starts on the same port.

The private server holds only ephemeral state (leases, targets, the journal), so a restart loses
nothing a running deployment cannot rebuild: every client reconnects to the same URL, each worker's
next heartbeat registers it again, and ``on_restart`` writes back what only the control plane knows
(the pool targets). Without this, a killed private Redis left the stack answering 503 for good.
A Redis given by URL (``redis.url``) is the operator's to run and is not watched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from controlplane.state.client import LocalRedis

log = logging.getLogger(__name__)


class PrivateRedisWatchdog:
    def __init__(self, redis: LocalRedis, on_restart: Callable[[], None], interval_s: float = 1.0) -> None:
        self.redis = redis
        self.on_restart = on_restart
        self.interval_s = interval_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-watchdog", daemon=True)

    def start(self) -> PrivateRedisWatchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.redis.running:
                continue
            log.error("the private redis-server (pid %d, port %d) exited; starting a new one on the same port",
                      self.redis.pid, self.redis.port)
            try:
                self.redis = LocalRedis(port=self.redis.port, password=self.redis.password).start()
                self.restarts += 1
                self.on_restart()
                log.warning("the private redis-server is back (pid %d); workers re-register on their next "
                            "heartbeat and the pool targets were written again", self.redis.pid)
            except Exception:  # the port taken, no redis-server...: say so, try again next interval
                log.exception("could not restart the private redis-server")

    def close(self) -> None:
        """Stop watching, then stop the current server."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.redis.close()
