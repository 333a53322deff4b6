"""gRPC options shared by both ends of a transfer."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 2**20  # grpc's default of 4 MiB is too small for a layer's blocks
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
