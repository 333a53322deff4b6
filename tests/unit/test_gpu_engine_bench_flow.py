"""`epd bench engine --device cuda` has never run where it is written (no GPU), and gpu-check gets one try
on a lent GPU: so its whole flow (model and transformers loaded, warm-up, decode and prefill rows beside
transformers, roofline, report, JSON) runs here on the CPU with the tiny preset. The figures of such a run
mean nothing; what is checked is that every row and line is there and consistent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from bench.gpu_engine_bench import decode_weight_bytes, run_cuda
from workers.runtime.loader import load_model
from workers.runtime.presets import write_preset_checkpoint

pytestmark = [pytest.mark.unit, pytest.mark.transformers]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


def _args(model: Path, out: Path, **over: object) -> argparse.Namespace:
    base: dict[str, object] = dict(device="cpu", model=model, dtype="float32", decode_tokens=4, repeats=1,
                                   no_hf=False, json=out)
    return argparse.Namespace(**(base | over))


def test_the_gpu_bench_flow_gives_every_row_beside_transformers(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert run_cuda(_args(tiny, out), [1, 3], [16]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["decode batch 1", "decode batch 3", "sampled batch 3", "prefill 16 tokens"]
    assert rows["sampled batch 3"]["ref_name"] == "HF sampled batch 3"
    for r in rows.values():
        assert r["epd_tok_s"] > 0 and r["ref_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["epd_tok_s"] / r["ref_tok_s"])
        assert r["name"] in text
    meta = report["meta"]
    assert meta["device"] == "cpu" and meta["reference_failed"] == [] and meta["graphs"] == "off"
    assert meta["roofline_tok_s"] == pytest.approx(2 * meta["copy_bytes_per_s"] / meta["decode_weight_bytes"])
    assert f"decode batch 1 at {rows['decode batch 1']['epd_tok_s'] / meta['roofline_tok_s']:.1%} of the roofline" \
        in text
    assert "; transformers " in text and "KV pool " in text and "CUDA graphs off" in text


def test_without_transformers_the_rows_have_no_reference(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert run_cuda(_args(tiny, out, no_hf=True), [1], [8]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["ref_tok_s"], r["ratio"]) for r in rows] == [("decode batch 1", None, None),
                                                                       ("sampled batch 1", None, None),
                                                                       ("prefill 8 tokens", None, None)]
    text = capsys.readouterr().out
    assert "of the roofline\n" in text and "; transformers" not in text


def test_a_failing_reference_keeps_the_engine_figures(tiny: Path, tmp_path: Path, capsys,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers running out of memory at batch 128 (say) must not lose the run's other figures."""
    import bench.gpu_engine_bench as gb

    def refuse(*_args: object, **_kw: object) -> float:
        raise RuntimeError("CUDA out of memory (a stand-in)")
    monkeypatch.setattr(gb, "_hf_forward_seconds", refuse)
    out = tmp_path / "bench.json"
    assert run_cuda(_args(tiny, out), [1], [16]) == 1
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["decode batch 1", "sampled batch 1", "prefill 16 tokens"]
    assert report["rows"][0]["ref_tok_s"] > 0 and report["rows"][1]["ref_tok_s"] > 0
    assert report["rows"][2]["ref_tok_s"] is None and report["rows"][2]["epd_tok_s"] > 0
    assert "FAILED the transformers reference: RuntimeError('CUDA out of memory (a stand-in)')" in \
        capsys.readouterr().out


def test_decode_weight_bytes_leave_out_the_embedding_table_unless_tied(tiny: Path) -> None:
    model = load_model(tiny, dtype=torch.float32, require_tokenizer=False).model
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    tied = embed is model.lm_head.weight
    assert decode_weight_bytes(model) == every - (0 if tied else embed.numel() * embed.element_size())


def test_decode_counts_the_tokens_of_the_timed_window_when_admission_takes_several_steps(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch 128 the 32-token prompts take more than one step to admit, so the first sequences are a few
    tokens ahead when the timer starts: the rate counts what came out while it ran, not batch x steps."""
    import bench.gpu_engine_bench as gb
    from workers.runtime.engine import Engine, EngineConfig

    monkeypatch.setattr(gb, "timed", lambda fn, device: (fn(), 1.0)[1])  # one "second": the rate is the count
    bundle = load_model(tiny, with_vision=False)

    def rate(max_num_batched_tokens: int) -> float:
        engine = Engine(bundle.model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens))
        return gb.engine_decode_rate(engine, bundle.config.vocab_size, 4, 8)
    assert rate(128) == 4 * 7  # admitted in one step: each sequence's 7 decode tokens
    assert 0 < rate(64) < 4 * 7  # two prompts a step: the first ones decoded while the others were admitted
