"""``epd bench kv``: KV-transfer throughput and time to first token, beside the wire's own ceilings.

Everything runs on loopback in one run: a receiver process (KVReceiver + gRPC server + a paged
cache) and this process as the sender. Figures:
  references   copy into a preallocated buffer, a raw TCP socket, a raw-bytes gRPC stream (4 MiB
               messages), a protobuf-bytes gRPC stream; measured before and after the transfers,
               the faster of the two kept;
  transfers    one push of a whole cache per codec and transport (gRPC bytes, the bulk TCP
               connection beside gRPC, shared memory): the demo model's 4k-token cache
               and a 256 MiB synthetic one. "Logical" GB/s counts bf16-equivalent bytes landed in
               the receiver's cache per second, encoding and decoding included. The cache is bf16,
               except for "kept int8": an int8 cache that stores the received bytes as they are
               (``decode_store: native``);
  paired       int8 for the 256 MiB cache, each push paired with its reference moving the same bytes
               right after (or before) it: over tcp (kept, and into a bf16 cache) with a TCP socket
               transfer, over shared memory (kept) with a memcpy. The median of the pairs' ratios,
               which the machine's drift between minutes moves far less than a best-of against a
               best-of;
  fixed cost   the median time of a push of one block per layer (16 layers, and 1), bf16 over each
               transport: what every push pays whatever its size (RPCs, a message per layer, the ack),
               against a one-byte TCP round trip between two processes;
  TTFT         a 2k-token prompt: prefill alone, and prefill streaming its KV layer by layer until
               the decode side holds all of it (what decode waits for before its first step).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench import kv_references as references
from kvtransfer.auth import TransferSecurity
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender, TransportChoice

MiB = 2**20


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    block_size: int = 16

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def logical_bytes(self) -> int:  # bf16 keys + values, all layers
        return self.layers * self.blocks * self.block_size * self.kv_heads * self.head_dim * 2 * 2


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    reference: str
    ref_value: float

    @property
    def ratio(self) -> float:
        return self.value / self.ref_value if self.ref_value else float("nan")


# ---------------------------------------------------------------- the receiver process
def _receiver_main(conn: Connection, token: str) -> None:
    from kvtransfer.receiver import KVReceiver, TransferOutcome
    from kvtransfer.server import kv_transfer_handler, start_server
    from workers.decode.kv_sink import CacheSink
    from workers.runtime.kv_cache import KVCacheSpec, PagedKVCache

    torch.set_num_threads(1)
    security = TransferSecurity(token=token)
    active: tuple[Any, KVReceiver] | None = None  # the gRPC server and the receiver it serves
    done: dict[str, TransferOutcome] = {}
    event = threading.Event()

    def finished(outcome: TransferOutcome) -> None:
        done["o"] = outcome
        event.set()

    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "setup":
                layout, cache_dtype, blocks = args
                if active is not None:
                    active[0].stop(0).wait(10)  # its threads must not outlive it holding the old cache
                    active[1].stop()
                spec = KVCacheSpec(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
                cache = PagedKVCache(spec, blocks, (cache_dtype,) * layout.num_layers)
                for storage in cache.layers:  # touch every page now, not during the timed push
                    for t in storage.pool_tensors():
                        t.view(torch.uint8).fill_(0)
                receiver = KVReceiver(layout, CacheSink(cache), max_chunk_bytes=256 * MiB)
                server, port = start_server([kv_transfer_handler(receiver)], "127.0.0.1:0", security)
                active = (server, receiver)
                receiver.enable_bulk("127.0.0.1")
                conn.send(port)
            elif cmd == "expect":
                rid, nblocks = args
                event.clear()
                assert active is not None, "expect before setup"
                active[1].expect(rid, list(range(nblocks)), finished, 120)
                conn.send("ok")
            elif cmd == "wait":
                event.wait(120)
                o = done["o"]
                conn.send((o.ok, o.error))
            elif cmd == "stop":
                break
    finally:
        if active is not None:
            active[0].stop(0).wait(10)
            active[1].stop()


class ReceiverProcess:
    """The receiving worker in a spawned process, driven by (command, *args) messages over a pipe;
    ``main(conn, token)`` serves them (this module's receiver by default)."""

    def __init__(self, token: str, main: Callable[[Connection, str], None] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main or _receiver_main, args=(child, token), daemon=True)
        self.proc.start()

    def call(self, *msg: object) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(180):
            raise RuntimeError(f"receiver did not answer {msg[0]}")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _push_once(sender: KVSender, target: str, layout: KVLayout, shape: Shape, keys: list[torch.Tensor],
               values: list[torch.Tensor], rx: ReceiverProcess, rid: str) -> float:
    """Seconds from opening the stream to the receiver's ack, all layers sent as soon as possible."""
    assert rx.call("expect", rid, shape.blocks) == "ok"
    start = time.perf_counter()
    stream = sender.open_stream(target, rid, layout, shape.tokens, timeout_s=120)
    for layer in range(shape.layers):
        stream.send_layer(layer, 0, keys[layer], values[layer])
    stream.finish(0)
    elapsed = time.perf_counter() - start
    ok, error = rx.call("wait")
    if not ok:
        raise RuntimeError(f"push failed: {error}")
    return elapsed


def random_cache(shape: Shape) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A bf16 cache of ``shape`` (keys, values per layer), the same on every run."""
    g = torch.Generator().manual_seed(0)
    dims = (shape.blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    keys = [torch.randn(*dims, generator=g).to(torch.bfloat16) for _ in range(shape.layers)]
    values = [torch.randn(*dims, generator=g).to(torch.bfloat16) for _ in range(shape.layers)]
    return keys, values


def transfer_figures(shape: Shape, codecs: list[tuple[str, TransportChoice, str, str]], rx: ReceiverProcess, token: str,
                     repeats: int, refs: dict[str, references.Measurement]) -> list[Figure]:
    """One Figure per (codec, transport, reference name, decode storage) for a cache of ``shape``.
    Storage ``dequantize``: the receiver's cache is bf16 (a decode worker's default); ``native``: the
    cache keeps the codec's own dtype (``decode_store: native``), so nothing is decoded on arrival."""
    keys, values = random_cache(shape)
    out = []
    for codec, transport, ref, store in codecs:
        layout = KVLayout(shape.layers, shape.kv_heads, shape.head_dim, shape.block_size, (codec,) * shape.layers,
                          "bench", "bfloat16")
        port = rx.call("setup", layout, codec if store == "native" else "bfloat16", shape.blocks)
        sender = KVSender(TransferSecurity(token=token), transport=transport,
                          stream_budget_bytes=256 * MiB, sender_budget_bytes=1024 * MiB)
        try:
            target = f"127.0.0.1:{port}"
            _push_once(sender, target, layout, shape, keys, values, rx, "warm")
            best = min(_push_once(sender, target, layout, shape, keys, values, rx, f"r{i}") for i in range(repeats))
        finally:
            sender.close()
        kept = f", kept {codec}" if store == "native" else ""
        out.append(Figure(f"{shape.name}: {codec} over {transport}{kept}", shape.logical_bytes / best / 1e9,
                          "GB/s logical", ref, refs[ref].gbps))
    return out


