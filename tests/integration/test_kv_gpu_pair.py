"""DisaggPair (a prefill engine and a decode engine joined by a real KV transfer) on every device pairing.

On CPU, both sides take their device paths (``device_path=True``: the prefill side encodes each layer's
blocks straight from its paged cache by index, the decode side stages the received bytes and decodes them
by block index), and the tokens still equal ``generate()``, and equal the host path's for lossy codecs.
The ``cuda`` tests (skipped without a GPU; ``make gpu-check`` runs them) put either side or both on the
GPU, for every codec and transport."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Literal

import grpc
import pytest
import torch

from kvtransfer.receiver import TransferOutcome
from kvtransfer.sender import TransportChoice
from tests.device_audit import DeviceAudit
from tests.integration.kv_helpers import tiny_model
from workers.disagg_pair import DisaggPair, model_on_device
from workers.runtime.engine import DTypeName, Engine, EngineConfig
from workers.runtime.kv_cache import CacheDType
from workers.runtime.loader import LoadedModel
from workers.runtime.sampler import SamplingParams

pytestmark = pytest.mark.integration
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[5, 9, 17, 33, 2 + i, 40, 41, 42, 7, 8, 11][: 7 + i] for i in range(3)]  # 7..9 tokens, block 4
MAX_TOKENS = 6
LOSSLESS = {"bfloat16": "bf16", "float32": "fp32"}  # the codec that moves a cache of that dtype exactly
KV_BYTES = 4 * 2**20  # explicit: on CUDA a pool sized from free memory would take most of the GPU, twice


def _bundle() -> LoadedModel:
    model = tiny_model()
    return LoadedModel(Path("."), model.cfg, model, None, (0,))


def _reference(bundle: LoadedModel, device: str = "cpu", dtype: DTypeName = "float32",
               forced: list[list[int]] | None = None) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Tokens and per-step logits of one engine running the whole request (``generate()``'s path)."""
    cfg = EngineConfig(dtype=dtype, device=device, block_size=4, kv_cache_bytes=KV_BYTES)
    model = model_on_device(bundle.model, device, dtype)
    engine = Engine(model, None, cfg, (0,))
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True,
                                forced_tokens=() if forced is None else tuple(forced[i]))
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, tuple[list[int], list[torch.Tensor]]] = {f"r{i}": ([], []) for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.logits is not None
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].append(o.logits)
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def _pair_tokens(bundle: LoadedModel, codecs: tuple[str, ...], transport: TransportChoice, *, prefill: str = "cpu",
                 decode: str = "cpu", dtype: DTypeName = "float32", staged: bool | None = None,
                 forced: list[list[int]] | None = None, prefill_cache: CacheDType | Literal["auto"] = "auto"):
    with DisaggPair(bundle, codecs,
                    prefill=EngineConfig(dtype=dtype, device=prefill, block_size=4, kv_cache_bytes=KV_BYTES,
                                         kv_cache_dtype=prefill_cache),
                    decode=EngineConfig(dtype=dtype, device=decode, block_size=4, kv_cache_bytes=KV_BYTES),
                    transport=transport,
                    device_path=staged) as pair:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True,
                                 forced_tokens=() if forced is None else tuple(forced[i])) for i in range(len(PROMPTS))]
        results = pair.run(PROMPTS, params)
        assert pair.decode.stats().blocks_free == pair.decode.stats().blocks_total  # nothing leaked
        return results


@pytest.mark.parametrize("transport, dtype", [("grpc", "float32"), ("tcp", "float32"), ("shm", "float32"),
                                              ("cuda_ipc", "float32"), ("grpc", "bfloat16")])
def test_cpu_pair_through_the_device_paths_equals_generate(transport: TransportChoice, dtype: DTypeName) -> None:
    bundle = _bundle()
    ref = _reference(bundle, dtype=dtype)
    codec = LOSSLESS[dtype]
    got = _pair_tokens(bundle, (codec, codec), transport, dtype=dtype, staged=True)
    assert [r.token_ids for r in got] == [tokens for tokens, _ in ref]


