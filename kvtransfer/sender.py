"""The sending end of KV pushes (runs on the prefill worker): ``KVSender`` holds what its streams share
(gRPC channels, bulk TCP connections, shared-memory segments, encoder threads, pooled buffers and the
sender-wide byte budget), picks each push's transport and opens its ``KVStream`` (kvtransfer.stream).

Transports: shared memory on the same host, else gRPC bytes; or the bulk TCP connection when configured
(kvtransfer.bulk). A shared-memory push sends its control messages (handshake, chunk offsets, finish)
over the bulk TCP connection too when the receiver has one, and over the gRPC Push stream otherwise.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc

from kvtransfer.auth import ChannelCache, TransferSecurity
from kvtransfer.budget import ByteBudget
from kvtransfer.bulk import BulkConnector
from kvtransfer.codecs import native
from kvtransfer.errors import TransferFailed
from kvtransfer.layout import KVLayout
from kvtransfer.memory import BufferPool, retain_freed_buffers
from kvtransfer.shm import SegmentPool, reap_orphans, shm_available
from kvtransfer.staging import PinnedPool
from kvtransfer.stream import KVStream
from kvtransfer.threads import single_threaded_torch

TransportChoice = Literal["auto", "grpc", "shm", "tcp"]
log = logging.getLogger(__name__)
# A receiver that could not give a shared-memory push a bulk connection for its control messages (no
# listener, say) is asked again after this long; meanwhile its shm pushes use the gRPC Push stream.
BULK_RETRY_S = 60.0


def is_local_target(target: str) -> bool:
    """True when ``target`` (host:port or unix:path) is on this host's loopback."""
    if target.startswith("unix:"):
        return True
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KVSender:
    """Opens KV streams; one per prefill worker. Channels are cached per target and reused."""

    def __init__(self, security: TransferSecurity, *, stream_budget_bytes: int = 64 * 2**20,
                 sender_budget_bytes: int = 512 * 2**20, max_chunk_bytes: int = 4 * 2**20,
                 shm_chunk_bytes: int = 16 * 2**20,
                 transport: TransportChoice = "auto", encode_threads: int = 2,
                 bulk_chunk_bytes: int = 8 * 2**20, inline_build_bytes: int = 512 * 2**10) -> None:
        self.security = security
        self.stream_budget_bytes = stream_budget_bytes
        self.max_chunk_bytes = max_chunk_bytes
        # Shared memory has no message to size, only a control round trip per chunk: bigger is cheaper.
        self.shm_chunk_bytes = shm_chunk_bytes
        self.bulk_chunk_bytes = bulk_chunk_bytes  # bigger than gRPC's: no message to copy, fewer headers
        # A chunk of at most this many input bytes is encoded by the thread that sends it, when its
        # turn comes: for a small chunk, the hand-off to an encoder thread and back costs more than
        # the encoding (64 one-block layers: 20 -> 12 ms a push here).
        self.inline_build_bytes = inline_build_bytes
        self.transport = transport
        # The bulk TCP connection carries tcp pushes, and the control messages of shm pushes (auto picks shm
        # on the same host); TLS under mTLS.
        self.bulk = BulkConnector(ssl_context=security.ssl_context(server_side=False) if transport != "grpc" else None,
                                  server_name=security.tls_server_name)
        self._no_bulk: dict[str, float] = {}  # target -> when to offer a shm push's control to its bulk port again
        self._budget = ByteBudget(sender_budget_bytes)
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

    def choose_transport(self, target: str) -> str:
        if self.transport == "grpc":
            return "grpc"
        if self.transport in ("shm", "tcp"):
            return self.transport
        return "shm" if is_local_target(target) and shm_available() else "grpc"

    def bulk_control_usable(self, target: str) -> bool:
        """Whether a shm push to ``target`` should ask for a bulk connection for its control messages."""
        if target.startswith(("unix:", "unix-abstract:")):
            return False
        until = self._no_bulk.get(target)
        return until is None or time.monotonic() >= until

    def bulk_control_failed(self, target: str, error: TransferFailed) -> None:
        """``target`` gave a shm push no bulk connection: use gRPC for its control for ``BULK_RETRY_S``."""
        if target not in self._no_bulk:
            log.warning("KV receiver %s gave no bulk TCP connection (%s); shared-memory pushes to it carry "
                        "their control on gRPC (slower per push) and ask again in %.0f s", target, error.message,
                        BULK_RETRY_S)
        self._no_bulk[target] = time.monotonic() + BULK_RETRY_S

    def open_stream(self, target: str, request_id: str, layout: KVLayout, num_tokens: int,
                    timeout_s: float = 30.0) -> KVStream:
        return KVStream(self, target, request_id, layout, num_tokens, timeout_s, self.choose_transport(target))
