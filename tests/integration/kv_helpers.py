"""Helpers for the KV-transfer integration tests: a tiny model, a decode-side rig (engine, receiver,
real gRPC server), hand-built Push frames, a raw client, and a throwaway PKI for mTLS."""

from __future__ import annotations

import datetime
import ipaddress
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.bulk import FRAME, HELLO
from kvtransfer.checksum import StreamChecksum, chunk_checksum
from kvtransfer.codecs import Kind, get_codec
from kvtransfer.cuda_ipc import DeviceParts
from kvtransfer.layout import KVLayout
from kvtransfer.options import CHANNEL_OPTIONS
from kvtransfer.receiver import KVReceiver, TransferOutcome, WireParts
from kvtransfer.sender import KVSender
from kvtransfer.server import kv_transfer_handler, start_server
from kvtransfer.stream import PushResult
from kvtransfer.wire import (
    OPEN_BULK_METHOD,
    PROTOCOL_VERSION,
    PUSH_METHOD,
    FirstLogprobs,
    encode_chunk,
    encode_control,
    pb,
)
from workers.decode.kv_sink import CacheSink
from workers.prefill.kv_stream import engine_layout
from workers.runtime.config import ModelConfig
from workers.runtime.engine import Engine, EngineConfig, KVReservation
from workers.runtime.model import DecoderModel

TOKEN = "kv-test-token-0123456789abcdef"
SECURITY = TransferSecurity(token=TOKEN)
AUTH = SECURITY.call_metadata()
BLOCK_SIZE = 4
NUM_TOKENS = 10  # 3 blocks of 4, the last one partly filled


def tiny_model(seed: int = 0) -> DecoderModel:
    """A 2-layer Llama (hidden 64, 2 KV heads of 16) with seeded weights; builds in milliseconds."""
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(0,))
    model = DecoderModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                scale = 1.0 if name in ("embed_tokens.weight", "lm_head.weight") else 0.1
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SpySink:
    """CacheSink that records every write (layer, physical blocks) before doing it."""

    def __init__(self, inner: CacheSink) -> None:
        self.inner = inner
        self.writes: list[tuple[int, tuple[int, ...]]] = []
        self._cv = threading.Condition()

    def write(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
              key: WireParts, value: WireParts) -> None:
        self.inner.write(layer, blocks, codec, shape, key, value)
        self._record(layer, blocks)

    def write_device(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
                     key: DeviceParts, value: DeviceParts) -> None:
        self.inner.write_device(layer, blocks, codec, shape, key, value)
        self._record(layer, blocks)

    def _record(self, layer: int, blocks: Sequence[int]) -> None:
        with self._cv:
            self.writes.append((layer, tuple(blocks)))
            self._cv.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.writes) >= n, timeout), f"only {len(self.writes)} writes"


@dataclass
class Pending:
    """A reservation the receiver expects; ``on_done`` fills ``outcomes`` and releases on failure."""

    reservation: KVReservation
    outcomes: list[TransferOutcome] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def rid(self) -> str:
        return self.reservation.request_id

    def outcome(self, timeout: float = 5.0) -> TransferOutcome:
        assert self.done.wait(timeout), f"on_done never ran for {self.rid}"
        assert len(self.outcomes) == 1, self.outcomes
        return self.outcomes[0]