ROUND_TRIP = "tcp round trip"  # the fixed-cost figures' reference


def fixed_cost_figures(rx: ReceiverProcess, token: str, pushes: int, round_trip_s: float) -> list[Figure]:
    """The median of ``pushes`` pushes of one block per layer (16 layers, then 1), bf16 into a bf16 cache,
    per transport, in ms, against ``round_trip_s``."""
    out = []
    for layers in (16, 1):
        shape = Shape(f"1-block cache, {layers} layer{'s' if layers > 1 else ''}", layers=layers, kv_heads=8,
                      head_dim=128, tokens=16)
        keys, values = random_cache(shape)
        layout = KVLayout(layers, shape.kv_heads, shape.head_dim, shape.block_size, ("bf16",) * layers, "bench",
                          "bfloat16")
        port = rx.call("setup", layout, "bfloat16", shape.blocks)  # one receiver takes every transport
        for transport in ("grpc", "tcp", "shm"):
            sender = KVSender(TransferSecurity(token=token), transport=transport)
            try:
                target = f"127.0.0.1:{port}"
                for i in range(3):  # connections, mappings and code paths warmed up
                    _push_once(sender, target, layout, shape, keys, values, rx, f"w{i}")
                times = [_push_once(sender, target, layout, shape, keys, values, rx, f"r{i}") for i in range(pushes)]
            finally:
                sender.close()
            out.append(Figure(f"{shape.name}: bf16 over {transport}", statistics.median(times) * 1e3, "ms",
                              ROUND_TRIP, round_trip_s * 1e3))
    return out


@dataclass
class Paired:
    name: str
    ratios: list[float]  # per pair: the socket's time / the push's time (logical GB/s over the socket's)

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)


