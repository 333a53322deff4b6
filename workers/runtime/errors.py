"""Errors raised by the engine.

Every error a caller can cause is an ``EngineError`` subclass with a message that names the
problem; the control plane maps them to HTTP 4xx / gRPC statuses. Anything else is a bug.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class for errors caused by input (a request, a checkpoint, a setting)."""


class CheckpointError(EngineError):
    """A checkpoint folder is missing a file or tensor, or a tensor has the wrong shape/dtype."""


class UnsupportedArchitectureError(CheckpointError):
    """config.json names an architecture the engine does not implement."""


class DeviceUnavailableError(EngineError):
    """The configured device does not exist in this process (no CUDA, an index past the GPU count, no MPS)."""


class InvalidRequestError(EngineError):
    """A request's parameters are out of range or inconsistent."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested tokens) cannot fit in the model's context."""


class CapacityError(EngineError):
    """The KV pool has no room for the request now (it may have later)."""


class RecomputeError(EngineError):
    """A sequence had to give its KV blocks back, and this engine cannot compute that KV again: it came from
    images this worker never saw (a disaggregated decode worker). The request must move, re-prefilled."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit in this worker's KV pool, however long it waits."""


class InvalidImageError(InvalidRequestError):
    """An image could not be decoded or has an unsupported size/format."""


class ImageTooLargeError(InvalidImageError):
    """An image has more pixels than the encoder takes."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already known to the engine."""
