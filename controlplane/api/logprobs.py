"""Logprobs in OpenAI's shapes: chat's ``logprobs.content`` entries, and text completions' parallel lists.

The figures are the engine's (``workers.runtime.sampler.token_logprobs``): log_softmax of the model's raw
logits, before temperature, top-k and top-p, as vLLM reports them by default. A token is shown as the text of
its id alone, special tokens included, and its ``bytes`` are that text's UTF-8 (a token that is part of a
multi-byte character reads as U+FFFD, as in vLLM). A log-probability too small for float32 is -9999.0 (JSON
has no -Infinity), as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from controlplane.api.models import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from workers.runtime.sampler import TokenLogprobs
from workers.runtime.tokenizer import Tokenizer

FLOOR = -9999.0  # vLLM's stand-in for -inf


class TokenText:
    """A tokenizer's text for single token ids, remembered (a request asks for the same ids again and again)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._text = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


def _figure(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > FLOOR else FLOOR


def chat_entries(tokens: TokenText, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
                 ) -> list[ChatTokenLogprob]:
    out = []
    for token_id, lp in zip(token_ids, logprobs):
        text = tokens(token_id)
        top = [TopLogprob(token=t, logprob=_figure(v), bytes=list(t.encode()))
               for t, v in ((tokens(i), v) for i, v in lp.top)]
        out.append(ChatTokenLogprob(token=text, logprob=_figure(lp.logprob), bytes=list(text.encode()),
                                    top_logprobs=top))
    return out


def completion_logprobs(tokens: TokenText, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                        offset: int = 0) -> CompletionLogprobs:
    """``offset``: the text offset of the first token (the completion's text before it). Each token's top dict
    holds the top tokens and the chosen one too (so up to logprobs + 1 entries, as in OpenAI's API)."""
    texts, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = tokens(token_id)
        top = {tokens(i): _figure(v) for i, v in lp.top}
        top.setdefault(text, _figure(lp.logprob))
        texts.append(text)
        values.append(_figure(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=texts, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def prompt_logprobs(tokens: TokenText, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
                    ) -> CompletionLogprobs:
    """An echoed prompt's entries: its first token has no log-probability (null, as in OpenAI's API); each later
    one has ``logprobs[i - 1]``, its top dict holding the prompt's own token too."""
    if not prompt_ids:
        return CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    first = tokens(prompt_ids[0])
    rest = completion_logprobs(tokens, prompt_ids[1:], logprobs, len(first))
    return CompletionLogprobs(tokens=[first, *rest.tokens], token_logprobs=[None, *rest.token_logprobs],
                              top_logprobs=[None, *rest.top_logprobs], text_offset=[0, *rest.text_offset])
