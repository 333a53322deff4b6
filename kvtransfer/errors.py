"""Transfer errors. Each carries the gRPC status a receiver answers with, and says what was wrong."""

from __future__ import annotations

import grpc


class TransferRefused(Exception):
    """A receiver refused a stream or a message in it; the reservation behind it is released."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TransferFailed(Exception):
    """A sender's transfer did not complete: refused, cancelled, timed out, or the peer went away."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status a result message's numeric ``code`` names (UNKNOWN for a number gRPC has not)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class ShmUnusable(TransferFailed):
    """No shared-memory segment could be made for a push (``/dev/shm`` full, or too small). ``lasting``: it
    could not hold one even empty, so only a larger ``/dev/shm`` helps; else it may have room for the next."""

    def __init__(self, message: str, lasting: bool) -> None:
        super().__init__(message, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.lasting = lasting
