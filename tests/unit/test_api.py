"""The HTTP ingress alone: create_app over a fake Backend, driven with FastAPI's TestClient.

The fake streams a fixed reply and can be told to refuse (Overloaded, BackendError) or fail mid-way;
it records every WorkerRequest, so the tests check what the workers would be asked to do.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import socket
import struct
import threading
import time
import uuid
import zlib
from collections.abc import AsyncGenerator, Iterator, MutableMapping
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from controlplane.api import create_app
from controlplane.backend import BackendError, Chunk, ModelInfo, Overloaded
from controlplane.cancellation import ClientGone
from controlplane.dispatch import WorkerRequest
from workers.runtime.default_model import BOS, CHAT_TEMPLATE, IM_END, IMAGE, build_tokenizer
from workers.runtime.errors import InvalidRequestError
from workers.runtime.multimodal import expand_image_tokens
from workers.runtime.sampler import SamplingParams, TokenLogprobs
from workers.runtime.tokenizer import Tokenizer

from http_helpers import serve_app

pytestmark = [pytest.mark.unit]

Response = httpx2.Response  # what starlette's TestClient answers with (it is built on httpx2)

NAME = "epd-test"
CONTEXT = 256
TOKENS_PER_IMAGE = 4
REPLY = " The cache moves between workers layer by layer."
def _png_bytes(width: int = 2, height: int = 2) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (30, 160, 90)).save(buf, format="PNG")
    return buf.getvalue()


PNG = base64.b64encode(_png_bytes()).decode()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(), bos_token=BOS, eos_token=IM_END, chat_template=CHAT_TEMPLATE,
                     image_token=IMAGE)


class FakeBackend:
    """Implements controlplane.backend.Backend: streams ``REPLY`` one token per chunk."""

    def __init__(self, model: ModelInfo) -> None:
        self.model = model
        self.requests: list[WorkerRequest] = []
        self.refuse: Exception | None = None  # raised by generate() itself
        self.fail_after: int | None = None  # raise after this many chunks
        self.fail_with: Exception = BackendError("decode worker lost", status=502)
        self.token_delay_s = 0.0
        self.pause_after: int | None = None  # after this many chunks, no token for pause_s (a preempted request)
        self.pause_s = 0.0
        self.gate: threading.Event | None = None  # the first chunk waits for it
        self.is_ready: bool | Exception = True
        self.degraded_reason: str | None = None
        self.end_early = False  # stop without a finished chunk (a broken backend)
        self.produced = 0
        self.closed: list[str] = []  # request ids whose iterator was closed before it ended

    def ready(self) -> bool:
        if isinstance(self.is_ready, Exception):
            raise self.is_ready
        return self.is_ready

    def degraded(self) -> str | None:
        return self.degraded_reason

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        self.requests.append(request)
        if self.refuse is not None:
            raise self.refuse
        return self._stream(request)

    def _stream(self, request: WorkerRequest) -> Iterator[Chunk]:
        tok = self.model.tokenizer
        ids = tok.encode(REPLY, add_special_tokens=False)[:request.params.max_tokens]
        reason = "length" if request.params.max_tokens < len(ids) + 1 else "stop"
        done = False
        try:
            if self.gate is not None:  # as the scheduler does while a request waits: a cancel ends the wait
                deadline = time.monotonic() + 10
                while not self.gate.wait(0.01) and time.monotonic() < deadline:
                    if request.cancel.cancelled:
                        raise ClientGone("the client went away before the request was routed")
            for i, token in enumerate(ids):
                if self.fail_after is not None and i == self.fail_after:
                    raise self.fail_with
                if i == self.pause_after and request.cancel.wait(self.pause_s):  # as the dispatcher's wait ends
                    raise ClientGone("the client went away")
                time.sleep(self.token_delay_s)
                last = i == len(ids) - 1 and not self.end_early
                self.produced += 1
                n, k = request.params.logprobs, request.params.prompt_logprobs
                logprobs = () if n is None else (fake_logprobs(token, n),)
                prompt = None if k is None or i else tuple(fake_logprobs(t, k) for t in request.prompt_ids[1:])
                yield Chunk((token,), tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):], last,
                            reason if last else None, len(request.prompt_ids), i + 1, logprobs=logprobs,
                            prompt_logprobs=prompt)
            done = True
        finally:
            if not done:
                self.closed.append(request.request_id)


def fake_logprobs(token: int, n: int) -> TokenLogprobs:
    """What FakeBackend says of ``token``: -token/64, and that tokens token+1 .. token+n were more likely."""
    return TokenLogprobs(-token / 64, tuple((token + k, -(token + k) / 64 + 0.5) for k in range(1, n + 1)))


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, f"the demo tokenizer has no {token!r}"
    return found


def model_info(tokenizer: Tokenizer, images: bool = True) -> ModelInfo:
    return ModelInfo(NAME, tokenizer, CONTEXT, token_id(tokenizer, IMAGE) if images else None,
                     TOKENS_PER_IMAGE, (token_id(tokenizer, IM_END),))


@pytest.fixture
def backend(tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(model_info(tokenizer))


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend)) as c:
        yield c


def chat(client: TestClient, **body: Any) -> Response:
    return client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                     **body})


def assert_error(resp: Response, status: int, fragment: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert fragment in err["message"], err
    assert err["type"] == type and err["param"] == param and err["code"] == code, err
    return err


def events(resp: Response) -> list[Any]:
    """Parse an SSE body strictly: every event is one ``data:`` line and a blank line."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    assert raw.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


# ------------------------------------------------------------------------------ basics
def test_health_ready_and_models(client: TestClient, backend: FakeBackend) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    assert client.head("/health").status_code == 200 and client.head("/ready").status_code == 200  # HEAD probes
    backend.is_ready = False
    assert client.get("/ready").status_code == 503 and client.head("/ready").status_code == 503
    backend.is_ready = RuntimeError("redis is gone")
    assert client.get("/ready").status_code == 503
    backend.is_ready, backend.degraded_reason = True, "Redis is degraded: routing on its last good snapshot"
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "degraded": backend.degraded_reason}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["object"] == "model"
    assert client.get(f"/v1/models/{NAME}").json()["id"] == NAME
    assert_error(client.get("/v1/models/gpt-4"), 404, "The model `gpt-4` does not exist.", param="model",
                 code="model_not_found")
    assert_error(client.get("/v1/embeddings"), 404, "Invalid URL (GET /v1/embeddings)")


def test_chat_answer_and_what_the_backend_was_asked(client: TestClient, backend: FakeBackend,
                                                    tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is prefill?"},
                {"role": "assistant", "content": "A stage."}, {"role": "user", "content": "And decode?"}]
    resp = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 64,
                                                     "temperature": 0, "top_p": 0.5, "seed": 7, "stop": "\n\n"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    req = backend.requests[-1]
    assert req.prompt_ids == tokenizer.encode_chat(messages)
    assert req.params == SamplingParams(max_tokens=64, temperature=0.0, top_p=0.5, seed=7, stop=("\n\n",))
    assert req.images == () and req.image_positions == ()
    assert str(uuid.UUID(req.request_id)) == req.request_id
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == NAME and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == REPLY and choice["finish_reason"] == "stop"
    completion = len(tokenizer.encode(REPLY, add_special_tokens=False))
    assert body["usage"] == {"prompt_tokens": len(req.prompt_ids), "completion_tokens": completion,
                             "total_tokens": len(req.prompt_ids) + completion}
    # a fresh request id each time
    chat(client)
    assert backend.requests[-1].request_id != req.request_id


def test_defaults_and_max_completion_tokens(client: TestClient, backend: FakeBackend, tokenizer: Tokenizer) -> None:
    assert chat(client).status_code == 200
    req = backend.requests[-1]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert req.prompt_ids == prompt
    assert req.params == SamplingParams(max_tokens=CONTEXT - len(prompt), temperature=1.0, top_p=1.0,
                                       to_context=True)
    resp = chat(client, max_tokens=50, max_completion_tokens=3, stop=["a", "b"])
    assert backend.requests[-1].params.max_tokens == 3 and backend.requests[-1].params.stop == ("a", "b")
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert backend.requests[-1].params.ignore_eos is False
    assert chat(client, max_tokens=4, ignore_eos=True).status_code == 200  # the vLLM/SGLang extension
    assert backend.requests[-1].params.ignore_eos is True