class Rig:
    """The decode side: an engine, a KVReceiver over its cache, a real gRPC server in front."""

    def __init__(self, model: DecoderModel, server_security: TransferSecurity, client_security: TransferSecurity,
                 codecs: tuple[str, ...] = ("fp32", "int8"), clock: Callable[[], float] | None = None) -> None:
        self.engine = Engine(model, None, EngineConfig(block_size=BLOCK_SIZE, kv_cache_bytes=48 * 2048))
        self.layout = engine_layout(self.engine, codecs)
        self.sink = SpySink(CacheSink(self.engine.cache))
        self.receiver = (KVReceiver(self.layout, self.sink) if clock is None
                         else KVReceiver(self.layout, self.sink, clock=clock))
        self.server, port = start_server([kv_transfer_handler(self.receiver)], "127.0.0.1:0", server_security)
        self.receiver.enable_bulk("127.0.0.1", ssl_context=server_security.ssl_context(server_side=True))  # tcp
        self.target = f"127.0.0.1:{port}"
        self.client_security = client_security
        self.sender = KVSender(client_security, transport="grpc")
        self.channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._n = 0

    def close(self) -> None:
        self.sender.close()
        self.channel.close()
        self.server.stop(0).wait(5)
        self.receiver.stop()

    # ------------------------------------------------------------------ reservations
    def reserve(self, rid: str | None = None, num_tokens: int = NUM_TOKENS, timeout_s: float = 30.0,
                cached_blocks: int = 0) -> Pending:
        """``cached_blocks``: the receiver is told its first blocks hold their KV already (a prefix cache's)."""
        if rid is None:
            self._n += 1
            rid = f"req-{self._n}"
        pending = Pending(self.engine.reserve(rid, num_tokens))

        def on_done(outcome: TransferOutcome) -> None:
            pending.outcomes.append(outcome)
            if not outcome.ok:
                self.engine.release(pending.reservation)
            pending.done.set()
        self.receiver.expect(rid, pending.reservation.blocks, on_done, timeout_s, cached_blocks)
        return pending

    def assert_failed(self, pending: Pending, code: grpc.StatusCode, words: str) -> None:
        """The transfer failed through on_done with ``code``, and its blocks went back to the pool."""
        outcome = pending.outcome()
        assert not outcome.ok and outcome.code == code, outcome
        assert words.lower() in (outcome.error or "").lower(), outcome.error
        assert self.engine.release(pending.reservation) is False  # on_done already released it

    def assert_clean(self) -> None:
        stats = self.engine.stats()
        assert self.receiver.pending == 0, f"{self.receiver.pending} transfers still expected"
        assert stats.num_reservations == 0, stats
        assert stats.blocks_free == stats.blocks_total, stats

    # ------------------------------------------------------------------ a good transfer through KVSender
    def send_good(self, pending: Pending, sender: KVSender | None = None, first_token: int = 7,
                  first_logprobs: FirstLogprobs | None = None) -> PushResult:
        """Push random blocks for ``pending`` with a KVSender, check what landed, release the blocks."""
        sender = sender or self.sender
        n = self.layout.blocks_for(pending.reservation.num_tokens)
        gen = torch.Generator().manual_seed(len(pending.rid))
        kv = [(torch.randn(self.layout.block_shape(n), generator=gen),
               torch.randn(self.layout.block_shape(n), generator=gen)) for _ in range(self.layout.num_layers)]
        stream = sender.open_stream(self.target, pending.rid, self.layout, pending.reservation.num_tokens,
                                    timeout_s=10)
        for layer, (k, v) in enumerate(kv):
            stream.send_layer(layer, 0, k.clone(), v.clone())
        result = stream.finish(first_token, first_logprobs)
        outcome = pending.outcome()
        assert outcome.ok and outcome.first_token == first_token, outcome
        assert outcome.first_logprobs == first_logprobs, outcome
        assert outcome.num_chunks == result.num_chunks >= self.layout.num_layers
        self.check_landed(pending.reservation.blocks[:n], kv)
        assert self.engine.release(pending.reservation)
        return result

    def good_transfer(self) -> None:
        """A fresh reservation and a good push on the same server still work."""
        self.send_good(self.reserve())

    def check_landed(self, blocks: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        bs = self.layout.block_size
        b = torch.tensor(blocks, dtype=torch.long)
        slots = (b[:, None] * bs + torch.arange(bs)).reshape(-1)
        for layer, (k, v) in enumerate(kv):
            got_k, got_v = self.engine.cache.layers[layer].gather(slots, torch.float32)
            codec = get_codec(self.layout.layer_codecs[layer])
            for got, sent, kind in ((got_k, k, Kind.KEY), (got_v, v, Kind.VALUE)):
                want = codec.decode(codec.encode(sent, kind), torch.float32)  # exact for fp32
                assert torch.equal(got.view(want.shape), want), f"layer {layer} {kind} differs"


# ---------------------------------------------------------------------- hand-built frames
class Frames:
    """Valid Push frames for one request, with knobs to break them. Tracks the stream totals."""

    def __init__(self, layout: KVLayout, rid: str, num_tokens: int = NUM_TOKENS, seed: int = 1) -> None:
        self.layout = layout
        self.rid = rid
        self.num_tokens = num_tokens
        self.num_blocks = layout.blocks_for(num_tokens)
        self.gen = torch.Generator().manual_seed(seed)
        self.seq = 0
        self.nbytes = 0
        self.checksum = StreamChecksum()

    def handshake(self, layout: KVLayout | pb.KVLayout | None = None, **fields: object) -> bytes:
        layout = layout or self.layout
        hs = pb.PushHandshake(protocol_version=PROTOCOL_VERSION, request_id=self.rid,
                              layout=layout.to_proto() if isinstance(layout, KVLayout) else layout,
                              num_tokens=self.num_tokens, transport=pb.TRANSPORT_GRPC, sender_host="test")
        for name, value in fields.items():
            setattr(hs, name, value)
        return encode_control(pb.PushMessage(handshake=hs))

    def chunk(self, layer: int, /, first_block: int = 0, num_blocks: int | None = None, *, codec: str | None = None,
              edit_payload: Callable[[bytes], bytes] | None = None,
              as_sent: Callable[[bytes, bytes], tuple[bytes, bytes]] | None = None, **header: object) -> bytes:
        """Blocks [first_block, first_block + num_blocks) of ``layer``, encoded with ``codec`` (the layer's
        by default). The checksum covers the bytes before ``edit_payload`` (corruption on the way) and
        after ``as_sent`` (scales, payload -> what a wrong sender sends); ``header`` overrides fields."""
        n = self.num_blocks - first_block if num_blocks is None else num_blocks
        c = get_codec(codec or self.layout.layer_codecs[layer])
        shape = self.layout.block_shape(max(n, 1))
        k, v = torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen)
        ek, ev = c.encode(k, Kind.KEY), c.encode(v, Kind.VALUE)
        scales = b"".join(bytes(m) for m in (ek.scales_view(), ek.zeros_view(), ev.scales_view(), ev.zeros_view())
                          if m is not None)
        payload = bytes(ek.payload_view()) + bytes(ev.payload_view())
        if as_sent is not None:
            scales, payload = as_sent(scales, payload)
        checksum = chunk_checksum([memoryview(scales), memoryview(payload)])
        fields: dict[str, Any] = dict(seq=self.seq, request_id=self.rid, layer=layer, first_block=first_block,
                                         num_blocks=n, codec=int(c.codec_id), checksum=checksum)
        fields.update(header)
        if edit_payload is not None:
            payload = edit_payload(payload)
        self.seq += 1
        self.nbytes += len(scales) + len(payload)
        self.checksum.add(int(fields["checksum"]))
        return encode_chunk(pb.KVChunk(**fields), [memoryview(scales)], [memoryview(payload)])

    def finish(self, first_token: int = 7, **fields: object) -> bytes:
        values: dict[str, Any] = dict(num_chunks=self.seq, num_bytes=self.nbytes, checksum=self.checksum.value,
                                         first_token=first_token)
        values.update(fields)
        return encode_control(pb.PushMessage(finish=pb.PushFinish(**values)))

    def all_layers(self) -> list[bytes]:
        return [self.chunk(layer) for layer in range(self.layout.num_layers)]


