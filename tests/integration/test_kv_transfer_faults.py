"""Fault injection against a real KV-transfer server: hand-built bad frames, bad credentials, expired
and cancelled streams, a sender process killed mid-stream, mTLS and shared memory.

Every refused push must end with a status naming the problem, release the reservation through
``on_done`` (exactly once), write nothing it should not, and leave the server serving the next push.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.errors import TransferFailed
from kvtransfer.expectations import WAKE_AFTER_S
from kvtransfer.receiver import HANDSHAKE_S
from kvtransfer.sender import KVSender
from kvtransfer.shm import SHM_DIR, SharedSegment
from kvtransfer.wire import encode_control, pb
from workers.prefill.kv_stream import LayerStreamer
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.model import DecoderModel
from workers.runtime.sampler import SamplingParams

from kv_helpers import (  # noqa: F401  (fixtures)
    AUTH,
    BLOCK_SIZE,
    CHILD_SENDER,
    NUM_TOKENS,
    SECURITY,
    TOKEN,
    FakeClock,
    Frames,
    OpenPush,
    Pending,
    Rig,
    clock,
    make_pki,
    make_rig,
    model,
    refused,
    wait_until,
)

pytestmark = [pytest.mark.integration]

Code = grpc.StatusCode


@pytest.fixture
def rig(make_rig: Callable[..., Rig], clock: FakeClock) -> Rig:
    return make_rig(clock=clock)  # deadlines only pass when a test moves the clock


def _untouched(rig: Rig, pending: Pending, writes: int = 0) -> None:
    """``pending`` still waits for its push, and no block was written since ``writes`` writes."""
    assert not pending.done.is_set() and rig.receiver.pending == 1 and len(rig.sink.writes) == writes


def test_good_transfer_lands_every_block_and_cleans_up(rig: Rig) -> None:
    pending = rig.reserve()
    result = rig.send_good(pending)
    assert result.num_chunks == 2 and result.transport == "grpc"
    assert [layer for layer, _ in rig.sink.writes] == [0, 1]
    assert all(blocks == pending.reservation.blocks for _, blocks in rig.sink.writes)
    rig.assert_clean()


# ---------------------------------------------------------------------- refused before a stream is bound
@pytest.mark.parametrize("case", ["chunk first", "finish first", "empty stream", "garbage first"])
def test_a_stream_must_open_with_a_handshake(rig: Rig, case: str) -> None:
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    first = {"chunk first": [frames.chunk(0)], "finish first": [frames.finish()], "empty stream": [],
             "garbage first": [b"\xff\xff"]}[case]
    err = refused(rig.channel, first, AUTH)
    assert err.code() == Code.INVALID_ARGUMENT
    assert ("malformed" if case == "garbage first" else "must open with a handshake") in err.details()
    _untouched(rig, pending)  # nothing named a reservation the receiver could trust
    rig.send_good(pending)
    rig.assert_clean()


def test_unknown_request_id_is_not_found(rig: Rig) -> None:
    pending = rig.reserve()
    frames = Frames(rig.layout, "nobody-reserved-this")
    err = refused(rig.channel, [frames.handshake(), *frames.all_layers(), frames.finish()], AUTH)
    assert err.code() == Code.NOT_FOUND and "'nobody-reserved-this'" in err.details()
    _untouched(rig, pending)
    rig.send_good(pending)
    rig.assert_clean()


# ---------------------------------------------------------------------- refused at the handshake
def _layout_proto(rig: Rig, **changes: object) -> pb.KVLayout:
    proto = rig.layout.to_proto()
    for name, value in changes.items():
        if name == "layer_codecs":
            del proto.layer_codecs[:]
            proto.layer_codecs.extend(value)
        else:
            setattr(proto, name, value)
    return proto


HANDSHAKES: dict[str, tuple[Callable[[Rig], dict], grpc.StatusCode, str]] = {
    "protocol version": (lambda r: dict(protocol_version=2), Code.FAILED_PRECONDITION, "protocol version 2"),
    "layers": (lambda r: dict(layout=dataclasses.replace(r.layout, num_layers=3, layer_codecs=("fp32",) * 3)),
               Code.FAILED_PRECONDITION, "num_layers differs: sender has 3, receiver has 2"),
    "kv heads": (lambda r: dict(layout=dataclasses.replace(r.layout, num_kv_heads=4)),
                 Code.FAILED_PRECONDITION, "num_kv_heads differs"),
    "head dim": (lambda r: dict(layout=dataclasses.replace(r.layout, head_dim=32)),
                 Code.FAILED_PRECONDITION, "head_dim differs"),
    "block size": (lambda r: dict(layout=dataclasses.replace(r.layout, block_size=8)),
                   Code.FAILED_PRECONDITION, "block_size differs"),
    "fingerprint": (lambda r: dict(layout=dataclasses.replace(r.layout, model_fingerprint="llama-otherweights")),
                    Code.FAILED_PRECONDITION, "model fingerprint differs"),
    "unknown codec id": (lambda r: dict(layout=_layout_proto(r, layer_codecs=[pb.CODEC_FP32, 42])),
                         Code.FAILED_PRECONDITION, "layout"),
    "codec count": (lambda r: dict(layout=_layout_proto(r, layer_codecs=[pb.CODEC_FP32])),
                    Code.FAILED_PRECONDITION, "1 codecs for 2 layers"),
    "zero tokens": (lambda r: dict(num_tokens=0), Code.OUT_OF_RANGE, "reserved"),
    "more tokens than reserved": (lambda r: dict(num_tokens=NUM_TOKENS + 2 * BLOCK_SIZE), Code.OUT_OF_RANGE,
                                  "need 5 blocks; 3 are reserved"),
    "unknown transport": (lambda r: dict(transport=7), Code.INVALID_ARGUMENT, "unknown transport 7"),
    "shm path traversal": (lambda r: dict(transport=pb.TRANSPORT_SHARED_MEMORY, shm_name="../etc/passwd",
                                          shm_size=4096), Code.FAILED_PRECONDITION, "invalid shared-memory name"),
    "shm absent": (lambda r: dict(transport=pb.TRANSPORT_SHARED_MEMORY, shm_name="epd-kv-1-" + "0" * 32,
                                  shm_size=4096), Code.FAILED_PRECONDITION, "cannot open"),
}


@pytest.mark.parametrize("case", list(HANDSHAKES))
def test_refused_handshake_releases_the_reservation(rig: Rig, case: str) -> None:
    make_fields, code, words = HANDSHAKES[case]
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(**make_fields(rig)), *frames.all_layers(), frames.finish()], AUTH)
    assert err.code() == code and words in err.details(), (err.code(), err.details())
    rig.assert_failed(pending, code, words)
    assert rig.sink.writes == []
    rig.assert_clean()
    rig.good_transfer()
    rig.assert_clean()


def test_transfer_shorter_than_the_reservation_is_refused(rig: Rig) -> None:
    """A complete-looking push for fewer tokens than reserved would leave reserved blocks stale."""
    pending = rig.reserve()  # 10 tokens: 3 blocks
    frames = Frames(rig.layout, pending.rid, num_tokens=4)  # 1 block per layer, every one of them sent
    err = refused(rig.channel, [frames.handshake(), *frames.all_layers(), frames.finish()], AUTH)
    assert err.code() == Code.OUT_OF_RANGE and "4 tokens need 1 blocks; 3 are reserved" in err.details()
    rig.assert_failed(pending, Code.OUT_OF_RANGE, "3 are reserved")
    assert rig.sink.writes == []
    rig.good_transfer()
    rig.assert_clean()


# ---------------------------------------------------------------------- refused chunks
def _float32_at(scales: bytes, index: int, value: float) -> bytes:
    """``scales`` (float32) with the one at ``index`` set to ``value``."""
    import struct

    values = list(struct.unpack(f"<{len(scales) // 4}f", scales))
    values[index] = value
    return struct.pack(f"<{len(values)}f", *values)


def _flip_byte(payload: bytes) -> bytes:
    i = len(payload) // 2
    return payload[:i] + bytes([payload[i] ^ 0x10]) + payload[i + 1:]


CHUNKS: dict[str, tuple[Callable[[Frames, Pending], list[bytes]], grpc.StatusCode, str]] = {
    "corrupted payload byte": (lambda f, o: [f.chunk(1, edit_payload=_flip_byte)], Code.DATA_LOSS,
                               "checksum mismatch"),
    "blocks sent twice": (lambda f, o: [f.chunk(0)], Code.INVALID_ARGUMENT, "overlaps blocks already received"),
    "seq skipped": (lambda f, o: [f.chunk(1, seq=5)], Code.INVALID_ARGUMENT, "expected seq 1"),
    "seq reused": (lambda f, o: [f.chunk(1, seq=0)], Code.INVALID_ARGUMENT, "out of order or duplicated"),
    "foreign request id": (lambda f, o: [f.chunk(1, request_id=o.rid)], Code.INVALID_ARGUMENT,
                           "is for request 'req-2' on the stream of 'req-1'"),
    "blocks past the reservation": (lambda f, o: [f.chunk(1, first_block=2, num_blocks=2)], Code.OUT_OF_RANGE,
                                    "outside the request's 3 blocks"),
    "zero blocks": (lambda f, o: [f.chunk(1, num_blocks=0)], Code.OUT_OF_RANGE, "outside"),
    "no such layer": (lambda f, o: [f.chunk(1, layer=9)], Code.INVALID_ARGUMENT, "no layer 9 in a 2-layer model"),
    "payload truncated": (lambda f, o: [f.chunk(1, edit_payload=lambda p: p[:-1])], Code.INVALID_ARGUMENT,
                          "expected"),
    "payload oversized": (lambda f, o: [f.chunk(1, edit_payload=lambda p: p + bytes(64))], Code.INVALID_ARGUMENT,
                          "expected"),
    "wrong codec for the layer": (lambda f, o: [f.chunk(1, codec="fp32")], Code.INVALID_ARGUMENT,
                                  "but the handshake gave layer 1 codec int8"),
    "shm reference on a grpc stream": (lambda f, o: [f.chunk(1, shm=pb.ShmRef(offset=0, length=8))],
                                       Code.INVALID_ARGUMENT, "shared-memory reference"),
    "second handshake": (lambda f, o: [f.handshake()], Code.INVALID_ARGUMENT, "second handshake"),
    "malformed frame": (lambda f, o: [b"\x12\x05ab"], Code.INVALID_ARGUMENT, "malformed message"),
    # well-formed and checksummed, but values a correct sender never sends (it refuses a NaN cache)
    "NaN in a scale": (lambda f, o: [f.chunk(1, as_sent=lambda s, p: (_float32_at(s, 1, float("nan")), p))],
                       Code.INVALID_ARGUMENT, "scales hold NaN or inf"),
    "inf in a scale": (lambda f, o: [f.chunk(1, as_sent=lambda s, p: (_float32_at(s, -1, float("inf")), p))],
                       Code.INVALID_ARGUMENT, "scales hold NaN or inf"),
    "a finite scale that decodes to inf": (
        lambda f, o: [f.chunk(1, as_sent=lambda s, p: (_float32_at(s, 1, 3e38), p))], Code.INVALID_ARGUMENT,
        "the keys' scales decode to magnitudes up to 3.84e+40, past 3.4e+38"),
}


@pytest.mark.parametrize("case", list(CHUNKS))
def test_refused_chunk_fails_the_stream_and_releases(rig: Rig, case: str) -> None:
    make_bad, code, words = CHUNKS[case]
    pending, other = rig.reserve(), rig.reserve()  # req-1 streams; req-2 must be unaffected
    frames = Frames(rig.layout, pending.rid)
    first = frames.chunk(0)
    bad = make_bad(frames, other)
    err = refused(rig.channel, [frames.handshake(), first, *bad, frames.chunk(1), frames.finish()], AUTH)
    assert err.code() == code and words in err.details(), (err.code(), err.details())
    rig.assert_failed(pending, code, words)
    assert rig.sink.writes == [(0, pending.reservation.blocks)]  # the good first chunk only
    assert not other.done.is_set() and rig.receiver.pending == 1
    rig.send_good(other)
    rig.good_transfer()
    rig.assert_clean()


def test_an_exact_duplicate_chunk_is_refused(rig: Rig) -> None:
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    chunk = frames.chunk(0)
    err = refused(rig.channel, [frames.handshake(), chunk, chunk, frames.chunk(1), frames.finish()], AUTH)
    assert err.code() == Code.INVALID_ARGUMENT and "duplicated: expected seq 1" in err.details()
    rig.assert_failed(pending, Code.INVALID_ARGUMENT, "duplicated")
    assert len(rig.sink.writes) == 1
    rig.good_transfer()
    rig.assert_clean()


# ---------------------------------------------------------------------- refused at the finish
FINISHES: dict[str, tuple[Callable[[Frames], list[bytes]], str]] = {
    "missing layer": (lambda f: [f.chunk(0), f.finish()], "truncated transfer: layer 1 is missing 3 of 3 blocks"),
    "missing block": (lambda f: [f.chunk(0), f.chunk(1, 0, 2), f.finish()], "layer 1 is missing 1 of 3"),
    "chunk count": (lambda f: [*f.all_layers(), f.finish(num_chunks=3)], "finish totals disagree"),
    "byte count": (lambda f: [*f.all_layers(), f.finish(num_bytes=f.nbytes + 1)], "finish totals disagree"),
    "stream checksum": (lambda f: [*f.all_layers(), f.finish(checksum=12345)], "finish totals disagree"),
    "stream ends without finish": (lambda f: f.all_layers(), "ended before its finish message"),
}


@pytest.mark.parametrize("case", list(FINISHES))
def test_incomplete_or_inconsistent_transfer_is_data_loss(rig: Rig, case: str) -> None:
    make_frames, words = FINISHES[case]
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(), *make_frames(frames)], AUTH)
    assert err.code() == Code.DATA_LOSS and words in err.details(), err.details()
    rig.assert_failed(pending, Code.DATA_LOSS, words)
    rig.good_transfer()
    rig.assert_clean()


BAD_LOGPROBS: dict[str, tuple[dict[str, Any], str]] = {
    "top without the first": ({"first_top_ids": [1], "first_top_logprobs": [-0.5]}, "top logprobs without"),
    "NaN": ({"first_logprob": math.nan}, "first_logprob is NaN"),
    "counts differ": ({"first_logprob": -0.1, "first_top_ids": [1, 2], "first_top_logprobs": [-0.5]},
                      "2 top token ids and 1 top logprobs"),
    "too many": ({"first_logprob": -0.1, "first_top_ids": list(range(21)), "first_top_logprobs": [-1.0] * 21},
                 "at most 20"),
    "NaN in the top": ({"first_logprob": -0.1, "first_top_ids": [1], "first_top_logprobs": [math.nan]},
                       "first_top_logprobs hold a NaN"),
}


@pytest.mark.parametrize("case", list(BAD_LOGPROBS))
def test_a_finish_with_malformed_first_token_logprobs_is_refused(rig: Rig, case: str) -> None:
    fields, words = BAD_LOGPROBS[case]
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(), *frames.all_layers(), frames.finish(**fields)], AUTH)
    assert err.code() == Code.INVALID_ARGUMENT and words in err.details(), err.details()
    rig.assert_failed(pending, Code.INVALID_ARGUMENT, words)
    rig.good_transfer()
    rig.assert_clean()


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_finish_carries_the_first_tokens_logprobs_to_the_receiver(rig: Rig, transport: str) -> None:
    sender = KVSender(rig.client_security, transport=transport)  # type: ignore[arg-type]
    try:
        rig.send_good(rig.reserve(), sender, first_token=7, first_logprobs=(-0.25, ((7, -0.25), (3, -2.5))))
    finally:
        sender.close()
    rig.assert_clean()


# ---------------------------------------------------------------------- credentials
@pytest.mark.parametrize("metadata", [
    (), (("authorization", "Bearer " + "x" * len(TOKEN)),), (("authorization", TOKEN),),
    (("authorization", f"Bearer {TOKEN} "),),
], ids=["none", "wrong token", "no bearer prefix", "trailing space"])
def test_unauthenticated_push_writes_nothing(rig: Rig, metadata: tuple) -> None:
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(), *frames.all_layers(), frames.finish()], metadata)
    assert err.code() == Code.UNAUTHENTICATED and "credential" in err.details()
    assert TOKEN not in err.details()
    _untouched(rig, pending)  # the handler never saw the stream: the reservation still waits
    rig.send_good(pending)  # and the real sender can still fill it
    rig.assert_clean()


def test_mtls_transfer_and_refused_clients(make_rig: Callable[..., Rig], tmp_path: Path) -> None:
    pki, other = make_pki(tmp_path / "pki", "epd"), make_pki(tmp_path / "other", "rogue")
    server = TransferSecurity(tls_ca=pki.ca, tls_cert=pki.server_cert, tls_key=pki.server_key)
    client = TransferSecurity(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    rig = make_rig(server_security=server, client_security=client)
    rig.good_transfer()
    writes = len(rig.sink.writes)

    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    valid = [frames.handshake(), *frames.all_layers(), frames.finish()]
    no_cert = grpc.secure_channel(rig.target, grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes()))
    rogue = TransferSecurity(tls_ca=pki.ca, tls_cert=other.client_cert, tls_key=other.client_key).open_channel(
        rig.target)
    try:
        for name, channel in (("no client cert", no_cert), ("cert from another CA", rogue),
                              ("plaintext", rig.channel)):
            err = refused(channel, valid, timeout=5)
            assert err.code() == Code.UNAVAILABLE, (name, err.code(), err.details())
            _untouched(rig, pending, writes)
    finally:
        no_cert.close()
        rogue.close()
    rig.send_good(pending)
    rig.assert_clean()


# ---------------------------------------------------------------------- one stream per request
def test_second_stream_for_a_request_is_already_exists(rig: Rig) -> None:
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    first = OpenPush(rig.channel, AUTH)
    first.send(frames.handshake(), frames.chunk(0))
    rig.sink.wait_for(1)  # the first stream holds the request now
    intruder = Frames(rig.layout, pending.rid, seed=9)
    err = refused(rig.channel, [intruder.handshake(), *intruder.all_layers(), intruder.finish()], AUTH)
    assert err.code() == Code.ALREADY_EXISTS and "already has a stream" in err.details()
    assert not pending.done.is_set() and len(rig.sink.writes) == 1
    first.send(frames.chunk(1), frames.finish(first_token=11))
    first.end()
    ack = first.result()
    assert ack.request_id == pending.rid and ack.num_chunks == 2 and ack.checksum == frames.checksum.value
    outcome = pending.outcome()
    assert outcome.ok and outcome.first_token == 11
    assert rig.engine.release(pending.reservation)
    rig.assert_clean()


# ---------------------------------------------------------------------- deadlines and cancellation
def test_idle_stream_expires_on_sweep_and_frees_blocks(rig: Rig, clock: FakeClock) -> None:
    pending = rig.reserve(timeout_s=5.0)
    frames = Frames(rig.layout, pending.rid)
    push = OpenPush(rig.channel, AUTH)
    try:
        push.send(frames.handshake(), frames.chunk(0))
        rig.sink.wait_for(1)
        clock.now += 4.9
        assert rig.receiver.sweep() == [] and not pending.done.is_set()
        clock.now += 0.2
        assert rig.receiver.sweep() == [pending.rid]
        # released while the stream is still open and idle
        rig.assert_failed(pending, Code.DEADLINE_EXCEEDED, "did not complete in time")
        rig.assert_clean()
        push.send(frames.chunk(1), frames.finish())  # the sender wakes up too late
        err = push.error()
        assert err.code() == Code.DEADLINE_EXCEEDED and "did not complete in time" in err.details()
        assert len(rig.sink.writes) == 1  # nothing written into the released blocks
    finally:
        push.end()
    assert rig.receiver.sweep() == []  # on_done ran once; nothing left to expire
    rig.good_transfer()
    rig.assert_clean()


def test_a_request_id_past_the_limit_is_refused_by_its_length(rig: Rig) -> None:
    """Not echoed: a status message over 16 KiB is replaced by gRPC's own, which reads as "busy, retry"."""
    pending = rig.reserve()
    err = refused(rig.channel, [Frames(rig.layout, "x" * 20_000).handshake()], AUTH)
    assert err.code() == Code.INVALID_ARGUMENT and err.details() == "request_id is 20000 characters long; at most 256"
    frames = Frames(rig.layout, pending.rid)  # and a chunk naming one is quoted cut short
    err = refused(rig.channel, [frames.handshake(), frames.chunk(0, request_id="y" * 20_000)], AUTH)
    assert err.code() == Code.INVALID_ARGUMENT and f"is for request '{'y' * 256}...' on the stream" in err.details()
    rig.assert_failed(pending, Code.INVALID_ARGUMENT, "on the stream of")
    rig.good_transfer()
    rig.assert_clean()


