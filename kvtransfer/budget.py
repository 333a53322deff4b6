"""The sender's flow control: queued KV bytes are bounded per stream and per sender, so a slow receiver
slows prefill down instead of filling memory."""

from __future__ import annotations

import threading
import time

import grpc

from kvtransfer.errors import TransferFailed


class ByteBudget:
    """A counting semaphore in bytes; an item larger than the whole budget still passes alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cv = threading.Condition()

    def acquire(self, n: int, deadline: float, failed: threading.Event) -> None:
        """Wait for room for ``n`` bytes until ``deadline``. Once ``failed`` is set it stops waiting
        and takes the bytes anyway: the caller raises next and releases them, so the count stays
        balanced (a failed stream must not leave the sender-wide budget short or over)."""
        with self._cv:
            while self.used and self.used + n > self.capacity and not failed.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferFailed("timed out waiting for the receiver to drain queued KV bytes",
                                         grpc.StatusCode.DEADLINE_EXCEEDED)
                self._cv.wait(min(remaining, 0.1))
            self.used += n

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()
