"""kvtransfer.wire: our hand-framed chunks are protobuf's own bytes, and the reader takes any valid
encoding while refusing everything else with WireError (never another exception)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtransfer.codecs import Kind, get_codec
from kvtransfer.wire import (
    PAYLOAD_FIELD,
    SCALES_FIELD,
    Frame,
    WireError,
    decode_frame,
    encode_chunk,
    encode_control,
    pb,
)

pytestmark = [pytest.mark.unit]

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _mv(data: bytes) -> memoryview:
    return memoryview(data)


def _real_chunk(codec_name: str = "int8", seed: int = 0) -> tuple[pb.KVChunk, list[memoryview], list[memoryview]]:
    """A chunk header plus the scales/payload parts a real codec produced for 2 blocks."""
    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, 4, 2, 32, generator=gen) for _ in range(2))
    ek, ev = codec.encode(k, Kind.KEY), codec.encode(v, Kind.VALUE)
    scales = [m for m in (ek.scales_view(), ek.zeros_view(), ev.scales_view(), ev.zeros_view())
              if m is not None and m.nbytes]
    payload = [ek.payload_view(), ev.payload_view()]
    header = pb.KVChunk(seq=3, request_id="req-7", layer=1, first_block=2, num_blocks=2,
                        codec=int(codec.codec_id),  # type: ignore[arg-type]  # enum fields take the int too
                        checksum=0xDEADBEEFCAFEF00D)
    return header, scales, payload


def _full(header: pb.KVChunk | pb.EmbeddingChunk, scales: list[memoryview],
          payload: list[memoryview]) -> pb.KVChunk | pb.EmbeddingChunk:
    """The same chunk with its bulk fields set, as protobuf itself would hold it."""
    full = type(header)()
    full.CopyFrom(header)
    if scales:
        full.scales = b"".join(bytes(m) for m in scales)
    full.payload = b"".join(bytes(m) for m in payload)
    return full


KV_CASES = {
    "all header fields": (pb.KVChunk(seq=2**40, request_id="r", layer=31, first_block=7, num_blocks=9,
                                     codec=pb.CODEC_INT4, checksum=2**64 - 1), [b"\x01\x02"], [b"abc", b"def"]),
    "empty scales": (pb.KVChunk(seq=1, request_id="r1", layer=0, num_blocks=1, codec=pb.CODEC_FP32,
                                checksum=5), [], [b"\x00" * 300]),
    "default header": (pb.KVChunk(), [], [b"x"]),
    "empty payload": (pb.KVChunk(seq=4, request_id="r"), [b"sc"], []),
    "nothing at all": (pb.KVChunk(), [], []),
    "unicode id, many parts": (pb.KVChunk(seq=9, request_id="réq-✓", codec=pb.CODEC_BF16),
                               [b"a", b"", b"bc"], [b"", b"p" * 200, b"q" * 20000]),
    "shm ref": (pb.KVChunk(seq=1, request_id="r", shm=pb.ShmRef(offset=4096, length=77)), [], []),
}


@pytest.mark.parametrize("case", sorted(KV_CASES))
def test_encode_chunk_is_protobufs_own_encoding(case: str) -> None:
    header, scales, payload = KV_CASES[case]
    s, p = [_mv(x) for x in scales], [_mv(x) for x in payload]
    ours = encode_chunk(header, s, p)
    assert ours == pb.PushMessage(chunk=_full(header, s, p)).SerializeToString()
    frame = decode_frame(ours, pb.PushMessage, pb.KVChunk)
    assert frame.kind == "chunk" and frame.header == header
    assert bytes(frame.scales) == b"".join(scales) and bytes(frame.payload) == b"".join(payload)


@pytest.mark.parametrize("codec_name", ["fp32", "bf16", "fp8", "int8", "int4"])
def test_encode_chunk_matches_protobuf_for_real_codec_output(codec_name: str) -> None:
    header, scales, payload = _real_chunk(codec_name)
    ours = encode_chunk(header, scales, payload)
    assert ours == pb.PushMessage(chunk=_full(header, scales, payload)).SerializeToString()
    frame = decode_frame(ours, pb.PushMessage, pb.KVChunk)
    assert frame.header == header
    assert bytes(frame.scales) == b"".join(bytes(m) for m in scales)
    assert bytes(frame.payload) == b"".join(bytes(m) for m in payload)
    assert isinstance(frame.payload, memoryview)  # kept as a view, not copied into a message


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_embedding_chunks_are_protobufs_own_encoding(rows: int) -> None:
    header = pb.EmbeddingChunk(seq=rows, first_row=3, num_rows=rows, checksum=12345)
    payload = [_mv(torch.arange(rows * 8, dtype=torch.float32).numpy().tobytes())]
    ours = encode_chunk(header, [], payload)
    assert ours == pb.EmbeddingMessage(chunk=_full(header, [], payload)).SerializeToString()
    frame = decode_frame(ours, pb.EmbeddingMessage, pb.EmbeddingChunk)
    assert frame.kind == "chunk" and frame.header == header and bytes(frame.payload) == bytes(payload[0])
    assert frame.scales.nbytes == 0


CONTROL = {
    "handshake": pb.PushMessage(handshake=pb.PushHandshake(
        protocol_version=1, request_id="r", num_tokens=33, transport=pb.TRANSPORT_SHARED_MEMORY,
        shm_name="epd-kv-1-" + "0" * 32, shm_size=1 << 20, sender_host="h",
        layout=pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4,
                           layer_codecs=[pb.CODEC_FP32, pb.CODEC_INT8], model_fingerprint="llama-x",
                           cache_dtype=pb.DTYPE_FLOAT32))),
    "empty handshake": pb.PushMessage(handshake=pb.PushHandshake()),
    "finish": pb.PushMessage(finish=pb.PushFinish(num_chunks=4, num_bytes=10**10, checksum=2**64 - 1,
                                                  first_token=-1)),
}


@pytest.mark.parametrize("name", sorted(CONTROL))
def test_control_messages_round_trip(name: str) -> None:
    msg = CONTROL[name]
    frame = decode_frame(encode_control(msg), pb.PushMessage, pb.KVChunk)
    assert frame.kind == name.split()[-1]
    assert frame.header == getattr(msg, frame.kind)


def _field(number: int, wtype: int, value: bytes | int) -> bytes:
    """One protobuf field, encoded by protobuf's wire rules (for hand-built orderings)."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)
    key = varint(number << 3 | wtype)
    if wtype == 0:
        return key + varint(int(value))
    if wtype == 1:
        return key + int(value).to_bytes(8, "little")
    assert isinstance(value, bytes)
    return key + varint(len(value)) + value


