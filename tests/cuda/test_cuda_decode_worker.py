"""A decode worker on CUDA: its CUDA IPC segments count within gpu_memory_utilization. Apart from
test_cuda_graphs.py because it imports the wire's generated code: gpu-check runs it in the KV steps, which
have it (docs/gpu.md)."""

from __future__ import annotations

import gc

import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.cuda_ipc import IPC_SEGMENT_BYTES, IPC_SEGMENTS
from tests.cuda.helpers import CUDA
from workers.decode.service import DecodeService
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.loader import load_model

pytestmark = [*CUDA, pytest.mark.transformers]


def test_a_decode_workers_cuda_ipc_segments_count_in_its_kv_budget(tiny_hf) -> None:
    """The worker allocates its CUDA IPC segments before the engine sizes the pool, so gpu_memory_utilization
    holds them too: with them the pool is smaller by their bytes (less a little measurement noise)."""
    bundle = load_model(tiny_hf("llama-gqa"), device="cuda", require_tokenizer=False)
    sizes = {}
    for transport in ("grpc", "cuda_ipc"):
        gc.collect()
        torch.cuda.empty_cache()
        worker = start_worker("decode", bundle, TransferSecurity(token="t" * 24), transport=transport,
                              config=EngineConfig(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4))
        try:
            service = worker.service
            assert isinstance(service, DecodeService)
            assert (service.receiver.ipc is not None) == (transport == "cuda_ipc")
            sizes[transport] = service.engine.cache.nbytes
        finally:
            worker.stop()
        del worker, service
    assert sizes["grpc"] - sizes["cuda_ipc"] >= IPC_SEGMENTS * IPC_SEGMENT_BYTES - 64 * 2**20
