"""Transfer errors. Each carries the gRPC status a receiver answers with, and says what was wrong."""

from __future__ import annotations

from typing import TypeVar

import grpc

E = TypeVar("E", bound=BaseException)


def detached(exc: E) -> E:
    """``exc`` without its traceback and the exceptions chained to it, for keeping after it is handled (on a
    stream, a reservation, in a queue). A traceback holds the frames it passed through, and their locals:
    one of them usually holds what keeps ``exc``, so the two would form a reference cycle, and everything
    those frames hold (a push's state, the model's activations) would stay allocated until Python's next
    full garbage collection. The message stays; the exception is the same object."""
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None
    return exc


def fresh(exc: E) -> E:
    """A new exception like ``exc`` (its type, arguments and attributes; no traceback, nothing chained), to
    raise an error that is kept (on a stream, a reservation): raising the kept one would give it a traceback
    through frames that hold what keeps it (a reference cycle; see ``detached``)."""
    new = type(exc).__new__(type(exc), *exc.args)
    new.__dict__.update(exc.__dict__)
    return new


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
