"""How each endpoint spells its answer: chat completions and text completions, whole or as stream chunks,
with logprobs when the request asked for them (``logprobs``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from controlplane.api.logprobs import TokenText, chat_entries, completion_logprobs
from controlplane.api.models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    Usage,
)
from controlplane.backend import Chunk
from workers.runtime.sampler import TokenLogprobs


def usage_of(last: Chunk) -> Usage:
    return Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                 total_tokens=last.prompt_tokens + last.completion_tokens)


class Shape(Protocol):
    """How one endpoint spells its answer. ``token_ids`` and ``logprobs``: the tokens a delta (or the whole
    answer) carries and their logprobs (empty unless the request asked for them)."""

    def opening(self) -> BaseModel | None: ...
    def delta(self, text: str, token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprobs] = ()) -> BaseModel: ...
    def closing(self, finish_reason: str) -> BaseModel: ...
    def usage(self, usage: Usage) -> BaseModel: ...
    def whole(self, text: str, last: Chunk, token_ids: Sequence[int] = (),
              logprobs: Sequence[TokenLogprobs] = ()) -> BaseModel: ...


@dataclass(frozen=True)
class ChatShape:
    id: str
    model: str
    tokens: TokenText | None = None  # how token ids read: set when the request asked for logprobs
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, delta: Delta, finish_reason: str | None = None,
               logprobs: ChatLogprobs | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[ChatChunkChoice(delta=delta, logprobs=logprobs,
                                                            finish_reason=finish_reason)])

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        if self.tokens is None:
            return None
        return ChatLogprobs(content=chat_entries(self.tokens, token_ids, logprobs))

    def opening(self) -> BaseModel:
        return self._chunk(Delta(role="assistant", content=""))

    def delta(self, text: str, token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprobs] = ()) -> BaseModel:
        return self._chunk(Delta(content=text), logprobs=self._logprobs(token_ids, logprobs))

    def closing(self, finish_reason: str) -> BaseModel:
        return self._chunk(Delta(), finish_reason)

    def usage(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, last: Chunk, token_ids: Sequence[int] = (),
              logprobs: Sequence[TokenLogprobs] = ()) -> BaseModel:
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage_of(last),
                              choices=[ChatChoice(message=AssistantMessage(content=text),
                                                  logprobs=self._logprobs(token_ids, logprobs),
                                                  finish_reason=last.finish_reason or "stop")])


@dataclass
class CompletionShape:
    id: str
    model: str
    tokens: TokenText | None = None  # how token ids read: set when the request asked for logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = field(default=0, init=False)  # text_offset of the next streamed token

    def _chunk(self, text: str, finish_reason: str | None = None,
               logprobs: CompletionLogprobs | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)])

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                  offset: int) -> CompletionLogprobs | None:
        if self.tokens is None:
            return None
        return completion_logprobs(self.tokens, token_ids, logprobs, offset)

    def opening(self) -> BaseModel | None:
        return None

    def delta(self, text: str, token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprobs] = ()) -> BaseModel:
        shown = self._logprobs(token_ids, logprobs, self._offset)
        if shown is not None and shown.tokens:
            self._offset = shown.text_offset[-1] + len(shown.tokens[-1])
        return self._chunk(text, logprobs=shown)

    def closing(self, finish_reason: str) -> BaseModel:
        return self._chunk("", finish_reason)

    def usage(self, usage: Usage) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, last: Chunk, token_ids: Sequence[int] = (),
              logprobs: Sequence[TokenLogprobs] = ()) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, usage=usage_of(last),
                          choices=[CompletionChoice(text=text, logprobs=self._logprobs(token_ids, logprobs, 0),
                                                    finish_reason=last.finish_reason or "stop")])