def test_chat_with_images(client: TestClient, backend: FakeBackend, tokenizer: Tokenizer) -> None:
    image = base64.b64decode(PNG)
    content = [{"type": "text", "text": "Compare"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
               {"type": "text", "text": "with"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}}]
    resp = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": content}]})
    assert resp.status_code == 200, resp.text
    req = backend.requests[-1]
    rendered = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                             {"type": "text", "text": "with"}, {"type": "image"}]}]
    ids, positions = expand_image_tokens(tokenizer.encode_chat(rendered), token_id(tokenizer, IMAGE),
                                         TOKENS_PER_IMAGE, 2)
    assert req.prompt_ids == ids and req.image_positions == positions and len(positions) == 2 * TOKENS_PER_IMAGE
    assert req.images == (image, image)
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("url, fragment", [
    ("https://example.com/cat.png", "remote image URLs are not supported; send a data: URL"),
    ("http://example.com/cat.png", "remote image URLs are not supported; send a data: URL"),
    ("data:image/png;base64,not*base64!", "not valid base64"),
    ("data:image/png;base64,", "holds no data"),
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("file:///etc/passwd", "must be a data: URL"),
])
def test_bad_image_urls(client: TestClient, backend: FakeBackend, url: str, fragment: str) -> None:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    resp = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": content}]})
    assert_error(resp, 400, fragment, param="messages[0].content[0].image_url", code="invalid_image_url")
    assert backend.requests == []


