"""gRPC options shared by both ends of a transfer (the same tuple must go to the server and channel).

The bulk options were chosen by interleaved A/B runs of a raw-bytes stream (see
bench/kv_references.py, FAST_CHANNEL_OPTIONS): a fixed HTTP/2 stream window with BDP
probing off, and large socket reads. The window is also the flow-control bound: a receiver buffers
at most about one window plus one message per stream, and runs at most ``max_streams`` streams
(kvtransfer.server), so its in-flight bytes are bounded by max_streams x (window + message).
"""

from __future__ import annotations

MiB = 2**20
MAX_MESSAGE_BYTES = 64 * MiB  # grpc's default of 4 MiB is too small for a layer's blocks
DEFAULT_WINDOW_BYTES = 16 * MiB

BASE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


def bulk_channel_options(window_bytes: int = DEFAULT_WINDOW_BYTES) -> tuple[tuple[str, int], ...]:
    return BASE_CHANNEL_OPTIONS + (
        ("grpc.http2.lookahead_bytes", window_bytes),
        ("grpc.http2.bdp_probe", 0),  # else every BDP ping resizes the window again
        ("grpc.experimental.tcp_read_chunk_size", 4 * MiB),
        ("grpc.experimental.tcp_min_read_chunk_size", 1 * MiB),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 * MiB),
    )


CHANNEL_OPTIONS = bulk_channel_options()


def server_stream_options(max_streams: int) -> tuple[tuple[str, int], ...]:
    """A server's HTTP/2 stream limit, as clients see it. grpc's overload protection (on by default) would
    also count streams already closed on the wire whose call the Python server has not released yet, and
    refuse new ones past the limit with RST_STREAM REFUSED_STREAM: a busy worker then refused calls its
    clients had every right to make (they keep to the advertised limit, queueing past it), and a caller
    took the refusal for a broken worker. Off, the limit is the one clients see and keep to."""
    return (("grpc.max_concurrent_streams", max_streams), ("grpc.http.overload_protection", 0))

