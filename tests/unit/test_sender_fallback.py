"""``auto`` steps down transport by transport when one cannot open a push: CUDA IPC (the receiver leases no
segment), then shared memory (no segment can be made here), then gRPC; a forced transport never falls back.
KVStream is replaced by a stand-in that refuses the first two: the order and the memory of failures are
the sender's own logic (the real fallbacks run in tests/integration/test_kv_shm_full.py)."""

from __future__ import annotations

import grpc
import pytest

import kvtransfer.sender as sender_module
from kvtransfer.auth import TransferSecurity
from kvtransfer.errors import TransferFailed
from kvtransfer.sender import KVSender

pytestmark = pytest.mark.unit


class _Stream:
    tried: list[str] = []

    def __init__(self, ctx, target, request_id, layout, num_tokens, timeout_s, transport) -> None:  # noqa: ANN001
        _Stream.tried.append(transport)
        if transport == "cuda_ipc":
            raise TransferFailed("receiver leased no segment", grpc.StatusCode.FAILED_PRECONDITION)
        if transport == "shm":
            raise TransferFailed("cannot use shared memory: /dev/shm has no room", grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.transport = transport


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(sender_module, "KVStream", _Stream)
    monkeypatch.setattr(sender_module, "shm_available", lambda: True)
    _Stream.tried = []
    return _Stream.tried


def test_auto_steps_down_to_grpc_and_remembers_what_failed(streams: list[str]) -> None:
    sender = KVSender(TransferSecurity(token="t" * 24), device="cuda")  # a CUDA cache; nothing runs on it here
    try:
        assert sender.open_stream("127.0.0.1:1", "r1", None, 4).transport == "grpc"  # type: ignore[arg-type]
        assert streams == ["cuda_ipc", "shm", "grpc"]
        streams.clear()
        assert sender.open_stream("127.0.0.1:1", "r2", None, 4).transport == "grpc"  # type: ignore[arg-type]
        assert streams == ["grpc"]  # both skipped a while
    finally:
        sender.close()


def test_a_forced_transport_does_not_fall_back(streams: list[str]) -> None:
    sender = KVSender(TransferSecurity(token="t" * 24), transport="shm")
    try:
        with pytest.raises(TransferFailed, match="/dev/shm has no room"):
            sender.open_stream("127.0.0.1:1", "r1", None, 4)  # type: ignore[arg-type]
        assert streams == ["shm"]
    finally:
        sender.close()
