"""A Prefill whose decode target holds no reservation is refused before any compute: the KV handshake
(DecodeWorker.Holds) goes first."""

from __future__ import annotations

import secrets

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