def test_reads_fields_in_any_order() -> None:
    header, scales, payload = _real_chunk("int4")
    sc, pl = b"".join(bytes(m) for m in scales), b"".join(bytes(m) for m in payload)
    fields = [_field(1, 0, header.seq), _field(8, 2, header.request_id.encode()), _field(2, 0, header.layer),
              _field(3, 0, header.first_block), _field(4, 0, header.num_blocks), _field(5, 0, header.codec),
              _field(6, 1, header.checksum), _field(SCALES_FIELD, 2, sc), _field(PAYLOAD_FIELD, 2, pl),
              _field(99, 2, b"unknown field")]
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(fields)
        data = _field(77, 0, 5) + _field(2, 2, b"".join(fields)) + _field(78, 2, b"outer unknown")
        expected = pb.PushMessage.FromString(data).chunk
        frame = decode_frame(data, pb.PushMessage, pb.KVChunk)
        got = frame.header
        assert isinstance(got, pb.KVChunk)
        assert got.seq == header.seq and got.request_id == header.request_id
        assert (got.layer, got.first_block, got.num_blocks) == (1, 2, 2)
        assert got.codec == header.codec and got.checksum == header.checksum
        assert bytes(frame.scales) == expected.scales == sc
        assert bytes(frame.payload) == expected.payload == pl


def test_repeated_scalar_header_field_is_last_one_wins_like_protobuf() -> None:
    data = _field(2, 2, _field(1, 0, 1) + _field(PAYLOAD_FIELD, 2, b"pp") + _field(1, 0, 9))
    assert pb.PushMessage.FromString(data).chunk.seq == 9
    got = decode_frame(data, pb.PushMessage, pb.KVChunk).header
    assert isinstance(got, pb.KVChunk) and got.seq == 9


@pytest.mark.parametrize("data, problem", [
    (b"", "exactly one"),
    (_field(5, 2, b"x"), "exactly one"),
    (_field(1, 2, b"") + _field(3, 2, b""), "exactly one"),
    (_field(2, 0, 1), "length-delimited"),
    (_field(2, 2, _field(PAYLOAD_FIELD, 2, b"a") + _field(PAYLOAD_FIELD, 2, b"b")), "once"),
    (_field(2, 2, _field(SCALES_FIELD, 0, 3)), "once"),
    (b"\x00\x01", "field number 0"),
    (b"\x0b", "wire type"),
    (b"\x12" + b"\xff" * 11, "varint"),
    (_field(2, 2, b"\x08"), "varint"),
    (_field(2, 2, b"\x42\x05ab"), "past the end"),
    (_field(2, 2, _field(8, 2, b"\xff\xfe")), "chunk header"),  # request_id that is not UTF-8
    (_field(1, 2, _field(2, 2, b"\xff")), "malformed message"),
])
def test_invalid_messages_raise_wire_error_naming_the_problem(data: bytes, problem: str) -> None:
    with pytest.raises(WireError, match=problem):
        decode_frame(data, pb.PushMessage, pb.KVChunk)


