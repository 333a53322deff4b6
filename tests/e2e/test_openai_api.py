"""The OpenAI-compatible API through the official ``openai`` client, over uvicorn and three real
workers (encode -> prefill -> decode over gRPC, KV and embeddings on the wire).

Greedy answers equal the single-process ``generate()``: the same token ids (recorded by the
backend adapter), the same text and the same usage counts. Bad input gets a 4xx in OpenAI's error
shape and the workers keep serving with nothing left held.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from workers.runtime.generate import GenerateRequest, GenerateResult, generate
from workers.runtime.sampler import SamplingParams

if TYPE_CHECKING:  # the fixtures come from tests/e2e/conftest.py; nothing imported at run time
    from conftest import Stack

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=77)
TEXT = [{"role": "user", "content": "What is the capital of France?"}]
# how far a logprob through the served path may be from generate()'s: a prefix reused from a worker's prefix
# cache moves it in the last bits (the tokens stay exact; HF parity is checked to 1e-4 too)
LOGPROB_ROUNDING = 1e-4
COMPLETION_PROMPT = "The model reads a checkpoint folder and"
CONCURRENT = [[{"role": "user", "content": f"Request {i}: " + "the cache moves " * (i % 5 + 1)}] for i in range(16)]


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, "PNG")
    return buf.getvalue()


IMAGE = _png((200, 40, 40))
IMAGE_URL = "data:image/png;base64," + base64.b64encode(IMAGE).decode()


@pytest.fixture(scope="module")
def refs(e2e_stack: Stack) -> dict[str, GenerateResult]:
    """Every reference answer, from one single-process generate() call."""
    reqs = {"text": GenerateRequest(messages=TEXT, params=GREEDY),
            "image": GenerateRequest(messages=[{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "Describe this image."}]}], images=(IMAGE,), params=GREEDY),
            "completion": GenerateRequest(prompt=COMPLETION_PROMPT, params=GREEDY),
            "seeded": GenerateRequest(prompt=COMPLETION_PROMPT, params=SEEDED)}
    reqs.update({f"conc-{i}": GenerateRequest(messages=m, params=GREEDY) for i, m in enumerate(CONCURRENT)})
    return dict(zip(reqs, generate(e2e_stack.bundle, list(reqs.values()))))


@pytest.fixture(scope="module")
def client(e2e_stack: Stack) -> OpenAI:
    return OpenAI(base_url=e2e_stack.base_url, api_key=e2e_stack.api_key, max_retries=0, timeout=60)


def _tokens(stack: Stack, response_id: str) -> list[int]:
    """The token ids the backend relayed for a response (its id carries the request's uuid)."""
    return stack.backend.tokens[str(uuid.UUID(hex=response_id.split("-", 1)[1]))]


def _check(stack: Stack, ref: GenerateResult, response_id: str, text: str, usage: Any, finish_reason: str) -> None:
    assert _tokens(stack, response_id) == ref.token_ids
    assert text == ref.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_ids), len(ref.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish_reason == ref.finish_reason.value


def _stream_chat(client: OpenAI, model: str, messages: list[dict[str, Any]]) -> tuple[str, str, Any, str]:
    """(id, text, usage, finish_reason) of a streamed chat answer, checking OpenAI's chunk order."""
    stream = client.chat.completions.create(model=model, messages=messages,  # type: ignore[call-overload]  # plain dicts
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, closing, usage = chunks
    assert usage.choices == [] and usage.usage is not None
    assert closing.choices[0].finish_reason is not None and not closing.choices[0].delta.content
    assert all(c.choices[0].finish_reason is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    return chunks[0].id, text, usage.usage, closing.choices[0].finish_reason


def _model(stack: Stack) -> str:
    return stack.backend.model.name


# ------------------------------------------------------------------------------ oracle
def test_models_and_health(e2e_stack: Stack, client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [_model(e2e_stack)]
    root = e2e_stack.base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200 and httpx.get(f"{root}/ready").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=e2e_stack.base_url, api_key="sk-wrong", max_retries=0).models.list()


def test_chat_text(e2e_stack: Stack, client: OpenAI, refs: dict[str, GenerateResult]) -> None:
    r = client.chat.completions.create(model=_model(e2e_stack), messages=TEXT, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]  # plain dicts for TypedDicts
                                       temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    _check(e2e_stack, refs["text"], r.id, r.choices[0].message.content or "", r.usage, r.choices[0].finish_reason)


def test_chat_text_streaming(e2e_stack: Stack, client: OpenAI, refs: dict[str, GenerateResult]) -> None:
    rid, text, usage, reason = _stream_chat(client, _model(e2e_stack), TEXT)
    _check(e2e_stack, refs["text"], rid, text, usage, reason)


def test_chat_image_and_text(e2e_stack: Stack, client: OpenAI, refs: dict[str, GenerateResult]) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
                                             {"type": "text", "text": "Describe this image."}]}]
    r = client.chat.completions.create(model=_model(e2e_stack), messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]  # plain dicts for TypedDicts
                                       temperature=0)
    _check(e2e_stack, refs["image"], r.id, r.choices[0].message.content or "", r.usage, r.choices[0].finish_reason)
    rid, text, usage, reason = _stream_chat(client, _model(e2e_stack), messages)
    _check(e2e_stack, refs["image"], rid, text, usage, reason)