def push_raw(channel: grpc.Channel, frames: Iterable[bytes], metadata: Sequence[tuple[str, str]] = (),
             timeout: float = 10.0) -> pb.PushAck:
    call: grpc.StreamUnaryMultiCallable[bytes, pb.PushAck] = channel.stream_unary(
        PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)
    return call(iter(list(frames)), metadata=tuple(metadata), timeout=timeout)


def refused(channel: grpc.Channel, frames: Iterable[bytes], metadata: Sequence[tuple[str, str]] = (),
            timeout: float = 10.0) -> grpc.RpcError:
    try:
        ack = push_raw(channel, frames, metadata, timeout)
    except grpc.RpcError as err:
        return err
    raise AssertionError(f"the push was accepted: {ack}")


class OpenPush:
    """A raw Push call whose frames the test feeds one at a time (so a stream can sit idle)."""

    def __init__(self, channel: grpc.Channel, metadata: Sequence[tuple[str, str]],
                 timeout: float | None = 20.0) -> None:
        """``timeout``: the call's deadline (None: none, as a careless sender might)."""
        self._q: queue.Queue[bytes | None] = queue.Queue()
        call: grpc.StreamUnaryMultiCallable[bytes, pb.PushAck] = channel.stream_unary(
            PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)
        self.future = call.future(iter(self._q.get, None), metadata=tuple(metadata), timeout=timeout)

    def send(self, *frames: bytes) -> None:
        for f in frames:
            self._q.put(f)

    def end(self) -> None:
        self._q.put(None)

    def error(self, timeout: float = 5.0) -> grpc.RpcError:
        exc = self.future.exception(timeout=timeout)
        assert exc is not None, f"the push was accepted: {self.future.result()}"
        assert isinstance(exc, grpc.RpcError), exc
        return exc

    def result(self, timeout: float = 5.0) -> pb.PushAck:
        return self.future.result(timeout=timeout)