@pytest.mark.parametrize("how", ["expired", "cancelled"])
def test_a_stream_left_silent_after_its_push_failed_is_ended(rig: Rig, clock: FakeClock, how: str) -> None:
    """A sender without a call deadline goes silent mid-push. Once the push failed (expired or cancelled),
    the receiver ends the call WAKE_AFTER_S later, so the stream no longer holds a thread and a stream slot
    for good. (A sender that sends before then learns why: the test above.)"""
    pending = rig.reserve(timeout_s=1.0)
    frames = Frames(rig.layout, pending.rid)
    push = OpenPush(rig.channel, AUTH, timeout=None)
    try:
        push.send(frames.handshake(), frames.chunk(0))
        rig.sink.wait_for(1)
        if how == "expired":
            clock.now += 1.1
            assert rig.receiver.sweep() == [pending.rid]
        else:
            assert rig.receiver.cancel(pending.rid, "decode worker aborted the request")
        rig.assert_clean()
        clock.now += WAKE_AFTER_S - 0.1
        rig.receiver.sweep()
        assert not push.future.done()  # not yet: a late sender may still learn why
        clock.now += 0.2
        rig.receiver.sweep()
        assert push.error(timeout=10).code() == Code.CANCELLED
    finally:
        push.end()
    rig.good_transfer()
    rig.assert_clean()


