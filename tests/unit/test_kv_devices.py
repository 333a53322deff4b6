"""Device placement of the KV path, checked on CPU: every index, slot, scale and staging tensor that the
device path (``CacheSink(staged=True)``, ``kvtransfer.staging``, the device chunk encoder, the layer
hook's slots) creates is given its device explicitly, and no operation mixes devices.

``DeviceAudit`` (tests/device_audit.py) records the factories called without ``device=`` and the calls
mixing devices. On CPU only the first can fire; with CUDA (tests.unit.triton_env.DEVICE) both do, so
these tests run on a GPU unchanged."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtransfer import staging
from kvtransfer.chunks import _encode_on_device, _sizes, chunk_nbytes, frame_chunk_into
from kvtransfer.codecs import Kind, get_codec
from kvtransfer.receiver import WireParts
from kvtransfer.staging import PinnedPool, index_on, side_stream, to_device, to_host
from kvtransfer.wire import pb
from tests.device_audit import DeviceAudit
from tests.unit.triton_env import DEVICE
from workers.decode.kv_sink import CacheSink
from workers.runtime.kv_cache import DenseLayerStorage, KVCacheSpec, PagedKVCache, block_slots

pytestmark = pytest.mark.unit

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
BLOCKS = [5, 6, 2, 9]  # a run of consecutive ids and lone ones, out of order


def _wire(codec: str, x: torch.Tensor, kind: Kind) -> WireParts:
    enc = get_codec(codec).encode(x, kind)

    def part(t: torch.Tensor | None) -> memoryview | None:
        return None if t is None else memoryview(t.contiguous().view(torch.uint8).numpy().tobytes())
    return WireParts(part(enc.payload), part(enc.scales), part(enc.zeros))  # type: ignore[arg-type]  # payload and scales are present


@pytest.mark.parametrize("codec, layer_dtypes", [
    ("fp32", ("float32", "float32")), ("bf16", ("bfloat16", "float32")), ("int8", ("float32", "float32")),
    ("int8", ("int8", "float32")), ("fp8", ("fp8", "float32")), ("int4", ("bfloat16", "float32")),
    ("fp8", ("int8", "float32")),
])
def test_staged_sink_lands_what_the_host_sink_lands_with_every_tensor_on_the_cache_device(
        codec: str, layer_dtypes: tuple[str, str]) -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (len(BLOCKS), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    dtype = torch.bfloat16 if codec == "bf16" else torch.float32
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    kw, vw = _wire(codec, k, Kind.KEY), _wire(codec, v, Kind.VALUE)
    host = PagedKVCache(SPEC, 12, layer_dtypes)  # type: ignore[arg-type]  # parametrized CacheDTypes
    CacheSink(host).write(0, BLOCKS, codec, shape, kw, vw)
    dev = PagedKVCache(SPEC, 12, layer_dtypes, DEVICE)  # type: ignore[arg-type]  # parametrized CacheDTypes
    sink = CacheSink(dev, staged=True)
    assert sink.staged
    with DeviceAudit() as audit:
        sink.write(0, BLOCKS, codec, shape, kw, vw)
    assert audit.no_device == [] and audit.mixed == []
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(host.layers[0], name, None), getattr(dev.layers[0], name, None)
        if a is not None:
            assert b.device == dev.device
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), name


def test_staged_sink_refuses_short_parts_and_writes_nothing() -> None:
    shape = (2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    k = torch.randn(shape)
    kw, vw = _wire("int8", k, Kind.KEY), _wire("int8", k, Kind.VALUE)
    for layer_dtypes in (("float32", "float32"), ("int8", "float32")):
        cache = PagedKVCache(SPEC, 12, layer_dtypes, DEVICE)
        sink = CacheSink(cache, staged=True)
        with pytest.raises(ValueError, match="payload"):
            sink.write(0, [1, 2], "int8", shape, WireParts(kw.payload[:-1], kw.scales, None), vw)
        assert not vars(cache.layers[0])["k"].float().any()


def test_block_slots_and_slots_for_live_on_the_cache_device() -> None:
    with DeviceAudit() as audit:
        slots = block_slots([3, 1], 4, DEVICE)
    assert slots.device == DEVICE and slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert audit.no_device == []
    cache = PagedKVCache(SPEC, 8, ("float32", "float32"), DEVICE)
    assert cache.slots_for([3, 1], 2, 6).device == DEVICE


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "bf16", "fp32"])
def test_device_chunk_encoder_sends_the_host_encoders_bytes(codec: str) -> None:
    """``_encode_on_device`` (encode where the tensors are, stage only the encoded bytes) frames exactly
    the bytes, and checksum, that the host path frames."""
    gen = torch.Generator().manual_seed(4)
    shape = (3, 32, 2, 64)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    c = get_codec(codec)
    n = chunk_nbytes(c, shape)
    want = torch.empty(n, dtype=torch.uint8)
    chunk = pb.KVChunk()
    frame_chunk_into(chunk, c, k, v, want)
    host = PinnedPool().take(n)[:n]
    s_len, k_len, _ = _sizes(c, shape)
    with DeviceAudit() as audit:
        checksum = _encode_on_device(c, k.to(DEVICE), v.to(DEVICE), host, host.numpy().data, s_len, k_len)
    assert audit.no_device == [] and audit.mixed == []
    assert checksum == chunk.checksum
    assert torch.equal(host, want)


def test_to_device_aligns_each_part_and_keeps_none() -> None:
    parts = [memoryview(b"abc"), None, memoryview(bytes(range(8))), memoryview(b"")]
    with DeviceAudit() as audit:
        out = to_device(parts, DEVICE)
    assert audit.no_device == []
    assert out[1] is None and out[3] is not None and out[3].numel() == 0
    assert bytes(out[0].cpu().numpy()) == b"abc" and bytes(out[2].cpu().numpy()) == bytes(range(8))
    assert out[2].view(torch.float32).numel() == 2  # 16-byte aligned: viewable as float32
    assert all(t.device == DEVICE for t in out if t is not None)


def test_pinned_pool_reuses_buffers_and_to_host_checks_sizes() -> None:
    pool = PinnedPool(max_bytes=1 << 20)
    a = pool.take(1000)
    pool.give(a)
    assert pool.idle_bytes == a.numel()
    assert pool.take(900).data_ptr() == a.data_ptr()  # reused, not reallocated
    assert pool.take(100).data_ptr() != a.data_ptr()  # too big to hand out for 100 bytes
    src = torch.arange(16, dtype=torch.uint8, device=DEVICE)
    with side_stream(DEVICE):
        dest = torch.empty(16, dtype=torch.uint8, device="cpu")
        to_host(src, dest)
    assert dest.tolist() == list(range(16))
    with pytest.raises(ValueError, match="host destination of 16 bytes"):
        to_host(src, torch.empty(8, dtype=torch.uint8, device="cpu"))


def test_index_on_puts_the_values_on_the_device_without_waiting_for_it() -> None:
    with DeviceAudit() as audit:
        ids = index_on(DEVICE, BLOCKS)
    assert audit.no_device == [] and audit.mixed == []
    assert ids.device == DEVICE and ids.dtype == torch.long and ids.tolist() == BLOCKS
    if DEVICE.type != "cuda":
        return
    torch.cuda.set_sync_debug_mode("error")  # any copy that waits for the stream raises
    try:
        with pytest.raises(RuntimeError):
            torch.tensor(BLOCKS, device=DEVICE)  # from pageable memory: the wait the layer hook must not make
        ids = index_on(DEVICE, [7, 3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.tolist() == [7, 3]


class _CudaLanding:
    """An int8 chunk landing in layer 1 of a CUDA cache through the staged sink (layer 0 landed once first:
    kernels loaded, pinned memory allocated)."""

    def __init__(self, seed: int) -> None:
        self.shape = (len(BLOCKS), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
        self.k = torch.randn(self.shape, generator=torch.Generator().manual_seed(seed))
        self.wire = _wire("int8", self.k, Kind.KEY), _wire("int8", self.k, Kind.VALUE)
        self.cache = PagedKVCache(SPEC, 12, ("float32", "float32"), "cuda")
        self.sink = CacheSink(self.cache)
        self.sink.write(0, BLOCKS, "int8", self.shape, *self.wire)

    def land(self) -> None:
        self.sink.write(1, BLOCKS, "int8", self.shape, *self.wire)

    def check_landed(self) -> None:
        torch.cuda.synchronize()
        got, _ = self.cache.read_tokens(1, BLOCKS, len(BLOCKS) * SPEC.block_size, torch.float32)
        want = get_codec("int8").decode(get_codec("int8").encode(self.k, Kind.KEY), torch.float32)
        assert torch.equal(got.cpu().view(self.shape), want)


def _queue_matmuls() -> None:
    """Hundreds of ms of GPU work on the current stream, launched without waiting for it."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(100):
        x = x @ x / 64


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_landing_a_chunk_does_not_wait_for_the_engines_queued_work() -> None:
    """A decode worker's receiver lands received bytes into reserved blocks on its side stream without
    waiting for the steps the engine has queued on its own stream (hundreds of ms of matmuls here)."""
    landing = _CudaLanding(seed=4)
    engine = torch.cuda.current_stream()
    _queue_matmuls()
    landing.land()
    assert not engine.query(), "the landing waited for the work queued on the engine's stream"
    landing.check_landed()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_landing_in_blocks_freed_behind_queued_work_waits_for_that_work() -> None:
    """The engine's queued step may still write blocks it has freed (a step that sampled nothing is not
    waited for); a landing in them once reserved again waits for that work (the cache's free fence), so the
    landed values are what stays."""
    landing = _CudaLanding(seed=6)
    storage = landing.cache.layers[1]
    assert isinstance(storage, DenseLayerStorage)
    held = landing.cache.allocator.allocate(landing.cache.num_blocks)  # the engine's sequence holds them all
    _queue_matmuls()
    storage.k[block_slots(BLOCKS, SPEC.block_size, landing.cache.device)] = 7.0  # its step, queued behind
    landing.cache.allocator.free(held)  # the sequence ends before that step ran
    assert landing.cache.free_fence is not None and not landing.cache.free_fence.query()
    landing.land()  # into blocks reserved again
    landing.check_landed()