def _valid_messages() -> list[bytes]:
    header, scales, payload = _real_chunk("int8")
    return [encode_chunk(header, scales, payload), encode_control(CONTROL["handshake"]),
            encode_control(CONTROL["finish"])]


@pytest.mark.parametrize("index", range(3))
def test_every_truncation_raises_wire_error(index: int) -> None:
    data = _valid_messages()[index]
    for n in range(len(data)):
        with pytest.raises(WireError):
            decode_frame(data[:n], pb.PushMessage, pb.KVChunk)


def _check_decodes_like_protobuf_or_refuses(data: bytes) -> None:
    try:
        frame = decode_frame(data, pb.PushMessage, pb.KVChunk)
    except WireError:
        return
    assert isinstance(frame, Frame) and frame.kind in ("handshake", "chunk", "finish")
    try:
        reference = pb.PushMessage.FromString(data)
    except Exception:  # protobuf is stricter about some unknown fields; decoding is still safe
        return
    assert reference.WhichOneof("kind") == frame.kind
    if frame.kind == "chunk":
        got = pb.KVChunk()
        got.CopyFrom(frame.header)
        got.scales, got.payload = bytes(frame.scales), bytes(frame.payload)
        assert got.SerializeToString(deterministic=True) == reference.chunk.SerializeToString(deterministic=True)
    else:
        assert frame.header == getattr(reference, frame.kind)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    _check_decodes_like_protobuf_or_refuses(data)


@FUZZ
@given(st.sampled_from(range(3)), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255),
                                                     st.sampled_from(["flip", "insert", "delete", "set"])),
                                           min_size=1, max_size=4))
def test_mutated_valid_messages_decode_or_raise_wire_error(index: int, edits: list[tuple[int, int, str]]) -> None:
    data = bytearray(_VALID[index])
    for where, byte, op in edits:
        i = where % (len(data) + 1)
        if op == "insert":
            data[i:i] = bytes([byte])
        elif i < len(data):
            if op == "flip":
                data[i] ^= 1 << (byte % 8)
            elif op == "set":
                data[i] = byte
            else:
                del data[i]
    _check_decodes_like_protobuf_or_refuses(bytes(data))


def _varint_end(data: bytes, pos: int) -> int:
    while data[pos] & 0x80:
        pos += 1
    return pos + 1


@FUZZ
@given(st.sampled_from(range(3)), st.integers(0, 2**40))
def test_lying_outer_length_raises_wire_error(index: int, fake: int) -> None:
    """A length prefix that claims more than is there is refused, without reading or allocating it."""
    data = _VALID[index]
    end = _varint_end(data, 1)  # the outer field's key is one byte; its length varint follows
    real = len(data) - end
    lied = data[:1] + _field(1, 0, fake)[1:] + data[end:]
    if fake > real:
        with pytest.raises(WireError, match="past the end"):
            decode_frame(lied, pb.PushMessage, pb.KVChunk)
    else:
        _check_decodes_like_protobuf_or_refuses(lied)


_VALID = _valid_messages()


def test_sampling_params_cross_the_wire_whole() -> None:
    """Every field a worker acts on arrives as sent; to_context decides whether a small pool runs a request
    without max_tokens or refuses it. temperature and top_p arrive as the same doubles: rounded to float32
    (as they once were), a top_p near a boundary of the cumulative mass let a served request draw another
    token than the single-process reference, and a temperature of 1e-5 became greedy."""
    from epd.worker.v1 import worker_pb2 as wpb
    from workers.runtime.sampler import SamplingParams
    from workers.service_base import sampling_from_proto, sampling_to_proto

    for params in (SamplingParams(max_tokens=7, temperature=0.5, top_p=0.75, top_k=3, seed=11, stop=("x",),
                                  stop_token_ids=(4,), ignore_eos=True, to_context=True),
                   SamplingParams(max_tokens=1, temperature=0.0),
                   SamplingParams(max_tokens=3, temperature=1e-5, top_p=0.9359933733940126, seed=1),
                   SamplingParams(max_tokens=3, temperature=1.7, top_p=1e-300),
                   SamplingParams(max_tokens=3, temperature=1.0, top_p=5e-324)):
        wire = sampling_to_proto(params).SerializeToString()
        assert sampling_from_proto(wpb.SamplingParams.FromString(wire)) == params