def test_a_stream_that_never_sends_its_handshake_is_ended(rig: Rig, clock: FakeClock) -> None:
    """An authenticated sender without a call deadline opens a push and sends nothing. No reservation is
    claimed yet, so no transfer's deadline covers it: the receiver cancels the call HANDSHAKE_S after it
    opened, and its stream slot is free again."""
    push = OpenPush(rig.channel, AUTH, timeout=None)
    try:
        wait_until(lambda: rig.receiver.awaiting_handshake == 1, 10, "the push to reach its handler")
        clock.now += HANDSHAKE_S - 0.1
        rig.receiver.sweep()
        assert not push.future.done() and rig.receiver.awaiting_handshake == 1
        clock.now += 0.2
        rig.receiver.sweep()
        assert push.error(timeout=10).code() == Code.CANCELLED
        assert rig.receiver.awaiting_handshake == 0
    finally:
        push.end()
    rig.good_transfer()  # a handshake that comes promptly is untouched by the sweep
    assert rig.receiver.awaiting_handshake == 0
    rig.assert_clean()


def test_reservation_expired_before_handshake_is_not_found(rig: Rig, clock: FakeClock) -> None:
    pending = rig.reserve(timeout_s=1.0)
    clock.now += 1.0
    assert rig.receiver.sweep() == [pending.rid]
    rig.assert_failed(pending, Code.DEADLINE_EXCEEDED, "in time")
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(), *frames.all_layers(), frames.finish()], AUTH)
    assert err.code() == Code.NOT_FOUND and "expired" in err.details()
    assert rig.sink.writes == []
    rig.assert_clean()


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
def test_receiver_cancel_mid_stream_reaches_the_sender(rig: Rig, transport: str) -> None:
    """The decode side cancels a push in flight: its reason reaches the sender (on tcp, in the
    connection's PushResult), the reservation is released once, nothing more lands."""
    pending = rig.reserve()
    sender = rig.sender if transport == "grpc" else KVSender(SECURITY, transport="tcp")
    stream = sender.open_stream(rig.target, pending.rid, rig.layout, NUM_TOKENS, timeout_s=10)
    k = torch.randn(rig.layout.block_shape(3))
    stream.send_layer(0, 0, k, k.clone())
    rig.sink.wait_for(1)
    assert rig.receiver.cancel(pending.rid, "decode worker aborted the request") is True
    assert rig.receiver.cancel(pending.rid) is False  # once only
    rig.assert_failed(pending, Code.CANCELLED, "decode worker aborted the request")
    rig.assert_clean()
    with pytest.raises(TransferFailed) as info:
        stream.send_layer(1, 0, k.clone(), k.clone())
        stream.finish(3)
    assert info.value.code == Code.CANCELLED and "decode worker aborted the request" in info.value.message
    assert len(rig.sink.writes) == 1
    if sender is not rig.sender:
        sender.close()
    rig.good_transfer()
    rig.assert_clean()


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
def test_killed_sender_process_frees_the_reservation(make_rig: Callable[..., Rig], transport: str) -> None:
    """A sender process that dies mid-push: its reservation is released within the deadline, and over
    shared memory the receiver's janitor also removes the dead process's segment (no new sender has to
    start on the host to reap it)."""
    rig = make_rig()  # the real clock, with the janitor running
    rig.receiver.orphan_reap_s = 0.2
    rig.receiver.start_janitor(0.05)
    lay = rig.layout
    layout_json = json.dumps(dict(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                                  block_size=lay.block_size, layer_codecs=list(lay.layer_codecs),
                                  model_fingerprint=lay.model_fingerprint, cache_dtype=lay.cache_dtype))
    timeout_s = 3.0
    env = {**os.environ, "EPD_KV_TEST_TOKEN": TOKEN}
    with subprocess.Popen([sys.executable, "-c", CHILD_SENDER, rig.target, "killed-1", str(NUM_TOKENS), layout_json,
                           transport],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        pending = rig.reserve("killed-1", timeout_s=timeout_s)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "sent"
        rig.sink.wait_for(1)  # layer 0 landed: the child is mid-stream
        dead_segments = set(SHM_DIR.glob(f"epd-kv-{child.pid}-*"))
        assert len(dead_segments) == (1 if transport == "shm" else 0)
        child.stdin.write("die\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 1
    wait_until(pending.done.is_set, timeout_s + 2.0, "the dead sender's reservation to be released")
    outcome = pending.outcome()
    # grpc reports the dead peer as a cancelled call or as the request stream simply ending
    assert not outcome.ok and outcome.code in (Code.CANCELLED, Code.DATA_LOSS), outcome
    assert "sender" in (outcome.error or ""), outcome
    assert rig.engine.release(pending.reservation) is False
    assert rig.sink.writes == [(0, pending.reservation.blocks)]
    wait_until(lambda: not any(p.exists() for p in dead_segments), 5.0, "the dead sender's segment to be removed")
    rig.assert_clean()
    rig.good_transfer()
    rig.assert_clean()


# ---------------------------------------------------------------------- shared memory
def _my_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"epd-kv-{os.getpid()}-*")}


