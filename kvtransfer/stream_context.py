"""What a ``KVStream`` gets from the sender that opens it: a small value, not the sender itself.

``KVSender`` (kvtransfer.sender) owns these resources and hands each stream one ``StreamContext``;
``KVStream`` (kvtransfer.stream) only uses it. So neither module imports the other's class
(sender imports stream, never the reverse), and the sender-wide byte budget is a public field
here rather than a private attribute a stream reaches into.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc

from kvtransfer.auth import TransferSecurity
from kvtransfer.budget import ByteBudget
from kvtransfer.bulk import BulkConnector
from kvtransfer.cuda_ipc import IpcMappings
from kvtransfer.errors import TransferFailed
from kvtransfer.memory import BufferPool
from kvtransfer.shm import SegmentPool
from kvtransfer.staging import PinnedPool

log = logging.getLogger(__name__)
# A receiver that could not give a shared-memory push a bulk connection for its control messages (no
# listener, say) is asked again after this long; meanwhile its shm pushes use the gRPC Push stream.
BULK_RETRY_S = 60.0


@dataclass(frozen=True)
class ChunkSizes:
    """Bytes: per-stream queue bound, and the target size of one chunk on each transport."""

    stream_budget: int
    grpc: int  # one gRPC message
    shm: int  # no message to size, only a control round trip per chunk: bigger is cheaper
    bulk: int  # bulk TCP: no message to copy, fewer headers than gRPC
    inline_build: int  # a chunk this small is encoded by the sending thread itself


class BulkControl:
    """Which receivers give a push an optional path (a bulk connection for a shm or cuda_ipc push's
    control messages; a CUDA IPC segment); one that did not is skipped for ``BULK_RETRY_S`` (the push then
    takes the plain path). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 what: str = "gave no bulk TCP connection", then: str = "shared-memory and CUDA IPC pushes to it "
                 "carry their control on gRPC (slower per push)", subject: str = "KV receiver {}") -> None:
        self._no_bulk: dict[str, float] = {}  # target -> when to ask it again
        self._clock = clock
        self._lock = threading.Lock()
        self._what, self._then, self._subject = what, then, subject

    def usable(self, target: str) -> bool:
        if target.startswith(("unix:", "unix-abstract:")):
            return False
        with self._lock:
            until = self._no_bulk.get(target)
        return until is None or self._clock() >= until

    def failed(self, target: str, error: TransferFailed) -> None:
        with self._lock:
            first = target not in self._no_bulk
            self._no_bulk[target] = self._clock() + BULK_RETRY_S
        if first:
            log.warning("%s %s (%s); %s, and try again in %.0f s", self._subject.format(target), self._what,
                        error.message, self._then, BULK_RETRY_S)


@dataclass(frozen=True)
class StreamContext:
    """The shared resources of one sender, as its streams use them."""

    security: TransferSecurity
    host: str  # this host's name, sent in the handshake
    sizes: ChunkSizes
    budget: ByteBudget  # sender-wide bound on queued input bytes
    channel: Callable[[str], grpc.Channel]  # cached gRPC channel per target
    bulk: BulkConnector
    bulk_control: BulkControl
    segments: SegmentPool
    encoders: Executor
    buffers: BufferPool  # host chunk buffers
    pinned: PinnedPool  # pinned chunk buffers for device input
    ipc: IpcMappings  # mapped CUDA IPC segments of receivers
