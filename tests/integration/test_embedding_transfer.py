"""Image embeddings from the encode stage to the prefill stage over real gRPC, and a prefill that
uses them reproduces the single-process reference."""

from __future__ import annotations

import io
import secrets
import threading

import grpc
import pytest
import torch
from PIL import Image

from kvtransfer.auth import TransferSecurity
from kvtransfer.embeddings import EmbeddingOutcome, EmbeddingReceiver, embedding_handler, push_embeddings
from kvtransfer.errors import TransferFailed
from kvtransfer.server import start_server
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.multimodal import expand_image_tokens
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import MultimodalInput
from workers.runtime.vision import encode_images, preprocess_image

pytestmark = [pytest.mark.integration]


@pytest.fixture()
def rig(default_bundle):
    security = TransferSecurity(token=secrets.token_urlsafe(24))
    vision = default_bundle.vision
    receiver = EmbeddingReceiver(default_bundle.config.hidden_size, vision.fingerprint())
    server, port = start_server([embedding_handler(receiver)], "127.0.0.1:0", security)
    channel = security.open_channel(f"127.0.0.1:{port}")
    yield default_bundle, security, receiver, channel
    channel.close()
    server.stop(0)
    assert receiver.pending == 0


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (50, 40), color).save(buf, "PNG")
    return buf.getvalue()


def _expect(receiver: EmbeddingReceiver, rid: str, rows: int
            ) -> tuple[threading.Event, dict[str, EmbeddingOutcome]]:
    done = threading.Event()
    box: dict[str, EmbeddingOutcome] = {}

    def arrived(outcome: EmbeddingOutcome) -> None:
        box.setdefault("o", outcome)
        done.set()

    receiver.expect(rid, rows, arrived, timeout_s=10)
    return done, box


def test_received_embeddings_reproduce_the_reference_generation(rig):
    bundle, security, receiver, channel = rig
    images = (_png((200, 30, 30)), _png((20, 180, 40)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "text", "text": "compare"}]}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = generate(bundle, [GenerateRequest(messages=messages, images=images, params=params)])[0]

    # encode stage: pixels -> embeddings, pushed over gRPC
    cfg = bundle.vision.config
    embeds = torch.cat(encode_images(bundle.vision, [preprocess_image(i, cfg) for i in images]))
    done, box = _expect(receiver, "mm-1", embeds.shape[0])
    sent = push_embeddings(channel, security, "mm-1", embeds, bundle.vision.fingerprint(), max_chunk_bytes=40_000)
    assert done.wait(5) and box["o"].ok and sent == embeds.numel() * 4
    received = box["o"].embeds
    assert received is not None and torch.equal(received, embeds)

    # prefill stage: the same prompt, with the received rows at the placeholders
    ids = bundle.tokenizer.encode_chat(messages)
    ids, positions = expand_image_tokens(ids, bundle.image_token_id, cfg.num_image_tokens, len(images))
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(), bundle.eos_token_ids)
    engine.add_request("mm-1", ids, params, MultimodalInput(received, positions))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert ids == reference.prompt_ids
    assert tokens == reference.token_ids


def test_refusals_name_the_problem_and_release_the_expectation(rig):
    bundle, security, receiver, channel = rig
    rows = torch.randn(64, bundle.config.hidden_size)
    fp = bundle.vision.fingerprint()
    with pytest.raises(TransferFailed, match="no reservation") as err:
        push_embeddings(channel, security, "never-expected", rows, fp)
    assert err.value.code == grpc.StatusCode.NOT_FOUND

    done, box = _expect(receiver, "wrong-encoder", 64)
    with pytest.raises(TransferFailed, match="embedding layout mismatch"):
        push_embeddings(channel, security, "wrong-encoder", rows, "vision-someoneelse")
    assert done.wait(5) and not box["o"].ok and box["o"].code == grpc.StatusCode.FAILED_PRECONDITION

    done, box = _expect(receiver, "wrong-rows", 64)
    with pytest.raises(TransferFailed, match="65 rows announced, 64 expected"):
        push_embeddings(channel, security, "wrong-rows", torch.randn(65, bundle.config.hidden_size), fp)
    assert done.wait(5) and box["o"].code == grpc.StatusCode.OUT_OF_RANGE

    done, box = _expect(receiver, "no-token", 64)
    with pytest.raises(TransferFailed) as err:
        push_embeddings(channel, TransferSecurity(allow_insecure=True), "no-token", rows, fp)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert not done.is_set()  # untouched: the rightful sender may still come
    push_embeddings(channel, security, "no-token", rows, fp)
    got = box["o"].embeds if done.wait(5) and box["o"].ok else None
    assert got is not None and torch.equal(got, rows)


def test_the_encoder_cache_is_an_lru_bounded_in_bytes(default_bundle):
    """The encode worker's embedding cache: a repeated image is a hit with the same embeddings; the least
    recently used goes first (a hit counts as a use) once the bytes pass the bound; one larger than the whole
    bound is not kept; what it keeps is in host memory; 0 keeps nothing."""
    from workers.encode.service import EncodeService

    security = TransferSecurity(token=secrets.token_urlsafe(24))
    a, b, c = _png((200, 30, 30)), _png((20, 180, 40)), _png((10, 10, 220))
    probe = EncodeService(default_bundle.vision, security)
    one = probe.embed([a])[0].nbytes  # bytes of one image's embeddings
    service = EncodeService(default_bundle.vision, security, cache_bytes=2 * one)
    first, hits = service.embed([a])
    assert hits == 0 and service.cached == (1, one)
    again, hits = service.embed([a])
    assert hits == 1 and torch.equal(again, first) and again.device.type == "cpu"
    assert service.embed([b])[1] == 0 and service.cached == (2, 2 * one)
    assert service.embed([a])[1] == 1  # a is now the most recently used: b goes first
    assert service.embed([c])[1] == 0 and service.cached == (2, 2 * one)
    assert service.embed([a, c])[1] == 2
    assert service.embed([b])[1] == 0  # b was dropped
    mixed, hits = service.embed([c, b, a])  # c and b hit; a is encoded again, to the same values
    assert hits == 2 and torch.equal(mixed[2 * (mixed.shape[0] // 3):], first)
    small = EncodeService(default_bundle.vision, security, cache_bytes=one - 1)
    small.embed([a])
    assert small.cached == (0, 0)
    off = EncodeService(default_bundle.vision, security, cache_bytes=0)
    assert off.embed([a])[1] == 0 and off.embed([a])[1] == 0 and off.cached == (0, 0)