def test_shm_segments_are_reused_and_removed_at_close(rig: Rig) -> None:
    before = _my_segments()
    sender = KVSender(SECURITY, transport="shm")
    try:
        result = rig.send_good(rig.reserve(), sender=sender)
        assert result.transport == "shm"
        wait_until(lambda: len(_my_segments() - before) == 1, 2.0, "the segment to return to the pool")
        pooled = _my_segments() - before
        rig.send_good(rig.reserve(), sender=sender)  # the second stream reuses the pooled segment
        wait_until(lambda: _my_segments() - before == pooled, 2.0, "the reused segment to return")
        # a refused shm stream's segment is not reused (the receiver may still read it) but removed
        pending = rig.reserve(num_tokens=4)
        stream = sender.open_stream(rig.target, pending.rid, rig.layout, NUM_TOKENS, timeout_s=10)
        with pytest.raises(TransferFailed) as info:
            stream.finish(1)
        assert info.value.code == Code.OUT_OF_RANGE
        rig.assert_failed(pending, Code.OUT_OF_RANGE, "reserved")
        wait_until(lambda: _my_segments() - before == set(), 2.0, "the refused stream's segment to go")
    finally:
        sender.close()
    assert _my_segments() - before == set()  # (other tests' senders in this process may hold their own)
    rig.assert_clean()


