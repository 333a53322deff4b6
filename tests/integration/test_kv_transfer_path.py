"""The real path: prefill in this process, decode in another, the KV cache between them over real gRPC.

The decode process (a spawned child) runs a decode engine, a KVReceiver and the gRPC server; this
process runs the prefill engine, the LayerStreamer and the KVSender. A pipe carries the test's own
control (reserve, wait, continue decoding); the KV goes only over gRPC.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import secrets
from pathlib import Path

import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.sender import KVSender, TransportChoice
from workers.decode.kv_sink import KVStore
from workers.prefill.kv_stream import LayerStreamer
from workers.runtime.engine import DTypeName, Engine, EngineConfig, LayerKVReady
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.integration]

TOKEN = secrets.token_urlsafe(24)


def decode_peer(conn, model_dir: str, dtype: str, codecs: tuple[str, ...], transport_token: str,
                store: str = "dequantize") -> None:
    """The decode side, in its own process (``store``: the decode worker's ``decode_store``)."""
    import threading

    from kvtransfer.receiver import KVReceiver, TransferOutcome
    from kvtransfer.server import kv_transfer_handler, start_server
    from workers.decode.kv_sink import CacheSink, decode_cache_dtypes
    from workers.prefill.kv_stream import engine_layout

    bundle = load_model(model_dir, dtype=getattr(torch, dtype), with_vision=False)
    engine = Engine(bundle.model, bundle.tokenizer,
                    EngineConfig(dtype=dtype, kv_layer_dtypes=decode_cache_dtypes(codecs, dtype, store)),  # type: ignore[arg-type]  # parametrized as str
                    bundle.eos_token_ids)
    receiver = KVReceiver(engine_layout(engine, codecs), CacheSink(engine.cache))
    receiver.start_janitor()
    server, port = start_server([kv_transfer_handler(receiver)], "127.0.0.1:0",
                                TransferSecurity(token=transport_token))
    receiver.enable_bulk("127.0.0.1")  # the tcp transport's connection lands here
    conn.send(port)
    outcomes: dict = {}
    events: dict[str, threading.Event] = {}
    reservations: dict = {}

    def landed(outcome: TransferOutcome) -> None:
        outcomes[outcome.request_id] = outcome
        events[outcome.request_id].set()

    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "reserve":
                rid, n = args
                reservations[rid] = engine.reserve(rid, n)
                events[rid] = threading.Event()
                receiver.expect(rid, reservations[rid].blocks, landed, 10.0)
                conn.send("ok")
            elif cmd == "wait":
                rid, prompt, params = args
                events[rid].wait(15)
                outcome = outcomes[rid]
                if not outcome.ok:
                    engine.release(reservations[rid])
                    conn.send(("failed", outcome.code.name, outcome.error))
                    continue
                res = reservations[rid]
                cache = [engine.cache.read_tokens(layer, list(res.blocks), len(prompt), engine.model.dtype)
                         for layer in range(engine.model.cfg.num_layers)]
                tokens = list(engine.add_prefilled(res, prompt, outcome.first_token, params).new_token_ids)
                while engine.has_unfinished():
                    for out in engine.step():
                        tokens.extend(out.new_token_ids)
                conn.send(("ok", tokens, cache))
            elif cmd == "cache_dtypes":
                conn.send([str(layer.k.dtype) for layer in engine.cache.layers])  # type: ignore[attr-defined]  # .k: all
            elif cmd == "stats":
                s = engine.stats()
                conn.send((s.blocks_free, s.blocks_total, s.num_reservations, receiver.pending))
            elif cmd == "stop":
                break
    finally:
        server.stop(0).wait(10)
        receiver.stop()


class Peer:
    def __init__(self, model_dir: Path, dtype: str, codecs: tuple[str, ...], store: str = "dequantize") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_peer, args=(child, str(model_dir), dtype, codecs, TOKEN, store),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("decode peer did not start")
        self.target = f"127.0.0.1:{self.conn.recv()}"

    def call(self, *msg):
        self.conn.send(msg)
        if not self.conn.poll(60):
            raise RuntimeError(f"decode peer did not answer {msg[0]}")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _disaggregated(model_dir: Path, dtype: DTypeName, codecs: tuple[str, ...], prompts: list[list[int]],
                   params: SamplingParams, transport: TransportChoice = "grpc", chunk: int = 64,
                   store: KVStore = "dequantize"):
    """Run prompts through prefill here and decode in the peer; returns tokens and cache comparisons
    (and the stats tuple, whose last entry is the decode cache's dtype per layer)."""
    bundle = load_model(model_dir, dtype=getattr(torch, dtype), with_vision=False)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(dtype=dtype, prefill_chunk_size=chunk),
                    bundle.eos_token_ids)
    sender = KVSender(TransferSecurity(token=TOKEN), transport=transport)
    streamer = LayerStreamer(engine, sender, codecs)
    prefill_kv: dict[str, list] = {}

    def capture(ev: LayerKVReady) -> None:  # what prefill computed, to compare with what decode holds
        for c in ev.chunks:
            k, v = engine.cache.read_tokens(ev.layer, list(c.blocks), c.end, engine.model.dtype)
            prefill_kv.setdefault(c.request_id, [None] * bundle.config.num_layers)[ev.layer] = (k.clone(), v.clone())

    engine.add_layer_hook(capture)
    peer = Peer(model_dir, dtype, codecs, store)
    results = []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            assert peer.call("reserve", rid, len(prompt)) == "ok"
            streamer.start(rid, peer.target, len(prompt), timeout_s=10)
            engine.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1))  # prefill draws the first token
            first = None
            while engine.has_unfinished():
                for out in engine.step():
                    first = out.new_token_ids[0]
            assert first is not None
            push = streamer.finish(rid, first)
            status, tokens, cache = peer.call("wait", rid, prompt, params)
            assert status == "ok"
            results.append((tokens, cache, prefill_kv[rid], push))
        stats = (*peer.call("stats"), peer.call("cache_dtypes"))
    finally:
        peer.close()
        sender.close()
    assert engine.stats().blocks_free == engine.stats().blocks_total
    return results, stats


