"""`epd bench kv --device cuda` had never run where it is written (no GPU), and gpu-check gets one try on
a lent GPU: so its whole flow (the fused codecs by block index, pushes into a receiver process's cache,
TTFT with layer-wise streaming per transport, the report and the JSON) runs here on the CPU at small sizes,
without cuda_ipc, the codec kernels through Triton's interpreter (tests.unit.triton_env). The figures of such
a run mean nothing; what is checked is that every section runs and every figure is there."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.unit.triton_env import DEVICE  # first: the codec kernels are interpreted without CUDA

# isort: split
from bench.kv_gpu_bench import Sizes, run_on
from workers.runtime.presets import PRESETS

pytestmark = [pytest.mark.integration]

SMALL = Sizes(codec_bytes=1 << 18, push_layers=2, push_tokens=256, pushes=(("int8", "tcp"), ("bf16", "shm")),
              ttft_tokens=64, ttft_preset="tiny", ttft_transports=("grpc", "tcp", "shm"))


def test_every_section_of_the_gpu_kv_bench_runs_on_cpu(tmp_path: Path, capsys, monkeypatch) -> None:
    # the TTFT prompt as long as the preset's context, as the benchmark's 4,096 tokens are on the 1b preset
    monkeypatch.setitem(PRESETS, "tiny", replace(PRESETS["tiny"], max_position_embeddings=SMALL.ttft_tokens))
    out = tmp_path / "kv.json"
    assert DEVICE.type == "cpu" or torch.cuda.is_available()
    rc = run_on(torch.device("cpu"), 1, "int8", out, SMALL)
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["failed"] == [] and rc == 0, text
    names = [f["name"] for f in report["figures"]]
    assert names[:8] == [f"{c} {op}" for c in ("int8", "fp8", "int4", "bf16")
                         for op in ("encode (by block index)", "decode (into blocks)")]
    assert names[8] == "device checksum (cuda_ipc chunks)"
    pushes = [name for path in ("int8 over tcp", "bf16 over shm")
              for name in (f"2 MiB cache, {path}", f"1-block cache, {path}",
                           f"2 MiB cache, {path}, past the fixed cost", f"2 MiB cache, {path}, 2 pushes at once")]
    expected = [*pushes, "TTFT 64-token prompt (tiny), int8 over grpc",
                "TTFT 64-token prompt (tiny), int8 over tcp", "TTFT 64-token prompt (tiny), int8 over shm"]
    # "past the fixed cost" exists only when the 2 MiB push outlasted a 1-block one: on a loaded 2-core
    # machine a 1-block push can take longer, and the benchmark then leaves that figure out
    optional = {n for n in pushes if n.endswith("past the fixed cost")}
    assert [n for n in names[9:] if n not in optional] == [n for n in expected if n not in optional]
    assert [n for n in names[9:] if n in optional] == [n for n in expected if n in optional and n in names]
    for f in report["figures"]:
        assert f["value"] > 0 and f["ref_value"] > 0 and f["name"] in text
    refs = {f["name"]: f["reference"] for f in report["figures"]}
    assert refs["2 MiB cache, int8 over tcp"] == "tcp socket (logical bytes)"
    assert refs["TTFT 64-token prompt (tiny), int8 over shm"] == "prefill alone"
    assert refs["1-block cache, bf16 over shm"] == "the 2 MiB push"
    assert all(refs[n] == "tcp socket (logical bytes)" for n in optional & set(refs))
    assert refs["2 MiB cache, int8 over tcp, 2 pushes at once"] == "tcp socket (logical bytes)"
    by_name = {f["name"]: f["value"] for f in report["figures"]}
    for path in ("int8 over tcp", "bf16 over shm"):  # the data's rate is above the whole push's, by the fixed cost
        if f"2 MiB cache, {path}, past the fixed cost" in by_name:
            assert by_name[f"2 MiB cache, {path}, past the fixed cost"] > by_name[f"2 MiB cache, {path}"]
