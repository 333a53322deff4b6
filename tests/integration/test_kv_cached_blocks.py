"""A KV push to a receiver whose prefix cache holds the prompt's first blocks already: the sender skips them
(``cached_blocks``, said in the handshake), the receiver counts them as landed and leaves them untouched, and
any disagreement between the two is refused by name, releasing the reservation. Real gRPC server and sender."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

from kv_helpers import AUTH, Frames, Rig, make_rig, model, refused  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

Code = grpc.StatusCode
SENTINEL = 0.25


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:  # noqa: F811
    return make_rig()


def _kv(rig: Rig, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = rig.layout.block_shape(n)
    layers = rig.layout.num_layers
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layers)]


def _block_values(rig: Rig, block: int) -> list[torch.Tensor]:
    bs = rig.layout.block_size
    slots = torch.arange(block * bs, (block + 1) * bs)
    return [t for layer in rig.engine.cache.layers for t in layer.gather(slots, torch.float32)]


def test_a_push_sends_only_the_blocks_the_receiver_does_not_hold(rig: Rig) -> None:
    full = rig.reserve()
    n = len(full.reservation.blocks)
    whole = rig.send_good(full)  # the same push with nothing cached, for its byte count
    pending = rig.reserve(cached_blocks=1)
    cached = pending.reservation.blocks[0]
    for layer in rig.engine.cache.layers:  # the "cached" block's KV, which the push must leave alone
        layer.write(torch.arange(cached * rig.layout.block_size, (cached + 1) * rig.layout.block_size),
                    torch.full((rig.layout.block_size, *rig.layout.block_shape(1)[2:]), SENTINEL),
                    torch.full((rig.layout.block_size, *rig.layout.block_shape(1)[2:]), SENTINEL))
    kv = _kv(rig, n, seed=3)
    writes = len(rig.sink.writes)
    stream = rig.sender.open_stream(rig.target, pending.rid, rig.layout, pending.reservation.num_tokens, 10,
                                    cached_blocks=1)
    with pytest.raises(ValueError, match="the receiver holds the first 1"):
        stream.send_layer(0, 0, kv[0][0][:1].clone(), kv[0][1][:1].clone())  # a cached block is never sent
    for layer, (k, v) in enumerate(kv):
        stream.send_layer(layer, 1, k[1:].clone(), v[1:].clone())
    result = stream.finish(7)
    assert pending.outcome().ok
    assert all(blocks == pending.reservation.blocks[1:] for _, blocks in rig.sink.writes[writes:])
    rig.check_landed(pending.reservation.blocks[1:], [(k[1:], v[1:]) for k, v in kv])
    assert all(bool((t == SENTINEL).all()) for t in _block_values(rig, cached))
    assert result.num_bytes < whole.num_bytes  # fp32 and int8 layers: the first block's bytes were not sent
    assert rig.engine.release(pending.reservation)
    rig.assert_clean()


def test_a_sender_cannot_skip_every_block(rig: Rig) -> None:
    pending = rig.reserve()
    n = len(pending.reservation.blocks)
    with pytest.raises(ValueError, match=f"cached_blocks must be in \\[0, {n}\\)"):
        rig.sender.open_stream(rig.target, pending.rid, rig.layout, pending.reservation.num_tokens, 10,
                               cached_blocks=n)
    with pytest.raises(ValueError, match=f"cached_blocks must be in \\[0, {n}\\)"):
        rig.receiver.expect("other", pending.reservation.blocks, lambda o: None, 10, cached_blocks=n)
    rig.send_good(pending)
    rig.assert_clean()


@pytest.mark.parametrize("says", [0, 2])
def test_a_push_that_disagrees_on_the_cached_blocks_is_refused_by_name(rig: Rig, says: int) -> None:
    pending = rig.reserve(cached_blocks=1)
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(cached_blocks=says)], AUTH)
    assert err.code() == Code.FAILED_PRECONDITION
    assert f"the push skips {says} blocks as cached here; this worker's prefix cache holds 1" in err.details()
    rig.assert_failed(pending, Code.FAILED_PRECONDITION, "prefix cache holds 1")
    rig.good_transfer()
    rig.assert_clean()


def test_a_chunk_into_a_cached_block_is_refused(rig: Rig) -> None:
    pending = rig.reserve(cached_blocks=1)
    frames = Frames(rig.layout, pending.rid)
    err = refused(rig.channel, [frames.handshake(cached_blocks=1), frames.chunk(0, 0, 2)], AUTH)
    assert err.code() == Code.INVALID_ARGUMENT and "overlaps blocks already received (or cached here)" in err.details()
    rig.assert_failed(pending, Code.INVALID_ARGUMENT, "overlaps")
    rig.assert_clean()


def test_an_expected_push_can_be_pointed_at_other_blocks(rig: Rig) -> None:
    """For a sender that sends every block: the push lands whole in the blocks it was pointed at last (fresh
    in place of the cached one); an unknown or finished push is not moved."""
    pending = rig.reserve(cached_blocks=1)
    spare = rig.engine.reserve("spare", 1)
    blocks = spare.blocks[:1] + pending.reservation.blocks[1:]
    assert rig.receiver.retarget(pending.rid, blocks, 0)
    assert not rig.receiver.retarget("nobody", blocks, 0)
    n = len(blocks)
    kv = _kv(rig, n, seed=5)
    stream = rig.sender.open_stream(rig.target, pending.rid, rig.layout, pending.reservation.num_tokens, 10)
    for layer, (k, v) in enumerate(kv):
        stream.send_layer(layer, 0, k.clone(), v.clone())
    stream.finish(7)
    assert pending.outcome().ok
    assert not rig.receiver.retarget(pending.rid, pending.reservation.blocks, 1)  # done: nothing to move
    rig.check_landed(list(blocks), kv)
    assert rig.engine.release(pending.reservation) and rig.engine.release(spare)
    rig.assert_clean()