@pytest.fixture(scope="module")
def prompts(default_ckpt):
    tok = load_model(default_ckpt, with_vision=False).tokenizer
    return [tok.encode("The quick brown fox jumps over the lazy dog. " * 7),
            tok.encode("Hello, world. What is the capital of France?"),
            tok.encode("Prefill runs the language model over the whole prompt and writes the cache. " * 3)]


@pytest.mark.parametrize("dtype, codec, transport", [("bfloat16", "bf16", "grpc"), ("float32", "fp32", "grpc"),
                                                     ("float32", "fp32", "shm"), ("bfloat16", "bf16", "tcp")])
def test_decode_cache_is_bit_exact_and_generation_matches_the_reference(default_ckpt, prompts, dtype, codec,
                                                                          transport):
    bundle = load_model(default_ckpt, dtype=getattr(torch, dtype), with_vision=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    layers = bundle.config.num_layers
    results, (free, total, reservations, pending, _) = _disaggregated(default_ckpt, dtype, (codec,) * layers, prompts,
                                                                   params, transport)
    reference = generate(bundle, [GenerateRequest(prompt_ids=p, params=params) for p in prompts],
                         EngineConfig(dtype=dtype))
    for (tokens, decode_kv, prefill_kv, push), ref in zip(results, reference):
        assert push.transport == transport
        for layer in range(layers):
            assert torch.equal(decode_kv[layer][0], prefill_kv[layer][0]), f"keys differ at layer {layer}"
            assert torch.equal(decode_kv[layer][1], prefill_kv[layer][1]), f"values differ at layer {layer}"
        assert tokens == ref.token_ids
    assert (free, reservations, pending) == (total, 0, 0), "the decode side leaked blocks or reservations"


def test_seeded_sampling_continues_across_the_transfer_as_in_one_engine(default_ckpt, prompts):
    """Prefill draws the first token and decode the rest, yet a seeded request samples exactly what one
    engine's generate() samples: each draw is seeded by the request's seed and the token's index."""
    bundle = load_model(default_ckpt, dtype=torch.float32, with_vision=False)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=4321, ignore_eos=True)
    results, _ = _disaggregated(default_ckpt, "float32", ("fp32",) * bundle.config.num_layers, prompts, params)
    reference = generate(bundle, [GenerateRequest(prompt_ids=p, params=params) for p in prompts],
                         EngineConfig(dtype="float32"))
    assert [tokens for tokens, *_ in results] == [ref.token_ids for ref in reference]
    assert len({tuple(ref.token_ids) for ref in reference}) == len(prompts), "sampling was meant to differ per prompt"


def test_int8_transfer_stays_within_its_bound_and_keeps_generating(default_ckpt, prompts):
    bundle = load_model(default_ckpt, with_vision=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results, (free, total, reservations, pending, _) = _disaggregated(
        default_ckpt, "float32", ("int8",) * bundle.config.num_layers, prompts[:1], params)
    tokens, decode_kv, prefill_kv, push = results[0]
    assert push.num_bytes < push.logical_bytes * 0.6  # int8 halves the bf16 bytes (plus scales)
    for (dk, dv), (pk, pv) in zip(decode_kv, prefill_kv):
        for got, want in ((dk, pk), (dv, pv)):
            # int8 per (block, head): error <= amax / 254 of that block and head
            bound = want.abs().amax(dim=(0, 2)).max().item() / 254 * 1.001 + 1e-6
            assert (got - want).abs().max().item() <= bound
            assert not torch.equal(got, want)  # it really was quantised
    assert len(tokens) == 8
    assert (free, reservations, pending) == (total, 0, 0)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_native_storage_keeps_the_codec_and_decodes_as_the_dequantized_cache_does(default_ckpt, prompts, codec):
    """``decode_store: native`` keeps int8/fp8 as received; read back in float32 it holds exactly what
    the default (dequantised) storage holds, so generation continues identically."""
    bundle = load_model(default_ckpt, with_vision=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    codecs = (codec,) * bundle.config.num_layers
    runs = {store: _disaggregated(default_ckpt, "float32", codecs, prompts[:2], params, "tcp", store=store)
            for store in ("dequantize", "native")}
    (dense, dense_stats), (native, native_stats) = runs["dequantize"], runs["native"]
    assert set(dense_stats[-1]) == {"torch.float32"}
    assert set(native_stats[-1]) == {"torch.int8" if codec == "int8" else "torch.float8_e4m3fn"}
    for (d_tokens, d_kv, _, _), (n_tokens, n_kv, prefill_kv, push) in zip(dense, native):
        assert push.transport == "tcp"
        for layer in range(bundle.config.num_layers):
            assert torch.equal(n_kv[layer][0], d_kv[layer][0]) and torch.equal(n_kv[layer][1], d_kv[layer][1])
            assert not torch.equal(n_kv[layer][0], prefill_kv[layer][0])  # it really was quantised
        assert n_tokens == d_tokens and len(n_tokens) == 8
    free, total, reservations, pending, _ = native_stats
    assert (free, reservations, pending) == (total, 0, 0)