# ---------------------------------------------------------------------- raw bulk TCP connections
def open_bulk(channel: grpc.Channel, metadata: Sequence[tuple[str, str]] = AUTH) -> pb.BulkTicket:
    call: grpc.UnaryUnaryMultiCallable[bytes, pb.BulkTicket] = channel.unary_unary(
        OPEN_BULK_METHOD, request_serializer=None, response_deserializer=pb.BulkTicket.FromString)
    return call(b"", metadata=tuple(metadata), timeout=5)


def connect(ticket: pb.BulkTicket, secret: bytes | None = None) -> tuple[socket.socket, bytes]:
    """Connect with ``ticket`` (or a wrong ``secret``); returns the socket and the receiver's answer."""
    sock = socket.create_connection(("127.0.0.1", ticket.port), timeout=5)
    sock.sendall(HELLO + ticket.connection_id + (secret if secret is not None else ticket.secret))
    try:
        answer = sock.recv(1)
    except ConnectionResetError:
        answer = b""
    return sock, answer


def frame(kind: int, message: bytes) -> bytes:
    return FRAME.pack(kind, len(message)) + message


def read_message(sock: socket.socket, kind: int, timeout: float = 5.0) -> bytes:
    """The next whole message on ``sock``, which must be of ``kind``."""
    sock.settimeout(timeout)
    data = b""
    while len(data) < FRAME.size or len(data) < FRAME.size + FRAME.unpack(data[:FRAME.size])[1]:
        got = sock.recv(65536)
        assert got, f"the connection closed after {len(data)} bytes, before a whole message"
        data += got
    got_kind, n = FRAME.unpack(data[:FRAME.size])
    assert got_kind == kind and len(data) == FRAME.size + n, f"message kind {got_kind} of {n} bytes, expected {kind}"
    return data[FRAME.size:]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---------------------------------------------------------------------- a throwaway PKI
@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(folder: Path, name: str) -> Pki:
    """A CA plus a server and a client certificate (CN=localhost, SAN DNS:localhost, IP:127.0.0.1)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return path

    def write_cert(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(usage: x509.ObjectIdentifier, stem: str) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        return write_cert(cert, folder / f"{stem}.pem"), write_key(key, folder / f"{stem}.key")

    server_cert, server_key = leaf(ExtendedKeyUsageOID.SERVER_AUTH, "server")
    client_cert, client_key = leaf(ExtendedKeyUsageOID.CLIENT_AUTH, "client")
    return Pki(write_cert(ca, folder / "ca.pem"), server_cert, server_key, client_cert, client_key)


# ---------------------------------------------------------------------- a sender process to kill
CHILD_SENDER = r"""
import json, os, sys
import torch
from kvtransfer.auth import TransferSecurity
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender

target, rid, num_tokens, layout_json, transport = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
fields = json.loads(layout_json)
layout = KVLayout(**{**fields, "layer_codecs": tuple(fields["layer_codecs"])})
sender = KVSender(TransferSecurity(token=os.environ["EPD_KV_TEST_TOKEN"]), transport=transport)
print("ready", flush=True)
sys.stdin.readline()
stream = sender.open_stream(target, rid, layout, num_tokens, timeout_s=60)
k = torch.randn(layout.block_shape(layout.blocks_for(num_tokens)))
stream.send_layer(0, 0, k, k.clone())
print("sent", flush=True)
sys.stdin.readline()
os._exit(1)  # no finish, no cancel, no goodbye: the process just dies mid-stream
"""


# ---------------------------------------------------------------------- fixtures (imported by the test modules)
@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_model()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_rig(model: DecoderModel) -> Iterator[Callable[..., Rig]]:
    """Rigs with the token on both sides unless told otherwise; each must be clean when the test ends."""
    rigs: list[Rig] = []

    def make(**kwargs: object) -> Rig:
        kwargs.setdefault("server_security", SECURITY)
        kwargs.setdefault("client_security", SECURITY)
        rig = Rig(model, **kwargs)  # type: ignore[arg-type]  # Rig's keyword arguments
        rigs.append(rig)
        return rig
    yield make
    for rig in rigs:
        try:
            rig.assert_clean()  # no reservation, expectation or block left behind
        finally:
            rig.close()
