"""The benchmark's reference ceilings: real receiver processes that confirm every byte, and leave nothing behind.

No speeds are asserted: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket
import zlib
from collections.abc import Callable, Iterator

import pytest

from bench import kv_references as references
from bench.kv_references import Measurement, TransferCheckError

pytestmark = [pytest.mark.integration]

MiB = 1 << 20

FUNCTIONS: dict[str, Callable[..., Measurement]] = {
    "tcp": references.tcp_socket,
    "unix": references.unix_socket,
    "grpc-raw": references.grpc_raw_stream,
    "grpc-proto": references.grpc_proto_bytes_stream,
}


@pytest.fixture(autouse=True)
def no_children_left() -> Iterator[None]:
    assert multiprocessing.active_children() == []
    yield
    assert multiprocessing.active_children() == []


def test_measurement_is_frozen_and_reports_decimal_gbps() -> None:
    m = Measurement("x", 2_000_000_000, 0.5)
    assert m.gbps == pytest.approx(4.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.seconds = 1.0  # type: ignore[misc]  # frozen: the test


@pytest.mark.parametrize("threads", [None, 1])
def test_memcpy(threads: int | None) -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    m = references.memcpy(8 * MiB, repeats=2, threads=threads)
    assert m.nbytes == 8 * MiB and m.seconds > 0 and m.gbps > 0
    used = before if threads is None else threads
    assert m.name.startswith(f"memcpy ({used} thread")
    assert torch.get_num_threads() == before  # restored


@pytest.mark.parametrize("name", FUNCTIONS)
def test_stream_confirms_every_byte(name: str) -> None:
    m = FUNCTIONS[name](8 * MiB, repeats=2)
    assert isinstance(m, Measurement)
    assert m.nbytes == 8 * MiB  # the count the receiver confirmed (with a matching CRC-32)
    assert m.seconds > 0 and m.gbps > 0


@pytest.mark.parametrize("name", FUNCTIONS)
def test_stream_with_a_short_last_chunk(name: str) -> None:
    nbytes = 3 * MiB + 12_345  # three 1 MiB chunks and a short one
    m = FUNCTIONS[name](nbytes, chunk=MiB, repeats=1)
    assert m.nbytes == nbytes and m.seconds > 0


@pytest.mark.parametrize("bad", [dict(nbytes=0), dict(chunk=0), dict(repeats=0)])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_bad_arguments_are_refused_before_any_process_starts(name: str, bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        FUNCTIONS[name](**{"nbytes": MiB, **bad})


@pytest.mark.parametrize("name", ["grpc-raw", "grpc-proto"])
def test_grpc_chunks_must_fit_the_message_limit(name: str) -> None:
    with pytest.raises(ValueError, match="message"):
        FUNCTIONS[name](MiB, chunk=references.MAX_MESSAGE_BYTES)


def _connect_and_close(address: tuple[str, int]) -> None:
    with socket.create_connection(address, timeout=10):
        pass


def test_socket_receiver_imports_nothing_heavy() -> None:
    with references._Child(references._socket_receiver, socket.AF_INET, ("127.0.0.1", 0), 16) as child:
        assert child.address[0] == "127.0.0.1"
        assert child.heavy_modules == []  # no torch, no numpy (this test process has both)
        _connect_and_close(child.address)


@pytest.mark.parametrize("proto", [False, True])
def test_grpc_receiver_imports_no_torch(proto: bool) -> None:
    with references._Child(references._grpc_receiver, proto, references.FAST_CHANNEL_OPTIONS) as child:
        assert isinstance(child.address, int) and child.address > 0
        assert child.heavy_modules == []


def test_receiver_fails_loudly_on_wrong_bytes() -> None:
    nbytes = 64 * 1024
    data = bytes(range(256)) * (nbytes // 256)
    with references._Child(references._socket_receiver, socket.AF_INET, ("127.0.0.1", 0), nbytes) as child:
        with socket.create_connection(child.address, timeout=10) as sock:
            sock.sendall(data)
            assert sock.recv(1) == b"\x01"
            assert child.verify(nbytes, zlib.crc32(data)) == nbytes  # the right answer passes
            sock.sendall(data)
            assert sock.recv(1) == b"\x01"
            with pytest.raises(TransferCheckError, match="crc32"):
                child.verify(nbytes, zlib.crc32(data) ^ 1)


def test_receiver_fails_loudly_on_a_short_transfer() -> None:
    nbytes = 64 * 1024
    with references._Child(references._socket_receiver, socket.AF_INET, ("127.0.0.1", 0), nbytes) as child:
        with socket.create_connection(child.address, timeout=10) as sock:
            sock.sendall(b"x" * 1000)
        with pytest.raises(TransferCheckError, match="after 1000 of 65536 bytes"):
            child.verify(nbytes, 0)


def test_tcp_round_trip_is_an_echo_between_two_processes() -> None:
    """The fixed-cost figures' reference: each byte comes back from the other process (the echo child
    answers what it got, byte for byte); the median is a time (no speed is asserted)."""
    with references._Child(references._echo_receiver, socket.AF_INET, ("127.0.0.1", 0)) as child:
        with socket.create_connection(child.address, timeout=10) as sock:
            for byte in (b"a", b"\x00", b"\xff"):
                sock.sendall(byte)
                assert sock.recv(1) == byte
    seconds = references.tcp_round_trip(repeats=20)
    assert seconds > 0
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        references.tcp_round_trip(repeats=0)


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert references.main(["--bytes", str(MiB), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[0] == "path" and "GB/s" in lines[0] and "x memcpy" in lines[0]
    names = [line[:30] for line in lines[1:]]
    for expected in ("memcpy (", "tcp socket", "unix socket", "grpc raw stream", "grpc protobuf bytes stream"):
        assert any(n.startswith(expected) for n in names), (expected, out)
    assert lines[1].startswith("memcpy") and lines[1].split()[-1] == "1.000"