def paired_figures(shape: Shape, rx: ReceiverProcess, token: str, pairs: int) -> list[Paired]:
    """int8 pushes, each paired with its reference moving the same logical bytes, the order alternating
    from pair to pair: over tcp into an int8 cache (kept) and a bf16 cache against a raw TCP socket;
    over shared memory into an int8 cache against a memcpy."""
    print(f"paired: {pairs} pushes of int8 per cache and transport, each beside its reference (a TCP socket; "
          "memcpy for shared memory) ...", flush=True)
    keys, values = random_cache(shape)
    layout = KVLayout(shape.layers, shape.kv_heads, shape.head_dim, shape.block_size, ("int8",) * shape.layers,
                      "bench", "bfloat16")

    def socket_s() -> float:
        return references.tcp_socket(shape.logical_bytes, repeats=1).seconds

    def memcpy_s() -> float:
        return references.memcpy(shape.logical_bytes, repeats=1).seconds

    out = []
    runs: list[tuple[TransportChoice, str, str, Callable[[], float]]] = [
        ("tcp", "native", "kept int8", socket_s), ("tcp", "dequantize", "bf16 cache", socket_s),
        ("shm", "native", "kept int8", memcpy_s)]
    for transport, store, label, reference in runs:
        port = rx.call("setup", layout, "int8" if store == "native" else "bfloat16", shape.blocks)
        sender = KVSender(TransferSecurity(token=token), transport=transport,
                          stream_budget_bytes=256 * MiB, sender_budget_bytes=1024 * MiB)
        ratios = []
        try:
            target = f"127.0.0.1:{port}"
            _push_once(sender, target, layout, shape, keys, values, rx, "paired-warm")
            for i in range(pairs):
                def push() -> float:
                    return _push_once(sender, target, layout, shape, keys, values, rx,
                                      f"paired-{transport}-{store}-{i}")

                if i % 2 == 0:
                    p_s, r_s = push(), reference()
                else:
                    r_s, p_s = reference(), push()
                ratios.append(r_s / p_s)
        finally:
            sender.close()
        out.append(Paired(f"{shape.name}: int8 over {transport}, {label}", ratios))
    return out


