"""What a failed attempt means for its request (``Verdict``), and the HTTP error it ends in."""

from __future__ import annotations

import enum

import grpc

from controlplane.backend import BackendError
from controlplane.dispatch import DispatchError
from workers.tracing import EXCEEDS_CONTEXT

_RETRY_AT_RESERVE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
_CLIENT_FAULT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
# statuses of a path that broke, not of a request that cannot be served: another route may serve it
_BROKEN_PATH = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                grpc.StatusCode.ABORTED)


class Verdict(enum.Enum):
    REFUSED = "refused"  # the decode replica refused the reservation (full, draining): try the next one
    BUSY = "busy"  # a chosen worker is at its call cap, or still holds this request's last attempt: wait, as for room
    LOST = "lost"  # a worker died or hung (or a transfer between two broke): move the request elsewhere
    FAILED = "failed"  # the request itself failed: end it with its error


def verdict(exc: DispatchError, started: bool) -> Verdict:
    """``started``: the request already streamed chunks from this attempt."""
    if not started and exc.stage in ("reserve", "complete") and exc.code in _RETRY_AT_RESERVE:
        return Verdict.REFUSED
    if not started and exc.stage == "busy":
        return Verdict.BUSY
    # Request ids are the scheduler's own, so a worker that already holds this one holds an earlier
    # attempt of it (a migration's retry chose the same prefill worker before that attempt's abort
    # landed there): wait for it to let go, as for room, rather than fail the request.
    if not started and exc.code == grpc.StatusCode.ALREADY_EXISTS:
        return Verdict.BUSY
    if exc.lost or exc.code in _BROKEN_PATH:
        return Verdict.LOST
    return Verdict.FAILED


def backend_error(exc: DispatchError) -> BackendError:
    if exc.code in _CLIENT_FAULT:  # a request no worker's context or KV pool can hold says so, as OpenAI's does
        return BackendError(exc.message, 400, "invalid_request_error",
                            code="context_length_exceeded" if exc.mark == EXCEEDS_CONTEXT else None)
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BackendError(f"{exc.stage} timed out: {exc.message}", 504)
    return BackendError(f"{exc.stage} failed: {exc.message}", 502)
