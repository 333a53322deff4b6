"""What the chaos and soak loads send through the HTTP API.

``GreedyWorkload``: completions of known prompts (token ids, ``temperature`` 0, ``ignore_eos``), each answer
checked against ``generate()``'s. The chaos run and the default soak use it.

``MixedWorkload`` (``epd bench chaos --soak M --mix``): what a serving system meets in a day, drawn per
request from a seeded generator, so run n's request k is the same in every run. Each kind says how it must
end; any other ending is a failure:

- ``greedy`` / ``greedy_stream``: a known prompt, whole or streamed: 200, the text equal to ``generate()``'s;
- ``sampled_chat``: a chat turn at temperature 0.8 with a seed, sometimes streamed: 200 and a finish reason;
- ``long``: random token ids filling a quarter to all of the context, 1-16 tokens out: 200 and every token
  (streamed: counted by the usage the stream ends with);
- ``image`` (a model with a vision tower): a chat turn with one or two small PNGs: 200;
- ``close_early``: a streamed known prompt the client closes after its first text;
- ``cancel_prefill``: a long streamed prompt the client gives up on 0.02-0.5 s into a read, mostly while it
  is still in prefill (so the server cancels a request whose KV may be half pushed);
- ``malformed``: a body the API must refuse (broken JSON, ``max_tokens`` 0, a prompt past the context, an
  unknown model, a token id past the vocabulary, an image that is not one): a 4xx other than 429 with an
  error message.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from bench.chaos.load import Outcome, journal_id

KINDS: tuple[tuple[str, int], ...] = (("greedy", 4), ("greedy_stream", 3), ("sampled_chat", 2), ("long", 1),
                                      ("image", 2), ("close_early", 1), ("cancel_prefill", 1), ("malformed", 1))
MALFORMED = ("bad_json", "zero_tokens", "too_long", "unknown_model", "bad_token", "bad_image")
WORDS = ("the quick brown fox jumps over a lazy dog while the cache moves blocks from prefill to decode "
         "and every worker keeps its own pool of memory threads sockets and streams").split()


def prompt_texts(n: int) -> list[str]:
    """``n`` prompts of 12 words each, drawn with seeds 0..n-1: different enough that a small random model
    answers each differently (prompts that differ in one digit got the demo model's same answer, so a
    request answered with another's text would have passed as equal)."""
    return [" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(n)]


def _message(status: int, text: str) -> str:
    """A refusal's message from its error body, else the start of the body."""
    try:
        msg = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = ""
    return f"HTTP {status}: {msg or text[:200] or '(empty body)'}"


def _retry_after(r: httpx.Response) -> float:
    """Seconds a 429 ("full; retry later") asks the client to wait; 0 for any other answer."""
    if r.status_code != 429:
        return 0.0
    try:
        return max(0.0, float(r.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """A streamed answer's JSON events, up to ``[DONE]``; an error event raises ``ValueError``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ValueError(f"error event in the stream: {event['error'].get('message', event['error'])}")
        yield event
    raise ValueError("the stream ended without [DONE]")


@dataclass
class _Answer:
    """What a streamed request got so far: its status, the refusal's message and Retry-After, its journal id."""

    status: int = 0
    error: str = ""
    retry: float = 0.0
    rid: str = ""


def _streamed(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str], answer: _Answer,
              **kwargs: Any) -> Iterator[dict[str, Any]]:
    """POST ``body`` streamed: its events (see ``_events``), recording status, refusal and id in ``answer``; a
    refusal yields nothing. Leaving the loop early closes the stream."""
    with client.stream("POST", url, json=body, headers=headers, **kwargs) as r:
        answer.status = r.status_code
        if r.status_code != 200:
            answer.error = _message(r.status_code, r.read().decode(errors="replace"))
            answer.retry = _retry_after(r)
            return
        for event in _events(r):
            answer.rid = answer.rid or journal_id(event.get("id", ""))
            yield event


def _piece(event: dict[str, Any]) -> str:
    """The text one streamed completion or chat event adds."""
    choices = event.get("choices") or [{}]
    c = choices[0]
    return str(c.get("text") or (c.get("delta") or {}).get("content") or "")


class GreedyWorkload:
    """Request n is prompt ``n % len(prompts)``, whole, greedy; its text must equal ``refs[i]``."""

    def __init__(self, base: str, model: str, prompts: list[list[int]], refs: list[str], max_tokens: int,
                 api_key: str | None = None) -> None:
        self.base, self.model, self.prompts, self.refs, self.max_tokens = base, model, prompts, refs, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, i: int, stream: bool = False) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.prompts[i], "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    def send(self, client: httpx.Client, n: int) -> Outcome:
        i = n % len(self.prompts)
        start = time.monotonic()
        status, error, match, rid, retry = 0, "", False, "", 0.0
        try:
            r = client.post(f"{self.base}/v1/completions", json=self.body(i), headers=self.headers)
            status = r.status_code
            if status == 200:
                data = r.json()
                rid = journal_id(data.get("id", ""))
                match = data["choices"][0]["text"] == self.refs[i]
            else:
                error, retry = _message(status, r.text), _retry_after(r)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        return Outcome(start, time.monotonic(), status, error[:300], match, rid, retry_after_s=retry)

    def send_streamed(self, client: httpx.Client, n: int, close_after_first: bool = False) -> Outcome:
        """Prompt ``n % len(prompts)`` streamed; with ``close_after_first`` the client closes the stream once
        some text came (a request that ends before that is fine too)."""
        i = n % len(self.prompts)
        kind = "close_early" if close_after_first else "greedy_stream"
        start = time.monotonic()
        a, text = _Answer(), ""
        try:
            for event in _streamed(client, f"{self.base}/v1/completions", self.body(i, stream=True), self.headers, a):
                text += _piece(event)
                if close_after_first and text:
                    break
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            a.error = f"{type(exc).__name__}: {exc}"
        match = not close_after_first and text == self.refs[i]
        return Outcome(start, time.monotonic(), a.status, a.error[:300], match, a.rid, kind, not close_after_first,
                       a.retry)


class MixedWorkload:
    """The soak's mixed load (see the module's docstring). ``max_model_len`` is the served context (from
    ``/v1/models``); ``images`` says whether the model takes images."""

    def __init__(self, greedy: GreedyWorkload, max_model_len: int, images: bool, seed: int = 0) -> None:
        self.greedy, self.max_model_len, self.images, self.seed = greedy, max_model_len, images, seed
        kinds = [(k, w) for k, w in KINDS if images or k != "image"]
        self.kinds, self.weights = [k for k, _ in kinds], [w for _, w in kinds]
        self.malformed = [m for m in MALFORMED if images or m != "bad_image"]
        from bench.serve.datasets import png_data_url

        img_rng = np.random.default_rng(seed)
        self.image_urls = [png_data_url(img_rng, w, h) for w, h in ((16, 16), (32, 24), (48, 48), (64, 40))]

    def kind_of(self, n: int) -> tuple[str, str, random.Random]:
        """Request n's kind, its ``MALFORMED`` variant ("" for other kinds), and the generator the rest of its
        draws come from (all seeded by ``seed`` and n)."""
        rng = random.Random(self.seed * 1_000_003 + n)
        kind = rng.choices(self.kinds, self.weights)[0]
        return kind, rng.choice(self.malformed) if kind == "malformed" else "", rng

    def send(self, client: httpx.Client, n: int) -> Outcome:
        kind, variant, rng = self.kind_of(n)
        if kind == "greedy":
            return self.greedy.send(client, n)
        if kind in ("greedy_stream", "close_early"):
            return self.greedy.send_streamed(client, n, close_after_first=kind == "close_early")
        if kind == "cancel_prefill":
            return self._cancel_prefill(client, rng)
        if kind == "malformed":
            return self._malformed(client, variant, rng)
        path, body, expect_tokens = self._served(kind, rng)
        return self._post(client, kind, path, body, expect_tokens)

    def _words(self, rng: random.Random, lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    def _long_prompt(self, rng: random.Random, room: int) -> list[int]:
        n = rng.randint(max(1, self.max_model_len // 4), max(1, self.max_model_len - room))
        return [rng.randrange(5, 200) for _ in range(n)]  # ids every model of this project's size has

    def _served(self, kind: str, rng: random.Random) -> tuple[str, dict[str, Any], int | None]:
        """(path, body, exact completion tokens or None) for the kinds that must be answered."""
        model, stream = self.greedy.model, rng.random() < 0.5
        if kind == "long":
            out = rng.randint(1, 16)
            long: dict[str, Any] = {"model": model, "prompt": self._long_prompt(rng, out), "max_tokens": out,
                                    "ignore_eos": True, "stream": stream}
            if stream:
                long["stream_options"] = {"include_usage": True}  # so a streamed one is counted too
            return "/v1/completions", long, out
        content: Any = self._words(rng, 1, 120)
        if kind == "image":
            content = [{"type": "text", "text": self._words(rng, 1, 20)}] + [
                {"type": "image_url", "image_url": {"url": rng.choice(self.image_urls)}}
                for _ in range(rng.choice((1, 1, 2)))]
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                                "max_tokens": rng.randint(1, 48), "stream": stream}
        if kind == "sampled_chat":
            body.update(temperature=0.8, seed=rng.randrange(10**6))
        return "/v1/chat/completions", body, None

    def _post(self, client: httpx.Client, kind: str, path: str, body: dict[str, Any],
              expect_tokens: int | None) -> Outcome:
        start = time.monotonic()
        a = _Answer()
        url, headers = f"{self.greedy.base}{path}", self.greedy.headers
        try:
            if body["stream"]:
                finish, got = None, None
                for event in _streamed(client, url, body, headers, a):
                    c = (event.get("choices") or [{}])[0]
                    finish = c.get("finish_reason") or finish
                    got = (event.get("usage") or {}).get("completion_tokens", got)
                if a.status == 200 and finish is None:
                    a.error = "the stream gave no finish_reason"
                elif a.status == 200 and expect_tokens is not None and got != expect_tokens:
                    a.error = f"usage says {got} completion tokens, asked for {expect_tokens} with ignore_eos"
            else:
                r = client.post(url, json=body, headers=headers)
                a.status = r.status_code
                if a.status != 200:
                    a.error, a.retry = _message(a.status, r.text), _retry_after(r)
                else:
                    data = r.json()
                    a.rid = journal_id(data.get("id", ""))
                    got = data["usage"]["completion_tokens"]
                    if data["choices"][0].get("finish_reason") is None:
                        a.error = "no finish_reason"
                    elif expect_tokens is not None and got != expect_tokens:
                        a.error = f"{got} completion tokens, asked for {expect_tokens} with ignore_eos"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            a.error = f"{type(exc).__name__}: {exc}"
        return Outcome(start, time.monotonic(), a.status, a.error[:300], False, a.rid, kind, False, a.retry)

    def _cancel_prefill(self, client: httpx.Client, rng: random.Random) -> Outcome:
        """A long prompt, streamed; the client gives up once a read has waited ``patience`` seconds."""
        patience = rng.uniform(0.02, 0.5)
        body = {"model": self.greedy.model, "prompt": self._long_prompt(rng, 64), "max_tokens": 64,
                "ignore_eos": True, "stream": True}
        start = time.monotonic()
        a = _Answer()
        timeout = httpx.Timeout(client.timeout.connect, read=patience, write=client.timeout.write,
                                pool=client.timeout.pool)
        try:
            for _ in _streamed(client, f"{self.greedy.base}/v1/completions", body, self.greedy.headers, a,
                               timeout=timeout):
                pass
        except httpx.ReadTimeout:
            if a.status not in (0, 200):  # a refusal whose body did not come in time: still a refusal
                a.error = f"HTTP {a.status} (its body did not come within {patience:.2f} s)"
            # else the client gave up, as this kind does
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            a.error = f"{type(exc).__name__}: {exc}"
        return Outcome(start, time.monotonic(), a.status, a.error[:300], False, a.rid, "cancel_prefill", False,
                       a.retry)

    def _malformed(self, client: httpx.Client, what: str, rng: random.Random) -> Outcome:
        model, base = self.greedy.model, self.greedy.base
        path, payload = "/v1/completions", None
        body: dict[str, Any] = {"model": model, "prompt": "hello", "max_tokens": 4}
        if what == "bad_json":
            payload = b'{"model": "' + model.encode() + b'", "prompt": ['
        elif what == "zero_tokens":
            body["max_tokens"] = 0
        elif what == "too_long":
            body["prompt"] = [7] * (self.max_model_len + 1)
        elif what == "unknown_model":
            body["model"] = "no-such-model-" + str(rng.randrange(1000))
        elif what == "bad_token":
            body["prompt"] = [5, 6, 2**31 - 1]
        else:  # bad_image
            path = "/v1/chat/completions"
            body = {"model": model, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}]}
        start = time.monotonic()
        status, error = 0, ""
        headers = {**self.greedy.headers, "Content-Type": "application/json"}
        try:
            r = client.post(f"{base}{path}", content=payload if payload is not None else json.dumps(body),
                            headers=headers)
            status = r.status_code
            message = ""
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            if not 400 <= status < 500 or status == 429 or not message:  # 429: "full", not a refusal of the body
                error = f"{what}: expected a 4xx with an error message, got {_message(status, r.text)}"
        except httpx.HTTPError as exc:
            error = f"{what}: {type(exc).__name__}: {exc}"
        return Outcome(start, time.monotonic(), status, error[:300], False, "", "malformed", False)
