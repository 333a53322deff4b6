"""The relay: worker chunks become the client's chunks, as one stream across migrations.

``Progress`` keeps what the client was sent: the token ids and the length of the text. After a worker
is lost, ``continuation`` is the request to run next: the prompt plus the tokens so far, with
``max_tokens`` and teacher-forced tokens reduced by them, so the new worker re-prefills and carries on.
Across that seam the relay, not the worker, turns tokens into text and applies the stop strings (a
worker's detokenizer sees only its own output, so a stop string or a multi-byte character that spans
the seam would be missed); usage counts the original prompt and every token sent.

Seeded sampling continues exactly: output token i is drawn with seed ``draw_seed(seed, i)``, a
splitmix64 of ``seed + (i + 1) * GOLDEN`` (mod 2^64), so a continuation from token j with seed
``seed + j * GOLDEN`` draws what the original would have. Seeds must stay below 2^63, so the seam
goes at the last j <= tokens-so-far whose shifted seed fits; the ``replay`` tokens between j and the
end are generated again (identically) and not sent twice.
"""

from __future__ import annotations

import dataclasses

import grpc

from controlplane.backend import Chunk
from controlplane.dispatch import DispatchError, WorkerRequest
from epd.worker.v1 import worker_pb2 as wpb
from workers.runtime.sampler import TokenLogprobs
from workers.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from workers.service_base import logprobs_from_proto

_GOLDEN = 0x9E3779B97F4A7C15  # workers.runtime.sampler.draw_seed's increment per token index
_MASK64 = (1 << 64) - 1
_SEED_LIMIT = 1 << 63


def shifted_seed(seed: int, tokens: int) -> int:
    """The seed whose draw i is ``seed``'s draw ``tokens + i`` (may be >= 2^63: then unusable)."""
    return (seed + tokens * _GOLDEN) & _MASK64


@dataclasses.dataclass(frozen=True)
class Seam:
    """Where the next attempt starts: it re-prefills the first ``at`` tokens sent; the next ``replay``
    tokens it generates were sent already."""

    at: int
    replay: int


class Progress:
    def __init__(self, request: WorkerRequest, tokenizer: Tokenizer) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text_chars = 0  # characters of text sent
        self.finished = False
        self.seams = 0
        self._detok: IncrementalDetokenizer | None = None  # from the first seam after a token on
        self._skip = 0  # replayed tokens still to drop from the current attempt

    def seam(self) -> Seam:
        sent, seed = len(self.token_ids), self.request.params.seed
        at = sent
        if seed is not None:
            while at > 0 and shifted_seed(seed, at) >= _SEED_LIMIT:
                at -= 1
        return Seam(at, sent - at)

    def continuation(self) -> WorkerRequest:
        """The request the next attempt runs (the original one until a token was sent)."""
        if not self.token_ids:
            return self.request
        seam = self.seam()
        p = self.request.params
        params = dataclasses.replace(
            p, max_tokens=p.max_tokens - seam.at, stop=(),  # stop strings: the relay's job after a seam
            prompt_logprobs=None,  # sent with the first token already
            seed=None if p.seed is None else shifted_seed(p.seed, seam.at),
            forced_tokens=p.forced_tokens[seam.at:])
        return dataclasses.replace(self.request, prompt_ids=list(self.request.prompt_ids) + self.token_ids[:seam.at],
                                   params=params)

    def begin_attempt(self) -> None:
        """A new attempt starts (after the first, a seam)."""
        if not self.token_ids:
            return
        self.seams += 1
        self._skip = self.seam().replay
        if self._detok is None:
            self._detok = IncrementalDetokenizer.resume(self.tokenizer, self.request.params.stop,
                                                        self.request.prompt_ids, self.token_ids, self.text_chars)

    def end(self, reason: str) -> Chunk:
        """The stream's last chunk when no worker can carry it on (finish_reason ``reason``): the text the
        relay held back across a seam (a possible stop string's start, a partial character), then the end."""
        text = self._detok.flush() if self._detok is not None and not self._detok.stopped else ""
        self.text_chars += len(text)
        self.finished = True
        return Chunk((), text, True, reason, len(self.request.prompt_ids), len(self.token_ids))

    def accept(self, c: wpb.TokenChunk) -> Chunk | None:
        """The client's chunk for worker chunk ``c``; None when it carries nothing new. Logprobs (one per
        token, when asked for) are dropped or kept with their tokens."""
        ids = list(c.token_ids)
        logprobs = [logprobs_from_proto(m) for m in c.logprobs] if c.logprobs else []
        if (logprobs or self.request.params.logprobs is not None) and len(logprobs) != len(ids):
            raise DispatchError("decode", grpc.StatusCode.INTERNAL,
                                f"a worker sent {len(logprobs)} logprobs for {len(ids)} tokens")
        if self._skip:
            dropped, ids, logprobs = ids[:self._skip], ids[self._skip:], logprobs[self._skip:]
            self._skip -= len(dropped)
        if self._detok is None:
            self.token_ids.extend(ids)
            self.text_chars += len(c.text)
            self.finished = c.finished
            prompt = None
            if self.request.params.prompt_logprobs is not None and ids and len(self.token_ids) == len(ids):  # 1st
                prompt = tuple(logprobs_from_proto(m) for m in c.prompt_logprobs)
                if len(prompt) != max(0, len(self.request.prompt_ids) - 1):
                    raise DispatchError("prefill", grpc.StatusCode.INTERNAL,
                                        f"a worker sent {len(prompt)} prompt logprobs for a "
                                        f"{len(self.request.prompt_ids)}-token prompt")
            return Chunk(tuple(ids), c.text, c.finished, c.finish_reason or None, len(self.request.prompt_ids),
                         len(self.token_ids), c.engine_seconds, tuple(logprobs), prompt)
        return self._across_seam(ids, c, logprobs)

    def _across_seam(self, ids: list[int], c: wpb.TokenChunk, logprobs: list[TokenLogprobs]) -> Chunk | None:
        assert self._detok is not None
        text, taken, reason = "", [], c.finish_reason or None
        # after a seam the worker has no stop strings: a "stop" is a stop token or EOS, whose text is never
        # output (as the engine leaves it out)
        end_token = len(ids) - 1 if c.finished and c.finish_reason == "stop" else -1
        for i, token in enumerate(ids):
            taken.append(token)
            if i == end_token:
                break
            step = self._detok.add(token)
            text += step.text
            if step.stopped:
                reason = "stop"
                break
        finished = c.finished or self._detok.stopped
        if finished and not self._detok.stopped:
            text += self._detok.flush()
        self.token_ids.extend(taken)
        self.text_chars += len(text)
        self.finished = finished
        if not taken and not finished:
            return None
        return Chunk(tuple(taken), text, finished, reason if finished else None, len(self.request.prompt_ids),
                     len(self.token_ids), logprobs=tuple(logprobs[:len(taken)]))
