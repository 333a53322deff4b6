"""A decode worker on CUDA: its CUDA IPC segments count within gpu_memory_utilization. It sizes pools from
free memory, so gpu-check runs it in the cuda step, alone on the GPU; it imports the wire's generated code,
and skips, saying so, where that does not import (docs/gpu.md)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.cuda.helpers import CUDA
from workers.runtime.engine import EngineConfig
from workers.runtime.loader import load_model

pytestmark = [*CUDA, pytest.mark.transformers]


def test_a_decode_workers_cuda_ipc_segments_count_in_its_kv_budget(tiny_hf) -> None:
    """The worker allocates its CUDA IPC segments before the engine sizes the pool, so gpu_memory_utilization
    holds them too: with them the pool is smaller by their bytes (give or take a little measurement noise)."""
    try:
        from kvtransfer.auth import TransferSecurity
        from kvtransfer.cuda_ipc import IPC_SEGMENT_BYTES, IPC_SEGMENTS
        from workers.decode.service import DecodeService
        from workers.run import start_worker
    except Exception as e:  # noqa: BLE001  # any import failure of the generated code skips, named
        pytest.skip(f"the generated wire code does not import here: {e!r}")
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
    segments = IPC_SEGMENTS * IPC_SEGMENT_BYTES
    assert segments - 64 * 2**20 <= sizes["grpc"] - sizes["cuda_ipc"] <= segments + 256 * 2**20, sizes