@pytest.mark.parametrize("codecs, transport", [(("int8", "int4"), "grpc"), (("fp8", "bf16"), "shm")])
def test_cpu_pair_device_paths_land_what_the_host_paths_land(codecs: tuple[str, str],
                                                             transport: TransportChoice) -> None:
    """Lossy codecs: the device paths' decode cache equals the host paths' bit for bit, so greedy tokens and
    every step's logits are the same."""
    bundle = _bundle()
    host = _pair_tokens(bundle, codecs, transport, staged=False)
    device = _pair_tokens(bundle, codecs, transport, staged=True)
    assert [r.token_ids for r in device] == [r.token_ids for r in host]
    for a, b in zip(device, host):
        assert all(torch.equal(x, y) for x, y in zip(a.logits[1:], b.logits[1:]))


@pytest.mark.parametrize("cache, codecs, transport", [("int8", ("int8", "fp8"), "grpc"),
                                                      ("fp8", ("fp8", "int4"), "shm")])
def test_a_quantised_prefill_cache_is_sent_from_the_cache(cache: CacheDType, codecs: tuple[str, str],
                                                          transport: TransportChoice,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantised prefill layer goes through send_blocks (QuantizedBlocks: codes and scales read by block
    index; on CPU gathered by the torch reference, which the fused kernels match byte for byte) and lands
    what the gathered snapshot lands: the same tokens and logits."""
    from kvtransfer.codecs.paged import QuantizedBlocks

    reads: list[int] = []
    gather = QuantizedBlocks.gather

    def counted(self: QuantizedBlocks, ids: torch.Tensor) -> torch.Tensor:
        reads.append(ids.numel())
        return gather(self, ids)

    monkeypatch.setattr(QuantizedBlocks, "gather", counted)
    bundle = _bundle()
    host = _pair_tokens(bundle, codecs, transport, staged=False, prefill_cache=cache)
    assert reads == []
    device = _pair_tokens(bundle, codecs, transport, staged=True, prefill_cache=cache)
    assert reads  # the from-cache path read the quantised blocks
    assert [r.token_ids for r in device] == [r.token_ids for r in host]
    for a, b in zip(device, host):
        assert all(torch.equal(x, y) for x, y in zip(a.logits[1:], b.logits[1:]))


@pytest.mark.parametrize("device_path", [False, True])
def test_the_layer_hook_and_calibration_name_their_device(device_path: bool) -> None:
    """The prefill side's hook (gathered snapshot or send_blocks) and the auto codec calibration create
    every index on the cache's device (tests/device_audit.py: the hooks run on this thread)."""
    from workers.prefill.calibrate import resolve_codecs

    bundle = _bundle()
    with DeviceAudit() as audit:
        _pair_tokens(bundle, ("int8", "bf16"), "grpc", staged=device_path)
        engine = Engine(bundle.model, None, EngineConfig(block_size=4, kv_cache_bytes=KV_BYTES), (0,))
        resolve_codecs("auto", engine, PROMPTS)
    assert audit.no_device == [] and audit.mixed == []


def test_closing_the_streamer_cancels_its_open_streams_and_detaches_it() -> None:
    """A prefill worker shutting down (or a benchmark moving to the next transport) closes its streamer:
    a push still open is cancelled on both sides, so the decode side frees its reserved blocks at once, and
    the engine's later layers no longer reach it."""
    bundle = _bundle()
    cfg = EngineConfig(block_size=4, kv_cache_bytes=KV_BYTES)
    with DisaggPair(bundle, ("fp32", "fp32"), prefill=cfg, decode=cfg) as pair:
        reserved = pair.decode.reserve("open", len(PROMPTS[0]))
        ended: list[TransferOutcome] = []
        done = threading.Event()

        def on_done(outcome: TransferOutcome) -> None:
            ended.append(outcome)
            done.set()

        pair.receiver.expect("open", reserved.blocks, on_done, 30)
        stream = pair.streamer.start("open", pair.target, len(PROMPTS[0]), 30)
        pair.prefill.add_request("open", PROMPTS[0], SamplingParams(max_tokens=1, ignore_eos=True))
        pair.prefill.step()  # the prompt's layers go out; the finish never will
        deadline = time.monotonic() + 10
        while not pair.decode.cache.read_tokens(0, list(reserved.blocks), 4, torch.float32)[0].any():
            assert time.monotonic() < deadline, "the first layer never landed"
            time.sleep(0.01)  # the push reached the receiver (a call cancelled before that only ends at its deadline)
        pair.streamer.close()
        assert stream.error is not None and stream.error.code == grpc.StatusCode.CANCELLED
        assert "streamer closed" in stream.error.message
        assert done.wait(10) and not ended[0].ok, "the receiver still holds the cancelled push's blocks"
        pair.decode.release(reserved)
        with pytest.raises(ValueError):  # the hook is gone: nothing to remove
            pair.prefill.remove_layer_hook(pair.streamer._on_layer)
        pair.streamer.close()  # again: nothing left to do


# ---------------------------------------------------------------------------------------------- CUDA


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm", "cuda_ipc", "auto"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_pair_with_a_lossless_codec_equals_generate(transport: TransportChoice, dtype: DTypeName) -> None:
    bundle = _bundle()
    ref = _reference(bundle, "cuda", dtype)
    codec = LOSSLESS[dtype]
    got = _pair_tokens(bundle, (codec, codec), transport, prefill="cuda", decode="cuda", dtype=dtype)
    assert [r.token_ids for r in got] == [tokens for tokens, _ in ref]


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm", "cuda_ipc", "auto"])
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "bf16"])
def test_cuda_pair_runs_every_codec(transport: TransportChoice, codec: str) -> None:
    """Every layer in ``codec``: the run completes and releases every block; bf16 (lossless for a bf16
    cache) decides exactly as one engine, the quantising codecs change the cache by design, so their
    teacher-forced decisions are only held to a floor (this random tiny model has small logit margins).
    That the decode cache holds exactly the codec's own decode is checked by test_kv_devices on CUDA."""
    bundle = _bundle()
    ref = _reference(bundle, "cuda", "bfloat16")
    forced = [tokens for tokens, _ in ref]
    got = _pair_tokens(bundle, (codec, codec), transport, prefill="cuda", decode="cuda", dtype="bfloat16",
                       forced=forced)
    agree = sum(int(lg.argmax()) == t for r, f in zip(got, forced) for lg, t in zip(r.logits[1:], f[1:]))
    floor = {"bf16": 1.0, "int8": 0.8, "fp8": 0.7, "int4": 0.5}[codec]
    assert agree >= floor * sum(len(f) - 1 for f in forced)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("prefill, decode", [("cuda", "cpu"), ("cpu", "cuda")])
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
def test_cross_device_pair_matches_one_engine(prefill: str, decode: str, transport: TransportChoice) -> None:
    """A CUDA prefill feeding a CPU decode, and the reverse, float32 and lossless: every decode step's
    logits (teacher-forced to the CPU reference's tokens) match one CPU engine's within float32 noise."""
    bundle = _bundle()
    ref = _reference(bundle)
    forced = [tokens for tokens, _ in ref]
    got = _pair_tokens(bundle, ("fp32", "fp32"), transport, prefill=prefill, decode=decode, forced=forced)
    for r, (_, logits) in zip(got, ref):
        for a, b in zip(r.logits[1:], logits[1:]):
            assert torch.allclose(a.cpu(), b.cpu(), atol=1e-3, rtol=1e-3)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_cuda_quantised_prefill_cache_from_the_cache_lands_what_the_snapshot_lands(cache: CacheDType,
                                                                                   transport: TransportChoice):
    """A quantised CUDA prefill cache: the fused int8/fp8 kernels read its codes and scales by block index,
    and the (CPU) decode side gets what the gathered snapshot sent: the same tokens and logits, exactly."""
    bundle = _bundle()
    runs = [_pair_tokens(bundle, ("int8", "fp8"), transport, prefill="cuda", decode="cpu", dtype="bfloat16",
                         staged=staged, prefill_cache=cache) for staged in (False, True)]
    assert [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[0]]
    for a, b in zip(runs[1], runs[0]):
        assert all(torch.equal(x, y) for x, y in zip(a.logits[1:], b.logits[1:]))