def test_segments_of_dead_senders_are_reaped() -> None:
    """Names carry the creator's pid; a segment whose pid is gone is removed unless a process still
    holds its lock (each sender holds its own segments' from before they get their name)."""
    from kvtransfer.shm import reap_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = SHM_DIR / f"epd-kv-{int(dead.stdout)}-{'0' * 32}"
    # a live sender whose pid means nothing here (another pid namespace sharing /dev/shm): it holds its lock
    elsewhere = SHM_DIR / f"epd-kv-{int(dead.stdout)}-{'1' * 32}"
    mine = SharedSegment.create(4096)
    orphan.write_bytes(b"x" * 16)
    elsewhere.write_bytes(b"x" * 16)
    held = os.open(elsewhere, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        removed = reap_orphans()
        assert orphan.name in removed and not orphan.exists()
        assert (SHM_DIR / mine.name).exists()  # a live sender's segment stays
        assert elsewhere.exists() and elsewhere.name not in removed
        os.close(held)  # that sender is gone now
        held = -1
        assert elsewhere.name in reap_orphans() and not elsewhere.exists()
    finally:
        if held >= 0:
            os.close(held)
        orphan.unlink(missing_ok=True)
        elsewhere.unlink(missing_ok=True)
        mine.close()


def test_shm_reference_outside_the_segment_is_out_of_range(rig: Rig) -> None:
    pending = rig.reserve()
    segment = SharedSegment.create(256)
    try:
        frames = Frames(rig.layout, pending.rid)
        chunk = pb.KVChunk(seq=0, request_id=pending.rid, layer=0, first_block=0, num_blocks=3, codec=pb.CODEC_FP32,
                           shm=pb.ShmRef(offset=128, length=10**6))
        err = refused(rig.channel, [frames.handshake(transport=pb.TRANSPORT_SHARED_MEMORY, shm_name=segment.name,
                                                     shm_size=segment.size),
                                    encode_control(pb.PushMessage(chunk=chunk)), frames.finish()], AUTH)
    finally:
        segment.close()
    assert err.code() == Code.OUT_OF_RANGE and "outside the 256-byte segment" in err.details()
    rig.assert_failed(pending, Code.OUT_OF_RANGE, "outside")
    assert rig.sink.writes == [] and not (SHM_DIR / segment.name).exists()
    rig.assert_clean()


# ---------------------------------------------------------------------- the whole path, prefill to decode
@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
def test_prefill_to_decode_matches_a_single_engine(make_rig: Callable[..., Rig], model: DecoderModel,
                                                   transport: str) -> None:
    rig = make_rig(codecs=("fp32", "fp32"))
    prompt = torch.randint(1, 128, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = Engine(model, None, EngineConfig(block_size=BLOCK_SIZE, kv_cache_bytes=48 * 2048))
    alone.add_request("ref", prompt, params)
    want: list[int] = []
    while alone.has_unfinished():
        for out in alone.step():
            want += out.new_token_ids

    prefill = Engine(model, None, EngineConfig(block_size=BLOCK_SIZE, kv_cache_bytes=48 * 2048,
                                               prefill_chunk_size=8))  # two chunks: blocks stream in pieces
    sender = KVSender(SECURITY, transport=transport)  # type: ignore[arg-type]  # parametrized as str
    streamer = LayerStreamer(prefill, sender, ("fp32", "fp32"))
    try:
        pending = rig.reserve("e2e", num_tokens=len(prompt))
        streamer.start("e2e", rig.target, len(prompt), timeout_s=10)
        prefill.add_request("e2e", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        first = None
        while prefill.has_unfinished():
            for out in prefill.step():
                first = out.new_token_ids[0]
        assert first is not None and streamer.failed("e2e") is None
        result = streamer.finish("e2e", first)
    finally:
        sender.close()
    assert result.transport == transport and result.num_chunks >= 4
    outcome = pending.outcome()
    assert outcome.ok and outcome.first_token == first == want[0]
    got = list(rig.engine.add_prefilled(pending.reservation, prompt, first, params).new_token_ids)
    while rig.engine.has_unfinished():
        for out in rig.engine.step():
            got += out.new_token_ids
    assert got == want
    pstats = prefill.stats()
    assert pstats.blocks_free == pstats.blocks_total
    rig.assert_clean()
