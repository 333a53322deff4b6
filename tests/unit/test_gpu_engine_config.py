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


def test_staging_writes_each_row_the_block_table_it_holds_now() -> None:
    """Staging writes only a table's new entries when a row holds the same (growing) table as last step; a
    row that takes another sequence's table, or a sequence's new table after preemption, is written whole."""
    pytest.importorskip("triton")
    import torch

    from workers.runtime.attention import DecodeItem
    from workers.runtime.cuda_graphs import DecodeBuffers

    buf = DecodeBuffers(4, 6, 16, torch.device("cpu"))
    a, b = [3, 9], [5]

    def stage(*items: tuple[list[int], int]) -> list[list[int]]:
        buf.stage([DecodeItem(1, pos, table) for table, pos in items], 4)
        assert torch.equal(buf.dev["tables"], buf.host["tables"])
        return [buf.dev["tables"][i, :len(t)].tolist() for i, (t, _) in enumerate(items)]

    assert stage((a, 20), (b, 3)) == [[3, 9], [5]]
    a.append(11)  # a grows into a third block
    assert stage((a, 32), (b, 4)) == [[3, 9, 11], [5]]
    assert buf.dev["slots"][:2].tolist() == [11 * 16, 5 * 16 + 4]
    assert stage((b, 5), (a, 33)) == [[5], [3, 9, 11]]  # the rows swap sequences
    a = [7]  # a preempted and recomputed: a new table
    assert stage((a, 0), (b, 6)) == [[7], [5]]
    b.extend([8, 2, 4, 6])
    assert stage((b, 70), (a, 1)) == [[5, 8, 2, 4, 6], [7]]


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan")])
def test_gpu_memory_utilization_outside_0_1_is_refused(value: float) -> None:
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)


def test_cpu_engine_keeps_the_torch_path_and_default_budget(default_bundle) -> None:
    engine = Engine(default_bundle.model, None, EngineConfig())
    assert engine._ops is None and engine.graphs is None
    assert engine.cache.nbytes <= DEFAULT_KV_CACHE_BYTES < engine.cache.nbytes + engine.cache.spec.bytes_per_block(
        engine.cache.layer_dtypes)


@pytest.mark.parametrize("value", ["0", "1.5", "-1"])
def test_settings_refuse_gpu_memory_utilization_outside_0_1_in_one_line(no_epd_env, monkeypatch, capsys,
                                                                        value: str) -> None:
    from controlplane.cli import main

    monkeypatch.setenv("EPD_DECODE__ENGINE__GPU_MEMORY_UTILIZATION", value)
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpu_memory_utilization" in err, err


def test_settings_pass_the_gpu_fields_and_keep_the_cpu_budget(no_epd_env) -> None:
    from controlplane.settings import EngineSettings

    cpu = EngineSettings().engine_config()
    assert cpu.kv_cache_bytes == DEFAULT_KV_CACHE_BYTES and cpu.cuda_graphs and cpu.gpu_memory_utilization == 0.9
    gpu = EngineSettings(device="cuda", gpu_memory_utilization=0.5, cuda_graphs=False).engine_config()
    assert gpu.kv_cache_bytes is None and gpu.gpu_memory_utilization == 0.5 and not gpu.cuda_graphs
    assert EngineSettings(device="cuda", kv_cache_bytes=2**30).engine_config().kv_cache_bytes == 2**30
