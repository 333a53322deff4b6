"""A Prefill whose decode target holds no reservation is refused before any compute: the KV handshake
(DecodeWorker.Holds) goes first."""

from __future__ import annotations

import secrets
import time

import grpc
import pytest

from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import start_worker
from workers.runtime.sampler import SamplingParams
from workers.service_base import sampling_to_proto
from workers.tracing import FAILURE_KEY, KV_TRANSFER_FAILURE

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))


def test_a_prefill_for_a_reservation_nobody_holds_computes_nothing(default_bundle):
    codecs = ("fp32",) * default_bundle.config.num_layers
    prefill = start_worker("prefill", default_bundle, SECURITY, codecs=codecs)
    decode = start_worker("decode", default_bundle, SECURITY, codecs=codecs)
    layers: list[object] = []
    prefill.service.engine.add_layer_hook(layers.append)  # type: ignore[attr-defined]  # PrefillService has an engine
    channel = SECURITY.open_channel(prefill.address)
    try:
        stub = wgrpc.PrefillWorkerStub(channel)
        prompt = default_bundle.tokenizer.encode("a long prompt " * 100)
        params = sampling_to_proto(SamplingParams(max_tokens=8, temperature=0.0))
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(wpb.PrefillRequest(request_id="nobody-reserved", prompt_token_ids=prompt, params=params,
                                            kv_target=decode.address, timeout_s=30),
                         metadata=SECURITY.call_metadata(), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "holds no reservation" in err.value.details() and "nobody-reserved" in err.value.details()
        assert (FAILURE_KEY, KV_TRANSFER_FAILURE) in tuple(err.value.trailing_metadata())  # not the prefill's fault
        assert layers == []  # not one layer computed
        # with a reservation, the same call goes through
        dchannel = SECURITY.open_channel(decode.address)
        dstub = wgrpc.DecodeWorkerStub(dchannel)
        dstub.Reserve(wpb.ReserveRequest(request_id="reserved", prompt_token_ids=prompt, params=params, timeout_s=30),
                      metadata=SECURITY.call_metadata(), timeout=30)
        reply = stub.Prefill(wpb.PrefillRequest(request_id="reserved", prompt_token_ids=prompt, params=params,
                                                kv_target=decode.address, timeout_s=30),
                             metadata=SECURITY.call_metadata(), timeout=30)
        assert reply.kv_layers == default_bundle.config.num_layers and layers
        dstub.Abort(wpb.AbortRequest(request_id="reserved"), metadata=SECURITY.call_metadata(), timeout=10)
        dchannel.close()
    finally:
        channel.close()
        prefill.stop()
        decode.stop()


def test_a_caller_gone_during_the_kv_handshake_leaves_the_prompt_uncomputed(default_bundle, monkeypatch):
    """The caller leaves (its deadline) while the prefill worker asks the decode worker for the reservation:
    the call's callback then finds nothing to abort. The prompt, queued after the handshake, is aborted at once
    instead of being computed whole (and its KV pushed) for nobody."""
    codecs = ("fp32",) * default_bundle.config.num_layers
    prefill = start_worker("prefill", default_bundle, SECURITY, codecs=codecs)
    decode = start_worker("decode", default_bundle, SECURITY, codecs=codecs)
    service = prefill.service
    layers: list[object] = []
    service.engine.add_layer_hook(layers.append)  # type: ignore[attr-defined]  # PrefillService has an engine
    real = service._check_reservation  # type: ignore[attr-defined]

    def slow_handshake(*args: object) -> int:
        time.sleep(1.0)  # the caller's 0.3 s deadline passes meanwhile
        return real(*args)

    monkeypatch.setattr(service, "_check_reservation", slow_handshake)
    channel, dchannel = SECURITY.open_channel(prefill.address), SECURITY.open_channel(decode.address)
    try:
        prompt = default_bundle.tokenizer.encode("a long prompt " * 600)  # four 512-token chunks
        params = sampling_to_proto(SamplingParams(max_tokens=8, temperature=0.0))
        wgrpc.DecodeWorkerStub(dchannel).Reserve(wpb.ReserveRequest(request_id="gone", prompt_token_ids=prompt,
                                                                    params=params, timeout_s=30),
                                                 metadata=SECURITY.call_metadata(), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            wgrpc.PrefillWorkerStub(channel).Prefill(
                wpb.PrefillRequest(request_id="gone", prompt_token_ids=prompt, params=params,
                                   kv_target=decode.address, timeout_s=30),
                metadata=SECURITY.call_metadata(), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 20
        while service._inflight or service.engine.stats().num_running:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the prefill worker still holds the request"
            time.sleep(0.02)
        num_layers = default_bundle.config.num_layers
        assert len(layers) <= num_layers, f"{len(layers) // num_layers} chunks computed for a caller gone"
    finally:
        channel.close()
        dchannel.close()
        prefill.stop()
        decode.stop()
