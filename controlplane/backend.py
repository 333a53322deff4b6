"""What the HTTP ingress needs from the rest of the control plane: one typed seam.

The ingress validates and tokenises a request, then hands a ``WorkerRequest`` to a ``Backend`` and
relays the chunks it yields. The scheduler (routing + admission + dispatch over the worker
services) is the real backend; tests of the ingress alone can pass any object with this shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.dispatch import WorkerRequest
from workers.runtime.sampler import TokenLogprobs
from workers.runtime.tokenizer import Tokenizer
from workers.service_base import logprobs_from_proto


@dataclass(frozen=True)
class Chunk:
    """Tokens produced since the last chunk. ``finish_reason``: "stop" | "length" | "abort"."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # On the finished chunk of a request one engine ran whole (a one-token request, or colocated mode):
    # that engine's time on it, admission to last output. 0.0 when unknown (disaggregated decoding).
    engine_seconds: float = 0.0
    # One per token id when the request asked for logprobs (SamplingParams.logprobs), else empty.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # On the first chunk when the request asked for prompt logprobs: one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @classmethod
    def from_wire(cls, c: Any) -> Chunk:
        """From a worker's ``TokenChunk`` (epd.worker.v1)."""
        return cls(tuple(c.token_ids), c.text, c.finished, c.finish_reason or None, c.prompt_tokens,
                   c.completion_tokens, c.engine_seconds, tuple(logprobs_from_proto(m) for m in c.logprobs),
                   tuple(logprobs_from_proto(m) for m in c.prompt_logprobs) if c.prompt_logprobs else None)


class Overloaded(Exception):
    """No decode room within the queue's bounds: answer 429 with Retry-After. ``reason`` labels
    ``epd:admission_rejections``, which the ingress counts when it answers 429 (not when a stream that had
    its 200 ends with this error)."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "overloaded") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class BackendError(Exception):
    """A stage failed; ``status`` is the HTTP status to answer with (4xx for the client's fault).
    ``retry_after_s``: the failure is the server's and passing (no replica, a worker lost too often);
    the answer carries Retry-After with it, in whole seconds. ``code``: OpenAI's error code, when one applies
    (``context_length_exceeded``)."""

    def __init__(self, message: str, status: int = 502, kind: str = "server_error",
                 retry_after_s: float | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.code = code


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id in /v1/models
    tokenizer: Tokenizer
    max_model_len: int
    image_token_id: int | None  # None: the model takes no images
    tokens_per_image: int
    eos_token_ids: tuple[int, ...]


class Backend(Protocol):
    model: ModelInfo

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        """Yield the request's chunks, the last one finished; raise Overloaded or BackendError."""
        ...

    def ready(self) -> bool:
        """True when every pool has a ready replica."""
        ...

    def degraded(self) -> str | None:
        """Why the backend serves in a degraded way now (Redis stalled: routing on its last good snapshot;
        workers routing avoids), or None."""
        ...
