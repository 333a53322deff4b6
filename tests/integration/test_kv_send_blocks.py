"""``KVStream.send_blocks``: a layer's blocks sent straight from the paged cache by index (the device
path's sender), over every host transport, through a real receiver; on CPU the codecs encode eagerly, so
the same stream logic runs that a CUDA cache runs with the fused kernels."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.errors import TransferFailed
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver, TransferOutcome
from kvtransfer.sender import KVSender, TransportChoice
from kvtransfer.server import kv_transfer_handler, start_server
from workers.decode.kv_sink import CacheSink
from workers.runtime.kv_cache import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.integration
LAYERS, HEADS, DIM, BS = 2, 2, 32, 4
CODECS = ("int8", "int4")


class Receiving:
    def __init__(self) -> None:
        self.security = TransferSecurity(token=secrets.token_urlsafe(24))
        self.layout = KVLayout(LAYERS, HEADS, DIM, BS, CODECS, "send-blocks", "float32")
        self.cache = PagedKVCache(KVCacheSpec(LAYERS, HEADS, DIM, BS), 32, ("float32", "float32"))  # LAYERS of them
        self.receiver = KVReceiver(self.layout, CacheSink(self.cache))
        self.server, port = start_server([kv_transfer_handler(self.receiver)], "127.0.0.1:0", self.security)
        self.receiver.enable_bulk("127.0.0.1")
        self.target = f"127.0.0.1:{port}"

    def expect(self, rid: str, blocks: list[int], timeout_s: float = 5.0) -> tuple[list[TransferOutcome],
                                                                                  threading.Event]:
        done: list[TransferOutcome] = []
        landed = threading.Event()
        def on_done(outcome: TransferOutcome) -> None:
            done.append(outcome)
            landed.set()
        self.receiver.expect(rid, blocks, on_done, timeout_s)
        return done, landed

    def landed(self, layer: int, blocks: list[int]) -> torch.Tensor:
        k, v = self.cache.read_tokens(layer, blocks, len(blocks) * BS, torch.float32)
        return torch.stack([k, v])

    def close(self) -> None:
        self.server.stop(0).wait(5)
        self.receiver.stop()


@pytest.fixture
def rx():
    r = Receiving()
    yield r
    r.close()
    assert r.receiver.pending == 0


def _prefill_cache(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, k and v caches [20 blocks, BS, HEADS, DIM] in float32."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(20, BS, HEADS, DIM, generator=g), torch.randn(20, BS, HEADS, DIM, generator=g))
            for _ in range(LAYERS)]


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
def test_send_blocks_lands_what_send_layer_lands(rx: Receiving, transport: TransportChoice) -> None:
    cache = _prefill_cache(1)
    ids = [7, 3, 12, 0]  # a request's blocks, scattered
    sender = KVSender(rx.security, transport=transport, max_chunk_bytes=600, bulk_chunk_bytes=600,
                      shm_chunk_bytes=600)  # several chunks per layer
    try:
        landed = {}
        for how, dest in (("layer", [1, 2, 3, 4]), ("blocks", [10, 11, 12, 13])):
            done, event = rx.expect(how, dest)
            stream = sender.open_stream(rx.target, how, rx.layout, len(ids) * BS)
            for layer, (k, v) in enumerate(cache):
                idx = torch.tensor(ids, dtype=torch.long)
                if how == "layer":
                    stream.send_layer(layer, 0, k.index_select(0, idx), v.index_select(0, idx))
                else:
                    stream.send_blocks(layer, 0, k, v, idx)
            result = stream.finish(9)
            assert event.wait(5) and done[0].ok and result.num_chunks > LAYERS
            landed[how] = [rx.landed(layer, dest) for layer in range(LAYERS)]
        for a, b in zip(landed["layer"], landed["blocks"]):
            assert torch.equal(a, b)
    finally:
        sender.close()


def test_a_non_finite_block_fails_the_stream_by_name(rx: Receiving) -> None:
    cache = _prefill_cache(2)
    cache[1][0][3, 2, 1, 4] = float("inf")
    sender = KVSender(rx.security, transport="grpc")
    try:
        done, event = rx.expect("bad", [1, 2], timeout_s=1.0)
        stream = sender.open_stream(rx.target, "bad", rx.layout, 2 * BS)
        stream.send_blocks(0, 0, cache[0][0], cache[0][1], torch.tensor([5, 6]))
        with pytest.raises(TransferFailed, match=r"layer 1, blocks 0\.\.1: int4: input holds NaN or inf"):
            stream.send_blocks(1, 0, cache[1][0], cache[1][1], torch.tensor([5, 3]))
        with pytest.raises(TransferFailed):
            stream.finish(0)
        _wait_failed(rx, event, done)
        done, event = rx.expect("x", [1], timeout_s=1.0)
        stream = sender.open_stream(rx.target, "x", rx.layout, BS)
        with pytest.raises(ValueError, match="do not fit"):  # two blocks for a one-block request
            stream.send_blocks(0, 0, cache[0][0], cache[0][1], torch.tensor([1, 2]))
        stream.cancel("test")
        _wait_failed(rx, event, done)
    finally:
        sender.close()


def _wait_failed(rx: Receiving, event: threading.Event, done: list[TransferOutcome]) -> None:
    """The cancelled call frees the reservation at once, or, cancelled before its handshake reached the
    receiver, at the reservation's deadline (the janitor's sweep, run here)."""
    for _ in range(100):
        if event.wait(0.1):
            break
        rx.receiver.sweep()
    assert event.is_set() and not done[0].ok
