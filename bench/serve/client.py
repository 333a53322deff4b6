"""A streaming OpenAI-compatible client that times every chunk (httpx, asyncio).

One request's life: build the body (``stream: true``, ``stream_options.include_usage``), note the send time,
read ``data:`` events line by line, time the first event that carries output (TTFT: text, or on chat
reasoning text or tool calls; an answer with no text at all, such as an immediate end-of-sequence, takes
its time from the event that finishes it) and every later one (ITL), end the answer at the last event
with a choice (E2E: the usage event and ``[DONE]`` that follow carry no token), take the token counts
from the final usage event when the server sends one (else one token per output chunk), and stop at
``data: [DONE]``. Anything that goes wrong (an HTTP error status, an in-band error event, a connection
lost mid-stream, a timeout, a malformed event, a stream with no answer in it, a ``finish_reason`` other
than an answer's end, such as ``abort``) becomes a failed ``RequestOutcome`` with a short reason; nothing
raises out of ``send_request``, so a server that errors mid-run is counted, not fatal.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.serve.config import BenchInputError, Endpoint
from bench.serve.datasets import BenchRequest
from bench.serve.metrics import RequestOutcome

_REASON_CHARS = 160  # failure reasons are grouped by text; keep them short and free of per-request detail
# an answer that ended as it should; any other finish_reason (vLLM's and epd's "abort", "error") is a failure
ANSWER_ENDS = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
_CHAT_OUTPUT = ("content", "reasoning_content", "reasoning")  # delta fields holding generated text


def _output(choice: dict[str, Any], chat: bool) -> bool | None:
    """Whether a choice carries generated output; None when it is malformed."""
    if not chat:
        text = choice.get("text")
        return bool(text) if text is None or isinstance(text, str) else None
    delta = choice.get("delta")
    if delta is None:
        return False
    if not isinstance(delta, dict):
        return None
    return any(isinstance(delta.get(k), str) and delta[k] for k in _CHAT_OUTPUT) or bool(delta.get("tool_calls"))


def headers_for(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_body(req: BenchRequest, model: str, endpoint: Endpoint, *, temperature: float,
               ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        content: str | list[dict[str, Any]] = req.text
        if req.image_urls:
            content = [{"type": "image_url", "image_url": {"url": u}} for u in req.image_urls]
            content.append({"type": "text", "text": req.text})
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.text
        body["max_tokens"] = req.output_len
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM/SGLang extension; OpenAI-strict servers ignore or refuse it
    return body


def _error_message(payload: Any) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}``), else the text itself."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return str(payload)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                       *, prompt_len: int, timeout_s: float,
                       clock: Callable[[], float] = time.perf_counter) -> RequestOutcome:
    """POST one streaming request to ``url`` (the full endpoint URL) and time it with ``clock`` (seconds;
    injectable so tests can feed exact timings). Never raises (but lets ``asyncio.CancelledError`` through)."""
    endpoint_chat = "messages" in body
    start = clock()
    last = prev = start
    chunks = 0
    ttft: float | None = None
    itl: list[float] = []
    usage: dict[str, Any] | None = None
    done = answered = False
    finish: str | None = None

    def fail(reason: str) -> RequestOutcome:
        return RequestOutcome(False, ttft_s=ttft, e2e_s=clock() - start, itl_s=itl,
                              output_tokens=chunks, prompt_tokens=prompt_len, error=_short(reason))

    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    try:
                        message = _error_message(json.loads(raw))
                    except ValueError:
                        message = raw.decode("utf-8", "replace") or resp.reason_phrase
                    return fail(f"HTTP {resp.status_code}: {message}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, ": keep-alive" comments, event:/id: fields
                    now = clock()
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        return fail(f"malformed event: {data[:60]!r}")
                    if not isinstance(event, dict):
                        return fail(f"malformed event: {data[:60]!r}")
                    if event.get("error") or event.get("object") == "error":
                        return fail(f"error event: {_error_message(event)}")
                    choices = event.get("choices")
                    if choices is not None and not isinstance(choices, list):
                        return fail(f"malformed event: choices is a {type(choices).__name__}")
                    if choices:
                        choice = choices[0]
                        output = _output(choice, endpoint_chat) if isinstance(choice, dict) else None
                        if output is None:
                            return fail(f"malformed event: {data[:60]!r}")
                        answered, last = True, now
                        if output:
                            if ttft is None:
                                ttft = now - start
                            else:
                                itl.append(now - prev)
                            prev = now
                            chunks += 1
                        reason = choice.get("finish_reason")
                        if reason:
                            finish = str(reason)
                            if ttft is None:  # an answer with no text: its first (and only) token ends it
                                ttft = now - start
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
    except TimeoutError:
        return fail(f"timeout: no complete answer within {timeout_s:g} s")
    except httpx.TimeoutException as exc:
        return fail(f"timeout ({type(exc).__name__})")
    except httpx.ConnectError as exc:
        return fail(f"connection failed: {exc}")
    except httpx.HTTPError as exc:  # RemoteProtocolError, ReadError: the server went away mid-answer
        return fail(f"connection lost mid-stream ({type(exc).__name__})")
    if not done and finish is None:
        return fail("stream ended without [DONE] or a finish_reason")
    if not answered:
        return fail("stream carried no answer (no event with a choice)")
    if finish is not None and finish not in ANSWER_ENDS:
        return fail(f"finish_reason {finish}")
    out_tokens, in_tokens = chunks, prompt_len
    if usage is not None:
        if isinstance(usage.get("completion_tokens"), int):
            out_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            in_tokens = usage["prompt_tokens"]
    return RequestOutcome(True, ttft_s=ttft, e2e_s=last - start, itl_s=itl, output_tokens=out_tokens,
                          prompt_tokens=in_tokens)


async def list_models(client: httpx.AsyncClient, base: str, headers: dict[str, str],
                      model_given: bool) -> list[str]:
    """``GET {base}/models``: proves the server is reachable and names its models. Raises BenchInputError
    when it cannot be reached, refuses the key, or (without ``--model``) gives no usable list."""
    try:
        resp = await client.get(f"{base}/models", headers=headers)
    except httpx.ConnectError as exc:
        raise BenchInputError(f"cannot reach {base}: {exc or 'connection failed'} (is the server running "
                              f"and the URL right?)") from None
    except httpx.TimeoutException:
        raise BenchInputError(f"{base} did not answer GET /models in time") from None
    except httpx.HTTPError as exc:
        raise BenchInputError(f"cannot talk to {base}: {type(exc).__name__}: {exc}") from None
    if resp.status_code in (401, 403):
        raise BenchInputError(f"{base} refused the API key (HTTP {resp.status_code}); pass --api-key or set "
                              f"OPENAI_API_KEY")
    try:
        data = resp.json() if resp.status_code == 200 else None
        ids = [m["id"] for m in data["data"]] if isinstance(data, dict) else []
        ids = [i for i in ids if isinstance(i, str)]
    except (ValueError, KeyError, TypeError):
        ids = []
    if not ids and not model_given:
        raise BenchInputError(f"GET {base}/models gave no model (HTTP {resp.status_code}); is this an "
                              f"OpenAI-compatible server? Pass --model NAME to skip the lookup")
    return ids
