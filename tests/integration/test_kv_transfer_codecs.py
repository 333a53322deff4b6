"""Every codec over every transport lands exactly what the codec decodes, through the real sender,
gRPC server, receiver and paged cache: the encoder-thread framing, encoding straight into shared
memory, several (evenly split) chunks per layer, and decoding from the received bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.codecs import Kind, get_codec
from kvtransfer.errors import TransferFailed
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver, TransferOutcome
from kvtransfer.sender import KVSender
from kvtransfer.server import kv_transfer_handler, start_server
from workers.decode.kv_sink import CacheSink
from workers.runtime.kv_cache import CacheDType, KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.integration

LAYERS, HEADS, DIM, BS = 2, 4, 32, 16
TOKENS = 37 * BS - 5  # 37 blocks, the last one partly filled
TOKEN = "codec-test-token-0123456789"


BUILT_BY = ["encoder threads", "sending thread"]


def _collect(done: list[TransferOutcome], landed: threading.Event) -> Callable[[TransferOutcome], None]:
    """A receiver callback that keeps the outcome and says it landed."""
    def on_done(outcome: TransferOutcome) -> None:
        done.append(outcome)
        landed.set()
    return on_done


def inline_bytes(built_by: str) -> int:
    """KVSender's inline_build_bytes that sends every chunk of these tests through the encoder threads
    (0), or has the sending thread encode each itself (chunks here are all far under 1 MiB)."""
    return 0 if built_by == "encoder threads" else 1 << 20


@pytest.fixture(scope="module")
def rig():
    spec = KVCacheSpec(LAYERS, HEADS, DIM, BS)
    bf16: list[CacheDType] = ["bfloat16"] * LAYERS
    cache = PagedKVCache(spec, 96, tuple(bf16))
    security = TransferSecurity(token=TOKEN)
    layout = KVLayout(LAYERS, HEADS, DIM, BS, ("bf16",) * LAYERS, "codec-test", "bfloat16")
    receiver = KVReceiver(layout, CacheSink(cache))
    server, port = start_server([kv_transfer_handler(receiver)], "127.0.0.1:0", security)
    receiver.enable_bulk("127.0.0.1")
    yield cache, security, f"127.0.0.1:{port}", receiver
    server.stop(0)
    receiver.stop()


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
@pytest.mark.parametrize("codec", ["bf16", "int8", "fp8", "int4", "fp32"])
@pytest.mark.parametrize("blocks", ["consecutive", "scattered"])
@pytest.mark.parametrize("built_by", BUILT_BY)
def test_each_codec_lands_what_it_decodes(rig, transport: str, codec: str, blocks: str,
                                          built_by: str) -> None:
    cache, security, target, receiver = rig
    nblocks = -(-TOKENS // BS)
    ids = list(range(40, 40 + nblocks)) if blocks == "consecutive" else [2 * i + 1 for i in range(nblocks)][::-1]
    layout = KVLayout(LAYERS, HEADS, DIM, BS, (codec,) * LAYERS, "codec-test", "bfloat16")
    g = torch.Generator().manual_seed(len(codec) + len(transport))
    keys = [torch.randn(nblocks, BS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    values = [(torch.randn(nblocks, BS, HEADS, DIM, generator=g) * 3).to(torch.bfloat16) for _ in range(LAYERS)]
    done: list[TransferOutcome] = []
    landed = threading.Event()
    rid = f"{codec}-{transport}-{blocks}-{built_by}"
    receiver.expect(rid, ids, _collect(done, landed), timeout_s=30)
    # small chunks: each layer goes in several, unevenly divisible, chunks (encoded as inline_bytes says)
    sender = KVSender(security, transport=transport, max_chunk_bytes=40_000, shm_chunk_bytes=20_000,  # type: ignore[arg-type]  # parametrized as str
                      bulk_chunk_bytes=30_000, inline_build_bytes=inline_bytes(built_by))
    try:
        stream = sender.open_stream(target, rid, layout, TOKENS, timeout_s=30)
        for layer in range(LAYERS):
            stream.send_layer(layer, 0, keys[layer][:20], values[layer][:20])
            stream.send_layer(layer, 20, keys[layer][20:], values[layer][20:])
        result = stream.finish(7)
    finally:
        sender.close()
    assert landed.wait(10) and done[0].ok, done
    assert result.transport == transport and result.num_chunks > 2 * LAYERS  # some send_layer split
    c = get_codec(codec)
    slots = (torch.tensor(ids)[:, None] * BS + torch.arange(BS)).reshape(-1)
    for layer in range(LAYERS):
        got_k, got_v = cache.layers[layer].gather(slots, torch.bfloat16)
        for got, x, kind in ((got_k, keys[layer], Kind.KEY), (got_v, values[layer], Kind.VALUE)):
            # per chunk: the sender splits each layer at chunk boundaries that scales never span
            want = c.decode(c.encode(x, kind), torch.bfloat16)
            assert torch.equal(got.view(x.shape).view(torch.int16), want.view(torch.int16)), (layer, kind)


@pytest.mark.parametrize("transport", ["tcp", "grpc", "shm"])
def test_pooled_chunk_buffers_are_reused_across_streams_without_mixing_their_data(rig, transport: str) -> None:
    """Quantised chunks are encoded into the sender's pooled buffers (over shared memory: into pooled
    segments), handed back once sent: with streams pushing at once from one sender, every stream still
    lands exactly its own data."""
    cache, security, target, receiver = rig
    nblocks = 10
    layout = KVLayout(LAYERS, HEADS, DIM, BS, ("int8",) * LAYERS, "codec-test", "bfloat16")
    sender = KVSender(security, transport=transport, max_chunk_bytes=12_000, bulk_chunk_bytes=12_000,  # type: ignore[arg-type]  # parametrized as str
                      shm_chunk_bytes=12_000, inline_build_bytes=0)  # encoder threads: several chunks at once
    c = get_codec("int8")
    errors: list[BaseException] = []

    def push(worker: int) -> None:
        try:
            for rnd in range(3):
                ids = list(range(worker * nblocks, (worker + 1) * nblocks))
                g = torch.Generator().manual_seed(100 * worker + rnd)
                keys = [torch.randn(nblocks, BS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
                values = [torch.randn(nblocks, BS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
                done: list[TransferOutcome] = []
                landed = threading.Event()
                rid = f"pool-{transport}-{worker}-{rnd}"
                receiver.expect(rid, ids, _collect(done, landed), timeout_s=30)
                stream = sender.open_stream(target, rid, layout, nblocks * BS, timeout_s=30)
                for layer in range(LAYERS):
                    stream.send_layer(layer, 0, keys[layer], values[layer])
                stream.finish(0)
                assert landed.wait(10) and done[0].ok, done
                slots = (torch.tensor(ids)[:, None] * BS + torch.arange(BS)).reshape(-1)
                for layer in range(LAYERS):
                    got_k, got_v = cache.layers[layer].gather(slots, torch.bfloat16)
                    for got, x, kind in ((got_k, keys[layer], Kind.KEY), (got_v, values[layer], Kind.VALUE)):
                        want = c.decode(c.encode(x, kind), torch.bfloat16)
                        assert torch.equal(got.view(x.shape), want), (rid, layer, kind)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        if transport == "shm":  # encoded straight into the segments, which went back to their pool
            assert sender.segments.idle >= 1
        else:
            assert sender.buffers.idle_bytes > 0  # the buffers went back to the pool, ready for the next chunk
    finally:
        sender.close()
    assert receiver.pending == 0


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
@pytest.mark.parametrize("built_by", BUILT_BY)
def test_a_non_finite_cache_fails_the_push_by_name_and_frees_the_reservation(rig, transport: str,
                                                                              built_by: str) -> None:
    cache, security, target, receiver = rig
    nblocks = 4
    layout = KVLayout(LAYERS, HEADS, DIM, BS, ("int8",) * LAYERS, "codec-test", "bfloat16")
    sender = KVSender(security, transport=transport,  # type: ignore[arg-type]  # parametrized as str
                      inline_build_bytes=inline_bytes(built_by))
    try:
        for rnd, poisoned in enumerate((True, False)):  # then the same sender pushes a good cache
            keys = [torch.randn(nblocks, BS, HEADS, DIM).to(torch.bfloat16) for _ in range(LAYERS)]
            if poisoned:
                keys[1][2, 3, 1, 5] = float("nan")
            done: list[TransferOutcome] = []
            landed = threading.Event()
            rid = f"nan-{transport}-{built_by}-{rnd}"
            receiver.expect(rid, list(range(60, 60 + nblocks)), _collect(done, landed),
                            timeout_s=2 if poisoned else 30)
            stream = sender.open_stream(target, rid, layout, nblocks * BS, timeout_s=30)
            for layer in range(LAYERS):
                stream.send_layer(layer, 0, keys[layer], keys[layer])
            if poisoned:
                with pytest.raises(TransferFailed, match=r"(?i)layer 1.*(nan|finite)|(nan|finite).*layer 1"):
                    stream.finish(0)
                # The cancelled call frees the reservation at once, or, when it was cancelled before its
                # handshake reached the receiver, at the reservation's deadline (the janitor's sweep).
                deadline = time.monotonic() + 10
                while not landed.wait(0.1) and time.monotonic() < deadline:
                    receiver.sweep()
                assert landed.is_set() and not done[0].ok
            else:
                assert stream.finish(0).num_chunks >= LAYERS
                assert landed.wait(10) and done[0].ok
    finally:
        sender.close()
    assert receiver.pending == 0


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
@pytest.mark.parametrize("built_by", BUILT_BY)
def test_a_refused_push_gives_back_all_the_senders_budget(rig, transport: str,
                                                           built_by: str) -> None:
    """Chunks still queued when the receiver refuses the stream are dropped with their bytes returned
    to the sender-wide budget: a refusal must not leave later pushes waiting for room that never frees."""
    cache, security, target, receiver = rig
    layout = KVLayout(LAYERS, HEADS, DIM, BS, ("int8",) * LAYERS, "codec-test", "bfloat16")
    sender = KVSender(security, transport=transport, max_chunk_bytes=4_000, shm_chunk_bytes=4_000,  # type: ignore[arg-type]  # parametrized as str
                      bulk_chunk_bytes=4_000, inline_build_bytes=inline_bytes(built_by))
    keys = torch.randn(20, BS, HEADS, DIM).to(torch.bfloat16)
    try:
        for rnd in range(3):
            stream = sender.open_stream(target, f"never-expected-{transport}-{built_by}-{rnd}", layout, 20 * BS,
                                        timeout_s=10)
            with pytest.raises(TransferFailed):
                for layer in range(LAYERS):
                    stream.send_layer(layer, 0, keys, keys)  # dozens of chunks queued behind the handshake
                stream.finish(0)
            deadline = time.monotonic() + 5
            while sender.budget.used and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sender.budget.used == 0, f"{sender.budget.used} bytes of the sender budget never came back"
    finally:
        sender.close()
