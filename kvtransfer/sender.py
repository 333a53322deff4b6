"""The sending end of KV pushes (runs on the prefill worker): ``KVSender`` holds what its streams share
(gRPC channels, bulk TCP connections, shared-memory segments, encoder threads, pooled buffers and the
sender-wide byte budget), picks each push's transport and opens its ``KVStream`` (kvtransfer.stream), handing it only a
``StreamContext`` (kvtransfer.stream_context): the stream never sees the sender.

Transports: shared memory on the same host, else gRPC bytes; or the bulk TCP connection when configured
(kvtransfer.bulk). A shared-memory push sends its control messages (handshake, chunk offsets, finish)
over the bulk TCP connection too when the receiver has one, and over the gRPC Push stream otherwise.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import torch

from kvtransfer.auth import ChannelCache, TransferSecurity
from kvtransfer.budget import ByteBudget
from kvtransfer.bulk import BulkConnector
from kvtransfer.codecs import native
from kvtransfer.cuda_ipc import IpcMappings
from kvtransfer.errors import ShmUnusable, TransferFailed
from kvtransfer.layout import KVLayout
from kvtransfer.memory import BufferPool, retain_freed_buffers
from kvtransfer.shm import SegmentPool, reap_orphans, shm_available
from kvtransfer.staging import PinnedPool
from kvtransfer.stream import KVStream
from kvtransfer.stream_context import BulkControl, ChunkSizes, StreamContext
from kvtransfer.threads import single_threaded_torch

log = logging.getLogger(__name__)

# OpenCudaIpc refusals after which ``auto`` falls back: no pool there, none free, or not mappable here.
_NO_IPC = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED)
_THIS_HOST = ""  # shm_control's one key: /dev/shm is this host's, whatever the target
TransportChoice = Literal["auto", "grpc", "shm", "tcp", "cuda_ipc"]


def is_local_target(target: str) -> bool:
    """True when ``target`` (host:port or unix:path) is on this host: its loopback, or an address of this
    host's own (workers in an external Ray cluster bind their node's IP, and two on one node are local)."""
    if target.startswith("unix:"):
        return True
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback or own_address(host)
    except ValueError:
        return False


@functools.lru_cache(maxsize=256)
def own_address(host: str) -> bool:
    """Whether the IP literal ``host`` is an address of this host (its network namespace). A socket binds to
    one only then, unless ``ip_nonlocal_bind`` is on (every address binds; ``auto`` would then pick shared
    memory for a receiver on another host). With it on, a UDP socket is also connected to the address
    (nothing is sent): the kernel routes an address of this host's own from that same address, any other
    from one of this host's. Nothing listens; the sockets close at once."""
    addr = ipaddress.ip_address(host)
    if addr.is_loopback:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        if not _nonlocal_bind(addr.version):
            return True
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            source = probe.getsockname()[0]
    except OSError:  # not this host's, no route there, or no such address family (or socket) here: not local
        return False
    return ipaddress.ip_address(source.split("%", 1)[0]) == addr


def _nonlocal_bind(version: int) -> bool:
    """Whether this network namespace lets a socket bind any address (unknown: assume it does)."""
    try:
        with open(f"/proc/sys/net/ipv{version}/ip_nonlocal_bind") as f:
            return f.read().strip() != "0"
    except OSError:
        return True