def test_completions(e2e_stack: Stack, client: OpenAI, refs: dict[str, GenerateResult]) -> None:
    r = client.completions.create(model=_model(e2e_stack), prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.object == "text_completion"
    _check(e2e_stack, refs["completion"], r.id, r.choices[0].text, r.usage, r.choices[0].finish_reason)
    chunks = list(client.completions.create(model=_model(e2e_stack), prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    *body, usage = chunks
    text = "".join(c.choices[0].text for c in body)
    _check(e2e_stack, refs["completion"], chunks[0].id, text, usage.usage, body[-1].choices[0].finish_reason)
    # token ids in, the same answer out
    ids = refs["completion"].prompt_ids
    r = client.completions.create(model=_model(e2e_stack), prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    _check(e2e_stack, refs["completion"], r.id, r.choices[0].text, r.usage, r.choices[0].finish_reason)


def test_a_seeded_sampled_answer_equals_the_single_process_one(e2e_stack: Stack, client: OpenAI,
                                                                refs: dict[str, GenerateResult]) -> None:
    """Prefill samples the first token and decode the rest; with a seed the tokens are generate()'s."""
    assert refs["seeded"].token_ids != refs["completion"].token_ids, "the seeded reference was meant to sample"
    for _ in range(2):
        r = client.completions.create(model=_model(e2e_stack), prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=SEEDED.temperature, top_p=SEEDED.top_p, seed=SEEDED.seed)
        _check(e2e_stack, refs["seeded"], r.id, r.choices[0].text, r.usage, r.choices[0].finish_reason)


def test_logprobs_of_a_sampled_answer_equal_the_single_process_ones(e2e_stack: Stack, client: OpenAI) -> None:
    """The first token's figures come from the prefill worker over the KV transfer, the rest from decode; chat
    and text completions show generate()'s logprobs, each token under its own text. Within float rounding
    (``LOGPROB_ROUNDING``), not exactly: the workers' prefix caches hold this prompt's head from the earlier
    tests, and a reused prefix moves logits in the last bits, as a different batch does."""
    params = dataclasses.replace(SEEDED, logprobs=3)
    ref = [generate(e2e_stack.bundle, [req])[0]  # each alone: a batch of two rounds its logits otherwise
           for req in (GenerateRequest(messages=TEXT, params=params),
                       GenerateRequest(prompt=COMPLETION_PROMPT, params=params))]
    tok = e2e_stack.bundle.tokenizer
    assert tok is not None
    chat = client.chat.completions.create(model=_model(e2e_stack), messages=TEXT, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]  # plain dicts for TypedDicts
                                          temperature=SEEDED.temperature, top_p=SEEDED.top_p, seed=SEEDED.seed,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content is not None and _tokens(e2e_stack, chat.id) == ref[0].token_ids
    assert [e.logprob for e in content] == pytest.approx([t.logprob for t in ref[0].logprobs], abs=LOGPROB_ROUNDING)
    assert [e.token for e in content] == [tok.decode([i], skip_special_tokens=False) for i in ref[0].token_ids]
    assert [[x.token for x in e.top_logprobs] for e in content] == [
        [tok.decode([i], skip_special_tokens=False) for i, _ in t.top] for t in ref[0].logprobs]
    assert [[x.logprob for x in e.top_logprobs] for e in content] == [
        pytest.approx([v for _, v in t.top], abs=LOGPROB_ROUNDING) for t in ref[0].logprobs]
    text = client.completions.create(model=_model(e2e_stack), prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=SEEDED.temperature, top_p=SEEDED.top_p, seed=SEEDED.seed,
                                     logprobs=3, stream=True)
    streamed = [x for c in text if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([t.logprob for t in ref[1].logprobs], abs=LOGPROB_ROUNDING)


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_harness_asks(e2e_stack: Stack, client: OpenAI,
                                                                      max_tokens: int) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1: the prefill worker's
    one-token path; and 4: the prompt's figures from the Prefill reply onto decode's first chunk): each prompt
    token after the first has generate()'s prompt logprob."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=1, logprobs=1)
    ref = generate(e2e_stack.bundle, [GenerateRequest(prompt=COMPLETION_PROMPT, params=params)])[0]
    r = client.completions.create(model=_model(e2e_stack), prompt=COMPLETION_PROMPT, max_tokens=max_tokens,
                                  temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and r.choices[0].text.startswith(COMPLETION_PROMPT)
    prompt_len = len(ref.prompt_ids)
    assert lp.token_logprobs[0] is None  # the first prompt token has none
    assert lp.token_logprobs[1:prompt_len] == pytest.approx([t.logprob for t in ref.prompt_logprobs],
                                                            abs=LOGPROB_ROUNDING)
    assert lp.token_logprobs[prompt_len:] == pytest.approx([t.logprob for t in ref.logprobs], abs=LOGPROB_ROUNDING)


def test_sampling_values_past_the_wires_types_mean_what_they_say(e2e_stack: Stack, client: OpenAI,
                                                                 refs: dict[str, GenerateResult]) -> None:
    """top_k is a uint32 and top_p a double on the worker wire: a top_k past any vocabulary is off (a 500
    before), and a tiny top_p keeps the most likely token (when the wire was float32, it rounded to zero and
    read as unset)."""
    model = _model(e2e_stack)
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=SEEDED.temperature, top_p=SEEDED.top_p, seed=SEEDED.seed,
                                  extra_body={"top_k": 2**32})
    _check(e2e_stack, refs["seeded"], r.id, r.choices[0].text, r.usage, r.choices[0].finish_reason)
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
                                  top_p=1e-46, seed=5)
    _check(e2e_stack, refs["completion"], r.id, r.choices[0].text, r.usage, r.choices[0].finish_reason)
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"top_k": 2**63 - 1})  # the one-token path: prefill alone
    assert _tokens(e2e_stack, r.id) == refs["completion"].token_ids[:1]
    e2e_stack.assert_workers_idle()


def test_a_one_token_answer_says_its_engine_time_in_server_timing(e2e_stack: Stack) -> None:
    """One engine computed it whole, so the response names that engine's time; a disaggregated
    multi-token answer (two engines) names none rather than a part."""
    from controlplane.observability.server_timing import engine_seconds

    headers = {"Authorization": f"Bearer {e2e_stack.api_key}"}
    body = {"model": _model(e2e_stack), "prompt": COMPLETION_PROMPT, "temperature": 0}
    t0 = time.perf_counter()
    one = httpx.post(f"{e2e_stack.base_url}/completions", json={**body, "max_tokens": 1}, headers=headers, timeout=60)
    elapsed = time.perf_counter() - t0
    assert one.status_code == 200 and one.json()["usage"]["completion_tokens"] == 1
    assert 0 < engine_seconds(one.headers["server-timing"]) < elapsed
    many = httpx.post(f"{e2e_stack.base_url}/completions", json={**body, "max_tokens": 3}, headers=headers, timeout=60)
    assert many.status_code == 200 and "server-timing" not in many.headers


def test_16_concurrent_streams_all_complete_and_match(e2e_stack: Stack, client: OpenAI,
                                                      refs: dict[str, GenerateResult]) -> None:
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        results = list(pool.map(lambda m: _stream_chat(client, _model(e2e_stack), m), CONCURRENT))
    for i, (rid, text, usage, reason) in enumerate(results):
        _check(e2e_stack, refs[f"conc-{i}"], rid, text, usage, reason)
    e2e_stack.assert_workers_idle()


def test_a_client_that_leaves_mid_stream_aborts_the_request(e2e_stack: Stack) -> None:
    before = set(e2e_stack.backend.abandoned)
    body = {"model": _model(e2e_stack), "messages": TEXT, "max_tokens": 2000, "temperature": 0, "stream": True}
    seen = 0
    with httpx.stream("POST", f"{e2e_stack.base_url}/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {e2e_stack.api_key}"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            seen += line.startswith("data: ") and '"content":' in line and '"role"' not in line
            if seen == 3:
                break  # leave with ~2000 tokens to go: the connection closes
    assert seen == 3
    deadline = time.monotonic() + 5
    while len(set(e2e_stack.backend.abandoned) - before) != 1:
        assert time.monotonic() < deadline, "the backend's iterator was not closed"
        time.sleep(0.05)
    e2e_stack.assert_workers_idle(within_s=5)


# ------------------------------------------------------------------------------ bad input
def _assert_openai_error(exc: openai.APIStatusError, status: int, fragment: str) -> dict[str, Any]:
    assert exc.status_code == status
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body
    return body["error"]


def test_bad_input_gets_4xx_and_the_workers_keep_serving(e2e_stack: Stack, client: OpenAI,
                                                         refs: dict[str, GenerateResult]) -> None:
    model = _model(e2e_stack)
    url, headers = f"{e2e_stack.base_url}/chat/completions", {"Authorization": f"Bearer {e2e_stack.api_key}"}
    # invalid JSON and wrong types, straight over HTTP
    resp = httpx.post(url, content=b'{"model": "x", "messages": [',
                      headers={**headers, "Content-Type": "application/json"})
    assert resp.status_code == 400 and "could not parse the JSON body" in resp.json()["error"]["message"]
    resp = httpx.post(url, json={"model": model, "messages": "hello"}, headers=headers)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    # and through the client
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=TEXT, max_tokens="many")  # type: ignore[call-overload]  # refused
    assert _assert_openai_error(err.value, 400, "valid integer")["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=TEXT, max_tokens=-1)  # type: ignore[arg-type]  # plain dicts for TypedDicts
    _assert_openai_error(err.value, 400, "max_tokens must be an integer >= 1")
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=TEXT)  # type: ignore[arg-type]  # plain dicts for TypedDicts
    assert _assert_openai_error(missing.value, 404, "The model `gpt-4o` does not exist.")["code"] == "model_not_found"
    not_an_image = "data:image/png;base64," + base64.b64encode(b"certainly not a PNG").decode()
    # a sound header over pixel data cut short: only the encode worker, decoding it, finds that out
    truncated = "data:image/png;base64," + base64.b64encode(_png((1, 2, 3))[:-40]).decode()
    part = "messages[0].content[0].image_url"
    for image_url, fragment, param in (
            (not_an_image, "is not a decodable image", part), ("data:image/png;base64,@@@", "not valid base64", part),
            ("https://example.com/cat.png", "remote image URLs are not supported", part),
            (truncated, "image 1 of 1: PNG image is corrupt or truncated", None)):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is it?"}]}])
        assert _assert_openai_error(err.value, 400, fragment)["param"] == param
    with pytest.raises(openai.BadRequestError) as err:  # the encoder's refusal, streaming: still a 400
        client.chat.completions.create(model=model, stream=True, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": truncated}}]}])
    _assert_openai_error(err.value, 400, "corrupt or truncated")
    long_prompt = [{"role": "user", "content": "the cache moves between workers " * 3000}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=long_prompt)  # type: ignore[arg-type]  # plain dicts for TypedDicts
    error = _assert_openai_error(err.value, 400, "This model's maximum context length is 8192 tokens.")
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=9000)
    # nothing held, and still serving the same answers
    e2e_stack.assert_workers_idle()
    r = client.chat.completions.create(model=model, messages=TEXT, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]  # plain dicts for TypedDicts
    _check(e2e_stack, refs["text"], r.id, r.choices[0].message.content or "", r.usage, r.choices[0].finish_reason)
