"""A codec a quantised decode layer does not store natively (int4, bf16, fp32 into int8/fp8; int8 into fp8; fp8
into int8) lands through the sink's device path (``CacheSink(staged=True)``) in the fused requantising kernel
(workers.runtime.kernels.kv_requant), byte for byte what the host path lands (decode to float32, then the
cache's own write): straight from the sink, from parts already on the device (``write_device``), and over a
real gRPC transfer into scattered blocks. A chunk that decodes to NaN or inf is refused by both paths with one
message and lands nothing.

On CPU the kernel runs through Triton's interpreter (tests.unit.triton_env); the ``cuda`` test runs it compiled
on a CUDA cache against the host path on CPU (skipped without a GPU; ``make gpu-check`` runs it)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.codecs import CodecError, Kind, get_codec
from kvtransfer.cuda_ipc import DeviceParts
from kvtransfer.layout import KVLayout
from kvtransfer.options import CHANNEL_OPTIONS
from kvtransfer.receiver import KVReceiver, TransferOutcome, WireParts
from kvtransfer.sender import KVSender
from kvtransfer.server import kv_transfer_handler, start_server
from tests.integration.kv_helpers import AUTH, TOKEN, Frames, refused
from tests.unit.triton_env import DEVICE
from workers.decode.kv_sink import CacheSink
from workers.runtime.kv_cache import CacheDType, KVCacheSpec, PagedKVCache, QuantizedLayerStorage, block_slots

pytestmark = pytest.mark.integration
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
LAYERS: tuple[CacheDType, CacheDType] = ("int8", "fp8")
BLOCKS = [5, 6, 2, 9]  # a run of consecutive ids and lone ones, out of order
CODECS = ["int8", "fp8", "int4", "bf16", "fp32"]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The codecs the requantising kernel was called for (it still runs): proof that the device path took it."""
    from workers.runtime.kernels import kv_requant

    calls: list[str] = []
    real = kv_requant.land_requantised

    def spy(codec: Any, *args: Any) -> None:
        calls.append(codec.name)
        real(codec, *args)
    monkeypatch.setattr(kv_requant, "land_requantised", spy)
    return calls