def _bmp() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="BMP")
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` (the header is all the API's check reads)."""
    data = bytearray(_png_bytes())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.mark.parametrize("image, fragment, code", [
    (b"certainly not a PNG", "is not a decodable image; supported: PNG, JPEG, WEBP, GIF", "invalid_image"),
    (_bmp(), "unsupported image format BMP; supported: PNG, JPEG, WEBP, GIF", "invalid_image"),
    (_png_claiming(9000, 9000), "image is too large: 9000x9000 pixels, the limit is 64000000", "image_too_large"),
    (b"\xff\xd8\xff\xc0\x00\x11\x08", "image header is corrupt or truncated", "invalid_image"),  # Pillow: OSError
    (b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"junk" * 4, "image header is corrupt or truncated", "invalid_image"),
], ids=["not-an-image", "bmp", "81-megapixels", "jpeg-cut-in-its-header", "webp-header-over-junk"])
def test_an_image_its_header_rules_out_is_refused_naming_its_part(client: TestClient, backend: FakeBackend,
                                                                  image: bytes, fragment: str, code: str) -> None:
    """Format and pixel count are read from the header at the API, so the 400 names the image's part (the
    encode worker, which decodes the pixels, could only say which image it was in its message)."""
    bad = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "Compare"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
               {"type": "image_url", "image_url": {"url": bad}}]
    resp = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": content}]})
    assert_error(resp, 400, fragment, param="messages[0].content[2].image_url", code=code)
    assert backend.requests == []


def _image_chat(client: TestClient, *sizes: int) -> Response:
    png = _png_bytes()  # a real PNG, padded to n bytes (a decoder ignores what follows its end)
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        png + b"\0" * (n - len(png))).decode()}} for n in sizes]
    return client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": content}]})


def test_images_over_the_size_limits_are_refused_before_decoding(client: TestClient, backend: FakeBackend,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An image past 20 MiB, or images past 48 MiB together, would not fit the encode worker's message;
    each is a 400 naming the image (this test lowers the limits to keep its bodies small)."""
    import controlplane.api.prompts as prompts
    monkeypatch.setattr(prompts, "MAX_IMAGE_BYTES", 3 * 1024)
    monkeypatch.setattr(prompts, "MAX_IMAGES_BYTES", 5 * 1024)
    assert _image_chat(client, 3 * 1024).status_code == 200  # at the limit
    err = assert_error(_image_chat(client, 2048, 3 * 1024 + 1), 400, "images may be at most",
                       param="messages[0].content[1].image_url", code="image_too_large")
    assert err["message"].startswith("the image is ")
    assert_error(_image_chat(client, 2048, 2048, 2048), 400, "together", param="messages[0].content[2].image_url",
                 code="image_too_large")
    assert len(backend.requests) == 1


def test_a_body_over_the_limit_is_a_413_whether_its_length_is_declared_or_not(backend: FakeBackend) -> None:
    with TestClient(create_app(backend, max_body_bytes=4096)) as client:
        big = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        declared = client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert_error(declared, 413, "larger than this server accepts", code="request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        chunked = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(chunked, 413, "larger than this server accepts", code="request_too_large")
        assert backend.requests == []
        assert chat(client).status_code == 200


def test_a_body_that_is_not_utf8_or_too_deep_gets_a_message_that_says_so(client: TestClient,
                                                                          backend: FakeBackend) -> None:
    headers = {"content-type": "application/json"}
    assert_error(client.post("/v1/completions", content=b'{"model": "\xff\xfe"}', headers=headers), 400,
                 "not valid UTF-8")
    assert_error(client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=headers), 400,
                 "nested too deeply")
    assert backend.requests == []


def test_a_text_only_model_refuses_images(tokenizer: Tokenizer) -> None:
    backend = FakeBackend(model_info(tokenizer, images=False))
    with TestClient(create_app(backend)) as client:
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]
        resp = client.post("/v1/chat/completions",
                           json={"model": NAME, "messages": [{"role": "user", "content": content}]})
        assert_error(resp, 400, f"The model `{NAME}` does not accept images.", param="messages[0].content[0].image_url")
        assert chat(client).status_code == 200  # text still works


def test_an_image_token_typed_into_the_text_is_refused(client: TestClient, backend: FakeBackend) -> None:
    assert_error(client.post("/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": f"look {IMAGE} here"}]}), 400, "image placeholder", param="messages")
    assert_error(client.post("/v1/completions", json={"model": NAME, "prompt": f"a {IMAGE}"}), 400,
                 "image placeholder", param="prompt")
    assert backend.requests == []


@pytest.mark.parametrize("sent, engine", [(-1, 2**63 - 1), (-2**63, 0), (0, 0), (2**63 - 1, 2**63 - 1)])
def test_a_seed_in_vllms_range_is_accepted_and_a_negative_one_draws_as_seed_plus_2_63(
        client: TestClient, backend: FakeBackend, sent: int, engine: int) -> None:
    """vLLM takes seeds in [-2^63, 2^63); a client sending seed -1 was refused with a 400."""
    resp = client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2, "seed": sent})
    assert resp.status_code == 200, resp.text
    assert backend.requests[-1].params.seed == engine


def test_completions(client: TestClient, backend: FakeBackend, tokenizer: Tokenizer) -> None:
    resp = client.post("/v1/completions", json={"model": NAME, "prompt": "The scheduler", "max_tokens": 5,
                                                "temperature": 0.7, "seed": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    req = backend.requests[-1]
    assert req.prompt_ids == tokenizer.encode("The scheduler")
    assert req.params == SamplingParams(max_tokens=5, temperature=0.7, seed=3)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == NAME
    [choice] = body["choices"]
    expected = tokenizer.decode(tokenizer.encode(REPLY, add_special_tokens=False)[:5])
    assert choice["text"] == expected and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {"prompt_tokens": len(req.prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(req.prompt_ids) + 5}
    ids = [5, 6, 7, 8]
    for prompt in (ids, [ids], ["The scheduler"]):
        resp = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200
    assert [r.prompt_ids for r in backend.requests[-3:]] == [ids, ids, tokenizer.encode("The scheduler")]
    assert backend.requests[-3].params.max_tokens == 2


@pytest.mark.parametrize("prompt, fragment, param", [
    ([], "The prompt is empty.", "prompt"),
    ([1, 99999], "prompt token ids must be in [0, ", "prompt"),
    (["a", "b"], "batched prompts are not supported", "prompt"),
    ([1.5], "Input should be a valid integer", "prompt[0]"),
    (42, "Input should be a valid", "prompt"),
])
def test_bad_completion_prompts(client: TestClient, prompt: Any, fragment: str, param: str) -> None:
    assert_error(client.post("/v1/completions", json={"model": NAME, "prompt": prompt}), 400, fragment, param=param)


# ------------------------------------------------------------------------------ streaming
def test_chat_stream_framing(client: TestClient, backend: FakeBackend) -> None:
    with client.stream("POST", "/v1/chat/completions", json={
            "model": NAME, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}) as resp:
        resp.read()
    chunks = events(resp)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all("usage" not in c for c in chunks)  # only with include_usage
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    middle = chunks[1:-1]
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None
                          for c in middle)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == REPLY
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]


def test_chat_stream_usage_in_the_last_chunk(client: TestClient, backend: FakeBackend) -> None:
    with client.stream("POST", "/v1/chat/completions", json={
            "model": NAME, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]}) as resp:
        resp.read()
    chunks = events(resp)
    prompt_tokens = len(backend.requests[-1].prompt_ids)
    *rest, last = chunks
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4,
                                                       "total_tokens": prompt_tokens + 4}
    assert all(c["usage"] is None for c in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_stream(client: TestClient, backend: FakeBackend, tokenizer: Tokenizer) -> None:
    with client.stream("POST", "/v1/completions", json={
            "model": NAME, "prompt": "Decode", "stream": True, "stream_options": {"include_usage": True}}) as resp:
        resp.read()
    chunks = events(resp)
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    *texts, closing, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in texts) == REPLY
    assert closing["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    n = len(tokenizer.encode(REPLY, add_special_tokens=False))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n


def test_an_error_after_the_stream_started_is_sent_in_band(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_after = 2
    with client.stream("POST", "/v1/chat/completions", json={
            "model": NAME, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}) as resp:
        resp.read()
    chunks = events(resp)
    assert chunks[-1] == {"error": {"message": "decode worker lost", "type": "server_error", "param": None,
                                    "code": None}}
    assert len(chunks) == 4 and all("choices" in c for c in chunks[:3])  # role, two tokens, then the error


def _sample(name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.observability import metrics

    return sum(s.value for fam in text_string_to_metric_families(metrics.exposition().decode()) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_client_that_leaves_mid_body_is_counted_499_not_400(tokenizer: Tokenizer) -> None:
    """It sent its head and part of its body, then closed: FastAPI's body reader fails, which read as a
    malformed body (a 400 in epd:requests_total, inflating the client-error rate); it is a client gone."""
    route = "/v1/chat/completions"
    before = {s: _sample("epd:requests_total", route=route, status=s) for s in ("400", "499")}
    with serve_app(create_app(FakeBackend(model_info(tokenizer)))) as base:
        host, port = base.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST " + route.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                             b"\r\nContent-Length: 5000\r\n\r\n" + b'{"model": "x", ')
                time.sleep(0.2)
        deadline = time.monotonic() + 10
        while _sample("epd:requests_total", route=route, status="499") - before["499"] < 3:
            assert time.monotonic() < deadline, "the three requests were never counted as 499"
            time.sleep(0.05)
    assert _sample("epd:requests_total", route=route, status="400") == before["400"]


def test_a_messages_name_reaches_the_chat_template(backend: FakeBackend, tokenizer: Tokenizer) -> None:
    named = Tokenizer(tokenizer.backend, chat_template="{% for m in messages %}{{ m.get('name', '-') }}: "
                                                       "{{ m['content'] }}\n{% endfor %}")
    backend.model = dataclasses.replace(backend.model, tokenizer=named)
    with TestClient(create_app(backend)) as client:
        assert chat(client, messages=[{"role": "user", "content": "Hi", "name": "ada"},
                                      {"role": "user", "content": "Yo"}]).status_code == 200
    assert named.decode(backend.requests[-1].prompt_ids) == "ada: Hi\n-: Yo\n"


def test_a_cut_short_answer_is_counted_once_under_its_status_and_times_no_stream_stage(
        client: TestClient, backend: FakeBackend) -> None:
    """A stream cut short after its 200 status line was an error only /metrics' cut-short counter knew of:
    the dashboard's timeline counted it as answered. A worker's refusal mid-answer was labelled 500 while
    the client got 400, and a cut-short stream timed a "stream" stage no other stage times."""
    from controlplane.observability import metrics

    def errors() -> int:
        return sum(slot.errors + slot.client_errors for slot in metrics.TIMELINE._slots.values())

    body = {"model": NAME, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    stream_stage = ("epd:request_stage_seconds_count", {"stage": "stream"})
    before = (errors(), _sample(stream_stage[0], **stream_stage[1]),
              _sample("epd:requests_cut_short_total", status="502"))
    backend.fail_after = 2
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.read()
    assert resp.status_code == 200 and errors() == before[0] + 1
    assert _sample("epd:requests_cut_short_total", status="502") == before[2] + 1
    assert _sample(stream_stage[0], **stream_stage[1]) == before[1]
    backend.fail_with = InvalidRequestError("the worker refused it")
    refused = _sample("epd:requests_cut_short_total", status="400")
    assert client.post("/v1/chat/completions", json={**body, "stream": False}).status_code == 400
    assert _sample("epd:requests_cut_short_total", status="400") == refused + 1
    assert errors() == before[0] + 2  # the non-streamed one by its own status (400), once
    backend.fail_after = None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.read()
    assert _sample(stream_stage[0], **stream_stage[1]) == before[1] + 1  # an answered stream times its stage


@pytest.mark.parametrize("fail_after, expected", [(2, "ERROR"), (None, "UNSET")])
def test_a_stream_cut_short_by_a_server_error_marks_its_root_span(client: TestClient, backend: FakeBackend,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    fail_after: int | None, expected: str) -> None:
    """The root span's status line said 200 before a worker was lost mid-answer: the span says ERROR (with
    the status the error maps to), or a trace search for failed requests misses it. An answered stream stays
    UNSET."""
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from controlplane.observability import tracing
    from controlplane.observability.metrics import OBSERVABILITY

    exporter = InMemorySpanExporter()

    class Gate(SpanProcessor):  # the provider is the process's: forward only while this test runs
        open = True

        def on_end(self, span: ReadableSpan) -> None:
            if self.open:
                exporter.export([span])

    gate = Gate()
    tracing.add_span_processor(gate, "epd-test")
    monkeypatch.setattr(OBSERVABILITY, "tracing", True)
    trace_id = uuid.uuid4().int
    try:
        backend.fail_after = fail_after
        with client.stream("POST", "/v1/chat/completions", headers={"traceparent": f"00-{trace_id:032x}-{1:016x}-01"},
                           json={"model": NAME, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
                           ) as resp:
            resp.read()
    finally:
        gate.open = False
    assert resp.status_code == 200
    (root,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER and s.context is not None
               and s.context.trace_id == trace_id]
    assert root.status.status_code is getattr(StatusCode, expected), root.status
    if expected == "ERROR":
        assert root.status.description is not None and "HTTP 502" in root.status.description
        assert "decode worker lost" in root.status.description


def test_refusals_keep_their_status_when_streaming(client: TestClient, backend: FakeBackend) -> None:
    backend.refuse = Overloaded("decode pool is full", retry_after_s=2.2)
    with client.stream("POST", "/v1/chat/completions", json={
            "model": NAME, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}) as resp:
        resp.read()
    assert_error(resp, 429, "decode pool is full", type="rate_limit_error", code="rate_limit_exceeded")
    assert resp.headers["retry-after"] == "3"


@pytest.mark.parametrize("stream, fail_after, status, counted", [
    (False, 2, 429, 1),  # moved after two tokens, no room in time: the client gets a 429 and nothing else
    (True, 2, 200, 0),   # the same in a stream: its 200 and two tokens went out; the error ends the stream
    (True, 0, 429, 1),   # refused before its first token: a 429 either way
])
def test_an_admission_refusal_is_counted_once_when_the_client_gets_a_429(
        client: TestClient, backend: FakeBackend, stream: bool, fail_after: int, status: int, counted: int) -> None:
    """A moved non-streaming request that found no decode room in time was answered 429 but not counted in
    epd:admission_rejections_total: the scheduler counted only requests with no tokens yet."""
    backend.fail_after, backend.fail_with = fail_after, Overloaded("no decode room", 1.0, reason="queue_timeout")
    before = _sample("epd:admission_rejections_total", reason="queue_timeout")
    body = {"model": NAME, "stream": stream, "messages": [{"role": "user", "content": "Hi"}]}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.read()
    assert resp.status_code == status
    if status == 429:
        assert_error(resp, 429, "no decode room", type="rate_limit_error", code="rate_limit_exceeded")
    else:
        assert events(resp)[-1]["error"]["message"] == "no decode room"
    assert _sample("epd:admission_rejections_total", reason="queue_timeout") == before + counted


# ------------------------------------------------------------------------------ backend failures
def test_health_is_503_with_the_reason_while_the_process_should_be_restarted(backend: FakeBackend) -> None:
    reason: list[str | None] = [None]
    with TestClient(create_app(backend, unhealthy=lambda: reason[0])) as client:
        assert client.get("/health").json() == {"status": "ok"}
        reason[0] = "the Ray cluster at ray://head:10001 has not answered for 61 s"
        resp = client.get("/health")
        assert resp.status_code == 503 and resp.json() == {"status": "unhealthy", "reason": reason[0]}
        assert client.head("/health").status_code == 503  # probes that send HEAD
        reason[0] = None
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("retry_after_s, header", [(2.2, "3"), (0.05, "1"), (0.0, "1"), (30.0, "30")])
def test_overloaded_is_429_with_retry_after(client: TestClient, backend: FakeBackend, retry_after_s: float,
                                            header: str) -> None:
    backend.refuse = Overloaded("no decode room", retry_after_s)
    resp = chat(client)
    assert_error(resp, 429, "no decode room", type="rate_limit_error", code="rate_limit_exceeded")
    assert resp.headers["retry-after"] == header


def test_backend_errors_keep_their_status(client: TestClient, backend: FakeBackend) -> None:
    backend.refuse = BackendError("encode: image is not a PNG, JPEG or WebP", status=400)
    assert_error(chat(client), 400, "image is not a PNG")
    backend.refuse = BackendError("prefill worker unreachable")
    assert_error(chat(client), 502, "prefill worker unreachable", type="server_error")
    backend.refuse = BackendError("decode: deadline", status=504, kind="timeout")
    assert_error(chat(client), 504, "decode: deadline", type="timeout")
    backend.refuse = BackendError("more than a worker's KV pool holds", 400, "invalid_request_error",
                                  code="context_length_exceeded")
    assert_error(chat(client), 400, "KV pool holds", code="context_length_exceeded")


def test_a_backend_that_ends_without_finishing_is_502(client: TestClient, backend: FakeBackend) -> None:
    backend.end_early = True
    assert_error(chat(client), 502, "without finishing", type="server_error")


def test_unexpected_errors_are_a_generic_500_and_logged(client: TestClient, backend: FakeBackend,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    backend.refuse = KeyError("internal detail 1234")
    with caplog.at_level(logging.ERROR):
        resp = chat(client)
    err = assert_error(resp, 500, "The server had an error", type="server_error")
    assert "1234" not in err["message"]
    assert any("1234" in (r.exc_text or "") for r in caplog.records)


# ------------------------------------------------------------------------------ bad input
def test_invalid_json(client: TestClient, backend: FakeBackend) -> None:
    for body in ('{"model": "x", "messages": [', "nonsense", '{"model": "a",}'):
        resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert_error(resp, 400, "We could not parse the JSON body of your request")
    assert_error(client.post("/v1/completions", content=b"", headers={"content-type": "application/json"}),
                 400, "The request body is missing")
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400, "must be a JSON object")
    assert backend.requests == []


@pytest.mark.parametrize("field, value, param, fragment", [
    ("max_tokens", "16", "max_tokens", "valid integer"),
    ("max_tokens", 2.5, "max_tokens", "valid integer"),
    ("temperature", "hot", "temperature", "valid number"),
    ("stream", "yes", "stream", "valid boolean"),
    ("stop", 5, "stop", "valid"),
    ("messages", "Hi", "messages", "valid list"),
    ("messages", [], "messages", "at least 1 item"),
    ("messages", [{"role": "robot", "content": "x"}], "messages[0].role", "'system', 'developer', 'user'"),
    ("messages", [{"role": "user", "content": 5}], "messages[0].content", "valid"),
    ("messages", [{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0]", "does not match"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]}],
     "messages[0].content[0].image_url", "valid dictionary"),
    ("model", 3, "model", "valid string"),
    ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage", "valid boolean"),
])
def test_wrong_types(client: TestClient, backend: FakeBackend, field: str, value: Any, param: str,
                     fragment: str) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], field: value}
    assert_error(client.post("/v1/chat/completions", json=body), 400, fragment, param=param)
    assert backend.requests == []


@pytest.mark.parametrize("path, field, value, param, at", [
    ("/v1/chat/completions", "messages", [{"role": "user", "content": "\ud800"}], "messages[0].content", 0),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": [{"type": "text", "text": "ok \udc80"}]}],
     "messages[0].content[0].text", 3),
    ("/v1/chat/completions", "stop", ["fine", "x\ud83d"], "stop[1]", 1),
    ("/v1/chat/completions", "model", "\ud800", "model", 0),
    ("/v1/chat/completions", "user", "\udfff", "user", 0),
    ("/v1/completions", "prompt", "caf\u00e9 \udc80", "prompt", 5),
])
def test_a_lone_surrogate_in_any_string_is_a_400_naming_it(client: TestClient, backend: FakeBackend, path: str,
                                                           field: str, value: Any, param: str, at: int) -> None:
    """JSON can escape half a UTF-16 pair; such a string cannot be tokenised or sent on, so it is refused."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", field: value}
    resp = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    err = assert_error(resp, 400, "lone UTF-16 surrogate", param=param)
    assert f"at character {at}" in err["message"]
    assert backend.requests == []
    assert chat(client).status_code == 200  # a good request after it


def test_missing_fields(client: TestClient) -> None:
    assert_error(client.post("/v1/chat/completions", json={"model": NAME}), 400, "Field required", param="messages")
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 400, "Field required", param="model")


@pytest.mark.parametrize("body, fragment, param", [
    ({"max_tokens": -1}, "max_tokens must be an integer >= 1, got -1", "max_tokens"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1", "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens must be an integer >= 1, got -3", "max_completion_tokens"),
    ({"temperature": -0.5}, "temperature must be in [0, 100]", "temperature"),
    ({"top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    ({"seed": -2**63 - 1}, "seed must be an integer in [-2^63, 2^63), got -9223372036854775809", "seed"),
    ({"seed": 2**63}, "seed must be an integer in [-2^63, 2^63)", "seed"),
    ({"stop": ["x" * 300]}, "stop must be", "stop"),
    ({"n": 2}, "n must be 1", "n"),
    ({"presence_penalty": 0.5}, "presence_penalty is not supported", "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs set to true", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20], got 21", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be an integer in [0, 20], got -1", "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools are not supported", "tools"),
    ({"response_format": {"type": "json_object"}}, "structured output is not supported", "response_format"),
    ({"stream_options": {"include_usage": True}}, "only allowed when 'stream' is enabled", "stream_options"),
    ({"messages": [{"role": "user"}]}, "messages[0].content is required", "messages[0].content"),
    # vLLM's extensions: served (top_k, stop_token_ids) but checked, or refused unless at their default
    ({"top_k": -5}, "top_k must be an integer >= 0", "top_k"),
    ({"stop_token_ids": [1, 10**9]}, "stop_token_ids must be in [0,", "stop_token_ids"),
    ({"min_p": 0.99}, "min_p is not supported by this server (only 0)", "min_p"),
    ({"repetition_penalty": 100}, "repetition_penalty is not supported by this server (only 1)", "repetition_penalty"),
    ({"min_tokens": 100}, "min_tokens is not supported by this server (only 0)", "min_tokens"),
    ({"use_beam_search": True}, "beam search is not supported", "use_beam_search"),
    ({"skip_special_tokens": False}, "skip_special_tokens must be true", "skip_special_tokens"),
    ({"echo": True}, "echo is not supported on chat completions", "echo"),
    ({"functions": [{"name": "f"}]}, "functions (tools) are not supported", "functions"),
    ({"function_call": {"name": "f"}}, "function_call needs tools", "function_call"),
    ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    # vLLM's extensions that change the prompt or the text: ignoring them gave another answer than asked for
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output is not supported", "include_stop_str_in_output"),
    ({"add_generation_prompt": False}, "continuing the last message is not supported", "add_generation_prompt"),
    ({"continue_final_message": True}, "continuing the last message is not supported", "continue_final_message"),
    ({"chat_template": "{{ messages }}"}, "chat_template is not supported", "chat_template"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs is not supported",
     "chat_template_kwargs"),
])
def test_bad_values(client: TestClient, backend: FakeBackend, body: dict[str, Any], fragment: str,
                    param: str) -> None:
    assert_error(chat(client, **body), 400, fragment, param=param)
    assert backend.requests == []


def test_n_1_and_zero_penalties_are_accepted(client: TestClient) -> None:
    assert chat(client, n=1, presence_penalty=0, frequency_penalty=0.0, user="u1", logprobs=False).status_code == 200
    assert chat(client, include_stop_str_in_output=False, add_generation_prompt=True, continue_final_message=False,
                chat_template_kwargs={}).status_code == 200  # the defaults, said out loud


def test_vllm_sampling_extensions_reach_the_request_or_ask_for_the_default(client: TestClient,
                                                                          backend: FakeBackend) -> None:
    assert chat(client, top_k=5, stop_token_ids=[3, 7], min_p=0, repetition_penalty=1.0, min_tokens=0,
                use_beam_search=False, skip_special_tokens=True, tool_choice="none", echo=False).status_code == 200
    assert chat(client, top_k=-1).status_code == 200  # vLLM's "off"
    first, off = backend.requests[-2].params, backend.requests[-1].params
    assert (first.top_k, first.stop_token_ids, off.top_k) == (5, (3, 7), 0)


def test_a_completion_without_max_tokens_gets_16_as_in_openais_api(client: TestClient, backend: FakeBackend) -> None:
    """A chat without it runs to the end of the context (as vLLM's chat does); a legacy completion stops at 16."""
    assert client.post("/v1/completions", json={"model": NAME, "prompt": "x"}).status_code == 200
    assert backend.requests[-1].params.max_tokens == 16 and not backend.requests[-1].params.to_context
    # the chat's ceiling is marked as the client's not setting one: a worker whose KV pool is smaller than the
    # context runs it as far as the pool holds instead of refusing it (Engine.fit)
    assert chat(client).status_code == 200
    assert backend.requests[-1].params.to_context
    assert chat(client, max_tokens=5).status_code == 200
    assert not backend.requests[-1].params.to_context


# ------------------------------------------------------------------------------ logprobs
def _reply_ids(backend: FakeBackend, max_tokens: int) -> list[int]:
    return backend.model.tokenizer.encode(REPLY, add_special_tokens=False)[:max_tokens]


def _shown(backend: FakeBackend, token: int) -> str:
    return backend.model.tokenizer.decode([token], skip_special_tokens=False)


def test_chat_logprobs_name_each_token_with_its_figure_and_the_top_ones(client: TestClient,
                                                                       backend: FakeBackend) -> None:
    resp = chat(client, logprobs=True, top_logprobs=2, max_tokens=5)
    assert resp.status_code == 200, resp.text
    assert backend.requests[-1].params.logprobs == 2
    content = resp.json()["choices"][0]["logprobs"]["content"]
    ids = _reply_ids(backend, 5)
    assert [e["token"] for e in content] == [_shown(backend, t) for t in ids]
    assert [e["logprob"] for e in content] == [-t / 64 for t in ids]
    assert [e["bytes"] for e in content] == [list(_shown(backend, t).encode()) for t in ids]
    assert [[(x["token"], x["logprob"]) for x in e["top_logprobs"]] for e in content] == [
        [(_shown(backend, t + k), -(t + k) / 64 + 0.5) for k in (1, 2)] for t in ids]
    streamed = [e for c in events(chat(client, logprobs=True, top_logprobs=2, max_tokens=5, stream=True))
                for e in ((c["choices"][0]["logprobs"] or {"content": []})["content"])]
    assert streamed == content  # the same entries, a chunk at a time
    plain = chat(client, max_tokens=5, logprobs=False)
    assert backend.requests[-1].params.logprobs is None and plain.json()["choices"][0]["logprobs"] is None
    alone = chat(client, logprobs=True, max_tokens=2).json()["choices"][0]["logprobs"]["content"]
    assert alone[0]["top_logprobs"] == []


def test_completion_logprobs_are_openais_parallel_lists_with_the_chosen_token_among_the_top(
        client: TestClient, backend: FakeBackend) -> None:
    body = {"model": NAME, "prompt": "hello", "max_tokens": 6, "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    ids = _reply_ids(backend, 6)
    texts = [_shown(backend, t) for t in ids]
    lp = whole["logprobs"]
    assert lp["tokens"] == texts and lp["token_logprobs"] == [-t / 64 for t in ids]
    # the top one, and the chosen token too (OpenAI's "up to logprobs + 1")
    assert lp["top_logprobs"] == [{_shown(backend, t + 1): -(t + 1) / 64 + 0.5, _shown(backend, t): -t / 64}
                                  for t in ids]
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    chunks = [c["choices"][0] for c in events(client.post("/v1/completions", json={**body, "stream": True}))
              if c["choices"][0]["logprobs"]]
    assert [x for c in chunks for x in c["logprobs"]["text_offset"]] == lp["text_offset"]
    assert [x for c in chunks for x in c["logprobs"]["tokens"]] == texts


@pytest.mark.parametrize("prompt", ["hello there", "token ids"])
def test_echo_puts_the_prompt_before_the_completion_and_with_logprobs_scores_its_tokens(
        client: TestClient, backend: FakeBackend, prompt: str) -> None:
    """lm-evaluation-harness scores a continuation this way: echo, logprobs 1, and reads token_logprobs of the
    prompt's tokens (null for the first, which nothing predicts)."""
    tok = backend.model.tokenizer
    ids = tok.encode("hello there")
    sent: Any = ids if prompt == "token ids" else prompt
    echoed = tok.decode(ids) if prompt == "token ids" else prompt
    body = {"model": NAME, "prompt": sent, "max_tokens": 3, "echo": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    answer = tok.decode(_reply_ids(backend, 3))
    assert plain["text"] == echoed + answer and plain["logprobs"] is None
    assert backend.requests[-1].params.prompt_logprobs is None
    scored = client.post("/v1/completions", json={**body, "logprobs": 1}).json()["choices"][0]
    assert backend.requests[-1].params.prompt_logprobs == 1 and scored["text"] == echoed + answer
    lp = scored["logprobs"]
    every = ids + _reply_ids(backend, 3)
    texts = [_shown(backend, t) for t in every]
    assert lp["tokens"] == texts
    assert lp["token_logprobs"] == [None] + [-t / 64 for t in every[1:]]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1:] == [{_shown(backend, t + 1): -(t + 1) / 64 + 0.5, _shown(backend, t): -t / 64}
                                      for t in every[1:]]
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    chunks = [c["choices"][0] for c in events(client.post("/v1/completions", json={**body, "logprobs": 1,
                                                                                  "stream": True}))]
    assert chunks[0]["text"] == echoed and chunks[0]["logprobs"]["tokens"] == texts[:len(ids)]
    assert "".join(c["text"] for c in chunks) == echoed + answer
    assert [x for c in chunks if c["logprobs"] for x in c["logprobs"]["text_offset"]] == lp["text_offset"]
    assert [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]] == lp["token_logprobs"]


def test_the_openai_client_reads_chat_logprobs(backend: FakeBackend) -> None:
    import openai

    with serve_app(create_app(backend)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        resp = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                              logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert content is not None and len(content) == 3 and len(content[0].top_logprobs) == 3
    assert content[0].logprob == -_reply_ids(backend, 1)[0] / 64


def test_unknown_model(client: TestClient, backend: FakeBackend) -> None:
    err = assert_error(chat(client, model="gpt-4o"), 404, "The model `gpt-4o` does not exist.", param="model",
                       code="model_not_found")
    assert err["message"] == "The model `gpt-4o` does not exist."
    assert_error(client.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404,
                 "The model `nope` does not exist.", param="model", code="model_not_found")
    assert backend.requests == []


def test_over_long_prompts(client: TestClient, backend: FakeBackend, tokenizer: Tokenizer) -> None:
    long_text = "the cache moves " * 200
    messages = [{"role": "user", "content": long_text}]
    n = len(tokenizer.encode_chat(messages))
    assert n > CONTEXT
    err = assert_error(client.post("/v1/chat/completions", json={"model": NAME, "messages": messages}), 400,
                       f"This model's maximum context length is {CONTEXT} tokens. However, your messages resulted "
                       f"in {n} tokens.", param="messages", code="context_length_exceeded")
    assert err["message"].endswith("Please reduce the length of the messages.")
    short = [{"role": "user", "content": "Hi"}]
    p = len(tokenizer.encode_chat(short))
    assert_error(client.post("/v1/chat/completions", json={"model": NAME, "messages": short, "max_tokens": CONTEXT}),
                 400, f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
                      f"{p + CONTEXT} tokens ({p} in the messages, {CONTEXT} in the completion).",
                 param="messages", code="context_length_exceeded")
    p = len(tokenizer.encode("x"))
    assert_error(client.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": CONTEXT}), 400,
                 f"However, you requested {p + CONTEXT} tokens ({p} in the prompt, {CONTEXT} in the completion)",
                 param="prompt", code="context_length_exceeded")
    assert backend.requests == []
    # exactly the context is fine
    assert chat(client, messages=short, max_tokens=CONTEXT - len(tokenizer.encode_chat(short))).status_code == 200


# ------------------------------------------------------------------------------ API keys
def test_api_keys_guard_v1_and_the_tokenizer_only(backend: FakeBackend) -> None:
    with TestClient(create_app(backend, api_keys=["sk-one", "sk-two"])) as client:
        assert_error(chat(client), 401, "You didn't provide an API key", code="invalid_api_key")
        bad = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-three"},
                          json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}]})
        assert_error(bad, 401, "Incorrect API key provided", code="invalid_api_key")
        assert_error(client.get("/v1/models", headers={"Authorization": "Basic sk-one"}), 401, "Incorrect API key",
                     code="invalid_api_key")
        # refused before the body is looked at
        assert_error(client.post("/v1/chat/completions", content="{", headers={"content-type": "application/json"}),
                     401, "API key", code="invalid_api_key")
        assert backend.requests == []
        for key in ("sk-one", "sk-two"):
            ok = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}]})
            assert ok.status_code == 200, ok.text
        tokenizer_calls = (("/tokenize", {"model": NAME, "prompt": "Hi"}),
                           ("/detokenize", {"model": NAME, "tokens": [5]}))
        for path, body in tokenizer_calls:
            assert_error(client.post(path, json=body), 401, "You didn't provide an API key", code="invalid_api_key")
            ok = client.post(path, json=body, headers={"Authorization": "Bearer sk-two"})
            assert ok.status_code == 200, ok.text
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200


def test_an_admin_router_is_mounted_with_openai_shaped_errors(backend: FakeBackend) -> None:
    from fastapi import APIRouter, Header, HTTPException

    admin = APIRouter(prefix="/admin")

    @admin.get("/pools")
    def pools(authorization: str = Header("")) -> dict[str, int]:
        if authorization != "Bearer admin-token":
            raise HTTPException(401, "wrong admin token")
        return {"decode": 1}

    with TestClient(create_app(backend, api_keys=["sk-one"], admin=admin)) as client:
        assert_error(client.get("/admin/pools", headers={"Authorization": "Bearer nope"}), 401, "wrong admin token")
        assert client.get("/admin/pools", headers={"Authorization": "Bearer admin-token"}).json() == {"decode": 1}


# ------------------------------------------------------------------------------ concurrency
def _asgi_scope(path: str, body: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


def test_a_client_that_leaves_mid_stream_stops_the_backend(backend: FakeBackend) -> None:
    app = create_app(backend)
    backend.token_delay_s = 0.05
    body = json.dumps({"model": NAME, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}).encode()
    total = len(backend.model.tokenizer.encode(REPLY, add_special_tokens=False))
    sent: list[MutableMapping[str, Any]] = []

    async def main() -> None:
        first_token = anyio.Event()
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await first_token.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and b'"content":"' in message.get("body", b"") \
                    and b'"role"' not in message["body"]:
                first_token.set()

        with anyio.fail_after(10):
            await app(_asgi_scope("/v1/chat/completions", body), receive, send)

    anyio.run(main)
    assert sent[0]["status"] == 200
    assert backend.closed == [backend.requests[0].request_id]
    assert backend.produced < total


def _without_comments(raw: str) -> tuple[str, int]:
    """The SSE body with its comment events left out, and how many there were."""
    blocks = raw.split("\n\n")
    comments = [b for b in blocks if b.startswith(":")]
    assert all(b == ": keepalive" for b in comments), comments
    return "\n\n".join(b for b in blocks if not b.startswith(":")), len(comments)


@pytest.mark.parametrize("keepalive_s", [0.1, 0.0])
def test_a_stream_silent_past_sse_keepalive_s_sends_comments_and_the_same_events(backend: FakeBackend,
                                                                                keepalive_s: float) -> None:
    """A preempted request sends no token for a while; behind a proxy that closes idle streams, its client would
    lose the answer. The stream sends SSE comments meanwhile (none at 0), and every data event is as without
    the silence."""
    body = {"model": NAME, "prompt": "hello", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with TestClient(create_app(backend, sse_keepalive_s=keepalive_s)) as c:
        steady = c.post("/v1/completions", json=body)
        backend.pause_after, backend.pause_s = 2, 0.65
        paused = c.post("/v1/completions", json=body)
    raw, comments = _without_comments(paused.text)
    if keepalive_s == 0:
        assert comments == 0, paused.text
    else:  # 0.65 s of silence: six, or fewer on a slow machine; all of them after the first two tokens
        assert 3 <= comments <= 6, paused.text
        assert paused.text.index(": keepalive") > paused.text.index('"text":"', paused.text.index('"text":"') + 1)
    strip = [{**e, "id": None, "created": None} for e in events(steady)]
    assert [{**e, "id": None, "created": None} for e in events(httpx2.Response(200, text=raw, headers=paused.headers))
            ] == strip


def test_no_keepalive_follows_the_final_message_of_a_stream_whose_client_stalls_at_its_end() -> None:
    """The client stops reading as the last event goes: the final message waits for the transport, and so
    would a keepalive that found the stream quiet. It must not be sent after the response ended (uvicorn
    raises, and the finished request was cancelled as if its client had left)."""
    from controlplane.api.streaming import EventStream

    sent: list[bytes] = []
    left: list[str] = []

    async def main() -> None:
        writable = asyncio.Event()
        writable.set()
        complete = False

        async def events() -> AsyncGenerator[str, None]:
            yield "data: x\n\n"
            yield "data: [DONE]\n\n"
            writable.clear()  # the client stops reading: writes wait
            asyncio.get_running_loop().call_later(0.35, writable.set)

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal complete
            await writable.wait()
            if complete:
                raise RuntimeError("Unexpected ASGI message after response already completed")
            sent.append(message.get("body", b""))
            complete = message["type"] == "http.response.body" and not message.get("more_body", False)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client never disconnects
            return {}

        await EventStream(events(), keepalive_s=0.1, on_leave=lambda: left.append("left"))({"type": "http"},
                                                                                            receive, send)

    asyncio.run(main())
    assert sent == [b"", b"data: x\n\n", b"data: [DONE]\n\n", b""] and left == []


def test_the_openai_client_reads_a_stream_with_keepalive_comments(backend: FakeBackend) -> None:
    import openai

    backend.pause_after, backend.pause_s = 1, 0.5
    with serve_app(create_app(backend, sse_keepalive_s=0.1)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        text = "".join(c.choices[0].text for c in client.completions.create(model=NAME, prompt="hello", max_tokens=5,
                                                                           stream=True) if c.choices)
    tok = backend.model.tokenizer
    assert text == tok.decode(tok.encode(REPLY, add_special_tokens=False)[:5])


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_while_no_token_comes_cancels_the_request_at_once(backend: FakeBackend,
                                                                               stream: bool) -> None:
    """After its first tokens the request waits (preempted, or moving to another replica) and its client
    leaves. The ingress cancels it, so the backend's wait ends then and the workers free its blocks, instead of
    holding them until the next token (up to scheduler.max_stall_s, a minute) for nobody."""
    backend.pause_after, backend.pause_s = 2, 60.0
    body = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 6, "stream": stream}).encode()
    with serve_app(create_app(backend, sse_keepalive_s=0.1)) as base:
        host, port = base.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        if stream:  # the status line and the first tokens came, then keepalives
            seen = b""
            while b": keepalive" not in seen:
                seen += sock.recv(4096)
                assert time.monotonic() < deadline, seen
        else:
            while backend.produced < 2:
                assert time.monotonic() < deadline, "the request never produced its first tokens"
                time.sleep(0.01)
        sock.close()
        (request,) = backend.requests
        while request.request_id not in backend.closed:
            assert time.monotonic() < deadline, "the request waited on after its client left"
            time.sleep(0.01)
    assert request.cancel.cancelled and backend.produced == 2


def test_a_slow_backend_never_blocks_the_event_loop(backend: FakeBackend) -> None:
    app = create_app(backend)
    backend.gate = threading.Event()  # generation stalls until /health has answered

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            results: dict[str, httpx.Response] = {}

            async def completion() -> None:
                results["chat"] = await http.post("/v1/chat/completions", json={
                    "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(completion)
                    while not backend.requests:  # the request is in the backend, blocked
                        await anyio.sleep(0.01)
                    health = await http.get("/health")
                    assert health.status_code == 200 and "chat" not in results
                    assert backend.gate is not None
                    backend.gate.set()
            assert results["chat"].status_code == 200

    anyio.run(main)


def test_tokenize_errors_name_the_field_of_the_kind_of_body_sent(client: TestClient, tokenizer: Tokenizer) -> None:
    """A body with messages is a chat's, any other a prompt's: a wrongly typed prompt is named as the prompt
    (it used to read "Invalid value for 'TokenizeChat.messages': Field required"), and both at once are
    refused rather than the prompt dropped."""
    assert_error(client.post("/tokenize", json={"prompt": 5}), 400, "Invalid value for 'prompt'", param="prompt")
    assert_error(client.post("/tokenize", json={}), 400, "Invalid value for 'prompt': Field required", param="prompt")
    assert_error(client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "prompt": "x"}),
                 400, "give a prompt or messages, not both")
    assert_error(client.post("/tokenize", json={"messages": "Hi"}), 400, "Invalid value for 'messages'",
                 param="messages")
    ok = client.post("/tokenize", json={"prompt": "Hi there"})
    assert ok.status_code == 200 and ok.json()["tokens"] == tokenizer.encode("Hi there")
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] == len(chat.json()["tokens"]) > 0


def test_an_answer_whose_client_leaves_after_the_last_token_is_not_cut_short() -> None:
    """The client closing the stream while its last event is sent: the answer was whole."""
    import asyncio

    from controlplane.observability.http import watch

    async def chunks() -> AsyncGenerator[Chunk, None]:
        yield Chunk((5,), "a", False, None, 3, 1)
        yield Chunk((6,), "b", True, "stop", 3, 2)

    async def leave_after_the_last() -> None:
        stream = watch(chunks(), "whole-then-gone", "/v1/completions", streamed=True)
        async for chunk in stream:
            if chunk.finished:
                await stream.aclose()  # the client went away as the last event was sent
                return

    before = _sample("epd:requests_cut_short_total", route="/v1/completions", status="499")
    asyncio.run(leave_after_the_last())
    assert _sample("epd:requests_cut_short_total", route="/v1/completions", status="499") == before


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": "word " * 600_000}),
    ("/v1/completions", {"model": NAME, "prompt": "word " * 600_000, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "word " * 600_000}],
                              "max_tokens": 1}),
])
def test_a_long_prompt_is_tokenised_off_the_event_loop(path: str, body: dict) -> None:
    """While a 3 MB prompt is tokenised, /health still answers: the event loop is not held. The tokenising
    waits (up to 30 s) for /health's answer, so the order of the two events is the check, whatever the
    machine's speed: where the loop is held, /health can answer only after the tokenising gave up waiting."""
    events: list[str] = []
    health_answered = threading.Event()

    class Recording(Tokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = super().encode(text, add_special_tokens)
            if len(text) > 1_000_000:
                health_answered.wait(30)
                events.append("tokenised")
            return ids

    tok = Recording(build_tokenizer(), bos_token=BOS, eos_token=IM_END, chat_template=CHAT_TEMPLATE, image_token=IMAGE)
    with serve_app(create_app(FakeBackend(model_info(tok)))) as base:
        thread = threading.Thread(target=lambda: httpx.post(base + path, json=body, timeout=120))
        thread.start()
        time.sleep(0.5)  # the body is sent and tokenising, if the machine is not very slow
        assert httpx.get(base + "/health", timeout=120).status_code == 200
        events.append("health")
        health_answered.set()
        thread.join(120)
    assert events == ["health", "tokenised"]


def test_a_long_id_list_is_detokenised_off_the_event_loop() -> None:
    """The same for /detokenize: while 6M ids are decoded (seconds here), /health still answers."""
    events: list[str] = []

    class Recording(Tokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            text = super().decode(ids, skip_special_tokens)
            if len(ids) > 1_000_000:
                events.append("decoded")
            return text

    tok = Recording(build_tokenizer(), bos_token=BOS, eos_token=IM_END, chat_template=CHAT_TEMPLATE, image_token=IMAGE)
    word = tok.encode("word", add_special_tokens=False)
    ids = word * (6_000_000 // len(word))
    with serve_app(create_app(FakeBackend(model_info(tok)))) as base:
        answers: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answers.append(httpx.post(base + "/detokenize", json={"tokens": ids},
                                                                           timeout=120)))
        thread.start()
        time.sleep(0.5)  # the body is sent and decoding, if the machine is not very slow
        assert httpx.get(base + "/health", timeout=120).status_code == 200
        events.append("health")
        thread.join(120)
    assert events == ["health", "decoded"]
    assert answers[0].status_code == 200 and answers[0].json()["prompt"] == "word" * (6_000_000 // len(word))


@pytest.mark.parametrize("path,body", [
    ("/detokenize", {"tokens": [5] * 30_000}),
    ("/tokenize", {"prompt": "hi"}),
    ("/v1/completions", {"model": NAME, "prompt": [7, 8], "max_tokens": 1}),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
])
def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer, path: str,
                                                   body: dict) -> None:
    """A body of 64 KiB or more is parsed as JSON in a worker thread (10M token ids take about 0.6 s): while
    it is parsed, /health still answers. The parse waits (up to 30 s) for /health's answer, so the order of the
    two events is the check, whatever the machine's speed. A small body is parsed where it is (no hand-off)."""
    import json as real_json
    import types

    from controlplane.api import limits

    events: list[str] = []
    health_answered = threading.Event()

    def loads(data: bytes) -> object:
        if len(data) >= limits.OFF_LOOP_BYTES:
            health_answered.wait(30)
            events.append("parsed")
        return real_json.loads(data)
    monkeypatch.setattr(limits, "json", types.SimpleNamespace(loads=loads, detect_encoding=real_json.detect_encoding))
    content = json.dumps(body).encode() + b" " * limits.OFF_LOOP_BYTES  # whitespace: large, and still valid
    with serve_app(create_app(FakeBackend(model_info(tokenizer)))) as base:
        answers: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answers.append(httpx.post(
            base + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)))
        thread.start()
        time.sleep(0.5)  # the body is sent and parsing, if the machine is not very slow
        assert httpx.get(base + "/health", timeout=120).status_code == 200
        events.append("health")
        health_answered.set()
        thread.join(120)
        assert httpx.post(base + "/detokenize", json={"tokens": [5]}, timeout=30).status_code == 200  # small
    assert events == ["health", "parsed"]
    assert answers[0].status_code == 200, answers[0].text


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_malformed_body_gets_the_same_refusal_whatever_its_size(client: TestClient, backend: FakeBackend,
                                                                 size: str) -> None:
    """A large body's JSON is parsed elsewhere (above), with the same refusal when it is not JSON."""
    padding = " " * (70_000 if size == "large" else 0)
    r = client.post("/v1/completions", content=b'{"model": "x", "prompt": [1, 2,' + padding.encode() + b"",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("We could not parse the JSON body of your request"), r.json()
    assert backend.requests == []


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-32-be"])
def test_a_body_in_utf16_or_utf32_is_refused(client: TestClient, backend: FakeBackend, encoding: str) -> None:
    """JSON between systems is UTF-8 (RFC 8259); Python's json would read these, the README says 400."""
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2}).encode(encoding)
    for path in ("/v1/completions", "/tokenize"):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("The request body is not UTF-8 (it reads as UTF-")
    assert backend.requests == []
    assert client.post("/v1/completions", content=json.dumps({"model": NAME, "prompt": "hi"}).encode("utf-8-sig"),
                       headers={"Content-Type": "application/json"}).status_code == 200


@pytest.mark.parametrize("path, shown", [
    ("/dashboard?token=s3cret", "/dashboard?token=***"),
    ("/dashboard?x=1&token=s3cret&y=2", "/dashboard?x=1&token=***&y=2"),
    ("/dashboard?t%6Fken=s3cret", "/dashboard?t%6Fken=***"),  # parse_qs decodes keys: the ops check reads it
    ("/dashboard?%74%6F%6B%65%6E=s3cret", "/dashboard?%74%6F%6B%65%6E=***"),
    ("/v1/models?tokens=5", "/v1/models?tokens=5"),  # another parameter stays
])
def test_the_access_log_mask_hides_every_spelling_of_the_ops_token(path: str, shown: str) -> None:
    from controlplane.api.auth import QueryTokenMask

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", path, "1.1", 200), None)
    assert QueryTokenMask().filter(record) and record.getMessage() == f'127.0.0.1:5 - "GET {shown} HTTP/1.1" 200'



@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_before_its_first_token_cancels_the_request(backend: FakeBackend, stream: bool) -> None:
    """The first chunk never comes by itself (admission, waiting for decode room and prefill take that
    long); the client closes its connection meanwhile. The ingress cancels the request, so the backend's
    wait ends then instead of running on for nobody."""
    backend.gate = threading.Event()
    body = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 4, "stream": stream}).encode()
    with serve_app(create_app(backend)) as base:
        host, port = base.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while not backend.requests:
            assert time.monotonic() < deadline, "the request never reached the backend"
            time.sleep(0.01)
        sock.close()
        (request,) = backend.requests
        while request.request_id not in backend.closed:
            assert time.monotonic() < deadline + 10, "the request ran on after its client left"
            time.sleep(0.01)
    assert request.cancel.cancelled and not backend.gate.is_set() and backend.produced == 0


def test_a_client_that_pipelines_and_leaves_mid_stream_is_not_an_error(backend: FakeBackend,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Two streamed requests pipelined on one connection, closed mid-answer. uvicorn marks only the newest
    request disconnected, so the one streaming writes on to a closed transport, where uvloop raises
    RuntimeError: that was logged as an unhandled error with its traceback. It is a client leaving."""
    backend.token_delay_s = 0.02
    body = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 64, "stream": True}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)
    caplog.set_level(logging.ERROR)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to the root's
    uvicorn_log.addHandler(caplog.handler)
    with serve_app(create_app(backend)) as base:
        host, port = base.removeprefix("http://").split(":")
        for _ in range(8):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(raw + raw)
                assert sock.recv(64).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 20
        while len(backend.closed) < 8:  # each cut answer's request was closed (aborted) in the backend
            assert time.monotonic() < deadline, backend.closed
            time.sleep(0.02)
    uvicorn_log.removeHandler(caplog.handler)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_tools_under_tool_choice_none_are_accepted_and_left_out_of_the_prompt(client: TestClient,
                                                                             backend: FakeBackend) -> None:
    """As vLLM by default: an agent framework sends its tool list also when it asks for plain text."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert chat(client).status_code == 200
    plain = backend.requests[-1].prompt_ids
    assert chat(client, tools=tools, tool_choice="none").status_code == 200
    assert backend.requests[-1].prompt_ids == plain
    assert chat(client, functions=[{"name": "f"}], function_call="none").status_code == 200
    assert_error(chat(client, tools=tools), 400, "tools are not supported", param="tools")  # tool_choice "auto"
    assert_error(chat(client, tools=tools, tool_choice="auto"), 400, "tools are not supported", param="tools")


def test_a_developer_message_is_the_system_message(client: TestClient, backend: FakeBackend) -> None:
    """OpenAI renamed the system role "developer"; a chat template knows only "system"."""
    turns: dict[str, list[int]] = {}
    for role in ("system", "developer"):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert chat(client, messages=messages).status_code == 200
        turns[role] = backend.requests[-1].prompt_ids
    assert turns["developer"] == turns["system"]


def test_a_history_with_tool_calls_is_refused_not_dropped_from_the_prompt(client: TestClient,
                                                                         backend: FakeBackend) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    for field, value in (("tool_calls", [call]), ("function_call", {"name": "lookup", "arguments": "{}"})):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, field: value},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"}]
        assert_error(chat(client, messages=messages), 400, "a conversation with tool calls is not supported",
                     param=f"messages[1].{field}")
    ok = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": []}]
    assert chat(client, messages=ok).status_code == 200  # an empty list says no call was made
    assert backend.requests[-1].prompt_ids


def test_cors_is_off_unless_origins_are_set_and_a_preflight_needs_no_key(backend: FakeBackend) -> None:
    """A browser page on an allowed origin may call the API: its preflight (which carries no key) is answered,
    and the answers carry Access-Control-Allow-Origin; the key is still asked for on the call itself. Other
    origins get no such header, and without the setting no answer carries one."""
    preflight = {"Origin": "https://chat.example.com", "Access-Control-Request-Method": "POST",  # as openai-node asks
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-retry-count, "
                                                   "x-stainless-os, x-stainless-lang"}
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]}
    with TestClient(create_app(backend, api_keys=["k1"])) as plain:
        assert plain.options("/v1/chat/completions", headers=preflight).status_code in (401, 405)
        reply = plain.post("/v1/chat/completions", json=body, headers={"Origin": "https://chat.example.com",
                                                                        "Authorization": "Bearer k1"})
        assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    with TestClient(create_app(backend, api_keys=["k1"], cors_origins=["https://chat.example.com"])) as cors:
        reply = cors.options("/v1/chat/completions", headers=preflight)
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == "https://chat.example.com"
        allowed = reply.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "x-stainless-retry-count" in allowed
        origin = {"Origin": "https://chat.example.com"}
        reply = cors.post("/v1/chat/completions", json=body, headers=origin | {"Authorization": "Bearer k1"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://chat.example.com"
        refused = cors.post("/v1/chat/completions", json=body, headers=origin)  # still needs its key
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://chat.example.com"
        other = cors.post("/v1/chat/completions", json=body, headers={"Origin": "https://evil.example",
                                                                       "Authorization": "Bearer k1"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
        assert cors.options("/v1/chat/completions", headers=preflight | {"Origin": "https://evil.example"}
                            ).status_code == 400
