"""``epd bench kv --device cuda``: the KV path on one GPU, each figure beside a reference from the same run.

Figures (bf16 cache on the GPU):
  codec kernels  each fused codec's encode (blocks read from a paged cache by index) and decode (written
                 into blocks by index), logical bf16 GB/s, and the device checksum that both ends of
                 cuda_ipc take of each chunk, against a device copy of the same bytes;
  cuda_ipc       a 256 MiB cache pushed device to device into a receiver process's cache, against the
                 device copy, a one-block push's time (the fixed cost of a push) beside it, the rate
                 past that fixed cost (the 256 MiB over the difference of the two times), and the
                 aggregate rate of two such pushes at once (steady state: one's fixed cost overlaps the
                 other's data);
  int8 over tcp  the same cache from GPU memory, int8 on the wire, into the receiver's GPU cache, logical
                 GB/s against a raw TCP socket moving the logical bytes on loopback;
  TTFT           a 4,096-token prompt on the 1b preset (random bf16 weights) with layer-wise streaming
                 until the decode side holds the whole cache, per transport, against prefill alone.
The receiver is a second process (CUDA IPC handles open only in another process). ``run_on`` takes the
device and the sizes, so the whole flow also runs on a CPU device at small sizes without cuda_ipc (how its
test checks it; no figure of such a run means anything).
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench import kv_references as references
from bench.gpu_engine_bench import copy_rate, synchronize, timed
from bench.kv_bench import ReceiverProcess
from kvtransfer.auth import TransferSecurity
from kvtransfer.cuda_ipc import IpcPool
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender, TransportChoice

MiB = 2**20


@dataclass
class GpuFigure:
    name: str
    value: float
    unit: str
    reference: str
    ref_value: float
    higher_is_better: bool = True

    @property
    def ratio(self) -> float:
        return self.value / self.ref_value if self.ref_value else float("nan")


def _receiver_main(conn: Connection, token: str) -> None:
    """The receiver process: a bf16 paged cache on the GPU behind a KVReceiver with a bulk listener and a
    CUDA IPC pool, driven by (command, args...) tuples on ``conn`` (the bench's own pipe)."""
    from kvtransfer.receiver import KVReceiver, TransferOutcome
    from kvtransfer.server import kv_transfer_handler, start_server
    from workers.decode.kv_sink import CacheSink
    from workers.runtime.kv_cache import KVCacheSpec, PagedKVCache

    security = TransferSecurity(token=token)
    current: tuple[Any, KVReceiver] | None = None  # the gRPC server and the receiver it serves
    outcomes: list[TransferOutcome] = []
    event = threading.Event()

    def on_done(outcome: TransferOutcome) -> None:
        outcomes.append(outcome)
        event.set()

    def stop() -> None:
        if current is not None:
            current[0].stop(0).wait(10)
            current[1].stop()

    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "setup":
                layout, blocks, ipc_bytes, device, *pushes = args  # blocks for each of ``pushes`` at once
                at_once = pushes[0] if pushes else 1
                stop()  # the old server's threads must not outlive it holding the old cache
                spec = KVCacheSpec(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
                cache = PagedKVCache(spec, blocks * at_once, ("bfloat16",) * layout.num_layers, device)
                receiver = KVReceiver(layout, CacheSink(cache), max_chunk_bytes=256 * MiB)
                server, port = start_server([kv_transfer_handler(receiver)], "127.0.0.1:0", security)
                receiver.enable_bulk("127.0.0.1")
                if cache.device.type == "cuda":
                    receiver.enable_cuda_ipc(IpcPool(cache.device, ipc_bytes, num_segments=max(2, at_once)))
                current = (server, receiver)
                conn.send(port)
            elif cmd == "expect" and current is not None:  # one push, or several at once into other blocks
                rids, nblocks = args
                event.clear()
                outcomes.clear()
                for i, rid in enumerate(rids):
                    current[1].expect(rid, list(range(i * nblocks, (i + 1) * nblocks)), on_done, 120)
                conn.send("ok")
            elif cmd == "wait":  # for every push expected last
                want = args[0] if args else 1
                deadline = time.monotonic() + 120
                while len(outcomes) < want and event.wait(max(0.0, deadline - time.monotonic())):
                    event.clear()
                failed = [o for o in outcomes if not o.ok]
                conn.send((False, failed[0].error) if failed else (True, None) if len(outcomes) >= want else
                          (False, f"{len(outcomes)} of {want} outcomes within 120 s"))
            elif cmd == "stop":
                break
    finally:
        stop()


def codec_figures(device: torch.device, nbytes: int, repeats: int, copy_gbps: float) -> list[GpuFigure]:
    """Each fused codec's encode and decode of ``nbytes`` of bf16 cache, by block index; then the device checksum
    over ``nbytes``."""
    from kvtransfer.codecs import Kind, get_codec
    from kvtransfer.codecs.fused import decode_blocks, encode_blocks
    from kvtransfer.device_checksum import device_checksum

    bs, h, d = 16, 8, 128
    n = nbytes // (bs * h * d * 2)
    cache = torch.randn(n, bs, h, d, device=device).to(torch.bfloat16)
    dest = torch.empty_like(cache)
    ids = torch.randperm(n, device=device)  # scattered blocks, as a request's are
    out = []
    for name in ("int8", "fp8", "int4", "bf16"):
        c = get_codec(name)
        payload = torch.empty(c.payload_nbytes((n, bs, h, d), Kind.VALUE), dtype=torch.uint8, device=device)
        enc = encode_blocks(c, cache, ids, Kind.VALUE, payload)
        decode_blocks(c, enc, dest, ids)
        t_enc = min(timed(lambda: encode_blocks(c, cache, ids, Kind.VALUE, payload), device) for _ in range(repeats))
        t_dec = min(timed(lambda: decode_blocks(c, enc, dest, ids), device) for _ in range(repeats))
        out.append(GpuFigure(f"{name} encode (by block index)", nbytes / t_enc / 1e9, "GB/s logical",
                             "device copy", copy_gbps))
        out.append(GpuFigure(f"{name} decode (into blocks)", nbytes / t_dec / 1e9, "GB/s logical",
                             "device copy", copy_gbps))
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)  # as cuda_ipc checks a chunk's bytes
    device_checksum(data)
    t_sum = min(timed(lambda: device_checksum(data), device) for _ in range(repeats))
    out.append(GpuFigure("device checksum (cuda_ipc chunks)", nbytes / t_sum / 1e9, "GB/s", "device copy", copy_gbps))
    return out


def _push(sender: KVSender, target: str, layout: KVLayout, tokens: int, keys: list[torch.Tensor],
          values: list[torch.Tensor], rx: ReceiverProcess, rid: str, at_once: int = 1) -> float:
    """Seconds from opening the stream to the receiver's ack; ``at_once`` pushes of the same cache, each
    from its own thread into its own blocks, until the last ack."""
    rids = [f"{rid}-{i}" for i in range(at_once)]
    assert rx.call("expect", rids, layout.blocks_for(tokens)) == "ok"

    def one(request_id: str) -> None:
        stream = sender.open_stream(target, request_id, layout, tokens, timeout_s=120)
        for layer in range(layout.num_layers):
            stream.send_layer(layer, 0, keys[layer], values[layer])
        stream.finish(0)

    pool = ThreadPoolExecutor(max_workers=at_once) if at_once > 1 else None  # one push: on this thread
    synchronize(keys[0].device)
    start = time.perf_counter()
    if pool is None:
        one(rids[0])
    else:
        with pool:
            for f in [pool.submit(one, r) for r in rids]:
                f.result()
    elapsed = time.perf_counter() - start
    ok, error = rx.call("wait", at_once)
    if not ok:
        raise RuntimeError(f"push failed: {error}")
    return elapsed


@dataclass(frozen=True)
class Sizes:
    """What the run moves; ``CUDA`` is the benchmark's, a test's are smaller."""
    codec_bytes: int = 128 * MiB
    push_layers: int = 16
    push_tokens: int = 4096
    pushes: tuple[tuple[str, TransportChoice], ...] = (("bf16", "cuda_ipc"), ("int8", "tcp"))
    in_flight: int = 2  # pushes at once for the steady-state figure
    ttft_tokens: int = 4096
    ttft_preset: str = "1b"
    ttft_transports: tuple[TransportChoice, ...] = ("grpc", "tcp", "shm", "cuda_ipc")


CUDA = Sizes()


def push_figures(rx: ReceiverProcess, token: str, repeats: int, copy_gbps: float, device: torch.device,
                 sizes: Sizes = CUDA) -> list[GpuFigure]:
    """By default a 256 MiB cache (16 layers, 8 kv heads of 128, 4,096 tokens) in the device's memory: bf16
    over cuda_ipc against the device copy; int8 over tcp against a raw TCP socket (any transport but cuda_ipc
    is measured against the socket). Each is followed by the time of a one-block push over the same path (what
    every push pays whatever its size), beside the big push's time, the big push's rate past that time, and
    the aggregate rate of ``sizes.in_flight`` big pushes at once, each from its own thread into its own blocks."""
    layers, h, d, tokens, bs = sizes.push_layers, 8, 128, sizes.push_tokens, 16
    blocks = tokens // bs
    logical = layers * blocks * bs * h * d * 2 * 2
    g = torch.Generator(device=device).manual_seed(0)
    keys = [torch.randn(blocks, bs, h, d, device=device, generator=g).to(torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(blocks, bs, h, d, device=device, generator=g).to(torch.bfloat16) for _ in range(layers)]
    socket = references.tcp_socket(logical, repeats=repeats).gbps
    out = []
    for codec, transport in sizes.pushes:
        ref, ref_gbps = ("device copy", copy_gbps) if transport == "cuda_ipc" else ("tcp socket (logical bytes)",
                                                                                     socket)
        layout = KVLayout(layers, h, d, bs, (codec,) * layers, "bench", "bfloat16")
        port = rx.call("setup", layout, blocks, logical + 64 * MiB, str(device), sizes.in_flight)
        sender = KVSender(TransferSecurity(token=token), transport=transport, device=str(device),
                          stream_budget_bytes=256 * MiB, sender_budget_bytes=1024 * MiB)
        one_k, one_v = [k[:1] for k in keys], [v[:1] for v in values]
        try:
            target = f"127.0.0.1:{port}"
            _push(sender, target, layout, tokens, keys, values, rx, "warm")
            best = min(_push(sender, target, layout, tokens, keys, values, rx, f"r{i}") for i in range(repeats))
            fixed = min(_push(sender, target, layout, bs, one_k, one_v, rx, f"one{i}") for i in range(repeats))
            n = sizes.in_flight
            steady = min(_push(sender, target, layout, tokens, keys, values, rx, f"many{i}", n)
                         for i in range(repeats))
        finally:
            sender.close()
        out.append(GpuFigure(f"{logical // MiB} MiB cache, {codec} over {transport}", logical / best / 1e9,
                             "GB/s logical", ref, ref_gbps))
        # what a push costs whatever its size (RPCs, a chunk per layer): beside the big push's time
        out.append(GpuFigure(f"1-block cache, {codec} over {transport}", fixed * 1e3, "ms",
                             f"the {logical // MiB} MiB push", best * 1e3, higher_is_better=False))
        if best > fixed:  # the rate the data alone moves at, once the fixed cost is paid: what kernels can change
            out.append(GpuFigure(f"{logical // MiB} MiB cache, {codec} over {transport}, past the fixed cost",
                                 logical / (best - fixed) / 1e9, "GB/s logical", ref, ref_gbps))
        # steady state: one push's fixed cost overlaps the others' data
        out.append(GpuFigure(f"{logical // MiB} MiB cache, {codec} over {transport}, {n} pushes at once",
                             n * logical / steady / 1e9, "GB/s logical", ref, ref_gbps))
    return out


def ttft_figures(rx: ReceiverProcess, token: str, repeats: int, codec: str, device: torch.device,
                 sizes: Sizes = CUDA) -> list[GpuFigure]:
    """TTFT of a ``sizes.ttft_tokens`` prompt with layer-wise streaming until the receiver holds the whole
    cache, per transport, against the same prefill alone."""
    from workers.prefill.kv_stream import LayerStreamer
    from workers.runtime.engine import Engine, EngineConfig
    from workers.runtime.model import DecoderModel
    from workers.runtime.presets import PRESETS
    from workers.runtime.sampler import SamplingParams

    tokens = sizes.ttft_tokens
    cfg = PRESETS[sizes.ttft_preset].config(1, (2,))
    # room for the prompt and its one sampled token, whatever the preset's default length
    cfg = replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, tokens + 1))
    torch.manual_seed(0)
    model = DecoderModel(cfg, torch.bfloat16, str(device))
    engine = Engine(model, None, EngineConfig(dtype="bfloat16", device=str(device), prefill_chunk_size=tokens,
                                              max_num_batched_tokens=tokens, kv_cache_bytes=512 * MiB,
                                              prefix_caching=False))  # runs repeat one prompt: compute it all
    prompt = torch.randint(10, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill_alone() -> float:
        synchronize(device)
        start = time.perf_counter()
        engine.add_request("alone", prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    prefill_alone()
    alone = min(prefill_alone() for _ in range(repeats))
    out = []
    for transport in sizes.ttft_transports:
        sender = KVSender(TransferSecurity(token=token), transport=transport, device=str(device))
        streamer = LayerStreamer(engine, sender, (codec,) * cfg.num_layers)
        blocks = engine.cache.blocks_for(tokens)
        port = rx.call("setup", streamer.layout, blocks, 512 * MiB, str(device))
        target = f"127.0.0.1:{port}"

        def streamed(i: int) -> float:
            rid = f"ttft-{transport}-{i}"
            assert rx.call("expect", [rid], blocks) == "ok"
            synchronize(device)
            start = time.perf_counter()
            streamer.start(rid, target, tokens, timeout_s=120)
            engine.add_request(rid, prompt, params)
            first = 0
            while engine.has_unfinished():
                for o in engine.step():
                    first = o.new_token_ids[0]
            streamer.finish(rid, first)
            elapsed = time.perf_counter() - start
            ok, error = rx.call("wait")
            if not ok:
                raise RuntimeError(error)
            return elapsed

        streamed(-1)
        with_kv = min(streamed(i) for i in range(repeats))
        streamer.close()  # the next transport's streamer is the engine's only hook
        sender.close()
        out.append(GpuFigure(f"TTFT {tokens}-token prompt ({sizes.ttft_preset}), {codec} over {transport}",
                             with_kv * 1e3, "ms",
                             "prefill alone", alone * 1e3, higher_is_better=False))
    return out


def run(args: argparse.Namespace) -> int:
    """``epd bench kv --device cuda``: every figure at the benchmark's sizes (rc 1 if a section failed)."""
    if not torch.cuda.is_available():
        raise SystemExit("epd bench kv --device cuda: no CUDA device is visible here")
    return run_on(torch.device("cuda"), max(1, args.repeats), args.ttft_codec, args.json)


def run_on(device: torch.device, repeats: int, ttft_codec: str, json_path: Path | None,
           sizes: Sizes = CUDA) -> int:
    """All figures; a section that fails is reported by name, with its traceback, and the others still run
    (rc 1)."""
    token = secrets.token_urlsafe(24)
    copy_gbps = copy_rate(device, min(256 * MiB, sizes.codec_bytes * 2)) / 1e9
    print(f"device copy: {copy_gbps:.0f} GB/s one way")
    # Each section's figures print as soon as it ends (flushed): a run stopped at a time limit keeps them.
    print(f"{'figure':<58}{'value':>10}  {'reference':<28}{'ref':>9}{'ratio':>10}", flush=True)
    figures: list[GpuFigure] = []
    failed: list[str] = []

    def section(name: str, fn: Callable[[], list[GpuFigure]]) -> None:
        try:
            got = fn()
        except Exception as exc:  # a bench run reports every section it can
            traceback.print_exc()
            failed.append(f"{name}: {exc!r}")
            print(f"FAILED {name}: {exc!r}", flush=True)
            return
        figures.extend(got)
        for f in got:
            print(f"{f.name:<58}{f.value:9.1f} {f.unit.split()[0]:<3} {f.reference:<28}{f.ref_value:9.1f}"
                  f"{f.ratio:9.3f}x", flush=True)

    section("codec kernels", lambda: codec_figures(device, sizes.codec_bytes, repeats, copy_gbps))
    rx = ReceiverProcess(token, _receiver_main)
    try:
        section("pushes", lambda: push_figures(rx, token, repeats, copy_gbps, device, sizes))
        section("TTFT", lambda: ttft_figures(rx, token, repeats, ttft_codec, device, sizes))
    finally:
        rx.close()
    if json_path:
        Path(json_path).write_text(json.dumps({"device_copy_gbps": copy_gbps,
                                               "figures": [asdict(f) | {"ratio": f.ratio} for f in figures],
                                               "failed": failed}, indent=2))
    return 1 if failed else 0
