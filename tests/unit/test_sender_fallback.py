"""``auto`` steps down transport by transport when one cannot open a push: CUDA IPC (the receiver leases no
segment), then shared memory (no segment can be made here), then gRPC; a forced transport never falls back.
KVStream is replaced by a stand-in that refuses the first two: the order and the memory of failures are
the sender's own logic (the real fallbacks run in tests/integration/test_kv_shm_full.py)."""

from __future__ import annotations

import grpc
import pytest

import kvtransfer.sender as sender_module
from kvtransfer.auth import TransferSecurity
from kvtransfer.errors import ShmUnusable, TransferFailed
from kvtransfer.sender import KVSender

pytestmark = pytest.mark.unit


class _Stream:
    tried: list[str] = []
    shm_lasting = True  # /dev/shm too small for any segment (else full only now)

    def __init__(self, ctx, target, request_id, layout, num_tokens, timeout_s, transport,  # noqa: ANN001
                 cached_blocks=0) -> None:  # noqa: ANN001
        _Stream.tried.append(transport)
        if transport == "cuda_ipc":
            raise TransferFailed("receiver leased no segment", grpc.StatusCode.FAILED_PRECONDITION)
        if transport == "shm":
            raise ShmUnusable("cannot use shared memory: /dev/shm has no room", _Stream.shm_lasting)
        if transport == "tcp":
            raise TransferFailed("cannot start a thread for the push", grpc.StatusCode.UNAVAILABLE)
        self.transport = transport


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(sender_module, "KVStream", _Stream)
    monkeypatch.setattr(sender_module, "shm_available", lambda: True)
    _Stream.tried = []
    _Stream.shm_lasting = True
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


def test_a_dev_shm_full_only_now_sends_that_push_over_grpc_and_tries_shm_again(streams: list[str]) -> None:
    _Stream.shm_lasting = False  # /dev/shm could hold a segment, but is full at the moment
    sender = KVSender(TransferSecurity(token="t" * 24))
    try:
        assert sender.open_stream("127.0.0.1:1", "r1", None, 4).transport == "grpc"  # type: ignore[arg-type]
        assert sender.open_stream("127.0.0.1:1", "r2", None, 4).transport == "grpc"  # type: ignore[arg-type]
        assert streams == ["shm", "grpc", "shm", "grpc"]  # not skipped for a minute
    finally:
        sender.close()


def test_other_failures_never_fall_back(streams: list[str]) -> None:
    """A push that could not start its thread is not a transport's fault: it fails (UNAVAILABLE: the request
    may move), and nothing is marked unusable."""
    sender = KVSender(TransferSecurity(token="t" * 24), transport="tcp")
    try:
        with pytest.raises(TransferFailed, match="cannot start a thread") as err:
            sender.open_stream("127.0.0.1:1", "r1", None, 4)  # type: ignore[arg-type]
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and streams == ["tcp"]
    finally:
        sender.close()
