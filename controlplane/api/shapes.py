"""How each endpoint spells its answer: chat completions and text completions, whole or as stream chunks,
with logprobs when the request asked for them (``logprobs``), and a text completion's prompt in front when it
asked for ``echo`` (with the prompt tokens' logprobs when it asked for both, as OpenAI's legacy API did)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from controlplane.api.logprobs import TokenText, chat_entries, completion_logprobs, prompt_logprobs
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


@dataclass(frozen=True)
class Whole:
    """A whole answer: its text, its finished chunk, every token id and its logprobs (when asked for), and
    the prompt's logprobs (when asked for)."""

    text: str
    last: Chunk
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


class Shape(Protocol):
    """How one endpoint spells its answer: ``opening`` (given the first chunk) and ``delta`` (per chunk with
    text or logprobs) while streaming, ``whole`` for an answer sent at once."""

    def opening(self, first: Chunk) -> BaseModel | None: ...
    def delta(self, chunk: Chunk) -> BaseModel: ...
    def closing(self, finish_reason: str) -> BaseModel: ...
    def usage(self, usage: Usage) -> BaseModel: ...
    def whole(self, whole: Whole) -> BaseModel: ...


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

    def _logprobs(self, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]) -> ChatLogprobs | None:
        if self.tokens is None:
            return None
        return ChatLogprobs(content=chat_entries(self.tokens, token_ids, logprobs))

    def opening(self, first: Chunk) -> BaseModel:
        return self._chunk(Delta(role="assistant", content=""))

    def delta(self, chunk: Chunk) -> BaseModel:
        return self._chunk(Delta(content=chunk.text), logprobs=self._logprobs(chunk.token_ids, chunk.logprobs))

    def closing(self, finish_reason: str) -> BaseModel:
        return self._chunk(Delta(), finish_reason)

    def usage(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, whole: Whole) -> BaseModel:
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage_of(whole.last),
                              choices=[ChatChoice(message=AssistantMessage(content=whole.text),
                                                  logprobs=self._logprobs(whole.token_ids, whole.logprobs),
                                                  finish_reason=whole.last.finish_reason or "stop")])


@dataclass
class CompletionShape:
    id: str
    model: str
    tokens: TokenText | None = None  # how token ids read: set when the request asked for logprobs
    echo: str | None = None  # the prompt's text, sent before the completion (``echo``)
    prompt_ids: tuple[int, ...] = ()  # with ``echo`` and ``tokens``: the prompt, whose logprobs come first
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = field(default=0, init=False)  # text_offset of the next streamed token

    def _chunk(self, text: str, finish_reason: str | None = None,
               logprobs: CompletionLogprobs | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)])

    def _prompt(self, logprobs: tuple[TokenLogprobs, ...] | None) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (the first token has none), when both were asked for."""
        if self.tokens is None or self.echo is None:
            return None
        self._offset = 0
        return self._advanced(prompt_logprobs(self.tokens, self.prompt_ids, logprobs or ()))

    def _logprobs(self, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]) -> CompletionLogprobs | None:
        if self.tokens is None:
            return None
        return self._advanced(completion_logprobs(self.tokens, token_ids, logprobs, self._offset))

    def _advanced(self, shown: CompletionLogprobs) -> CompletionLogprobs:
        """``shown``, with the next token's text_offset moved past its last token."""
        if shown.tokens:
            self._offset = shown.text_offset[-1] + len(shown.tokens[-1])
        return shown

    def opening(self, first: Chunk) -> BaseModel | None:
        if self.echo is None:
            return None
        return self._chunk(self.echo, logprobs=self._prompt(first.prompt_logprobs))

    def delta(self, chunk: Chunk) -> BaseModel:
        return self._chunk(chunk.text, logprobs=self._logprobs(chunk.token_ids, chunk.logprobs))

    def closing(self, finish_reason: str) -> BaseModel:
        return self._chunk("", finish_reason)

    def usage(self, usage: Usage) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, whole: Whole) -> BaseModel:
        last = whole.last
        self._offset = 0
        prompt = self._prompt(whole.prompt_logprobs)
        answer = self._logprobs(whole.token_ids, whole.logprobs)
        if prompt is not None and answer is not None:
            answer = CompletionLogprobs(tokens=prompt.tokens + answer.tokens,
                                        token_logprobs=prompt.token_logprobs + answer.token_logprobs,
                                        top_logprobs=prompt.top_logprobs + answer.top_logprobs,
                                        text_offset=prompt.text_offset + answer.text_offset)
        return Completion(id=self.id, created=self.created, model=self.model, usage=usage_of(last),
                          choices=[CompletionChoice(text=(self.echo or "") + whole.text, logprobs=answer,
                                                    finish_reason=last.finish_reason or "stop")])