class KVSender:
    """Opens KV streams; one per prefill worker. Channels are cached per target and reused."""

    def __init__(self, security: TransferSecurity, *, stream_budget_bytes: int = 64 * 2**20,
                 sender_budget_bytes: int = 512 * 2**20, max_chunk_bytes: int = 4 * 2**20,
                 shm_chunk_bytes: int = 16 * 2**20,
                 transport: TransportChoice = "auto", encode_threads: int = 2,
                 bulk_chunk_bytes: int = 8 * 2**20, inline_build_bytes: int = 512 * 2**10,
                 device: torch.device | str = "cpu", max_timeout_s: float | None = None) -> None:
        """``device``: where the KV cache it sends from lives; ``auto`` picks cuda_ipc for a CUDA cache
        and a receiver on this host that leases a CUDA IPC segment (else shm, else gRPC). ``max_timeout_s``:
        the longest deadline a push gets, whatever its caller asks (the settings' ``transfer.timeout_s``)."""
        self.security = security
        self.max_timeout_s = max_timeout_s
        self.transport = transport
        self.device = torch.device(device)
        # Receivers that leased no CUDA IPC segment (no pool, all in use, another GPU): skipped a while.
        self.ipc_control = BulkControl(what="leased no CUDA IPC segment",
                                       then="its pushes use shared memory or gRPC")
        # The bulk TCP connection carries tcp pushes, and the control messages of shm pushes (auto picks shm
        # on the same host); TLS under mTLS.
        self.bulk = BulkConnector(ssl_context=security.ssl_context(server_side=False) if transport != "grpc" else None,
                                  server_name=security.tls_server_name)
        self.bulk_control = BulkControl()
        # Shared memory this process could not use (/dev/shm full or too small): auto skips it a while.
        self.shm_control = BulkControl(what="could not use shared memory", then="auto's pushes use gRPC",
                                       subject="This KV sender{}")
        self.budget = ByteBudget(sender_budget_bytes)
        self._channels = ChannelCache(security)
        self.host = socket.gethostname()
        self.segments = SegmentPool()
        # Encoding, checksumming and framing are the costly steps; they run here, in parallel across
        # chunks and streams, while gRPC's thread sends in order. Each encoder thread runs torch on
        # itself alone: the pool is the parallelism (kvtransfer.threads).
        self.encoders = ThreadPoolExecutor(max_workers=encode_threads, thread_name_prefix="kv-encode",
                                           initializer=single_threaded_torch)
        retain_freed_buffers()  # each gRPC message is a fresh multi-MiB bytes object (see kvtransfer.memory)
        # Quantised chunks are encoded into pooled buffers (see kvtransfer.memory). The pool holds at
        # most what was in flight at once, which the sender budget bounds (quantised wire bytes are
        # fewer than the input bytes the budget counts).
        self.buffers = BufferPool(max_bytes=sender_budget_bytes)
        # A device cache's encoded chunks land in pinned buffers (kvtransfer.staging), reused the same way.
        self.pinned = PinnedPool(max_bytes=sender_budget_bytes)
        # A chunk of at most inline_build_bytes input bytes is encoded by the thread that sends it, when
        # its turn comes: for a small chunk, the hand-off to an encoder thread and back costs more than
        # the encoding (a push of many one-block layers shows it most).
        self.sizes = ChunkSizes(stream_budget=stream_budget_bytes, grpc=max_chunk_bytes, shm=shm_chunk_bytes,
                                bulk=bulk_chunk_bytes, inline_build=inline_build_bytes)
        self.context = StreamContext(security, self.host, self.sizes, self.budget, self._channels.get, self.bulk,
                                     self.bulk_control, self.segments, self.encoders, self.buffers, self.pinned,
                                     IpcMappings())
        native.load_in_background()
        if transport != "grpc":
            reap_orphans()

    def channel(self, target: str) -> grpc.Channel:
        return self._channels.get(target)

    def close(self) -> None:
        self._channels.close()
        self.segments.close()
        self.bulk.close()
        self.encoders.shutdown(wait=False, cancel_futures=True)
        self.buffers.clear()
        self.pinned.clear()
        self.context.ipc.close()

    def choose_transport(self, target: str, ipc: bool = True) -> str:
        """The transport of the next push to ``target``; ``ipc=False``: not cuda_ipc (auto's fallback)."""
        if self.transport in ("grpc", "shm", "tcp", "cuda_ipc"):
            return self.transport
        local = is_local_target(target)
        if ipc and local and self.device.type == "cuda" and self.ipc_control.usable(target):
            return "cuda_ipc"
        return "shm" if local and shm_available() and self.shm_control.usable(_THIS_HOST) else "grpc"

    def bulk_control_usable(self, target: str) -> bool:
        """Whether a shm push to ``target`` should ask for a bulk connection for its control messages."""
        return self.bulk_control.usable(target)

    def open_stream(self, target: str, request_id: str, layout: KVLayout, num_tokens: int,
                    timeout_s: float = 30.0, cached_blocks: int = 0) -> KVStream:
        transport = self.choose_transport(target)
        if self.max_timeout_s is not None:
            timeout_s = min(timeout_s, self.max_timeout_s)
        while True:  # auto steps down: cuda_ipc, then shm, then grpc (which has nothing to fall back to)
            try:
                return KVStream(self.context, target, request_id, layout, num_tokens, timeout_s, transport,
                                cached_blocks)
            except TransferFailed as exc:
                ipc = transport == "cuda_ipc" and exc.code in _NO_IPC
                if self.transport != "auto" or not (ipc or isinstance(exc, ShmUnusable)):
                    raise
                # CUDA IPC: every segment busy, or this push larger than one (RESOURCE_EXHAUSTED): for this push
                # only; no pool there, or none this process can map: for a while. Shared memory: /dev/shm too
                # small for a segment even empty, for a while; full now, for this push only.
                if isinstance(exc, ShmUnusable):
                    if exc.lasting:
                        self.shm_control.failed(_THIS_HOST, exc)
                    else:
                        log.debug("push %s goes over gRPC: %s", request_id, exc.message)
                elif exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.ipc_control.failed(target, exc)
            following = self.choose_transport(target, ipc=False)
            if following == transport:  # shm full for this push only: on to gRPC, not shm again
                following = "grpc"
            transport = following
