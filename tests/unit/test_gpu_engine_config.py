"""The GPU engine's settings and bucket ladder, checked on CPU (pure logic; the graphs themselves are
tested in tests/cuda)."""

from __future__ import annotations

import pytest

from workers.runtime.engine import DEFAULT_KV_CACHE_BYTES, Engine, EngineConfig
from workers.runtime.errors import InvalidRequestError

pytestmark = pytest.mark.unit


def test_bucket_ladder() -> None:
    pytest.importorskip("triton")
    from workers.runtime.cuda_graphs import bucket_ladder

    assert bucket_ladder(1) == (1,)
    assert bucket_ladder(8) == (1, 2, 4, 8)
    assert bucket_ladder(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert bucket_ladder(40) == (1, 2, 4, 8, 16, 32, 40)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan")])
def test_gpu_memory_utilization_outside_0_1_is_refused(value: float) -> None:
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)


def test_cpu_engine_keeps_the_torch_path_and_default_budget(default_bundle) -> None:
    engine = Engine(default_bundle.model, None, EngineConfig())
    assert engine._ops is None and engine.graphs is None
    assert engine.cache.nbytes <= DEFAULT_KV_CACHE_BYTES < engine.cache.nbytes + engine.cache.spec.bytes_per_block(
        engine.cache.layer_dtypes)