def test_only_a_cuda_cache_fences_its_frees() -> None:
    cache = PagedKVCache(SPEC, 4, ("float32", "float32"))
    cache.allocator.free(cache.allocator.allocate(2))
    assert cache.allocator.on_free is None and cache.free_fence is None


def test_side_streams_are_one_per_thread_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``side_stream`` waits for its own stream at the end of a block: a stream shared by threads would make
    a receiver's landing wait for an encoder's copies (queued behind the prefill engine's layers)."""
    made: list[torch.device] = []

    class Stream:  # torch.cuda.Stream needs a GPU; only which stream each (thread, device) gets is checked
        def __init__(self, device: torch.device) -> None:
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(staging._threads, "streams", {}, raising=False)  # this thread's real ones kept aside
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    mine = staging._side(first)
    assert staging._side(first) is mine  # reused by its thread
    assert staging._side(second) is not mine
    theirs: list[object] = []
    worker = threading.Thread(target=lambda: theirs.extend([staging._side(first), staging._side(first)]))
    worker.start()
    worker.join()
    assert theirs[0] is theirs[1] and theirs[0] is not mine
    assert made == [first, second, first]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_landing_a_chunk_does_not_wait_for_another_threads_side_stream_work() -> None:
    """An encoder thread's side-stream work (here seconds of matmuls, still queued) does not hold up a
    receiver thread's landing in the same process (DisaggPair, a worker running both pools)."""
    landing = _CudaLanding(seed=5)
    queued, landed = threading.Event(), threading.Event()
    busy: list[torch.cuda.Event] = []

    def encoder() -> None:
        with side_stream(DEVICE):
            _queue_matmuls()
            done = torch.cuda.Event()
            done.record()
            busy.append(done)
            queued.set()
            landed.wait(60)  # the block (and its wait) ends only after the landing below

    worker = threading.Thread(target=encoder)
    worker.start()
    try:
        assert queued.wait(60)
        landing.land()
        assert not busy[0].query(), "the landing waited for another thread's side-stream work"
    finally:
        landed.set()
        worker.join()
    landing.check_landed()