def ttft_figure(rx: ReceiverProcess, token: str, tokens: int, repeats: int, codec: str) -> list[Figure]:
    from workers.prefill.kv_stream import LayerStreamer
    from workers.runtime.default_model import ensure_default_checkpoint
    from workers.runtime.engine import Engine, EngineConfig
    from workers.runtime.loader import load_model
    from workers.runtime.sampler import SamplingParams

    bundle = load_model(ensure_default_checkpoint(), with_vision=False)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(prefill_chunk_size=tokens,  # runs repeat one prompt:
                                                                 max_num_batched_tokens=tokens,  # compute it all
                                                                 prefix_caching=False))
    prompt = torch.randint(10, bundle.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill_alone() -> float:
        start = time.perf_counter()
        engine.add_request("alone", prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    sender = KVSender(TransferSecurity(token=token), transport="auto")
    streamer = LayerStreamer(engine, sender, (codec,) * bundle.config.num_layers)
    port = rx.call("setup", streamer.layout, "float32", engine.cache.blocks_for(tokens))
    target = f"127.0.0.1:{port}"

    def streamed(i: int) -> float:
        rid = f"ttft-{i}"
        assert rx.call("expect", rid, engine.cache.blocks_for(tokens)) == "ok"
        start = time.perf_counter()
        streamer.start(rid, target, tokens, timeout_s=120)
        engine.add_request(rid, prompt, params)
        first = 0
        while engine.has_unfinished():
            for out in engine.step():
                first = out.new_token_ids[0]
        streamer.finish(rid, first)
        elapsed = time.perf_counter() - start
        ok, error = rx.call("wait")
        if not ok:
            raise RuntimeError(error)
        return elapsed

    prefill_alone()
    streamed(-1)
    alone = min(prefill_alone() for _ in range(repeats))
    with_kv = min(streamed(i) for i in range(repeats))
    streamer.close()
    sender.close()
    transport = sender.choose_transport(target)
    return [Figure(f"TTFT {tokens}-token prompt, {codec} over {transport}", with_kv * 1e3, "ms",
                   "prefill compute alone", alone * 1e3)]


def measure_references(nbytes: int, repeats: int) -> dict[str, references.Measurement]:
    return {m.name: m for m in (references.memcpy(nbytes, repeats),
                                references.tcp_socket(nbytes, repeats=repeats),
                                references.grpc_raw_stream(nbytes, repeats=repeats),
                                references.grpc_proto_bytes_stream(nbytes, repeats=repeats))}


def best_of(a: dict[str, references.Measurement],
            b: dict[str, references.Measurement]) -> dict[str, references.Measurement]:
    """Per reference, the faster of two measurements (the ceiling the figures are held to)."""
    return {name: max(m, b.get(name, m), key=lambda x: x.gbps) for name, m in a.items()}


def _run_paired_only(shape: Shape, token: str, pairs: int, json_path: Path | None) -> int:
    rx = ReceiverProcess(token)
    try:
        paired = paired_figures(shape, rx, token, pairs)
    finally:
        rx.close()
    _print_paired(paired)
    if json_path:
        Path(json_path).write_text(json.dumps({"paired": [asdict(pf) | {"median": pf.median} for pf in paired]},
                                              indent=2))
    return 0


def _print_paired(paired: list[Paired]) -> None:
    print()
    print(f"{'paired with its reference, same bytes, same pair':<46}{'median':>8}  [min-max] over pairs")
    for pf in paired:
        print(f"{pf.name:<46}{pf.median:7.2f}x  [{min(pf.ratios):.2f}-{max(pf.ratios):.2f}] over {len(pf.ratios)}")


def run(args: argparse.Namespace) -> int:
    pairs = (0 if args.quick else 8) if args.paired is None else args.paired  # flags checked by bench.cli
    if args.threads:
        torch.set_num_threads(args.threads)
    token = secrets.token_urlsafe(24)
    demo = Shape("demo 4k-token cache", layers=4, kv_heads=4, head_dim=64, tokens=4096)
    synthetic = Shape("synthetic 256 MiB", layers=16, kv_heads=8, head_dim=128, tokens=4096)
    shapes = [demo] if args.quick else [demo, synthetic]
    if args.paired_only:
        return _run_paired_only(shapes[-1], token, pairs or 8, args.json)
    ref_bytes = 64 * MiB if args.quick else 256 * MiB
    print(f"references ({ref_bytes // MiB} MiB, best of {args.repeats}, before and after the transfers) ...",
          flush=True)
    refs = measure_references(ref_bytes, args.repeats)
    names = {k.split(" ")[0]: k for k in refs}
    memcpy, tcp, grpc_raw = names["memcpy"], names["tcp"], [k for k in refs if "raw" in k][0]
    d, n = "dequantize", "native"  # the receiver's cache: bf16, or the codec's own dtype
    plan: list[tuple[str, TransportChoice, str, str]] = [
        ("bf16", "grpc", grpc_raw, d), ("int8", "grpc", tcp, d), ("fp8", "grpc", tcp, d), ("int4", "grpc", tcp, d),
        ("bf16", "tcp", grpc_raw, d), ("int8", "tcp", tcp, d), ("int8", "tcp", tcp, n),
        ("bf16", "shm", memcpy, d), ("int8", "shm", memcpy, d), ("int8", "shm", memcpy, n)]
    rx = ReceiverProcess(token)
    figures: list[Figure] = []
    paired: list[Paired] = []
    try:
        for shape in shapes:
            print(f"{shape.name}: {shape.logical_bytes / MiB:.0f} MiB logical ...", flush=True)
            figures += transfer_figures(shape, plan, rx, token, args.repeats, refs)
        if pairs > 0:
            paired = paired_figures(shapes[-1], rx, token, pairs)
        print("fixed cost of a push ...", flush=True)
        round_trip = references.tcp_round_trip()
        figures += fixed_cost_figures(rx, token, 10 if args.quick else 40, round_trip)
        print("TTFT ...", flush=True)
        figures += ttft_figure(rx, token, args.ttft_tokens, args.repeats, args.ttft_codec)
    finally:
        rx.close()
    # Measured again after the transfers, keeping each reference's best: on a shared machine a
    # reference caught in a busy moment would flatter every ratio computed against it.
    refs = best_of(refs, measure_references(ref_bytes, args.repeats))
    for f in figures:
        if f.reference in refs:
            f.ref_value = refs[f.reference].gbps
    print()
    print(f"{'reference':<34}{'GB/s':>8}")
    for m in refs.values():
        print(f"{m.name:<34}{m.gbps:8.2f}")
    print(f"{ROUND_TRIP:<34}{round_trip * 1e3:8.3f} ms")
    print()
    print(f"{'figure':<46}{'value':>12}  {'reference':<30}{'ref':>9}{'ratio':>10}")
    for f in figures:  # (a latency's reference is a round trip of hundredths of a ms: 4 significant digits)
        print(f"{f.name:<46}{f.value:9.2f} {f.unit.split()[0]:<3} {f.reference:<30}{f.ref_value:9.4g}{f.ratio:9.2f}x")
    if paired:
        _print_paired(paired)
    if args.json:
        Path(args.json).write_text(json.dumps({"references": {k: m.gbps for k, m in refs.items()},
                                               "latency_references_ms": {ROUND_TRIP: round_trip * 1e3},
                                               "figures": [asdict(f) | {"ratio": f.ratio} for f in figures],
                                               "paired": [asdict(pf) | {"median": pf.median} for pf in paired]},
                                              indent=2))
    return 0
