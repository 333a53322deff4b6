"""Exact prompt lengths from the server's own tokenizer, through vLLM's ``POST /tokenize`` and ``/detokenize``.

A prompt of N tokens is built from "pieces": tokens of the server's vocabulary that decode to a space plus a
word (``" data"``). Split at spaces, each piece is encoded alone, so a run of k pieces is k tokens; the
server then counts every prompt (with its special tokens, or its chat template for the chat endpoint,
exactly as it will count it in ``usage.prompt_tokens``; or, for text that is only part of a prompt, the
text's own tokens) and the piece list is trimmed or extended until the
count is N. A server without /tokenize gets ``TokenizeUnavailable`` (the caller falls back to word prompts).
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from bench.serve.config import BenchInputError, Endpoint

# Text whose tokens seed the pieces: common words, so most vocabularies hold them as " word" tokens.
_CORPUS = ("the of and to in is for on that with as it at by from this be are or an was have not but they you all "
           "can more one time will about new there their what which when up out would so some if no other into has "
           "two its our do only over also after use how first any these may than then such each well most where "
           "many very work way even back much good before just through long made year same set part small world "
           "great place high three under last right old end day man point hand light water system data model state "
           "cache block token layer request server worker memory number value")
MAX_ROUNDS = 12  # count-and-fix rounds per prompt; each changes the length by the count's error


class TokenizeUnavailable(Exception):
    """The server has no /tokenize (or refused it): exact lengths are not available."""


class ServerTokens:
    """A ``datasets.TextSource`` whose prompts the server counts as exactly the asked length."""

    def __init__(self, root: str, model: str, headers: dict[str, str], endpoint: Endpoint,
                 timeout_s: float = 30.0, whole_prompt: bool = True) -> None:
        """``root``: the server without /v1 (``http://127.0.0.1:8000``). ``whole_prompt``: lengths count the
        prompt as the server will (special tokens, chat template); False: the text's own tokens only (for
        text that is one part of a prompt: a prefix, a suffix, the text beside images)."""
        self.root, self.model, self.endpoint, self.whole_prompt = root, model, endpoint, whole_prompt
        self.client = httpx.Client(headers=headers, timeout=timeout_s, trust_env=False)
        try:
            self.overhead = self.count("")  # special tokens, or the chat template around empty content
            self.pieces = self._pieces()
        except BaseException:
            self.client.close()
            raise

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ the server
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self.client.post(f"{self.root}{path}", json={"model": self.model, **body})
        except httpx.HTTPError as exc:
            raise TokenizeUnavailable(f"POST {path} failed: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise TokenizeUnavailable(f"POST {path} answered HTTP {resp.status_code}")
        try:
            data = resp.json()
        except ValueError:
            raise TokenizeUnavailable(f"POST {path} did not answer JSON") from None
        if not isinstance(data, dict):
            raise TokenizeUnavailable(f"POST {path} answered {type(data).__name__}, not an object")
        return data

    def _ids(self, text: str, *, raw: bool = False) -> list[int]:
        if raw:  # the text's own tokens, nothing added
            body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        elif self.endpoint == "chat":
            body = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        else:
            body = {"prompt": text}
        tokens = self._post("/tokenize", body).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise TokenizeUnavailable("POST /tokenize gave no list of token ids")
        return tokens

    def count(self, text: str) -> int:
        """Prompt tokens the server counts for ``text`` sent to this endpoint (``whole_prompt``), or the
        text's own tokens."""
        return len(self._ids(text, raw=not self.whole_prompt))

    def _pieces(self) -> list[str]:
        ids = sorted(set(self._ids(" " + _CORPUS, raw=True)))
        texts = [self._post("/detokenize", {"tokens": [i]}).get("prompt") for i in ids]
        pieces = sorted({t for t in texts if isinstance(t, str) and t.startswith(" ") and len(t) > 1
                         and not any(c.isspace() for c in t[1:])})
        single = [p for p in pieces if len(self._ids(p, raw=True)) == 1]
        if len(single) < 2:
            raise TokenizeUnavailable("the server's tokenizer has too few ' word' tokens for exact prompts")
        return single

    # ------------------------------------------------------------------ prompts
    def text(self, rng: np.random.Generator, n_tokens: int) -> str:
        """A prompt the server counts as ``n_tokens`` (special tokens / chat template included)."""
        want = n_tokens - self.overhead
        if want < 1:
            raise BenchInputError(f"--input-len {n_tokens} leaves no room for text: the server adds {self.overhead} "
                                  f"tokens to every prompt on this endpoint ({self.endpoint})")
        chosen = [self.pieces[i] for i in rng.integers(0, len(self.pieces), size=want)]
        for _ in range(MAX_ROUNDS):
            text = "".join(chosen)
            got = self.count(text)
            if got == n_tokens:
                return text
            if got > n_tokens:
                del chosen[max(1, len(chosen) - (got - n_tokens)):]
            else:
                chosen += [self.pieces[i] for i in rng.integers(0, len(self.pieces), size=n_tokens - got)]
        raise BenchInputError(f"could not build a prompt the server counts as {n_tokens} tokens "
                              f"(last try: {got}); pass --tokenizer to count locally instead")