def _encoded(codec: str, seed: int, n: int = len(BLOCKS)) -> tuple[Any, Any]:
    """Keys and values of ``n`` blocks at different magnitudes per block, encoded with ``codec``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    mags = torch.tensor([1e-3, 1.0, 300.0, 7.0] * n)[:n].view(-1, 1, 1, 1)
    c = get_codec(codec)
    return (c.encode(torch.randn(shape, generator=gen) * mags, Kind.KEY),
            c.encode(torch.randn(shape, generator=gen) * mags, Kind.VALUE))


def _wire(enc: Any) -> WireParts:
    def part(t: torch.Tensor | None) -> memoryview | None:
        return None if t is None else memoryview(t.contiguous().view(torch.uint8).numpy().tobytes())
    return WireParts(part(enc.payload), part(enc.scales), part(enc.zeros))  # type: ignore[arg-type]  # payload and scales are present


def _device(enc: Any, device: torch.device) -> DeviceParts:
    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous().view(torch.uint8).reshape(-1).to(device)
    return DeviceParts(part(enc.payload), part(enc.scales), part(enc.zeros))  # type: ignore[arg-type]  # payload and scales are present


def _assert_same(host: PagedKVCache, dev: PagedKVCache) -> None:
    for layer, (a, b) in enumerate(zip(host.layers, dev.layers, strict=True)):
        for name in ("k", "v", "k_scale", "v_scale"):
            x, y = getattr(a, name).view(torch.uint8), getattr(b, name).cpu().view(torch.uint8)
            assert torch.equal(x, y), f"layer {layer} {name}: {int((x != y).sum())} bytes differ"


def _lands_as_the_host_path(codec: str, device: torch.device, kernel_calls: list[str]) -> None:
    shape = (len(BLOCKS), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    host, dev = PagedKVCache(SPEC, 12, LAYERS), PagedKVCache(SPEC, 12, LAYERS, device)
    sink = CacheSink(dev, staged=True)
    for layer in range(SPEC.num_layers):
        k, v = _encoded(codec, seed=layer)
        CacheSink(host).write(layer, BLOCKS, codec, shape, _wire(k), _wire(v))
        sink.write(layer, BLOCKS, codec, shape, _wire(k), _wire(v))
        # parts already in device memory (CUDA IPC's path), into other blocks
        k, v = _encoded(codec, seed=10 + layer, n=2)
        CacheSink(host).write(layer, [11, 0], codec, (2, *shape[1:]), _wire(k), _wire(v))
        sink.write_device(layer, [11, 0], codec, (2, *shape[1:]), _device(k, device), _device(v, device))
    _assert_same(host, dev)
    non_native = [d for d in LAYERS if d != codec]
    assert kernel_calls == [codec] * 2 * len(non_native)  # the native layer (int8/fp8 itself) stores as received


@pytest.mark.parametrize("codec", CODECS)
def test_staged_sink_requantises_in_the_kernel_what_the_host_sink_lands(codec: str, kernel_calls: list[str]) -> None:
    _lands_as_the_host_path(codec, DEVICE, kernel_calls)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("codec", CODECS)
def test_cuda_sink_requantises_in_the_kernel_what_the_cpu_host_sink_lands(codec: str,
                                                                         kernel_calls: list[str]) -> None:
    _lands_as_the_host_path(codec, torch.device("cuda"), kernel_calls)


def _corrupt_bf16(enc: Any) -> Any:
    from kvtransfer.codecs import EncodedTensor

    p = enc.payload.clone()
    p.view(torch.int16)[37] = 0x7FC0  # a NaN in one value of one block
    return EncodedTensor(enc.codec_id, enc.kind, enc.shape, p, enc.scales, enc.zeros)


def _overflowing_int8(enc: Any) -> Any:
    """Finite scales (the receiver's finite check passes them) whose -128 code overflows float32 once decoded."""
    from kvtransfer.codecs import EncodedTensor

    p, s = enc.payload.clone(), enc.scales.clone()
    p.view(torch.int8)[3] = -128
    s.view(-1)[0] = 3.0e38
    return EncodedTensor(enc.codec_id, enc.kind, enc.shape, p, s, enc.zeros)


def test_finite_scales_that_decode_past_the_range_are_refused_before_the_kernel(kernel_calls: list[str]) -> None:
    """int8 scales of 3e38 are finite, but a -128 code decodes past float32's range: the sink's bound on the
    scales refuses the chunk on both paths before anything is decoded or written."""
    shape = (len(BLOCKS), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    k, v = _encoded("int8", seed=4)
    v = _overflowing_int8(v)
    for staged in (False, True):
        cache = PagedKVCache(SPEC, 12, ("fp8", "fp8"), DEVICE)
        with pytest.raises(ValueError, match=r"the values' scales decode to magnitudes up to 3\.84e\+40, past"):
            CacheSink(cache, staged=staged).write(1, BLOCKS, "int8", shape, _wire(k), _wire(v))
        for name in ("k", "v", "k_scale", "v_scale"):
            assert not getattr(cache.layers[1], name).view(torch.uint8).any(), (staged, name)  # still all zero
    assert kernel_calls == []


@pytest.mark.parametrize("codec, corrupt", [("bf16", _corrupt_bf16)])
def test_a_chunk_that_decodes_to_nan_or_inf_is_refused_by_both_paths_and_lands_nothing(
        codec: str, corrupt: Callable[[Any], Any], kernel_calls: list[str]) -> None:
    shape = (len(BLOCKS), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    k, v = _encoded(codec, seed=4)
    v = corrupt(v)
    messages = []
    for staged in (False, True):
        cache = PagedKVCache(SPEC, 12, ("fp8", "fp8"), DEVICE)
        with pytest.raises(CodecError, match="NaN or inf") as err:
            CacheSink(cache, staged=staged).write(1, BLOCKS, codec, shape, _wire(k), _wire(v))
        messages.append(str(err.value))
        for name in ("k", "v", "k_scale", "v_scale"):
            assert not getattr(cache.layers[1], name).view(torch.uint8).any(), (staged, name)  # still all zero
    assert messages[0] == messages[1] == (f"{codec}: the received KV holds NaN or inf once decoded; refusing to "
                                          f"land it in the fp8 cache (nothing was written)")
    assert kernel_calls == [codec]  # the staged write refused in the kernel, not before it


def test_block_ids_outside_the_cache_are_refused_before_any_launch(kernel_calls: list[str]) -> None:
    shape = (2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    k, v = _encoded("int4", seed=5, n=2)
    cache = PagedKVCache(SPEC, 12, LAYERS, DEVICE)
    for blocks in ([3, 12], [-1, 3]):
        with pytest.raises(ValueError, match="outside the cache's 12"):
            CacheSink(cache, staged=True).write(0, blocks, "int4", shape, _wire(k), _wire(v))
    layer = cache.layers[0]
    assert isinstance(layer, QuantizedLayerStorage)
    assert kernel_calls == [] and not layer.k.view(torch.uint8).any() and not layer.k_scale.any()


# ---------------------------------------------------------------------- over a real transfer
@pytest.fixture
def rig() -> Iterator[tuple[PagedKVCache, KVReceiver, str]]:
    """A decode cache with an int8 and an fp8 layer behind a real gRPC server, its sink on the device path;
    the senders send int4 keys and values for layer 0 and bf16 for layer 1."""
    cache = PagedKVCache(SPEC, 16, LAYERS, DEVICE)
    receiver = KVReceiver(_layout(), CacheSink(cache, staged=True))
    server, port = start_server([kv_transfer_handler(receiver)], "127.0.0.1:0", TransferSecurity(token=TOKEN))
    yield cache, receiver, f"127.0.0.1:{port}"
    server.stop(0)
    receiver.stop()


def _layout() -> KVLayout:
    return KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, SPEC.block_size, ("int4", "bf16"),
                    "requant-test", "float32")


def _expect(receiver: KVReceiver, rid: str, ids: list[int]) -> tuple[list[TransferOutcome], threading.Event]:
    done: list[TransferOutcome] = []
    landed = threading.Event()

    def on_done(outcome: TransferOutcome) -> None:
        done.append(outcome)
        landed.set()
    receiver.expect(rid, ids, on_done, timeout_s=30)
    return done, landed


def test_a_real_transfer_requantises_int4_and_bf16_into_int8_and_fp8_layers(rig, kernel_calls: list[str]) -> None:
    cache, receiver, target = rig
    ids = [13, 2, 7, 0, 9]
    tokens = len(ids) * SPEC.block_size - 1
    done, landed = _expect(receiver, "r1", ids)
    gen = torch.Generator().manual_seed(6)
    shape = (len(ids), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    kv = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 5) for _ in LAYERS]
    sender = KVSender(TransferSecurity(token=TOKEN), transport="grpc", max_chunk_bytes=1_000)  # several chunks a layer
    try:
        stream = sender.open_stream(target, "r1", _layout(), tokens, timeout_s=30)
        for layer, (k, v) in enumerate(kv):
            stream.send_layer(layer, 0, k.clone(), v.clone())
        result = stream.finish(7)
    finally:
        sender.close()
    assert landed.wait(30) and done[0].ok, done
    assert result.num_chunks > len(LAYERS) and sorted(set(kernel_calls)) == ["bf16", "int4"]
    # the reference: each layer's codec decoded to float32 and written by the cache's own write, on CPU
    slots = block_slots(ids, SPEC.block_size, torch.device("cpu"))
    for layer, ((k, v), codec) in enumerate(zip(kv, _layout().layer_codecs, strict=True)):
        c = get_codec(codec)
        want = QuantizedLayerStorage(SPEC, 16, LAYERS[layer], torch.device("cpu"))
        h, d = SPEC.num_kv_heads, SPEC.head_dim
        want.write(slots, c.decode(c.encode(k, Kind.KEY), torch.float32).reshape(-1, h, d),
                   c.decode(c.encode(v, Kind.VALUE), torch.float32).reshape(-1, h, d))
        got = cache.layers[layer]
        for name in ("k", "v", "k_scale", "v_scale"):
            assert torch.equal(getattr(want, name).view(torch.uint8), getattr(got, name).cpu().view(torch.uint8)), (
                layer, name)


def test_a_real_transfer_of_a_nan_bf16_payload_is_refused_by_the_sink(rig, kernel_calls: list[str]) -> None:
    """The receiver checks scales and fp8 codes before the sink, not float payloads (the sender refuses those):
    a wrong sender's NaN in a bf16 payload reaches the sink, whose kernel refuses it, and the push fails."""
    cache, receiver, target = rig
    ids = [4, 1, 10]
    done, landed = _expect(receiver, "r2", ids)
    frames = Frames(_layout(), "r2")

    def nan_value(scales: bytes, payload: bytes) -> tuple[bytes, bytes]:
        return scales, payload[:-2] + b"\xc0\x7f"  # the last value's last element: a bf16 NaN
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    try:
        err = refused(channel, [frames.handshake(), frames.chunk(0), frames.chunk(1, as_sent=nan_value),
                                frames.finish()], AUTH)
    finally:
        channel.close()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bf16: the received KV holds NaN or inf once decoded" in (err.details() or "")
    assert landed.wait(10) and not done[0].ok
    assert kernel_calls == ["int4", "bf16"]
    assert not cache.layers[1].k.view(torch.uint8).any() and not cache.layers[1].v_scale.any()  # nothing of layer 1
