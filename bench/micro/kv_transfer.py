"""``kv-grpc``, ``kv-tcp`` and ``kv-shm``: one whole-cache KV push to a receiver process, against the wire's ceilings.

The receiver is ``epd bench kv``'s: a separate process running a real ``KVReceiver`` behind the real
gRPC server, landing blocks in a paged cache through ``CacheSink``. This process sends with a real
``KVSender``; a push is timed from opening the stream to the receiver's ack. The cache is bf16,
[layers, blocks, 16, heads, dim] (64 MiB: 8 layers x 8 heads x 128 x 2048 tokens; --quick: the demo
model's shape, 4 x 4 x 64 x 4096 tokens, 16 MiB). Figures are logical GB/s: bf16 bytes landed per second.

  kv-grpc  bf16 and int8 over the gRPC byte stream, against ``bench.kv_references``' raw TCP
           socket and raw-bytes gRPC stream moving the same number of bytes (each reference spawns its own
           receiver process, which checks every byte);
  kv-tcp   bf16 and int8 over the bulk TCP connection, no gRPC call per push (kvtransfer.bulk), against
           the same references: int8 against the raw TCP socket it must outrun (issue 3's int8 target),
           bf16 against the raw gRPC stream; ``kv-tcp.int8-kept`` lands int8 in an int8 cache
           (``decode_store: native``: nothing is dequantised on arrival);
  kv-shm   bf16 through shared memory (only control travels, on the bulk connection), against memcpy of the same bytes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import torch

from bench import kv_references as references
from bench.kv_bench import ReceiverProcess, Shape, random_cache
from bench.micro.results import Result
from bench.micro.timing import Plan, paired
from kvtransfer.auth import TransferSecurity
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender, TransportChoice

MiB = 2**20


def _shape(plan: Plan) -> Shape:
    if plan.quick:
        return Shape("demo 4k-token cache", layers=4, kv_heads=4, head_dim=64, tokens=4096)
    return Shape("64 MiB cache", layers=8, kv_heads=8, head_dim=128, tokens=2048)


class _Pusher:
    """One codec and transport to the receiver process: ``push()`` sends the whole cache, returns seconds."""

    def __init__(self, rx: ReceiverProcess, token: str, shape: Shape, codec: str, transport: TransportChoice,
                 cache: tuple[list[torch.Tensor], list[torch.Tensor]], store: str = "dequantize") -> None:
        self.rx, self.shape, self.cache = rx, shape, cache
        self.layout = KVLayout(shape.layers, shape.kv_heads, shape.head_dim, shape.block_size,
                               (codec,) * shape.layers, "bench-micro", "bfloat16")
        port = rx.call("setup", self.layout, codec if store == "native" else "bfloat16", shape.blocks)
        self.target = f"127.0.0.1:{port}"
        self.sender = KVSender(TransferSecurity(token=token), transport=transport,
                               stream_budget_bytes=256 * MiB, sender_budget_bytes=1024 * MiB)
        self.transport = self.sender.choose_transport(self.target)
        self._n = 0

    def push(self) -> float:
        self._n += 1
        rid = f"micro-{self._n}"
        if self.rx.call("expect", rid, self.shape.blocks) != "ok":
            raise RuntimeError("the receiver process did not accept the reservation")
        keys, values = self.cache
        start = time.perf_counter()
        stream = self.sender.open_stream(self.target, rid, self.layout, self.shape.tokens, timeout_s=120)
        for layer in range(self.shape.layers):
            stream.send_layer(layer, 0, keys[layer], values[layer])
        stream.finish(0)
        elapsed = time.perf_counter() - start
        ok, error = self.rx.call("wait")
        if not ok:
            raise RuntimeError(f"push {rid} failed at the receiver: {error}")
        return elapsed

    def close(self) -> None:
        self.sender.close()


Reference = tuple[str, str, Callable[[], float]]  # (name suffix, what it is, seconds of one measurement)


def _results(name: str, benchmark: str, shape: Shape, pusher: _Pusher, refs: list[Reference], plan: Plan,
             ref_inner: int | None) -> list[Result]:
    """One Result per reference; the first one is named ``name``, the others ``name.<suffix>``."""
    pusher.push()  # warm-up: channel, segments, codec paths
    out = []
    for i, (suffix, what, ref) in enumerate(refs):
        figs, ref_secs = paired(pusher.push, ref, plan, ref_inner)
        out.append(Result(name if i == 0 else f"{name}.{suffix}", benchmark, "GB/s", "higher", f"{what}, same bytes",
                          tuple(shape.logical_bytes / s / 1e9 for s in figs),
                          tuple(shape.logical_bytes / s / 1e9 for s in ref_secs),
                          note=f"{shape.name}, {shape.logical_bytes / MiB:.0f} MiB bf16 logical, "
                               f"{pusher.transport} transport"))
    return out


def run_grpc(plan: Plan) -> list[Result]:
    return _run_wire(plan, "grpc", ("bf16", ("grpc", "tcp"), "dequantize"), ("int8", ("grpc",), "dequantize"))


def run_tcp(plan: Plan) -> list[Result]:
    return _run_wire(plan, "tcp", ("int8", ("tcp",), "dequantize"), ("int8", ("tcp",), "native"),
                     ("bf16", ("grpc",), "dequantize"))


def _run_wire(plan: Plan, transport: TransportChoice, *codecs: tuple[str, tuple[str, ...], str]) -> list[Result]:
    """Each (codec, references, decode storage) over ``transport``, against the named references (the
    first gives the figure's name); storage ``native`` keeps the codec's dtype in the receiver's cache."""
    shape = _shape(plan)
    nbytes = shape.logical_bytes
    cache = random_cache(shape)
    token = secrets.token_urlsafe(24)
    # A reference call spawns a receiver and takes the best of `inner` transfers itself.
    refs: dict[str, Reference] = {
        "grpc": ("vs-grpc-raw", "raw gRPC stream",
                 lambda: references.grpc_raw_stream(nbytes, repeats=plan.inner).seconds),
        "tcp": ("vs-tcp", "raw TCP socket", lambda: references.tcp_socket(nbytes, repeats=plan.inner).seconds)}
    rx = ReceiverProcess(token)
    out: list[Result] = []
    try:
        for codec, which, store in codecs:
            pusher = _Pusher(rx, token, shape, codec, transport, cache, store)
            try:
                kept = "-kept" if store == "native" else ""
                out += _results(f"kv-{transport}.{codec}{kept}", f"kv-{transport}", shape, pusher,
                                [refs[w] for w in which], plan, ref_inner=1)
            finally:
                pusher.close()
    finally:
        rx.close()
    return out


def run_shm(plan: Plan) -> list[Result]:
    shape = _shape(plan)
    nbytes = shape.logical_bytes
    cache = random_cache(shape)
    token = secrets.token_urlsafe(24)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(0xA5)
    dst = torch.empty_like(src)
    dst.copy_(src)

    def memcpy() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    rx = ReceiverProcess(token)
    try:
        pusher = _Pusher(rx, token, shape, "bf16", "shm", cache)
        try:
            if pusher.transport != "shm":
                raise RuntimeError("shared memory is not available here (/dev/shm missing or not writable)")
            threads = torch.get_num_threads()
            return _results("kv-shm.bf16", "kv-shm", shape, pusher,
                            [("vs-memcpy", f"memcpy ({threads} thread(s))", memcpy)], plan, None)
        finally:
            pusher.close()
    finally:
        rx.close()
